"""The `vlmserve` command: info, generate, demo, serve, caption, estimate."""

from __future__ import annotations

import argparse
import json
import sys
import time

from kernels import isa_target
from vlmserve.cli import caption_cli
from vlmserve.cli import serve as serve_cli
from vlmserve.cli.engine_args import add_engine_args, engine_config_from_args
from vlmserve.cli.estimate import main as estimate_cli
from vlmserve.config import QUANTIZATION_CHOICES
from vlmserve.engine.stats import render_engine_stats


def cmd_info(args: argparse.Namespace) -> int:
    from vlmserve.cli import info

    kernels, built = info.build_kernels() if args.build_kernels else ({}, True)
    data = info.collect(
        args.model, args.tensor_parallel_size, args.tokenizer, args.recalibrate, args.quantization
    )
    if kernels:
        data["cpu_kernels"] = kernels
    print(json.dumps(data, indent=2) if args.json else info.render(data))
    return 0 if built else 1


def cmd_generate(args: argparse.Namespace) -> int:
    from vlmserve.engine.core import Engine
    from vlmserve.inputs.processing import Request
    from vlmserve.sample.params import SamplingParams

    engine = Engine(engine_config_from_args(args))
    content = [{"type": "image", "image": path} for path in args.image]
    content.append({"type": "text", "text": args.prompt})
    from vlmserve.cli.caption_json import load_schema

    structured = load_schema(args.json_schema) if args.json_schema else None
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, n=args.n, seed=args.seed,
        logprobs=args.logprobs, structured=structured,
    )  # fmt: skip
    request = Request(messages=[{"role": "user", "content": content}], sampling=params)
    start = time.perf_counter()
    try:
        outs = engine.generate([request])
    finally:
        engine.close()  # tensor-parallel workers end with the command
    if outs[0].error:
        print(f"error: {outs[0].error}", file=sys.stderr)
        return 2
    for i, out in enumerate(outs):
        print(f"[{i}] {out.text}" if len(outs) > 1 else out.text)
        if args.logprobs is not None:
            print(render_logprobs(out.logprobs, engine.tokenizer), file=sys.stderr)
    out = outs[0]
    print(
        f"[{out.num_prompt_tokens} prompt tokens ({out.num_image_tokens} image), "
        f"{len(out.token_ids)} output, {time.perf_counter() - start:.2f}s]",
        file=sys.stderr,
    )
    print(render_engine_stats(engine.stats()), file=sys.stderr)
    return 0


def render_logprobs(records: list, tokenizer) -> str:
    """One line per output token: its text, logprob and the top alternatives (raw)."""
    lines = []
    for r in records:
        top = " ".join(f"{tokenizer.decode([t])!r}={lp:.3f}" for t, lp in r.top)
        lines.append(f"  {tokenizer.decode([r.token_id])!r} {r.logprob:.4f}  {top}".rstrip())
    return "\n".join(lines)


def cmd_demo(args: argparse.Namespace) -> int:
    from vlmserve.cli.demo import run_demo

    return run_demo(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vlmserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("info", help="versions, PIL build, device, attention backend")
    p.add_argument("--json", action="store_true")
    p.add_argument(
        "--model",
        help="checkpoint folder or GGUF file: what it holds, and how --tensor-parallel-size "
        "splits it",
    )
    p.add_argument("--tokenizer", default=None, help="a GGUF model's HF tokenizer folder")
    p.add_argument("--tensor-parallel-size", "--tp", type=int, default=1, metavar="N")
    p.add_argument(
        "--quantization",
        choices=QUANTIZATION_CHOICES,
        default="auto",
        help="with --model: how its weights would run (as `serve --quantization`): each "
        "quantized layer's block types, bytes per weight and kernels",
    )
    p.add_argument(
        "--build-kernels",
        action="store_true",
        help="build the C++ CPU kernels now (otherwise the first engine start builds them)",
    )
    p.add_argument(
        "--recalibrate",
        action="store_true",
        help="measure every CPU kernel choice anew (as VLMSERVE_RECALIBRATE=1 does at start)",
    )
    p.set_defaults(func=cmd_info)

    p = sub.add_parser("generate", help="one offline multimodal generation")
    add_engine_args(p)
    p.add_argument("--prompt", required=True)
    p.add_argument("--image", action="append", default=[], help="image file (repeatable)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--n", type=int, default=1, help="answers (seeded: answer i uses seed + i)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--logprobs", type=int, default=None, metavar="N",
                   help="print each token's logprob and its N likeliest alternatives")  # fmt: skip
    p.add_argument(
        "--json-schema", metavar="FILE", default=None,
        help="the answer is JSON following this schema (structured outputs)",
    )  # fmt: skip
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("demo", help="the main job on the default model")
    add_engine_args(p)
    p.set_defaults(func=cmd_demo)

    estimate_cli.register(sub)
    serve_cli.register(sub)
    caption_cli.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        isa_target()  # VLMSERVE_ISA: an unknown target refused before any work
        return int(args.func(args) or 0)
    except ValueError as e:  # bad input: a message, not a traceback
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
