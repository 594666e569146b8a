"""Replica routing: which of N engine replicas serves a request (pure, torch-free)."""
