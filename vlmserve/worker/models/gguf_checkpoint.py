"""`--model FILE.gguf`: a GGUF file served as a HF checkpoint folder whose weights stay in
the file.

The first start with a file builds its *sidecar*, a small folder under
~/.cache/vlmserve/gguf/ keyed by the file (path, size, mtime) and the tokenizer given:
config.json from the file's metadata (transformers' GGUF config reader, as vLLM uses it),
the tokenizer converted from the file's vocabulary (or `--tokenizer`'s), its chat
template, generation_config.json with the end-of-turn tokens, and `model.gguf`, a link
to the file. Every door then reads config and tokenizer from the sidecar as from any
checkpoint folder; the loader reads the weights from the link (gguf_weights.py). The
conversion of a 262k-token vocabulary takes tens of seconds: once per file, not per
start.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections import Counter
from pathlib import Path

from encoders.weights import CheckpointError
from vlmserve.worker.models.gguf_file import GGUFFile
from vlmserve.worker.models.gguf_weights import ARCHITECTURES, unsupported_architecture

log = logging.getLogger(__name__)

CACHE_DIR = Path.home() / ".cache" / "vlmserve" / "gguf"
SIDECAR_VERSION = 3
WEIGHTS_LINK = "model.gguf"
INFO_FILE = "gguf.json"  # what `vlmserve info` prints: source, architecture, block types
# Turn-ending tokens that stop generation beside the file's EOS (llama.cpp's end-of-
# generation set): a chat reply ends at its turn's end, which GGUF files rarely list.
END_OF_TURN_TOKENS = ("<end_of_turn>", "<|im_end|>", "<|eot_id|>", "<|end|>", "<|eom_id|>")
# Gemma 3's chat template as Google publishes it (the HF checkpoints' tokenizer_config):
# GGUF repacks often drop it, and Gemma 3 has one format only.
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}{%- if messages[0]['role'] == 'system' -%}{%- if messages[0]['content'] "
    "is string -%}{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}{%- else -%}"
    "{%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}{%- endif -%}"
    '{%- set loop_messages = messages[1:] -%}{%- else -%}{%- set first_user_prefix = "" -%}'
    "{%- set loop_messages = messages -%}{%- endif -%}{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}{{ raise_exception("
    '"Conversation roles must alternate user/assistant/user/assistant/...") }}{%- endif -%}'
    "{%- if (message['role'] == 'assistant') -%}{%- set role = \"model\" -%}{%- else -%}"
    "{%- set role = message['role'] -%}{%- endif -%}{{ '<start_of_turn>' + role + '\n' + "
    "(first_user_prefix if loop.first else \"\") }}{%- if message['content'] is string -%}"
    "{{ message['content'] | trim }}{%- elif message['content'] is iterable -%}{%- for item "
    "in message['content'] -%}{%- if item['type'] == 'image' -%}{{ '<start_of_image>' }}"
    "{%- elif item['type'] == 'text' -%}{{ item['text'] | trim }}{%- endif -%}{%- endfor -%}"
    '{%- else -%}{{ raise_exception("Invalid content type") }}{%- endif -%}'
    "{{ '<end_of_turn>\n' }}{%- endfor -%}{%- if add_generation_prompt -%}"
    "{{'<start_of_turn>model\n'}}{%- endif -%}"
)
_BUILTIN_TEMPLATES = {"gemma3": GEMMA3_CHAT_TEMPLATE}
_HF_CLASSES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}


def find_gguf(path: str | Path) -> Path | None:
    """The GGUF file `path` names: the file itself, or the one *.gguf in a folder without a
    config.json (None: a HF checkpoint folder, or no such path)."""
    path = Path(path)
    if path.is_file():
        return path if path.suffix == ".gguf" else None
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    files = sorted(path.glob("*.gguf"))
    if len(files) > 1:
        names = ", ".join(f.name for f in files)
        raise CheckpointError(f"{path} holds several GGUF files ({names}): pass one as --model")
    return files[0] if files else None


def resolve_model_path(path: str, tokenizer: str | None = None) -> str:
    """The checkpoint folder to read `--model PATH` from: a GGUF file's sidecar (built on
    first use), or the folder itself. ValueError: neither."""
    gguf = find_gguf(path)
    if gguf is not None:
        return str(prepare(gguf, tokenizer))
    if tokenizer is not None and weights_file(path) is None:
        raise ValueError(f"--tokenizer applies to GGUF files; {path!r} is a checkpoint folder")
    if not Path(path).is_dir():
        raise ValueError(f"model path {path!r} is neither a checkpoint folder nor a GGUF file")
    return path


def weights_file(folder: str | Path) -> Path | None:
    """The GGUF file a sidecar's weights come from (None: an ordinary checkpoint folder)."""
    link = Path(folder) / WEIGHTS_LINK
    return link if link.exists() else None


def sidecar_dir(gguf: Path, tokenizer: str | None) -> Path:
    import transformers

    stat = gguf.stat()
    source = Path(tokenizer).resolve() if tokenizer else ""
    key = "\n".join(
        map(str, (gguf.resolve(), stat.st_size, stat.st_mtime_ns, source, SIDECAR_VERSION))
    )
    key += f"\n{transformers.__version__}"
    return CACHE_DIR / hashlib.sha256(key.encode()).hexdigest()[:16]


def prepare(path: str | Path, tokenizer: str | None = None) -> Path:
    """The sidecar folder of the GGUF file `path` names, built on first use (atomically:
    concurrent starts each build and one rename wins)."""
    gguf = find_gguf(path)
    if gguf is None:
        raise CheckpointError(f"{path}: not a GGUF file or a folder holding one")
    target = sidecar_dir(gguf, tokenizer)
    if (target / INFO_FILE).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    log.info("GGUF %s: building its config and tokenizer in %s (once per file)", gguf, target)
    scratch = Path(tempfile.mkdtemp(prefix=".building-", dir=target.parent))
    try:
        _build(gguf, tokenizer, scratch)
        try:
            os.rename(scratch, target)
        except OSError:  # another start built it first
            if not (target / INFO_FILE).is_file():
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    log.info("GGUF sidecar ready in %.1f s", time.perf_counter() - start)
    return target


def _build(gguf: Path, tokenizer: str | None, out: Path) -> None:
    from gguf import GGMLQuantizationType
    from transformers import AutoConfig, AutoTokenizer

    file = GGUFFile(gguf)
    arch = str(file.field("general.architecture"))
    if arch not in ARCHITECTURES:
        raise CheckpointError(unsupported_architecture(arch))
    types = Counter(GGMLQuantizationType(t.qtype).name for t in file.tensors)
    config = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name).to_dict()
    config["model_type"] = ARCHITECTURES[arch]
    config["architectures"] = [_HF_CLASSES[arch]]  # what other engines read off config.json
    config["torch_dtype"] = _dtype_of(types)
    if arch == "gemma3":
        _gemma3_fields(config, file)
    if tokenizer:
        tok = AutoTokenizer.from_pretrained(tokenizer)
    else:
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    template, template_source = _chat_template(file, tok, arch)
    if template is not None:
        tok.chat_template = template
    tok.save_pretrained(str(out))
    (out / "config.json").write_text(json.dumps(config, indent=1))
    eos = _eos_ids(config, tok)
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    (out / WEIGHTS_LINK).symlink_to(gguf.resolve())
    info = {
        "source": str(gguf.resolve()),
        "architecture": arch,
        "tensor_types": dict(types.most_common()),
        "tokenizer": tokenizer or "converted from the file",
        "chat_template": template_source,
        "eos_token_ids": eos,
    }
    (out / INFO_FILE).write_text(json.dumps(info, indent=1))


def _gemma3_fields(config: dict, file: GGUFFile) -> None:
    """What transformers' GGUF config reader leaves at Gemma3TextConfig's defaults, as
    llama.cpp reads the file: the query scale is 1/sqrt(head_dim) (27B: hidden / heads),
    and the global layers' RoPE scaling (4B-27B: linear x8) is in rope.scaling.*."""
    head_dim = config["head_dim"]
    if config["num_hidden_layers"] == 62:  # 27B, as llama.cpp singles it out
        head_dim = config["hidden_size"] // config["num_attention_heads"]
    config["query_pre_attn_scalar"] = head_dim
    kind, factor = file.field("gemma3.rope.scaling.type"), file.field("gemma3.rope.scaling.factor")
    if kind == "linear" and factor:
        full = config.setdefault("rope_parameters", {}).setdefault("full_attention", {})
        full.update(rope_type="linear", factor=float(factor))


def _dtype_of(types: Counter) -> str:
    """The dtype `--dtype auto` reads: float32 for an all-float32 file, the 16-bit type a
    16-bit file has, bfloat16 for quantized blocks (their scales are 16-bit)."""
    if set(types) <= {"F32"}:
        return "float32"
    return "float16" if set(types) <= {"F32", "F16"} else "bfloat16"


def _chat_template(file: GGUFFile, tok, arch: str) -> tuple[str | None, str]:
    template = file.field("tokenizer.chat_template")
    if isinstance(template, str):
        return template, "from the file"
    if getattr(tok, "chat_template", None):
        return tok.chat_template, "from the tokenizer"
    if arch in _BUILTIN_TEMPLATES:
        return _BUILTIN_TEMPLATES[arch], f"built in ({arch}: the file has none)"
    return None, "none (chat requests are refused; /v1/completions serves)"


def _eos_ids(config: dict, tok) -> list[int]:
    eos = config.get("eos_token_id", tok.eos_token_id)
    ids = list(eos) if isinstance(eos, list) else [eos] if eos is not None else []
    vocab = tok.get_vocab()
    ids += [vocab[t] for t in END_OF_TURN_TOKENS if t in vocab and vocab[t] not in ids]
    return [int(i) for i in ids]
