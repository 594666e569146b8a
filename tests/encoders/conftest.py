"""This folder's tests run torch: the checkpoint fixtures and Triton's interpreter setting."""

from tests.fixtures.models import chi_square, idefics3_path, llama_path, llava_ov_path  # noqa: F401
