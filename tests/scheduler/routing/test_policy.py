"""The replica routing policy: affinity order, the load bounds (prefix's absolute one, ours
bounded loads on queue + KV and on traffic share), power of two, bounded state."""

from __future__ import annotations

from collections import Counter

import pytest

from scheduler.routing.policy import ReplicaRouter, RouteKeys, RouterConfig

H = [bytes([i]) * 16 for i in range(10)]  # stand-in block hashes (chained in real use)
IMG_A, IMG_B = b"A" * 16, b"B" * 16


def router(kind: str = "cache_aware", **kw) -> ReplicaRouter:
    return ReplicaRouter(RouterConfig(kind=kind, **kw), seed=0)


def test_power_of_two_never_picks_the_longest_queue_of_three():
    r = router("pow2")
    loads = {"a": 0, "b": 1, "c": 9}
    picks = Counter(r.choose(RouteKeys(), loads).replica for _ in range(600))
    # Pairs {a,b} and {a,c} go to a, {b,c} to b: a 2/3, b 1/3, c never.
    assert picks["c"] == 0
    assert 340 < picks["a"] < 460 and 140 < picks["b"] < 260


def test_image_affinity_wins_within_the_bound_and_yields_past_it():
    # Bounded loads, eps 0.25, loads {r0: 0, r1: q}: r1 may take one more while
    # q <= 1.25 * (q + 1) / 2, the mean with it placed: q = 1 (1 <= 1.25), not q = 2.
    r = router(load_factor=0.25, share_window=0)
    r.record(RouteKeys(image_keys=((IMG_A, 700),)), "r1")
    keys = RouteKeys(image_keys=((IMG_A, 700),))
    d = r.choose(keys, {"r0": 0, "r1": 1})
    assert (d.replica, d.reason, d.cached_tokens) == ("r1", "image", 700)
    # q = 2: 2 > 1.875, over the bound: the least loaded of the two wins.
    d = r.choose(keys, {"r0": 0, "r1": 2})
    assert (d.replica, d.reason) == ("r0", "balance")
    # 8 replicas holding 8 requests: capacity 1.25 * 9 / 8 = 1.41, so 1 fits and 2 not.
    many = {f"r{i}": 1 for i in range(8)}
    assert r.choose(keys, many).replica == "r1"
    assert r.choose(keys, many | {"r0": 0, "r1": 2}).reason == "balance"


def test_the_prefix_router_keeps_its_absolute_bound():
    r = router("prefix", max_imbalance=4)
    r.record(RouteKeys(text_block_hashes=(H[0],)), "r1")
    keys = RouteKeys(text_block_hashes=(H[0],))
    assert r.choose(keys, {"r0": 0, "r1": 4}).replica == "r1"
    assert r.choose(keys, {"r0": 0, "r1": 5}).reason == "balance"


def test_longest_prefix_wins_over_the_most_recent_shorter_one():
    r = router(share_window=0)
    r.record(RouteKeys(block_hashes=tuple(H[:3])), "r1")  # 3 blocks on r1
    r.record(RouteKeys(block_hashes=tuple(H[:1])), "r2")  # then block 0 again on r2
    d = r.choose(RouteKeys(block_hashes=tuple(H[:4]), block_size=16), {"r0": 1, "r1": 1, "r2": 0})
    # r2 holds the most recent copy of block 0 only (16 tokens); r1 blocks 1-2 (48).
    assert (d.replica, d.reason, d.cached_tokens) == ("r1", "prefix", 48)


def test_a_prefix_match_stops_at_the_first_unseen_block():
    r = router()
    r.record(RouteKeys(block_hashes=(H[5],)), "r1")  # a block seen only deep in another chain
    d = r.choose(RouteKeys(block_hashes=(H[0], H[5])), {"r0": 0, "r1": 0})
    assert d.reason == "balance"


def test_image_tokens_outweigh_a_short_text_prefix():
    r = router()
    r.record(RouteKeys(block_hashes=(H[0], H[1])), "r1")  # 32 tokens of system prompt
    r.record(RouteKeys(image_keys=((IMG_B, 500),)), "r2")
    keys = RouteKeys(image_keys=((IMG_B, 500),), block_hashes=(H[0], H[1]))
    d = r.choose(keys, {"r1": 0, "r2": 0})
    assert (d.replica, d.reason, d.cached_tokens) == ("r2", "image", 500)


def test_prefix_kind_sees_text_only_and_ignores_images():
    r = router("prefix")
    r.record(RouteKeys(image_keys=((IMG_A, 900),), text_block_hashes=(H[0],)), "r1")
    r.record(RouteKeys(image_keys=((IMG_B, 900),), text_block_hashes=(H[1],)), "r2")
    # Image A with r2's text: a text router follows the text, ours the image.
    keys = RouteKeys(image_keys=((IMG_A, 900),), text_block_hashes=(H[1],))
    assert r.choose(keys, {"r1": 0, "r2": 0}).replica == "r2"
    ours = router()
    ours.record(RouteKeys(image_keys=((IMG_A, 900),), text_block_hashes=(H[0],)), "r1")
    ours.record(RouteKeys(image_keys=((IMG_B, 900),), text_block_hashes=(H[1],)), "r2")
    assert ours.choose(keys, {"r1": 0, "r2": 0}).replica == "r1"


def test_a_session_stays_on_its_replica_and_pow2_ignores_it():
    r = router(share_window=0)
    r.record(RouteKeys(session="conv-1"), "r1")
    for _ in range(20):
        d = r.choose(RouteKeys(session="conv-1"), {"r0": 1, "r1": 2})
        assert (d.replica, d.reason) == ("r1", "session")
    # Past the bound: r1 holds 4 of 4 in flight, capacity 1.25 * 5 / 2 = 3.1.
    d = r.choose(RouteKeys(session="conv-1"), {"r0": 0, "r1": 4})
    assert (d.replica, d.reason) == ("r0", "balance")
    p = router("pow2")
    p.record(RouteKeys(session="conv-1"), "r1")
    assert p.choose(RouteKeys(session="conv-1"), {"r0": 0, "r1": 3}).replica == "r0"


def test_state_is_bounded_least_recently_used_first():
    r = router(max_keys=3, max_sessions=2)
    for i in range(5):
        r.record(RouteKeys(block_hashes=(H[i],), session=f"s{i}"), "r1")
    r.record(RouteKeys(block_hashes=(H[2],)), "r1")  # refreshes H[2]
    r.record(RouteKeys(block_hashes=(H[5],)), "r1")  # evicts the oldest: H[3]
    assert r.num_entries == (0, 3, 2)
    assert list(r._blocks) == [H[4], H[2], H[5]]
    assert list(r._sessions) == ["s3", "s4"]


def test_a_removed_replica_loses_its_affinity_and_the_others_keep_theirs():
    r = router(share_window=0)
    r.record(RouteKeys(image_keys=((IMG_A, 10),), session="s"), "dead")
    r.record(RouteKeys(image_keys=((IMG_B, 10),)), "alive")
    r.keep_only({"alive", "fresh"})  # "dead" was restarted as "fresh"
    assert r.num_entries == (1, 0, 0)
    assert r.choose(RouteKeys(image_keys=((IMG_B, 10),)), {"alive": 1, "fresh": 0}).replica == (
        "alive"
    )
    d = r.choose(RouteKeys(image_keys=((IMG_A, 10),), session="s"), {"alive": 1, "fresh": 0})
    assert (d.replica, d.reason) == ("fresh", "balance")


def test_affinity_to_a_replica_not_in_the_live_list_is_ignored():
    r = router()
    r.record(RouteKeys(image_keys=((IMG_A, 10),)), "gone")
    assert r.choose(RouteKeys(image_keys=((IMG_A, 10),)), {"x": 0}).replica == "x"


def test_config_refuses_bad_values():
    with pytest.raises(ValueError, match="router kind"):
        RouterConfig(kind="random")
    with pytest.raises(ValueError, match="max_imbalance"):
        RouterConfig(max_imbalance=-1)
    with pytest.raises(ValueError, match="load_factor"):
        RouterConfig(load_factor=-0.1)
    with pytest.raises(ValueError, match="no replica"):
        router().choose(RouteKeys(), {})


def test_equal_matches_go_to_the_shorter_queue_and_holders_are_bounded():
    r = router(max_holders=2, share_window=0)
    for replica in ("r1", "r2", "r3"):  # r1 is dropped: two holders, most recent kept
        r.record(RouteKeys(block_hashes=(H[0],)), replica)
    d = r.choose(RouteKeys(block_hashes=(H[0],)), {"r1": 0, "r2": 2, "r3": 1})
    assert (d.replica, d.reason) == ("r3", "prefix")
    assert r._blocks[H[0]] == ("r2", "r3")


def hot_image_run(r: ReplicaRouter, num_replicas: int, num_requests: int, finish: bool) -> list:
    """Route `num_requests` of one image; queues are the requests routed and (without
    `finish`) never finished, else every replica idle. Returns requests per replica."""
    routed = {f"r{i}": 0 for i in range(num_replicas)}
    keys = RouteKeys(image_keys=((IMG_A, 700),))
    for _ in range(num_requests):
        queues = dict.fromkeys(routed, 0) if finish else routed
        d = r.choose(keys, queues)
        if d.reason == "image" and not finish:  # an affinity placement respects the capacity
            mean_after = (sum(routed.values()) + 1) / num_replicas
            assert routed[d.replica] <= (1 + r.config.load_factor) * mean_after
        r.record(keys, d.replica)
        routed[d.replica] += 1
    return sorted(routed.values())


def test_bounded_loads_hold_a_hot_image_within_one_plus_eps_of_the_mean():
    # Every request wants the image of the first replica to see it; nothing finishes.
    counts = hot_image_run(router(load_factor=0.25, share_window=0), 8, 400, finish=False)
    assert max(counts) <= 1.25 * 400 / 8 + 1
    # With no bound (a huge eps) affinity takes all of them to the first holder.
    unbounded = hot_image_run(router(load_factor=1e6, share_window=0), 8, 400, finish=False)
    assert max(unbounded) == 400


def test_the_share_bound_spreads_a_hot_image_when_queues_stay_empty():
    # Requests finish before the next arrives (light load): queues never tell replicas
    # apart, the share of recent traffic does.
    counts = hot_image_run(router(share_window=32), 2, 400, finish=True)
    assert max(counts) / 200 <= 1.3
    # Without the share bound every request follows the image to one replica.
    assert hot_image_run(router(share_window=0), 2, 400, finish=True) == [0, 400]


def test_kv_use_pushes_an_affinity_target_past_the_bound():
    # Queues {r0: 0, r1: 1} leave r1 within capacity (1.25 * 2 / 2 = 1.25) ...
    r = router(kv_weight=4.0, share_window=0)
    r.record(RouteKeys(image_keys=((IMG_A, 700),)), "r1")
    keys = RouteKeys(image_keys=((IMG_A, 700),))
    assert r.choose(keys, {"r0": 0, "r1": 1}, {"r0": 0.0, "r1": 0.0}).replica == "r1"
    # ... a half-full KV pool adds 2: load 3 of capacity 1.25 * 4 / 2 = 2.5, over.
    d = r.choose(keys, {"r0": 0, "r1": 1}, {"r0": 0.0, "r1": 0.5})
    assert (d.replica, d.reason) == ("r0", "balance")
    # With kv_weight 0 the KV pool is not looked at.
    off = router(kv_weight=0.0, share_window=0)
    off.record(RouteKeys(image_keys=((IMG_A, 700),)), "r1")
    assert off.choose(keys, {"r0": 0, "r1": 1}, {"r0": 0.0, "r1": 0.5}).replica == "r1"


def test_power_of_two_weighs_kv_use_for_ours_and_not_for_the_default():
    loads, kv = {"a": 2, "b": 2}, {"a": 1.0, "b": 0.0}
    ours = router()
    assert {ours.choose(RouteKeys(), loads, kv).replica for _ in range(50)} == {"b"}
    pow2 = router("pow2")  # Ray Serve's default: queue lengths only (ties to the first drawn)
    assert {pow2.choose(RouteKeys(), loads, kv).replica for _ in range(50)} == {"a", "b"}


def test_decisions_are_a_function_of_the_seed():
    def run(seed: int) -> list:
        r = ReplicaRouter(RouterConfig(), seed=seed)
        out = []
        for i in range(200):
            keys = RouteKeys(image_keys=((bytes([i % 7]) * 16, 100),), session=f"s{i % 13}")
            loads = {f"r{j}": (i * (j + 3)) % 5 for j in range(6)}
            d = r.choose(keys, loads)
            r.record(keys, d.replica)
            out.append(d)
        return out

    assert run(3) == run(3)
    assert run(3) != run(4)  # the power-of-two draws differ


def test_an_unseen_image_is_placed_by_load_not_pulled_by_a_shared_system_prompt():
    # r1 holds the system prompt's blocks; the request's image was never seen.
    keys = RouteKeys(image_keys=((IMG_B, 500),), block_hashes=(H[0], H[1]))
    ours = router(share_window=0)
    ours.record(RouteKeys(block_hashes=(H[0], H[1])), "r1")
    picks = {ours.choose(keys, {"r0": 0, "r1": 0, "r2": 0}).reason for _ in range(20)}
    assert picks == {"balance"}
    # Text-only requests still follow the prefix, and with image_first off so do these.
    assert ours.choose(RouteKeys(block_hashes=(H[0], H[1])), {"r0": 0, "r1": 0}).replica == "r1"
    prefix_pull = router(share_window=0, image_first=False)
    prefix_pull.record(RouteKeys(block_hashes=(H[0], H[1])), "r1")
    assert prefix_pull.choose(keys, {"r0": 0, "r1": 0, "r2": 0}).reason == "prefix"


def img(i: int, weight: int) -> RouteKeys:
    return RouteKeys(image_keys=((bytes([65 + i]) * 16, weight),))


def test_an_image_the_replicas_encoder_cache_evicted_no_longer_pulls():
    # r1's encoder cache: 100 tokens, LRU. Images 0, 1, 2 of 40 tokens each: the third
    # evicts the first (120 > 100); image 1, used again, outlives image 2.
    r = router(share_window=0, encoder_cache_tokens=100)
    for i in (0, 1, 2):
        r.record(img(i, 40), "r1")
    loads = {"r0": 0, "r1": 0}
    assert r.choose(img(0, 40), loads).reason == "balance"
    assert (r.choose(img(1, 40), loads).replica, r.choose(img(2, 40), loads).reason) == (
        "r1",
        "image",
    )
    r.record(img(1, 40), "r1")
    r.record(img(3, 40), "r1")  # evicts image 2, the least recently sent
    assert [r.choose(img(i, 40), loads).reason for i in (1, 2, 3)] == ["image", "balance", "image"]
    # The eviction is r1's alone: r0 still holds image 2 once sent there.
    r.record(img(2, 40), "r0")
    assert r.choose(img(2, 40), {"r0": 0, "r1": 0}).replica == "r0"
    # An image larger than the whole cache is never held; without the model, all are.
    r.record(img(4, 101), "r1")
    assert r.choose(img(4, 101), loads).reason == "balance"
    unbounded = router(share_window=0)
    for i in (0, 1, 2, 3, 4):
        unbounded.record(img(i, 40 if i < 4 else 101), "r1")
    assert {unbounded.choose(img(i, 1), loads).reason for i in range(5)} == {"image"}
    with pytest.raises(ValueError, match="encoder_cache_tokens"):
        RouterConfig(encoder_cache_tokens=0)


def test_a_removed_replica_forgets_its_encoder_cache():
    r = router(share_window=0, encoder_cache_tokens=100)
    r.record(img(0, 60), "r1")
    r.remove_replica("r1")
    loads = {"r0": 0, "r1": 0}
    assert r.choose(img(0, 60), loads).reason == "balance"
    # The restarted replica's cache starts empty: 60 + 40 tokens fit (a count still
    # holding the dead replica's 60 tokens would evict image 1 at once).
    r.record(img(1, 60), "r1")
    r.record(img(2, 40), "r1")
    assert [r.choose(img(i, 1), loads).reason for i in (1, 2)] == ["image", "image"]


def test_the_encoder_cache_size_set_later_models_the_cache_from_then_on():
    # The live router exists before its replicas report their caches' size.
    r = router(share_window=0)
    r.set_encoder_cache_tokens(100)
    assert r.config.encoder_cache_tokens == 100
    for i in (0, 1, 2):  # 3 x 40 tokens > 100: image 0 is evicted
        r.record(img(i, 40), "r1")
    loads = {"r0": 0, "r1": 0}
    assert [r.choose(img(i, 40), loads).reason for i in (0, 1, 2)] == ["balance", "image", "image"]
    with pytest.raises(ValueError, match="encoder_cache_tokens"):
        r.set_encoder_cache_tokens(0)


def test_the_encoder_cache_model_holds_at_most_max_keys_images_a_replica():
    # Tiny weights in a huge cache: the entries, not the tokens, bound the model.
    r = router(share_window=0, encoder_cache_tokens=10**9, max_keys=3)
    for i in range(5):
        r.record(img(i, 1), "r1")
    assert len(r._encoded["r1"]) == 3  # internal: the bound on the router's state
    loads = {"r0": 0, "r1": 0}
    assert [r.choose(img(i, 1), loads).reason for i in (2, 3, 4)] == ["image"] * 3


def test_keep_only_forgets_a_gone_replicas_cache_model_held_nowhere_else():
    # max_keys=1: image 0 leaves the image table when image 1 comes, so r1 is known only
    # to its encoder-cache model; a fresh replica list without r1 must drop that too.
    r = router(share_window=0, encoder_cache_tokens=100, max_keys=1)
    r.record(img(0, 10), "r1")
    r.record(img(1, 10), "r2")
    r.keep_only({"r2"})
    assert set(r._encoded) == {"r2"}  # internal: nothing of r1 left
