"""`vlmserve estimate pipeline`: the door to the auto-search, on a GPU preset (synthetic
profiles) and on this CPU (measured), with its caches and its errors."""

import json

import pytest

from search.nanoflow.schedule import Schedule, check
from tests.vlmserve.cli.test_estimate_cli import PNG_MAGIC, run_cli

# A small GQA decoder's HF config: the search and a CPU profile of it both take seconds.
TINY = {
    "model_type": "llama",
    "hidden_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "intermediate_size": 768,
    "vocab_size": 1000,
}


@pytest.fixture
def tiny_config(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY))
    return str(path)


def test_gpu_preset_table_plot_and_cache(tmp_path, tiny_config, capsys):
    cache, plot = tmp_path / "cache", tmp_path / "gantt.png"
    argv = ["pipeline", "--model", tiny_config, "--accelerator", "a100", "--dense-batch", "256"]
    argv += ["--decode-context", "4096", "--cache-dir", str(cache), "--time-limit", "1.5"]
    code, out, err = run_cli(capsys, *argv, "--plot", str(plot))
    assert code == 0, err
    assert "pipeline: " in out and "dense batch 256 (synthetic profiles)" in out
    assert "compute  qkv" in out and f"wrote {plot}" in err
    assert plot.read_bytes()[:8] == PNG_MAGIC
    assert sorted(p.name.split("-")[0] for p in cache.iterdir()) == ["profile", "schedule"]
    code, out, _ = run_cli(capsys, *argv, "--json")
    doc = json.loads(out)
    assert code == 0 and doc["cached"] is True
    doc.pop("command"), doc.pop("cached")
    assert check(Schedule.from_json(json.dumps(doc))) == []


@pytest.mark.slow
def test_cyclic_search_prints_its_period_and_caches_apart(tmp_path, tiny_config, capsys):
    cache = tmp_path / "cache"
    argv = ["pipeline", "--model", tiny_config, "--accelerator", "a100", "--dense-batch", "256"]
    argv += ["--decode-context", "4096", "--cache-dir", str(cache), "--time-limit", "1.5"]
    code, out, err = run_cli(capsys, *argv, "--cyclic", "--json")
    assert code == 0, err
    doc = json.loads(out)
    doc.pop("command"), doc.pop("cached")
    schedule = Schedule.from_json(json.dumps(doc))
    assert schedule.notes["cyclic"] is True and check(schedule) == []
    period = schedule.notes["period_us"]
    if period is not None:  # overlap pays: a layer every period, under the layer's span
        assert period <= schedule.makespan_us + 1e-6
        assert period < schedule.sequential_us
    assert [p.name for p in cache.glob("schedule-*")][0].endswith("-b256-cyclic.json")
    code, out, _ = run_cli(capsys, *argv, "--cyclic")
    assert code == 0 and "cached" in out
    assert ("period " in out) == (period is not None)


@pytest.mark.slow
def test_under_tp_both_partitionings_are_searched_and_the_faster_kept(
    tmp_path, tiny_config, capsys
):
    cache = tmp_path / "cache"
    argv = ["pipeline", "--model", tiny_config, "--accelerator", "a100", "--dense-batch", "256"]
    argv += ["--tp", "2", "--cache-dir", str(cache), "--time-limit", "1.5"]
    code, out, err = run_cli(capsys, *argv, "--json")
    assert code == 0, err
    doc = json.loads(out)
    costs = doc["notes"]["partitioning_costs_us"]
    assert set(costs) == {"allreduce", "allgather"}
    assert doc["notes"]["partitioning"] == min(costs, key=costs.get)
    assert len(list(cache.glob("schedule-*"))) == 2  # one per partitioning
    code, out, _ = run_cli(capsys, *argv)
    assert code == 0 and "cached" in out and "partitioning      " in out
    code, out, _ = run_cli(capsys, *argv, "--partitioning", "allgather", "--json")
    doc = json.loads(out)
    assert doc["cached"] is True and doc["notes"]["partitioning"] == "allgather"
    assert "partitioning_costs_us" not in doc["notes"]


@pytest.mark.slow
def test_cpu_profiles_are_measured_then_reused(tmp_path, tiny_config, capsys):
    cache = tmp_path / "cache"
    argv = ["pipeline", "--model", tiny_config, "--accelerator", "cpu", "--dense-batch", "64"]
    argv += ["--cache-dir", str(cache), "--time-limit", "1.5"]
    code, out, err = run_cli(capsys, *argv)
    assert code == 0, err
    assert "(measured profiles)" in out
    profile = next(cache.glob("profile-*-cpu.json"))
    saved = profile.read_text()
    assert json.loads(saved)["granularity"] == 16
    code, out, _ = run_cli(capsys, *argv, "--dense-batch", "48")
    assert code == 0 and profile.read_text() == saved  # 48 <= 64 profiled rows: reused


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--accelerator", "a100", "--dense-batch", "100"], "multiple of 128"),
        (["--accelerator", "cpu", "--model", "llama-3-8b"], "too big to profile"),
        (["--accelerator", "cpu", "--tp", "2"], "--tp must be 1"),
        (["--time-limit", "0"], "--time-limit"),
        (["--plot", "x.svg"], "--plot"),
    ],
)
def test_errors_are_one_line_and_exit_2(argv, message, tmp_path, capsys):
    code, _, err = run_cli(capsys, "pipeline", "--cache-dir", str(tmp_path), *argv)
    assert code == 2 and message in err and "Traceback" not in err
