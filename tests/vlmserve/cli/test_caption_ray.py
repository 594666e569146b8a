"""`vlmserve caption --ray`: the job on a real local Ray cluster (a head and 2 worker
nodes, started and stopped here) gives the single-process job's lines, and a rerun after
the job is killed halfway writes each item exactly once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from vlmserve.cli.caption_ray import (
    LOCAL,
    RayConfig,
    parse_actors,
    pool_size,
    ray_config_from_args,
    ray_init_kwargs,
)

ROOT = Path(__file__).resolve().parents[3]
NUM_SCENES = 9
# The fields that must match the single-process job (timings and prefix-cache hits differ).
SAME = ("path", "caption", "finish_reason", "num_prompt_tokens", "num_image_tokens",
        "num_output_tokens", "error", "error_type")  # fmt: skip
JOB_ARGS = ["--max-tokens", "40", "--no-progress", "--preprocess-workers", "0"]
# Ray Data reads its own deprecated settings when it copies its context.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:ray.data.context")


def test_actor_flags_and_cluster_sizing():
    assert parse_actors("2") == (2, 2) and parse_actors("1,4") == (1, 4)
    for bad in ("0", "3,2", "x", "1,2,3"):
        with pytest.raises(ValueError, match="--ray-actors"):
            parse_actors(bad)
    # A local cluster always has room for the largest pool and the read map.
    local = ray_init_kwargs(RayConfig(max_actors=8, cpus_per_actor=2, object_store_mb=200))
    assert local["address"] == LOCAL and local["num_cpus"] >= 17
    assert local["object_store_memory"] == 200 << 20 and not local["include_dashboard"]
    remote = ray_init_kwargs(RayConfig(address="10.0.0.1:6379"))
    assert remote["address"] == "10.0.0.1:6379" and "num_cpus" not in remote
    # Unbounded: as many actors as the cluster's CPUs hold beside the read map.
    assert pool_size(RayConfig(cpus_per_actor=2), 16.0) == (1, 7)
    assert pool_size(RayConfig(min_actors=2), 1.0) == (2, 2)
    with pytest.raises(ValueError, match="min_actors"):
        RayConfig(min_actors=3, max_actors=2)


def test_cli_flags_build_the_ray_config():
    from vlmserve.cli.main import build_parser

    parse = build_parser().parse_args
    args = parse(["caption", "in", "-o", "out.jsonl", "--ray", "--max-in-flight", "8"])
    assert ray_config_from_args(args) == RayConfig(batch_size=16)
    args = parse(["caption", "in", "-o", "o", "--ray", "auto", "--ray-actors", "2,6",
                  "--ray-cpus-per-actor", "4", "--ray-batch-size", "5"])  # fmt: skip
    assert ray_config_from_args(args) == RayConfig(
        address="auto", min_actors=2, max_actors=6, cpus_per_actor=4, batch_size=5
    )
    assert parse(["caption", "in", "-o", "o"]).ray is None  # without --ray: the plain job


@pytest.fixture(scope="module")
def scenes(tmp_path_factory) -> Path:
    from vlmserve.embedded.evaluate import heldout_scenes
    from vlmserve.embedded.scenes import render_scene

    root = tmp_path_factory.mktemp("scenes")
    for i, scene in enumerate(heldout_scenes(NUM_SCENES)):
        render_scene(scene).save(root / f"s{i}.{'png' if i % 2 else 'jpg'}", quality=95)
    (root / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 truncated")  # a per-item error
    return root


@pytest.fixture(scope="module")
def cluster():
    """A head node (the read map's CPU) and 2 worker nodes of one CPU each (an engine
    actor each), on this machine; its workers import this checkout."""
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    saved = {k: os.environ.get(k) for k in ("PYTHONPATH", "RAY_USAGE_STATS_ENABLED")}
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), saved["PYTHONPATH"]]))
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    node = {"num_cpus": 1, "object_store_memory": 80 << 20}
    cluster = Cluster(initialize_head=True, head_node_args={**node, "include_dashboard": False})
    try:
        for _ in range(2):
            cluster.add_node(**node)
        cluster.wait_for_nodes()
        yield cluster.address
    finally:
        if ray.is_initialized():
            ray.shutdown()
        workers = worker_pids(cluster)
        cluster.shutdown()
        for pid in workers:  # one still in an actor's constructor outlives its raylet a while
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for key, value in saved.items():
            os.environ.pop(key, None) if value is None else os.environ.__setitem__(key, value)


def worker_pids(cluster) -> set[int]:
    """The cluster's worker processes: the children of its raylets."""
    nodes = [cluster.head_node, *cluster.worker_nodes]
    raylets = {p.process.pid for node in nodes for p in node.all_processes.get("raylet", [])}
    pids = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if parent in raylets:
            pids.add(int(stat.parent.name))
    return pids


def whole_lines(path: Path) -> list[dict]:
    """The records on disk; a killed writer's partial last line is not one."""
    data = path.read_bytes() if path.exists() else b""
    return [json.loads(line) for line in data[: data.rfind(b"\n") + 1].splitlines()]


@pytest.mark.slow
def test_ray_job_matches_the_single_process_job_and_resumes_after_a_kill(scenes, cluster, tmp_path):
    from vlmserve.cli.main import main

    single = tmp_path / "single.jsonl"
    assert main(["caption", str(scenes), "-o", str(single), *JOB_ARGS]) == 0
    expected = {r["id"]: r for r in whole_lines(single)}
    assert len(expected) == NUM_SCENES + 1 and expected["broken.jpg"]["caption"] is None

    out = tmp_path / "ray.jsonl"
    ray_args = [*JOB_ARGS, "--ray", cluster, "--ray-batch-size", "1", "--ray-actors"]
    job = ["caption", str(scenes), "-o", str(out), *ray_args, "1"]
    with (tmp_path / "job.log").open("w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "vlmserve.cli", *job], cwd=ROOT, stdout=log, stderr=log
        )
        try:  # kill the job (no chance to clean up) once some lines are on disk
            deadline = time.monotonic() + 300
            while len(whole_lines(out)) < 2:
                assert proc.poll() is None, (tmp_path / "job.log").read_text()
                assert time.monotonic() < deadline, "no lines from the Ray job"
                time.sleep(0.02)
            proc.send_signal(signal.SIGKILL)
        finally:
            proc.kill()
            proc.wait()
    killed = whole_lines(out)
    assert 2 <= len(killed) < len(expected), "killed halfway"
    print(f"killed with {len(killed)} of {len(expected)} lines on disk")

    # The rerun, on both workers: the killed job's lines stay, the rest are appended.
    assert main(["caption", str(scenes), "-o", str(out), *ray_args, "2"]) == 0
    records = whole_lines(out)
    ids = [r["id"] for r in records]
    assert len(ids) == len(set(ids)), "no item twice"
    assert set(ids) == set(expected), "none missing"
    assert [r["id"] for r in records[: len(killed)]] == [r["id"] for r in killed]
    for record in records:
        want = expected[record["id"]]
        assert {k: record.get(k) for k in SAME} == {k: want.get(k) for k in SAME}
    assert sum(r["caption"] is not None for r in records) == NUM_SCENES
