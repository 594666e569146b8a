"""The pure parts of benchmarks/serving/vs_vllm.py (no vLLM here: CI never runs it)."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from benchmarks.lib.vllm_cpu import core_list
from benchmarks.lib.vs_vllm_serve import (
    chat_payloads,
    is_saturated,
    median_point,
    pass_order,
    process_cpu_s,
    server_command,
)  # fmt: skip
from benchmarks.serving.vs_vllm import agreement, last_error, matched_prefix, round_order, summarize


def test_matched_prefix_stops_at_first_difference():
    assert matched_prefix([1, 2, 3, 4], [1, 2, 9, 4]) == 2
    assert matched_prefix([1, 2], [1, 2, 3]) == 2
    assert matched_prefix([], [1]) == 0


def test_agreement_counts_identical_outputs_and_mean_prefix():
    vllm = [[1, 2, 3], [4, 5, 6], [7, 8]]
    ours = [[1, 2, 3], [4, 0, 6], [0, 8]]
    got = agreement(vllm, ours)
    assert got.num_requests == 3
    assert got.num_identical == 1
    assert got.mean_matched_prefix == pytest.approx((3 + 1 + 0) / 3)
    assert got.mean_output_len == pytest.approx(8 / 3)


def test_agreement_refuses_unequal_request_counts():
    with pytest.raises(AssertionError):
        agreement([[1]], [[1], [2]])


def test_rounds_interleave_vllm_first():
    assert round_order(2) == [(0, "vllm"), (0, "vlmserve"), (1, "vllm"), (1, "vlmserve")]


def _run(system: str, seconds: float, **extra) -> dict:
    return {"system": system, "seconds": seconds, "load_s": 1.0, "warmup_s": 0.5, **extra}


def test_summarize_takes_medians_and_skips_failed_rounds():
    runs = [
        _run("vllm", 10.0), _run("vlmserve", 20.0),
        _run("vllm", 12.0), _run("vlmserve", 40.0),
        _run("vllm", 11.0), {"system": "vlmserve", "error": "boom"},
    ]  # fmt: skip
    got = summarize(runs, num_output_tokens=1100)
    assert got["vllm"]["median_seconds"] == 11.0
    assert got["vllm"]["median_output_tok_per_s"] == pytest.approx(100.0)
    assert got["vlmserve"]["rounds"] == 2
    assert got["vlmserve"]["median_seconds"] == 30.0
    assert got["ratio_vlmserve_over_vllm"] == pytest.approx(11.0 / 30.0)


def test_summarize_without_a_successful_vllm_round_has_no_ratio():
    got = summarize([{"system": "vllm", "error": "refused"}, _run("vlmserve", 2.0)], 10)
    assert got["vllm"] is None
    assert got["ratio_vlmserve_over_vllm"] is None


def test_last_error_is_the_last_exception_line():
    log = "INFO start\nValueError: first\nTraceback\nRuntimeError: Engine core failed\nINFO bye\n"
    assert last_error(log) == "RuntimeError: Engine core failed"
    assert last_error("just noise\n") == "just noise"


def test_core_list_compacts_ranges():
    assert core_list({0, 1}) == "0-1"
    assert core_list({0, 1, 2, 3, 6, 8, 9}) == "0-3,6,8-9"
    assert core_list({5}) == "5"


def _point(rate: float, completed: float, failed: int = 0) -> dict:
    return {"rate": rate, "completed_per_s": completed, "failed": failed}


def test_saturation_is_the_knee_of_completed_against_offered_rate():
    assert not is_saturated(None, _point(0.5, 0.4))  # one point cannot tell
    assert not is_saturated(_point(0.5, 0.45), _point(1.0, 0.9))  # served the added load
    assert is_saturated(_point(1.0, 0.9), _point(2.0, 1.2))  # 0.3 of 1.0 more served
    assert is_saturated(None, _point(0.5, 0.4, failed=1))


def test_pass_order_alternates_within_and_across_rates():
    assert pass_order(0, 2) == [(0, "vllm"), (0, "vlmserve"), (1, "vlmserve"), (1, "vllm")]
    assert pass_order(1, 1) == [(0, "vlmserve"), (0, "vllm")]
    # Odd repeats: the next rate starts with the server that went second last.
    assert [s for _, s in pass_order(1, 3)][:2] == ["vlmserve", "vllm"]
    for k in range(4):  # every server gets every pass once
        order = pass_order(k, 3)
        assert sorted(order) == sorted((j, s) for j in range(3) for s in ("vllm", "vlmserve"))


def _pass(completed: float, ttft_p99: float, tpot_p50: float | None, failed: int = 0) -> dict:
    return {
        "rate": 1.0, "requests": 8, "failed": failed, "errors": ["e"] if failed else [],
        "completed_per_s": completed, "output_tok_per_s": 10 * completed,
        "ttft_s": {"p50": ttft_p99 / 2, "p90": ttft_p99 / 1.5, "p99": ttft_p99},
        "tpot_s": {"p50": tpot_p50, "p90": None, "p99": None}, "idle_cpu_s": completed,
    }  # fmt: skip


def test_median_point_takes_medians_over_passes_and_sums_failures():
    passes = [_pass(0.9, 3.0, 0.05), _pass(0.5, 1.0, 0.2, failed=1), _pass(0.7, 2.0, None)]
    point = median_point(passes)
    assert point["completed_per_s"] == 0.7 and point["output_tok_per_s"] == 7.0
    assert point["ttft_s"]["p99"] == 2.0 and point["ttft_s"]["p50"] == 1.0
    assert point["tpot_s"]["p50"] == pytest.approx(0.125)  # the passes that have one
    assert point["tpot_s"]["p99"] is None
    assert point["requests"] == 24 and point["failed"] == 1 and point["errors"] == ["e"]
    assert point["idle_cpu_s"] == 0.9 and point["passes"] == passes
    assert is_saturated(None, point)  # a failed request in any pass


def test_chat_payloads_keep_text_lengths_and_carry_the_image(tmp_path):
    image = tmp_path / "a.jpg"
    image.write_bytes(b"\xff\xd8jpeg")
    requests = [
        {"prompt_token_ids": [5] * 7, "max_tokens": 3},
        {"prompt": "p", "question": "what colour", "image": str(image), "max_tokens": 4},
    ]
    (text, n_text), (chat, n_image) = chat_payloads(requests)
    assert len(text[0]["content"].split()) == 7 and n_text == 3
    image_part, question = chat[0]["content"]
    assert image_part["image_url"]["url"] == "data:image/jpeg;base64,/9hqcGVn"
    assert question == {"type": "text", "text": "what colour"} and n_image == 4


def test_chat_payload_variants_share_lengths_not_content(tmp_path):
    image = tmp_path / "a.jpg"
    image.write_bytes(b"\xff\xd8jpeg")
    requests = [
        {"prompt_token_ids": [5] * 40, "max_tokens": 3},
        {"prompt": "p", "question": "q", "image": str(image), "max_tokens": 4},
    ]
    (text0, _), (chat0, _) = chat_payloads(requests, 0)
    (text1, _), (chat1, _) = chat_payloads(requests, 1)
    assert text0[0]["content"] != text1[0]["content"]
    assert len(text1[0]["content"].split()) == 40
    assert (tmp_path / "a_v1.jpg").is_file()  # a new picture for the variant
    assert chat0[0]["content"][0] != chat1[0]["content"][0]


@pytest.mark.slow  # real processes burning CPU
def test_process_cpu_s_counts_a_server_session_and_its_children():
    # A "server" in its own session: it and a child each burn 0.3 s of CPU (process_time,
    # the kernel's own count), say so, then sleep. Their session's total must hold both.
    burn = "import time\nwhile time.process_time() < 0.3: pass\nprint('done', flush=True)\n"
    leader = textwrap.dedent(f"""
        import subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c", {burn!r} + "time.sleep(60)"],
                                 stdout=subprocess.PIPE, text=True)
        exec({burn!r})
        child.stdout.readline()
        print("both", flush=True)
        time.sleep(60)
    """)
    proc = subprocess.Popen(
        [sys.executable, "-c", leader], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        assert proc.stdout.readline() == "done\n" and proc.stdout.readline() == "both\n"
        assert 0.55 <= process_cpu_s(proc.pid) < 5.0
        assert process_cpu_s(2**22 + 1) == 0.0  # no such session
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the child is in the leader's process group
        proc.wait()


def test_dtype_reaches_both_engines_and_names_the_result(tmp_path):
    """--dtype bfloat16: vs_vllm_bf16.json; the spec's engine record carries the dtype both
    workers and both servers take (--dtype on each); the KV sizing counts 2-byte elements."""
    from benchmarks.lib import vs_vllm_serve, vs_vllm_workloads
    from benchmarks.serving.vs_vllm import parse_args

    assert parse_args(["--dtype", "bfloat16"]).name == "vs_vllm_bf16"
    assert parse_args(["--dtype", "bfloat16", "--serve"]).name == "vs_vllm_serve_bf16"
    assert parse_args([]).name == "vs_vllm"
    args = vs_vllm_workloads.text_args(quick=True)
    args.dtype = "bfloat16"
    engine = vs_vllm_workloads._engine(args, 4096, [100], [10])
    assert engine["dtype"] == "bfloat16"
    half = vs_vllm_workloads.kv_bytes_per_token(args)
    args.dtype = "float32"
    assert vs_vllm_workloads.kv_bytes_per_token(args) == 2 * half
    spec = {
        "engine": engine,
        "model": str(tmp_path),
        "workload": "text",
        "kv_bytes_per_token": half,
    }
    ns = argparse.Namespace(vllm_python="python", speculative_tokens=None)
    for system in ("vllm", "vlmserve"):
        cmd = vs_vllm_serve.server_command(system, spec, ns, 1234)
        assert cmd[cmd.index("--dtype") + 1] == "bfloat16"


def test_speculative_tokens_reach_each_engine_and_name_the_result():
    """Each engine as shipped by default (vlmserve's adaptive γ, vLLM without drafts);
    --speculative-tokens K sets ours (0: none), --vllm-speculative-tokens K vLLM's, both
    drafting n-grams of the same lengths, vLLM through its ngram method (offline only)."""
    import importlib.util

    from benchmarks.serving import vs_vllm

    real = ["--workload", "real", "--dtype", "bfloat16"]
    args = vs_vllm.parse_args(real)
    assert (args.name, args.speculative_tokens, args.vllm_speculative_tokens) == (
        "vs_vllm_real_bf16",
        None,
        0,
    )
    assert vs_vllm.workloads.ngram_config(None).num_speculative_tokens is None  # the default
    args = vs_vllm.parse_args([*real, "--speculative-tokens", "0"])
    assert (args.name, args.speculative_tokens) == ("vs_vllm_real_bf16_spec0", 0)
    args = vs_vllm.parse_args([*real, "--speculative-tokens", "4", "--vllm-speculative-tokens=4"])
    assert (args.name, args.vllm_speculative_tokens) == ("vs_vllm_real_bf16_spec4_vllm4", 4)
    with pytest.raises(SystemExit):
        vs_vllm.parse_args(["--serve", "--vllm-speculative-tokens", "4"])
    serve = vs_vllm.parse_args(["--serve", "--speculative-tokens", "0"])
    spec = {"workload": "real", "model": "m", "engine": {"dtype": "bfloat16", "max_num_seqs": 64,
            "max_num_batched_tokens": 2048, "max_model_len": 4096, "kv_cache_gib": 1}}  # fmt: skip
    cmd = server_command("vlmserve", spec, serve, 1234)
    assert cmd[cmd.index("--speculative-tokens") + 1] == "0"
    spec = importlib.util.spec_from_file_location("vllm_worker", vs_vllm.VLLM_WORKER)
    worker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(worker)
    ngram = worker._ngram(4)
    assert ngram["method"] == "ngram" and ngram["num_speculative_tokens"] == 4
    ours = vs_vllm.workloads.ngram_config(4)
    assert (ngram["prompt_lookup_min"], ngram["prompt_lookup_max"]) == (ours.min_n, ours.max_n)
    assert ours.num_speculative_tokens == 4 and ours.adaptive


def test_gemma3_workload_names_its_result_and_prices_the_hybrid_kv(tmp_path):
    """--workload gemma3: vs_vllm_gemma3.json (offline only); its KV report: sliding layers
    hold their window, so at 8k context the 12-layer 5:1 shape with a 256 window holds
    (2 x 8192 + 10 x 256) / (12 x 8192) of all-global."""
    import json

    from benchmarks.lib import vs_vllm_workloads
    from benchmarks.serving.vs_vllm import parse_args

    assert parse_args(["--workload", "gemma3"]).name == "vs_vllm_gemma3"
    assert parse_args(["--workload", "gemma3", "--quick"]).name == "vs_vllm_gemma3_quick"
    with pytest.raises(SystemExit):
        parse_args(["--workload", "gemma3", "--serve"])
    layer_types = (["sliding_attention"] * 5 + ["full_attention"]) * 2
    config = {"model_type": "gemma3", "text_config": {
        "model_type": "gemma3_text", "hidden_size": 768, "num_attention_heads": 12,
        "num_key_value_heads": 4, "head_dim": 64, "num_hidden_layers": 12,
        "intermediate_size": 2048, "vocab_size": 32000, "sliding_window": 256,
        "layer_types": layer_types}}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    kv = vs_vllm_workloads.kv_report(tmp_path, 8192, 4)
    mine = kv["checkpoint"]
    assert mine["all_global_bytes"] == 8192 * 2 * 12 * 4 * 64 * 4
    assert mine["hybrid_over_all_global"] == pytest.approx((2 * 8192 + 10 * 256) / (12 * 8192))
    assert 0.2 < kv["gemma-3-4b"]["hybrid_over_all_global"] < 0.3


def test_real_payloads_are_the_spec_then_other_prose_of_the_same_lengths(monkeypatch):
    from benchmarks.lib import vs_vllm_serve

    monkeypatch.setattr(vs_vllm_serve, "_real_corpus", lambda: list(range(1000, 3000)))
    requests = [{"prompt_token_ids": [2, 7, 8, 9], "max_tokens": 5},
                {"prompt_token_ids": [2] + [4] * 30, "max_tokens": 6}]  # fmt: skip
    spec = {"workload": "real"}
    assert vs_vllm_serve.payloads_of(spec, requests, 0) == [([2, 7, 8, 9], 5), ([2] + [4] * 30, 6)]
    one, two = vs_vllm_serve.payloads_of(spec, requests, 1), vs_vllm_serve.payloads_of(
        spec, requests, 2)  # fmt: skip
    for variant in (one, two):
        assert [len(ids) for ids, _ in variant] == [4, 31] and [n for _, n in variant] == [5, 6]
        assert all(ids[0] == 2 and all(t >= 1000 for t in ids[1:]) for ids, _ in variant)
    assert one != two
    assert vs_vllm_serve.payloads_of(spec, requests, 1) == one  # the same for both servers


def test_real_serving_gives_vlmserve_vllms_kv_bytes_and_is_allowed(tmp_path):
    """--serve --workload real: the KV budget as bytes (Gemma 3's sliding layers keep blocks
    of their own, so vLLM's GiB are not a count of full-attention blocks)."""
    from benchmarks.lib import vs_vllm_serve
    from benchmarks.serving.vs_vllm import parse_args

    args = parse_args(["--serve", "--workload", "real", "--dtype", "bfloat16"])
    assert args.name == "vs_vllm_serve_real_bf16" and args.serve_rates_real[0] == 0.1
    engine = {"dtype": "bfloat16", "max_num_seqs": 256, "max_num_batched_tokens": 2048,
              "max_model_len": 2048, "kv_cache_gib": 2}  # fmt: skip
    spec = {"engine": engine, "model": str(tmp_path), "workload": "real"}
    cmd = vs_vllm_serve.server_command("vlmserve", spec, args, 1234)
    assert cmd[cmd.index("--kv-cache-mb") + 1] == "2048" and "--num-kv-blocks" not in cmd


@pytest.mark.slow  # a server on a real port
def test_one_request_streams_a_completion_of_token_ids_and_a_chat(llava_ov_path):
    """The load generator's two request kinds against our server on a loopback port: a
    completion of token ids (the real workload) and a chat, each ignore_eos to max_tokens."""
    import asyncio

    import httpx

    from benchmarks.reliability.server import in_process_server
    from benchmarks.serving.serve_load import one_request
    from scheduler.config import CacheConfig
    from vlmserve.config import EngineConfig, ModelConfig
    from vlmserve.engine.core import Engine
    from vlmserve.server.app import ServerConfig, create_app

    config = EngineConfig(
        ModelConfig(str(llava_ov_path)), CacheConfig(num_blocks=256, block_size=4)
    )
    app = create_app(lambda: Engine(config), ServerConfig(model_name="m"))

    async def both(url: str):
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            ids = await one_request(client, "real", [1, 5, 9, 13, 17], 6)
            chat = await one_request(client, "chat", [{"role": "user", "content": "hi"}], 4)
            return ids, chat

    with in_process_server(app) as url:
        ids, chat = asyncio.run(both(url))
    assert ids.ok and ids.num_output_tokens == 6 and ids.ttft_s is not None, ids
    assert ids.tpot_s is not None and ids.num_prompt_tokens == 5  # those ids, no template
    assert chat.ok and chat.num_output_tokens == 4 and chat.ttft_s is not None, chat
