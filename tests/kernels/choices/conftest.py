"""The kernel-choice tests (kernels/calibration.py, kernels/lm_head.py): a fresh
calibration cache and the skinny kernel's availability, as fixtures."""

from tests.kernels.choices.calibration_cache import cache_dir, needs_skinny  # noqa: F401
