"""Benchmarks of one operation or component: attention, linears, the C++ and GPU kernels,
the vision tower, image preprocessing, sampling."""
