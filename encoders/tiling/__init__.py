"""Tiling rules per family: layout and exact token count from (width, height)."""
