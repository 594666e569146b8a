"""Argument types for the engine flags: each parses one flag's text or raises an
argparse error naming what is wrong (argparse adds the flag's name)."""

from __future__ import annotations

import argparse
from collections.abc import Callable


def int_at_least(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    parse.__name__ = f"integer >= {minimum}"  # argparse names the type in its errors
    return parse


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def ttft_targets(text: str) -> tuple[float, float]:
    """`--slo-ttft-ms`: "MS" or "text=MS,image=MS" -> (text, image) seconds."""
    parts = dict(p.split("=", 1) if "=" in p else ("", p) for p in text.split(","))
    if set(parts) == {""}:
        value = positive_float(parts[""]) / 1e3
        return value, value
    if not set(parts) <= {"text", "image"} or not parts:
        raise argparse.ArgumentTypeError(f"{text!r}: want MS or text=MS,image=MS")
    text_s = positive_float(parts["text"]) / 1e3 if "text" in parts else None
    image_s = positive_float(parts["image"]) / 1e3 if "image" in parts else None
    if text_s is None or image_s is None:
        raise argparse.ArgumentTypeError(f"{text!r}: give both text= and image= targets")
    return text_s, image_s


def device(text: str) -> str:
    import torch

    try:
        torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a device (cpu, cuda, cuda:1)") from None
    return text
