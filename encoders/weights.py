"""Reading HF checkpoint folders (config.json + *.safetensors, sharded or not) and copying
their tensors into our modules with errors that name the tensor and both shapes."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from safetensors import safe_open


class CheckpointError(ValueError):
    """A checkpoint folder that cannot be served: unsupported, incomplete or mismatched."""


def read_config(path: str | Path) -> dict:
    config_path = Path(path) / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"{path}: no config.json (expected a HF checkpoint folder)")
    with open(config_path) as f:
        return json.load(f)


def load_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint folder, by their names on disk (shards merged)."""
    folder = Path(path)
    index_path = folder / "model.safetensors.index.json"
    if index_path.is_file():
        with open(index_path) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = sorted(p.name for p in folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path}: no *.safetensors files")
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        with safe_open(str(folder / name), framework="pt") as f:
            for key in f.keys():
                tensors[key] = f.get_tensor(key)
    return tensors


class TensorView(Mapping[str, torch.Tensor]):
    """A checkpoint's tensors seen through a change made as each is read (a subclass's
    `__getitem__`): the names, and how many, are the underlying mapping's."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def __contains__(self, name: object) -> bool:
        return name in self.tensors

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)


def take(tensors: Mapping[str, torch.Tensor], name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """The tensor `name`, checked against the shape our module expects."""
    if name not in tensors:
        raise CheckpointError(f"missing weight {name!r} (expected shape {tuple(shape)})")
    tensor = tensors[name]
    if tuple(tensor.shape) != tuple(shape):
        raise CheckpointError(
            f"weight {name!r} has shape {tuple(tensor.shape)} in the checkpoint, "
            f"the model expects {tuple(shape)}"
        )
    return tensor


def load_into(
    module: torch.nn.Module, tensors: Mapping[str, torch.Tensor], names: Mapping[str, str]
) -> None:
    """Copy checkpoint tensors into `module`: `names` maps our parameter name to the
    checkpoint's. Every parameter of `module` must be covered."""
    own = dict(module.named_parameters())
    missing = sorted(set(own) - set(names))
    assert not missing, f"no checkpoint name for our parameters {missing[:5]}"
    with torch.no_grad():
        for ours, theirs in names.items():
            dst = own[ours]
            dst.copy_(take(tensors, theirs, tuple(dst.shape)).to(dst.dtype))
