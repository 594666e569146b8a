"""Which replica serves a request: cache affinity bounded by load, else power of two.

One policy, three kinds (the benchmark's routers):
  * `pow2`: Ray Serve's default: two replicas drawn at random, the shorter queue wins.
  * `prefix`: what SGLang's router and Ray Serve LLM's prefix-cache-affinity router do:
    the replica that most recently served the longest shared prefix of the prompt's
    *text* (images are invisible to them), unless its queue is more than
    `max_imbalance` longer than the shortest (their absolute imbalance threshold).
  * `cache_aware` (ours): a pinned session first (`x-session-id` or `user`); then the
    replica holding the most cached work for this request: the images it most recently
    encoded (keyed by content, weighted by their visual tokens) plus its longest shared
    prefix of block hashes computed as the prefix cache computes them (images by
    content); among the replicas holding it, the next best (a second holder) before
    none. With `image_first`, a request with images follows only its images: an image no
    replica holds is placed by load, not by a shared text prefix (a system prompt is
    cheap to prefill anywhere, an image costs an encode, and placing new images by load
    spreads them over all the encoder caches instead of onto the few replicas holding
    the popular system prompts).

Ours bounds affinity by load the way consistent hashing with bounded loads does
(Mirrokni, Thorup, Zadimoghaddam 2018): a replica may take one more request by affinity
only while its load is at most (1 + eps) x the mean load with this request placed,
eps = `load_factor`, so no replica exceeds (1 + eps) x the mean + 1 through affinity. The bound
is applied to two loads: what a replica holds now (its queue plus `kv_weight` x the
share of its KV pool in use: a long-context queue weighs more than a short one) and its
share of the recent traffic (requests routed to it, decayed over `share_window`
requests a replica), which is the load of the near future: queues show a hot spot only
once it has formed, shares before. Past the bound: power of two choices on queue + KV.

Given each replica's encoder-cache size (`encoder_cache_tokens`, in the image keys'
weights), ours keeps an LRU of the images it sent each replica as the cache does, so an
image the replica has evicted since stops counting as held there.

The state (who served which image key, block hash and session) is three LRU maps, each
bounded, of at most `max_holders` replicas a key (among equal matches the lighter load
wins), and one decayed count a replica; a replica that goes away (death, restart,
scale-down) loses its entries, since its caches went with it.

Pure and torch-free: Ray Serve's request router (`vlmserve/replicas/ray_router.py`) and
the N-replica simulator (`search/sim/cluster_sim.py`) run this same class.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, replace
from typing import Literal

__all__ = [
    "ROUTERS",
    "Decision",
    "ReplicaRouter",
    "RouteKeys",
    "RouterConfig",
    "encoder_cache_tokens",
]

RouterKind = Literal["pow2", "prefix", "cache_aware"]
ROUTERS: tuple[RouterKind, ...] = ("pow2", "prefix", "cache_aware")
Reason = Literal["session", "image", "prefix", "balance"]
ReplicaId = Hashable


@dataclass(frozen=True)
class RouteKeys:
    """What a router may know of a request before any replica sees it."""

    # (image content key, its weight in tokens: the visual tokens a hit saves)
    image_keys: tuple[tuple[bytes, int], ...] = ()
    # Chained hashes of the prompt's full blocks, images hashed by content (the prefix
    # cache's view) ...
    block_hashes: tuple[bytes, ...] = ()
    # ... and of its text alone (what a text-prefix router sees: images left out).
    text_block_hashes: tuple[bytes, ...] = ()
    block_size: int = 16  # tokens (or key units) per block: a match's length in tokens
    session: str | None = None  # `x-session-id` or the OpenAI `user` field


@dataclass(frozen=True)
class RouterConfig:
    kind: RouterKind = "cache_aware"
    # `prefix`: affinity wins unless its replica's queue exceeds the shortest by more.
    max_imbalance: int = 4
    # `cache_aware`: eps of the bounded loads; a replica's KV pool, full, counts as
    # `kv_weight` queued requests; shares of traffic decay over `share_window` requests a
    # replica (0: no share bound).
    load_factor: float = 0.25
    kv_weight: float = 4.0
    share_window: int = 32
    # `cache_aware`: a request with images goes by affinity only to a replica holding
    # one of them; a text-prefix match alone does not pull it (see the module doc).
    image_first: bool = True
    max_keys: int = 200_000  # image keys + block hashes remembered (LRU)
    max_sessions: int = 50_000
    # Replicas remembered per image key or block hash, most recent last: a prefix that
    # spilled to a second replica spreads over both instead of piling onto the first.
    max_holders: int = 4
    # `cache_aware`: each replica's encoder cache in the image keys' weight (visual
    # tokens), the router keeping an LRU of what it sent each replica as the cache does:
    # an image the replica has evicted since no longer pulls a request there (a miss
    # that would queue behind its affinity). None: images are held until `max_keys` forgets.
    encoder_cache_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in ROUTERS:
            raise ValueError(f"router kind {self.kind!r}: expected one of {', '.join(ROUTERS)}")
        if self.max_imbalance < 0:
            raise ValueError(f"max_imbalance={self.max_imbalance} must be >= 0")
        if self.load_factor < 0 or self.kv_weight < 0 or self.share_window < 0:
            raise ValueError(
                f"load_factor={self.load_factor}, kv_weight={self.kv_weight} and "
                f"share_window={self.share_window} must be >= 0"
            )
        if self.encoder_cache_tokens is not None and self.encoder_cache_tokens < 1:
            raise ValueError(f"encoder_cache_tokens={self.encoder_cache_tokens} must be >= 1")
        if min(self.max_keys, self.max_sessions, self.max_holders) < 1:
            raise ValueError(
                f"max_keys={self.max_keys}, max_sessions={self.max_sessions} and "
                f"max_holders={self.max_holders} must be >= 1"
            )


def encoder_cache_tokens(cache_bytes: float, hidden_size: int, dtype_bytes: int) -> int | None:
    """An encoder cache of `cache_bytes` in visual tokens (`RouterConfig.
    encoder_cache_tokens`): it holds each image's pooled embeddings, `hidden_size` x
    `dtype_bytes` bytes a token. None: no cache (not one token fits)."""
    if hidden_size < 1 or dtype_bytes < 1:
        raise ValueError(f"hidden_size={hidden_size} and dtype_bytes={dtype_bytes} must be >= 1")
    tokens = int(cache_bytes // (hidden_size * dtype_bytes))
    return tokens if tokens >= 1 else None


@dataclass(frozen=True)
class Decision:
    replica: ReplicaId
    reason: Reason
    cached_tokens: int = 0  # the affinity score the choice was made on (0: balance)


class ReplicaRouter:
    """`choose` a replica for a request's keys given each live replica's queue length
    (and KV use); `record` where it went; `remove_replica` when one goes away."""

    def __init__(self, config: RouterConfig = RouterConfig(), seed: int | None = None) -> None:
        self.config = config
        self.rng = random.Random(seed)
        self._images: OrderedDict[bytes, ReplicaId] = OrderedDict()
        self._blocks: OrderedDict[bytes, ReplicaId] = OrderedDict()
        self._sessions: OrderedDict[str, ReplicaId] = OrderedDict()
        # Requests routed to each replica, decayed: sum over past routings of d^age.
        self._shares: dict[ReplicaId, float] = {}
        self._num_replicas = 1  # as of the last `choose` (the decay's horizon)
        # With `encoder_cache_tokens`: each replica's encoder cache as an LRU of the image
        # keys sent there, oldest first, with their weights; their sum stays within it.
        self._encoded: dict[ReplicaId, OrderedDict[bytes, int]] = {}
        self._encoded_tokens: dict[ReplicaId, int] = {}

    @property
    def num_entries(self) -> tuple[int, int, int]:
        """(image keys, block hashes, sessions) remembered."""
        return len(self._images), len(self._blocks), len(self._sessions)

    def choose(
        self,
        keys: RouteKeys,
        loads: Mapping[ReplicaId, int],
        kv_usage: Mapping[ReplicaId, float] | None = None,
    ) -> Decision:
        """`loads`: each live replica's queue (requests sent and not finished);
        `kv_usage`: the share of its KV pool in use, 0..1 (ours only; absent: 0)."""
        if not loads:
            raise ValueError("no replica to route to")
        self._num_replicas = len(loads)
        kind = self.config.kind
        if kind == "cache_aware":
            load = self.loads(loads, kv_usage)
            within = self.can_take(load)
        else:
            load = dict(loads)
            least = min(loads.values())
            within = {r for r, n in loads.items() if n - least <= self.config.max_imbalance}
        if kind == "cache_aware" and keys.session is not None:
            pinned = self._sessions.get(keys.session)
            if pinned in within:
                return Decision(pinned, "session")
        if kind != "pow2":
            # Most cached work among the replicas within the bound (the best holder, else
            # the next); among equals the lighter load. Past the bound a replica's cache
            # cannot buy it more work.
            scores = {r: v for r, v in self.affinity(keys, loads).items() if r in within}
            if kind == "cache_aware" and self.config.image_first and keys.image_keys:
                scores = {r: v for r, v in scores.items() if v[1] == "image"}
            if scores:
                best = max(scores, key=lambda r: (scores[r][0], -load[r]))
                return Decision(best, scores[best][1], scores[best][0])
        return Decision(self._power_of_two(load), "balance")

    def loads(
        self, queues: Mapping[ReplicaId, int], kv_usage: Mapping[ReplicaId, float] | None
    ) -> dict[ReplicaId, float]:
        """Each replica's load as ours weighs it: queue + kv_weight x KV pool share used."""
        kv = kv_usage or {}
        w = self.config.kv_weight
        return {r: q + w * min(1.0, max(0.0, kv.get(r, 0.0))) for r, q in queues.items()}

    def can_take(self, load: Mapping[ReplicaId, float]) -> set:
        """The replicas that may take one more request by affinity: both their load and
        their share of recent traffic stay within the bounded-load capacity."""
        ok = _within_capacity(load, self.config.load_factor)
        if self.config.share_window > 0:
            shares = {r: self._shares.get(r, 0.0) for r in load}
            ok &= _within_capacity(shares, self.config.load_factor)
        return ok

    def affinity(self, keys: RouteKeys, loads: Mapping[ReplicaId, int]) -> dict:
        """{replica: (cached tokens there, "image" | "prefix")} for the live replicas
        that hold any of this request's work, as far as this router has seen."""
        tokens: dict[ReplicaId, int] = {}
        image_tokens: dict[ReplicaId, int] = {}
        hashes = keys.block_hashes if self.config.kind == "cache_aware" else keys.text_block_hashes
        for i, h in enumerate(hashes):
            holders = self._blocks.get(h)
            if holders is None:
                break  # a chained hash: nothing past the first unseen block can match
            for owner in holders:
                if owner in loads:
                    tokens[owner] = (i + 1) * keys.block_size  # the longest match so far
        if self.config.kind == "cache_aware":
            for key, weight in keys.image_keys:
                for owner in self._images.get(key, ()):
                    if owner in loads:
                        image_tokens[owner] = image_tokens.get(owner, 0) + weight
        out = {}
        for r in tokens.keys() | image_tokens.keys():
            reason = "image" if image_tokens.get(r, 0) > 0 else "prefix"
            out[r] = (tokens.get(r, 0) + image_tokens.get(r, 0), reason)
        return out

    def _power_of_two(self, loads: Mapping[ReplicaId, float]) -> ReplicaId:
        replicas = sorted(loads, key=str)  # seeded draws independent of dict order
        if len(replicas) == 1:
            return replicas[0]
        a, b = self.rng.sample(replicas, 2)
        return b if loads[b] < loads[a] else a

    def record(self, keys: RouteKeys, replica: ReplicaId) -> None:
        """`replica` now serves `keys`: it is the most recent holder of each."""
        if self.config.kind == "pow2":
            return  # stateless
        cfg = self.config
        if cfg.kind == "cache_aware" and cfg.share_window > 0:
            decay = 1.0 - 1.0 / (cfg.share_window * self._num_replicas)
            for r in self._shares:
                self._shares[r] *= decay
            self._shares[replica] = self._shares.get(replica, 0.0) + 1.0
        if keys.session is not None and cfg.kind == "cache_aware":
            _put(self._sessions, keys.session, replica, cfg.max_sessions)
        hashes = keys.block_hashes if cfg.kind == "cache_aware" else keys.text_block_hashes
        for h in hashes:
            _add_holder(self._blocks, h, replica, cfg.max_keys, cfg.max_holders)
        if cfg.kind == "cache_aware":
            for key, _ in keys.image_keys:
                _add_holder(self._images, key, replica, cfg.max_keys, cfg.max_holders)
            if cfg.encoder_cache_tokens is not None:
                for key in self._encode(replica, keys.image_keys, cfg.encoder_cache_tokens):
                    self._drop_holder(self._images, key, replica)

    def _encode(
        self, replica: ReplicaId, image_keys: tuple[tuple[bytes, int], ...], capacity: int
    ) -> list[bytes]:
        """`replica`'s encoder cache takes `image_keys` (most recently used last) as an LRU
        of `capacity` tokens does: the keys it evicts. An image larger than the whole
        cache is not held (as `encoders.cache.EncoderCache` does not store it)."""
        lru = self._encoded.setdefault(replica, OrderedDict())
        total = self._encoded_tokens.get(replica, 0)
        for key, weight in image_keys:
            total -= lru.pop(key, 0)
            if weight <= capacity:
                lru[key] = weight
                total += weight
        evicted = []
        # The tokens bound the LRU; `max_keys` bounds its entries too (tiny weights).
        while total > capacity or len(lru) > self.config.max_keys:
            key, weight = lru.popitem(last=False)
            evicted.append(key)
            total -= weight
        self._encoded_tokens[replica] = total
        return [k for k, _ in image_keys if k not in lru] + evicted

    @staticmethod
    def _drop_holder(table: OrderedDict, key: bytes, replica: ReplicaId) -> None:
        rest = tuple(r for r in table.get(key, ()) if r != replica)
        if rest:
            table[key] = rest
        else:
            table.pop(key, None)

    def set_encoder_cache_tokens(self, tokens: int | None) -> None:
        """Each replica's encoder-cache size, once the replicas report it (the live router
        exists before they do): the cache models start empty."""
        self.config = replace(self.config, encoder_cache_tokens=tokens)  # validated there
        self._encoded.clear()
        self._encoded_tokens.clear()

    def remove_replica(self, replica: ReplicaId) -> None:
        """Forget what `replica` held (it died or was replaced: its caches are gone)."""
        for table in (self._images, self._blocks):
            for key in [k for k, held in table.items() if replica in held]:
                self._drop_holder(table, key, replica)
        self._encoded.pop(replica, None)
        self._encoded_tokens.pop(replica, None)
        for session in [s for s, r in self._sessions.items() if r == replica]:
            del self._sessions[session]
        self._shares.pop(replica, None)

    def keep_only(self, live: set) -> None:
        """Forget every replica not in `live` (a fresh replica list from the cluster)."""
        known = {r for t in (self._images, self._blocks) for held in t.values() for r in held}
        known |= set(self._sessions.values()) | set(self._shares) | set(self._encoded)
        for replica in known - live:
            self.remove_replica(replica)


def _within_capacity(load: Mapping[ReplicaId, float], eps: float) -> set:
    """Consistent hashing with bounded loads, for real-valued loads: with one more
    request placed the mean is (total + 1) / n; a replica may take it while its load is at
    most (1 + eps) x that, so none exceeds (1 + eps) x the mean + 1 by affinity. (The
    paper's whole-number form, load + 1 <= ceil((1 + eps) x mean), is the same up to
    that 1.) The least loaded always fits: its load is at most the mean."""
    capacity = (1.0 + eps) * (sum(load.values()) + 1.0) / len(load)
    return {r for r, x in load.items() if x <= capacity + 1e-9}


def _put(table: OrderedDict, key, replica: ReplicaId, limit: int) -> None:
    table[key] = replica
    table.move_to_end(key)
    while len(table) > limit:
        table.popitem(last=False)


def _add_holder(table: OrderedDict, key, replica: ReplicaId, limit: int, holders: int) -> None:
    """`replica` becomes `key`'s most recent holder (of at most `holders`)."""
    held = tuple(r for r in table.get(key, ()) if r != replica)
    _put(table, key, (*held[-(holders - 1) :], replica) if holders > 1 else (replica,), limit)
