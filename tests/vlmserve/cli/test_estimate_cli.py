"""``vlmserve estimate``: tables, JSON, plots and error exits, through ``register()``.

Expected figures are the article's (§11 Table 4, §17), not this code's output.
"""

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from vlmserve.cli.estimate.labs import read_image_size
from vlmserve.cli.estimate.main import register

REPO = Path(__file__).resolve().parents[3]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vlmserve")
    register(parser.add_subparsers())
    return parser


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    args = make_parser().parse_args(["estimate", *argv])
    code = args.func(args)
    out, err = capsys.readouterr()
    return code, out, err


def within3(expected: float):
    return pytest.approx(expected, rel=0.03)


# --- image (Lab 4) ----------------------------------------------------------------------


def test_image_table_reproduces_s17(capsys):
    # §17: 13 tiles, 9,477 patch tokens, ≈ 2,370 visual tokens, 1.24 GB, about 50
    code, out, err = run_cli(capsys, "image", "--width", "2048", "--height", "1536")
    assert code == 0 and err == ""
    assert "13 tiles" in out and "9,477" in out and "2,370" in out
    assert "1.24 GB" in out
    assert "concurrent conversations  50" in out


def test_image_json(capsys):
    code, out, _ = run_cli(capsys, "image", "--width", "2048", "--height", "1536", "--json")
    assert code == 0
    doc = json.loads(out)
    r = doc["results"]
    assert doc["command"] == "image"
    assert r["patch_tokens_per_image"] == 9477
    assert r["ttft_s"] == within3(0.118)  # §17: "TTFT ≈ 118 ms"
    assert r["kv_bytes_per_image"] == within3(1.24e9)
    assert r["concurrent_requests"] == within3(50)


def test_image_four_images_about_twelve(capsys):
    # §17: "about twelve if users attach four images each"
    argv = ["image", "--width", "2048", "--height", "1536", "--images", "4", "--json"]
    code, out, _ = run_cli(capsys, *argv)
    assert code == 0 and json.loads(out)["results"]["concurrent_requests"] == within3(12)


def test_image_file_header_only(tmp_path, capsys):
    # A JPEG cut off after its header still gives its size: no pixel is decoded.
    full = tmp_path / "full.jpg"
    Image.new("RGB", (2048, 1536), (120, 80, 40)).save(full, quality=50)
    cut = tmp_path / "cut.jpg"
    cut.write_bytes(full.read_bytes()[:1024])
    assert read_image_size(str(cut)) == (2048, 1536)
    code, out, _ = run_cli(capsys, "image", str(cut))
    assert code == 0 and "2048 x 1536" in out and "13 tiles" in out


def test_image_exif_rotation_swaps_sides(tmp_path):
    path = tmp_path / "rotated.jpg"
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90° on display
    Image.new("RGB", (300, 200)).save(path, exif=exif)
    assert read_image_size(str(path)) == (200, 300)


# --- kv, plan, batching (Labs 1–3) ---------------------------------------------------


def test_kv_table_table2_row(capsys):
    # Table 2: Llama-2-7B (MHA) 512 KiB per token, 68.7 GB at 128k
    code, out, _ = run_cli(capsys, "kv", "--model", "llama-2-7b", "--context", "131072")
    assert code == 0
    assert "512 KiB" in out and "68.7 GB" in out


def test_kv_reads_an_hf_config(tmp_path, capsys):
    cfg = {
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "intermediate_size": 14336,
        "vocab_size": 128256,
    }
    (tmp_path / "config.json").write_text(json.dumps({"text_config": cfg}))  # fmt: skip
    code, out, _ = run_cli(capsys, "kv", "--model", str(tmp_path), "--json")
    assert code == 0
    assert json.loads(out)["results"]["kv_bytes_per_token"] == 128 * 1024  # Table 2


def test_plan_table_rows(capsys):
    code, out, _ = run_cli(capsys, "plan")
    assert code == 0
    for label in ("fits?", "TTFT", "TPOT", "E2E latency", "per-user tok/s", "decode intensity"):
        assert label in out


def test_plan_flags_tp_past_n_kv(capsys):
    argv = ["plan", "--model", "llama-3-70b", "--tp", "16"]
    code, out, _ = run_cli(capsys, *argv)
    assert code == 0 and "cache replicated" in out


def test_batching_json_table4_row(capsys):
    # Table 4, 8,192: B_cross 15, throughput ceiling 3,120 tok/s; §11: B* 295, B_max 57
    code, out, _ = run_cli(capsys, "batching", "--context", "8192", "--json")
    assert code == 0
    r = json.loads(out)["results"]
    assert r["b_star"] == within3(295)
    assert r["b_cross"] == within3(15)
    assert r["b_max"] == 57
    assert r["throughput_ceiling"] == within3(3120)
    assert r["intensity_ceiling"] == within3(19.0)


def test_cpu_accelerator_is_measured(capsys):
    code, out, _ = run_cli(capsys, "kv", "--accelerator", "cpu", "--json")
    assert code == 0 and json.loads(out)["accelerator"]["name"] == "cpu"


@pytest.mark.parametrize(
    "argv",
    [
        ["kv", "--context", "4096"],
        ["plan", "--batch", "4"],
        ["batching", "--context", "32768"],
        ["image", "--width", "1920", "--height", "1080"],
    ],
)
def test_plot_writes_a_png(tmp_path, capsys, argv):
    path = tmp_path / "curves.png"
    code, out, err = run_cli(capsys, *argv, "--plot", str(path))
    assert code == 0 and f"wrote {path}" in err
    assert path.read_bytes()[:8] == PNG_MAGIC


# --- errors: a message on stderr, exit code 2, no traceback --------------------------


@pytest.mark.parametrize(
    "argv,message",
    [
        (["kv", "--model", "gpt-5"], "unknown model"),
        (["kv", "--model", "/no/such/config.json"], "not found"),
        (["kv", "--accelerator", "tpu-v9"], "unknown accelerator"),
        (["kv", "--context", "0"], "context"),
        (["kv", "--workspace-gb", "-1"], "workspace"),
        (["image", "--width", "100"], "go together"),
        (["image", "--width", "0", "--height", "10"], "positive"),
        (["image", "--encoder", "clip", "--width", "9", "--height", "9"], "unknown vision encoder"),
        (["image"], "needs the image size"),
        (["image", "--width", "9", "--height", "9", "--pooling", "0"], "pooling"),
        (["plan", "--tp", "3"], "divide"),
        (["plan", "--plot", "out.jpg"], ".png"),
        (["batching", "--plot", "/no/such/dir/out.png"], "folder"),
    ],
)
def test_bad_input_exits_2_with_message(capsys, argv, message):
    code, out, err = run_cli(capsys, *argv)
    assert code == 2
    assert message in err and "Traceback" not in err
    assert out == ""


def test_unreadable_image_exits_2(tmp_path, capsys):
    bad = tmp_path / "photo.png"
    bad.write_bytes(b"this is not an image")
    code, _, err = run_cli(capsys, "image", str(bad))
    assert code == 2 and "cannot read image" in err


def test_image_and_size_together_rejected(tmp_path, capsys):
    path = tmp_path / "a.png"
    Image.new("RGB", (10, 10)).save(path)
    code, _, err = run_cli(capsys, "image", str(path), "--width", "10", "--height", "10")
    assert code == 2 and "not both" in err


def test_estimate_without_command_exits_2(capsys):
    code, _, err = run_cli(capsys)
    assert code == 2 and "choose one of" in err


def test_bad_choice_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as exc:
        make_parser().parse_args(["estimate", "kv", "--kv-dtype", "int4"])
    assert exc.value.code == 2


# --- as a separate process --------------------------------------------------------------

DRIVER = (
    "import argparse, sys; from vlmserve.cli.estimate.main import register; "
    "p = argparse.ArgumentParser(prog='vlmserve'); register(p.add_subparsers()); "
    "a = p.parse_args(sys.argv[1:]); sys.exit(a.func(a))"
)


def run_process(*argv: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-c", DRIVER, "estimate", *argv]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)


@pytest.mark.slow  # two `vlmserve estimate` subprocesses
def test_subprocess_json_and_error_exit():
    ok = run_process("batching", "--context", "131072", "--json")
    assert ok.returncode == 0, ok.stderr
    # Table 4, 131,072: throughput ceiling 195 tok/s
    assert json.loads(ok.stdout)["results"]["throughput_ceiling"] == within3(195)
    bad = run_process("image", "--model", "nope", "--width", "10", "--height", "10")
    assert bad.returncode == 2
    assert "unknown model" in bad.stderr and "Traceback" not in bad.stderr


# --- capacity (trace simulator) ---------------------------------------------------------


@pytest.mark.slow
def test_capacity_table_per_class(capsys):
    argv = ["capacity", "--mix", "vlm", "--num-requests", "80", "--rate", "2"]
    code, out, err = run_cli(capsys, *argv)
    assert code == 0 and err == ""
    for label in ("text (n=", "image (n=", "all (n=80)", "goodput", "preemptions", "lost / hang"):
        assert label in out
    assert "0 / no" in out


def test_capacity_trace_json_plot_and_refusal(tmp_path, capsys):
    from search.sim.traces import lumpy_trace, to_jsonl

    trace = tmp_path / "lumpy.jsonl"
    trace.write_text(to_jsonl(lumpy_trace(4.0, 10.0, 3.0, 3, 1.0, seed=0, num_never_fits=1)))
    png = tmp_path / "kv.png"
    argv = ["capacity", "--trace", str(trace), "--json", "--plot", str(png)]
    code, out, _ = run_cli(capsys, *argv)
    assert code == 0 and png.read_bytes()[:8] == PNG_MAGIC
    doc = json.loads(out)
    r = doc["results"]
    assert doc["command"] == "capacity"
    assert r["num_refused"] == 1 and r["num_lost"] == 0 and r["hang"] is False
    classes = {c["request_class"]: c for c in r["classes"]}
    assert classes["never-fits"]["num_refused"] == 1
    assert classes["4x13-tile"]["num_finished"] == 3
    assert doc["timeline"] and 0 < r["peak_kv_occupancy"] <= 1
    # The SLO classes, by whether a request carries images: the never-fits one has an image.
    by_images = {c["request_class"]: c for c in r["by_images"]}
    assert by_images["image"]["num_requests"] == 4 and by_images["image"]["num_refused"] == 1
    assert by_images["text"]["num_requests"] == classes["text"]["num_requests"]
    assert by_images["text"]["num_slo_met"] == classes["text"]["num_slo_met"]


def test_capacity_prints_slo_attainment_and_percentiles_per_class(capsys):
    argv = ["capacity", "--mix", "vlm", "--num-requests", "60", "--rate", "2"]
    code, out, _ = run_cli(capsys, *argv)
    assert code == 0
    for cls in ("text", "image"):
        [line] = [x for x in out.splitlines() if f"class {cls} (n=" in x]
        assert "SLO met" in line and "TTFT p50/p90/p99" in line and "TPOT p50/p99" in line


def test_capacity_find_max_rate(capsys):
    argv = ["capacity", "--mix", "chat", "--num-requests", "40", "--find-max-rate"]
    argv += ["--slo-ttft-ms", "50", "--accelerator", "h200", "--json"]
    code, out, _ = run_cli(capsys, *argv)
    assert code == 0
    doc = json.loads(out)
    search = doc["rate_search"]
    assert search["max_rate"] > 0 and doc["rate"] == search["max_rate"]
    assert doc["accelerator"]["name"] == "h200"


@pytest.mark.slow  # three simulator runs of 3 replicas
def test_capacity_prices_replicas_behind_a_router(capsys):
    argv = ["capacity", "--mix", "affinity", "--num-requests", "120", "--rate", "12", "--json"]
    runs = {}
    for router in ("pow2", "cache_aware"):
        code, out, _ = run_cli(capsys, *argv, "--replicas", "3", "--router", router)
        assert code == 0
        runs[router] = json.loads(out)
    pow2, ours = runs["pow2"]["routing"], runs["cache_aware"]["routing"]
    assert pow2["num_replicas"] == ours["num_replicas"] == 3
    assert sum(pow2["requests_per_replica"]) == sum(ours["requests_per_replica"]) == 120
    assert pow2["reasons"] == {"balance": 120} and ours["reasons"].get("session", 0) > 0
    # Ours models each replica's encoder cache as the live router does: its bytes over a
    # visual token's (hidden x 2 bytes in the simulator); pow2 keeps no model.
    inputs, hidden = runs["cache_aware"]["inputs"], runs["cache_aware"]["model"]["hidden_size"]
    assert runs["cache_aware"]["router"]["encoder_cache_tokens"] == int(
        inputs["encoder_cache_gb"] * 1e9 // (hidden * 2)
    )
    assert runs["pow2"]["router"]["encoder_cache_tokens"] is None
    results = runs["cache_aware"]["results"]
    assert results["num_lost"] == 0 and results["classes"][-1]["num_finished"] == 120
    one = json.loads(run_cli(capsys, "capacity", "--mix", "affinity", "--num-requests", "20",
                             "--json")[1])  # fmt: skip
    assert one["routing"] is None and one["router"] is None


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--trace", "/nonexistent/trace.jsonl"], "cannot read trace"),
        (["--replicas", "0"], "--replicas"),
        (["--rate", "0"], "--rate"),
    ],
)
def test_capacity_bad_input_exits_2(capsys, argv, message):
    code, _, err = run_cli(capsys, "capacity", *argv)
    assert code == 2 and message in err


# --- kv --tp (article §16: the cache shards min(n, n_kv) ways, then replicates) ---------


def test_kv_tp_per_gpu_bytes_and_replication(capsys):
    # llama-3-8b: L = 32, n_kv = 8, d_head = 128, bf16 cache: 2·32·8·128·2 = 131,072 B a
    # token (128 KiB). Per GPU: / min(n, 8). "A GQA-8 model on 16-way tensor parallelism
    # holds two copies of every cache" (§16).
    per_token = {}
    for tp in (1, 4, 8, 16):
        code, out, _ = run_cli(capsys, "kv", "--tp", str(tp), "--json")
        assert code == 0
        results = json.loads(out)["results"]
        per_token[tp] = results["kv_bytes_per_token_per_device"]
        assert results["kv_replicas"] == (2 if tp == 16 else 1)
        assert results["kv_bytes_per_token"] == 131_072
    assert per_token == {1: 131_072, 4: 32_768, 8: 16_384, 16: 16_384}
    code, out, _ = run_cli(capsys, "kv", "--tp", "16")
    assert code == 0
    assert "KV per token per GPU   16 KiB" in out
    assert "1 of 8 (2 copies of each KV head)" in out
    assert "17.2 GB (2 copies)" in out  # 8 sequences x 8,192 tokens x 128 KiB, twice
    assert "tp=16 > n_kv=8: cache replicated" in out
    code, _, err = run_cli(capsys, "kv", "--tp", "3")
    assert code == 2 and "does not divide the 32 attention heads" in err


def test_kv_and_image_know_gemma3(capsys):
    code, out, _ = run_cli(capsys, "kv", "--model", "gemma-3-4b", "--context", "8192")
    assert code == 0
    assert "29 of 34, window 1,024" in out
    assert re.search(r"hybrid KV / all global\s+25%", out)
    # The engine's manager: 512 blocks of the global group + 6 sliding groups x 65 blocks
    # (a window of 1,024 in blocks of 16, +1), 5 layers a block (the last group has 4).
    assert "902 blocks of 5 layers" in out and "26% of all global" in out
    code, out, _ = run_cli(capsys, "image", "--model", "gemma-3-27b", "--width", "900",
                           "--height", "600")  # fmt: skip
    assert code == 0 and "siglip-so400m-14-896" in out and "256 per image (16:1" in out


@pytest.mark.parametrize("model", ["gemma-3-4b", "gemma-3-27b"])
def test_image_gemma3_pan_and_scan_is_the_engines_rule(capsys, model):
    """`--tiling pan-and-scan`: the crops and tokens the engine gives the same size."""
    from encoders.tiling.pan_and_scan import pan_and_scan_layout

    for (width, height), crops in {(1000, 400): 3, (400, 1000): 3, (4000, 500): 4,
                                   (599, 500): 0, (896, 896): 0}.items():  # fmt: skip
        code, out, _ = run_cli(capsys, "image", "--model", model, "--width", str(width),
                               "--height", str(height), "--tiling", "pan-and-scan")  # fmt: skip
        layout = pan_and_scan_layout(width, height, tokens_per_image=256, enabled=True)
        assert code == 0 and len(layout.crops) == crops
        assert f"whole image + {crops} crops = {1 + crops} tiles" in out
        assert f"{layout.num_tokens:,} per image (16:1" in out
