"""Helpers the benchmark programs import (not programs themselves)."""
