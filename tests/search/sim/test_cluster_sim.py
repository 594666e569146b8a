"""N replicas behind the router on simulated time, and the recurring-image trace."""

from __future__ import annotations

import json

import pytest

from scheduler.routing.policy import ReplicaRouter, RouterConfig
from search.costmodel.presets import get_accelerator, get_encoder, get_model
from search.image_budget import ImageAssumptions
from search.sim.affinity_trace import AffinityShape, affinity_trace, describe
from search.sim.cluster_sim import simulate_cluster
from search.sim.step_time import StepHardware
from search.sim.trace_sim import simulate
from search.sim.traces import TraceImage, TraceRequest, read_jsonl, to_jsonl

HW = StepHardware(get_model("llama-3-8b"), get_encoder("siglip-so400m-14-384"),
                  get_accelerator("h100-sxm"), ImageAssumptions(), 2)  # fmt: skip


def test_one_replica_is_the_one_engine_simulator():
    trace = affinity_trace(30, 20.0, seed=3)
    alone = {r.request_id: (r.first_token_s, r.finish_s) for r in simulate(trace, HW).records}
    cluster = simulate_cluster(trace, HW, 1, RouterConfig("pow2"))
    assert {r.request_id: (r.first_token_s, r.finish_s) for r in cluster.records} == alone
    assert cluster.num_routed == [30] and cluster.reasons == {"balance": 30}


def where(result) -> dict[str, int]:
    return {r.request_id: i for i, rep in enumerate(result.replicas) for r in rep.records}


def test_a_conversation_stays_on_one_replica_and_every_request_finishes():
    trace = affinity_trace(60, 30.0, seed=1)
    # No load bound: a conversation never moves.
    no_bound = RouterConfig("cache_aware", load_factor=1e6, share_window=0)
    result = simulate_cluster(trace, HW, 4, no_bound)
    assert not result.hang and sum(result.num_routed) == 60
    assert all(r.finish_s is not None for r in result.records)
    placed = where(result)
    by_session: dict[str, set[int]] = {}
    for req in trace:
        by_session.setdefault(req.session_id, set()).add(placed[req.request_id])
    assert any(len([r for r in trace if r.session_id == s]) > 1 for s in by_session)
    assert all(len(replicas) == 1 for replicas in by_session.values())


def test_encoder_hits_are_images_already_on_the_chosen_replica():
    # One image, eight requests far apart (each done before the next): ours sends the
    # repeats where it is (7 hits; no share bound, which would spread this hot image);
    # pow2 hits wherever it happens to have been before.
    image = (TraceImage("same", 4),)
    trace = [TraceRequest(f"r{i}", 10.0 * i, "image", 20, 8, image) for i in range(8)]
    ours = simulate_cluster(trace, HW, 2, RouterConfig("cache_aware", share_window=0))
    assert (ours.num_image_lookups, ours.num_image_hits) == (8, 7)
    pow2 = simulate_cluster(trace, HW, 2, RouterConfig("pow2"), seed=5)
    placed = where(pow2)
    seen: set[int] = set()
    expected = 0
    for req in trace:
        expected += placed[req.request_id] in seen
        seen.add(placed[req.request_id])
    assert pow2.num_image_hits == expected < 7


def test_the_oracle_sends_an_image_where_a_cache_holds_it():
    # The pow2 router alone misses (seed 5, above); the oracle peeks into the caches.
    image = (TraceImage("same", 4),)
    trace = [TraceRequest(f"r{i}", 10.0 * i, "image", 20, 8, image) for i in range(8)]
    oracle = simulate_cluster(trace, HW, 2, RouterConfig("pow2"), seed=5, oracle=True)
    assert (oracle.num_image_lookups, oracle.num_image_hits) == (8, 7)
    assert oracle.reasons == {"balance": 1, "image": 7}


def test_the_router_sees_each_replicas_kv_use(monkeypatch):
    seen: list[dict] = []
    real = ReplicaRouter.choose

    def spy(self, keys, loads, kv_usage=None):
        seen.append(dict(kv_usage))
        return real(self, keys, loads, kv_usage)

    monkeypatch.setattr(ReplicaRouter, "choose", spy)
    simulate_cluster(affinity_trace(40, 40.0, seed=2), HW, 2, RouterConfig())
    assert all(set(kv) == {0, 1} and all(0.0 <= v <= 1.0 for v in kv.values()) for kv in seen)
    assert any(v > 0.0 for kv in seen for v in kv.values())  # requests hold KV blocks


def test_the_affinity_trace_continues_conversations_and_round_trips_jsonl(tmp_path):
    shape = AffinityShape(num_images=10, followup_share=0.5, max_turns=3)
    trace = affinity_trace(200, 10.0, shape, seed=0)
    assert trace == affinity_trace(200, 10.0, shape, seed=0)
    turns: dict[str, list[TraceRequest]] = {}
    for req in trace:
        turns.setdefault(req.session_id, []).append(req)
    chats = [t for t in turns.values() if len(t) > 1]
    assert chats and max(len(t) for t in turns.values()) == 3
    for t in chats:
        assert len({(r.system_prompt_id, r.images) for r in t}) == 1
        assert all(a.num_text_tokens < b.num_text_tokens for a, b in zip(t, t[1:], strict=False))
    pool = {im.content_hash for r in trace for im in r.images} - {
        f"own{r.request_id[1:]}" for r in trace
    }
    assert pool <= {f"img{k}" for k in range(10)}
    path = tmp_path / "t.jsonl"
    path.write_text(to_jsonl(trace))
    assert read_jsonl(path) == trace
    assert json.loads(path.read_text().splitlines()[0])["session_id"] == trace[0].session_id


def test_the_default_trace_holds_the_issues_stated_shape():
    # AffinityShape's defaults as its docstring states them: a pool of 300 images that
    # half the conversations reuse by Zipf(0.8), 0.3 with an image of their own, 35% of
    # requests a later turn. Counted here from the requests, not by `describe`.
    trace = affinity_trace(6000, 50.0, seed=11)
    opening: dict[str, TraceRequest] = {}
    for req in trace:
        opening.setdefault(req.session_id, req)
    keys = [r.images[0].content_hash if r.images else None for r in opening.values()]
    pool = [k for k in keys if k is not None and k.startswith("img")]
    own = [k for k in keys if k is not None and k.startswith("own")]
    assert len(pool) + len(own) + keys.count(None) == len(keys)
    assert abs(len(pool) / len(keys) - 0.5) < 0.03 and abs(len(own) / len(keys) - 0.3) < 0.03
    assert abs((len(trace) - len(keys)) / len(trace) - 0.35) < 0.03
    assert {int(k[3:]) for k in pool} <= set(range(300)) and len(set(pool)) > 250
    assert len(set(own)) == len(own)  # an own image belongs to one conversation
    # Zipf(0.8): the 10 most popular images draw sum(k^-0.8, k <= 10) / sum(k <= 300).
    expected = sum(k**-0.8 for k in range(1, 11)) / sum(k**-0.8 for k in range(1, 301))
    top = sum(int(k[3:]) < 10 for k in pool) / len(pool)
    assert abs(top - expected) < 0.04, (top, expected)
    # Every turn of a conversation resends its image: image requests outnumber openings.
    assert sum(1 for r in trace if r.images) > len(pool) + len(own)


def test_describe_counts_conversations_and_images():
    a, own = (TraceImage("img0", 2),), (TraceImage("own3", 1),)
    trace = [
        TraceRequest("r0", 0.0, "image", 8, 4, a, session_id="s0"),
        TraceRequest("r1", 1.0, "text", 8, 4, (), session_id="s1"),
        TraceRequest("r2", 2.0, "image", 20, 4, a, session_id="s0"),
        TraceRequest("r3", 3.0, "image", 8, 4, own, session_id="s3"),
    ]
    assert describe(trace) == {
        "num_requests": 4, "num_conversations": 3, "pool_share": 1 / 3, "unique_share": 1 / 3,
        "followup_share": 0.25, "num_pool_images_drawn": 1, "num_image_requests": 3,
        "num_distinct_images": 2,
    }  # fmt: skip


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="num_replicas"):
        simulate_cluster(affinity_trace(5, 1.0), HW, 0)
    with pytest.raises(ValueError, match="followup_share"):
        AffinityShape(followup_share=1.5)
    with pytest.raises(ValueError, match="exceeds 1"):
        AffinityShape(pool_share=0.6, unique_share=0.5)
