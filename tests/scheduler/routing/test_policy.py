"""The replica routing policy: affinity order, the load bound, power of two, bounded state."""

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
    r = router(max_imbalance=4)
    r.record(RouteKeys(image_keys=((IMG_A, 700),)), "r1")
    keys = RouteKeys(image_keys=((IMG_A, 700),))
    d = r.choose(keys, {"r0": 0, "r1": 4})
    assert (d.replica, d.reason, d.cached_tokens) == ("r1", "image", 700)
    # r1's queue 5 longer than r0's: over the bound, the least loaded of the two wins.
    d = r.choose(keys, {"r0": 0, "r1": 5})
    assert (d.replica, d.reason) == ("r0", "balance")


def test_longest_prefix_wins_over_the_most_recent_shorter_one():
    r = router()
    r.record(RouteKeys(block_hashes=tuple(H[:3])), "r1")  # 3 blocks on r1
    r.record(RouteKeys(block_hashes=tuple(H[:1])), "r2")  # then block 0 again on r2
    d = r.choose(RouteKeys(block_hashes=tuple(H[:4]), block_size=16), {"r0": 0, "r1": 1, "r2": 0})
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
    r = router()
    r.record(RouteKeys(session="conv-1"), "r1")
    for _ in range(20):
        d = r.choose(RouteKeys(session="conv-1"), {"r0": 0, "r1": 3})
        assert (d.replica, d.reason) == ("r1", "session")
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
    r = router()
    r.record(RouteKeys(image_keys=((IMG_A, 10),), session="s"), "dead")
    r.record(RouteKeys(image_keys=((IMG_B, 10),)), "alive")
    r.keep_only({"alive", "fresh"})  # "dead" was restarted as "fresh"
    assert r.num_entries == (1, 0, 0)
    assert r.choose(RouteKeys(image_keys=((IMG_B, 10),)), {"alive": 2, "fresh": 0}).replica == (
        "alive"
    )
    d = r.choose(RouteKeys(image_keys=((IMG_A, 10),), session="s"), {"alive": 2, "fresh": 0})
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
    with pytest.raises(ValueError, match="no replica"):
        router().choose(RouteKeys(), {})


def test_equal_matches_go_to_the_shorter_queue_and_holders_are_bounded():
    r = router(max_holders=2)
    for replica in ("r1", "r2", "r3"):  # r1 is dropped: two holders, most recent kept
        r.record(RouteKeys(block_hashes=(H[0],)), replica)
    d = r.choose(RouteKeys(block_hashes=(H[0],)), {"r1": 0, "r2": 2, "r3": 1})
    assert (d.replica, d.reason) == ("r3", "prefix")
    assert r._blocks[H[0]] == ("r2", "r3")
