"""This folder's tests run torch: the checkpoint fixtures and Triton's interpreter setting."""

from tests.fixtures.models import (  # noqa: F401
    chi_square,
    gemma3_path,
    idefics3_path,
    llama_path,
    llava_ov_path,
)
