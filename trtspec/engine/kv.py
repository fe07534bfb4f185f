"""KV caches within a byte budget, with prefix reuse (TensorRT-LLM's KV-cache block reuse, per sequence).

Every running request holds a cache sized for its whole call (its tokens + the tokens it may add), reserved
when it is admitted, so a running request never runs out of room. When a request ends, its cache is kept,
labelled with the tokens it holds, for the next call that starts with the same tokens: the orchestrator
re-sends the growing sequence every iteration, and without reuse each iteration would re-prefill it.

The budget (`engine.kv_cache_mb` in the build config) covers running and kept caches together; kept caches
are limited further by `engine.kv_cache_reuse_mb`, and are evicted least recently used first whenever a
running request needs their room. A request that needs more than the whole budget is refused with an error
that names the limit; one that fits the budget but not beside the running ones waits for them to end.
"""

from __future__ import annotations

from dataclasses import dataclass

from trtspec.errors import RequestError


@dataclass
class KVStats:
    lookups: int = 0
    hits: int = 0
    reused_tokens: int = 0
    computed_tokens: int = 0
    evictions: int = 0
    refused: int = 0
    peak_bytes: int = 0


@dataclass(eq=False)  # kept caches are told apart by identity: two may hold the same tokens, and tensors have no ==
class _Kept:
    tokens: tuple[int, ...]  # the tokens whose keys and values the cache holds
    kv: object
    nbytes: int


@dataclass(eq=False)
class Lease:
    """A running request's cache: it holds the first `cached` of its tokens on admission."""

    kv: object
    cached: int
    nbytes: int


class KVPool:
    def __init__(self, model, budget_bytes: int, reuse_bytes: int, *, reuse: bool = True):
        self.model = model  # new_kv / kv_capacity / kv_room / kv_nbytes / copy_kv / crop_kv
        self.budget_bytes = budget_bytes
        self.reuse_bytes = reuse_bytes
        self.reuse = reuse
        self.entries: list[_Kept] = []  # most recently used first
        self.running_bytes = 0
        self.stats = KVStats()

    @property
    def kept_bytes(self) -> int:
        return sum(e.nbytes for e in self.entries)

    def bytes_for(self, tokens: int) -> int:
        return self.model.kv_capacity(tokens) * self.model.kv_bytes_per_token

    def check(self, tokens: int, field: str) -> None:
        """Refuse a call that cannot fit even alone."""
        need = self.bytes_for(tokens)
        if need > self.budget_bytes:
            self.stats.refused += 1
            per_token = self.model.kv_bytes_per_token
            raise RequestError(
                field,
                f"needs {need / 2**20:.1f} MiB of KV cache for {tokens} tokens, more than the engine's KV-cache "
                f"budget engine.kv_cache_mb = {self.budget_bytes / 2**20:.0f} MiB (room for about "
                f"{self.budget_bytes // per_token} tokens); ask for fewer tokens or rebuild with a larger "
                "engine.kv_cache_mb",
            )

    def acquire(self, ids: list[int], tokens: int, max_cached: int) -> Lease | None:
        """A cache for a call over `ids` that may grow to `tokens` positions, holding the longest prefix of
        `ids` that a kept cache has (at most `max_cached` tokens); None while the running calls leave no room."""
        need = self.bytes_for(tokens)
        best, best_len = self._lookup(ids)
        keep = min(best_len, max_cached)
        if best is not None and keep == len(best.tokens) and self.model.kv_room(best.kv) >= tokens:
            self.entries.remove(best)  # the usual next call of the same sequence: take it over
            return self._lease(best.kv, keep, max(best.nbytes, need))
        if not self._make_room(need, spare=best):
            return None
        if best is None or keep == 0 or best not in self.entries:  # no prefix, or it had to be evicted
            return self._lease(self.model.new_kv(tokens), 0, need)
        kv = self._fresh(best, keep, tokens)
        if keep == len(best.tokens):
            self.entries.remove(best)  # outgrown: its content now lives in the larger cache
        return self._lease(kv, keep, need)

    def release(self, lease: Lease, tokens: list[int]) -> None:
        """A call ended; its cache holds `tokens` and is kept for reuse if the budget allows."""
        self.running_bytes -= lease.nbytes
        self.keep(tokens, lease.kv)

    def keep(self, tokens: list[int], kv) -> None:
        """Keep `kv`, which holds `tokens`, for reuse (most recently used first), within the budgets."""
        if not self.reuse or self.reuse_bytes <= 0 or not tokens:
            return
        self.model.crop_kv(kv, len(tokens))
        self.entries.insert(0, _Kept(tuple(tokens), kv, self.model.kv_nbytes(kv)))
        while self.entries and (
            self.kept_bytes > self.reuse_bytes or self.kept_bytes + self.running_bytes > self.budget_bytes
        ):
            self.entries.pop()
            self.stats.evictions += 1

    def kept(self, tokens: list[int]):
        """The kept cache that holds exactly `tokens` (left in place), or None."""
        return next((e.kv for e in self.entries if e.tokens == tuple(tokens)), None)

    def clear(self) -> None:
        self.entries.clear()

    # ---- internals ---------------------------------------------------------------------------------------------
    def _lookup(self, ids: list[int]):
        self.stats.lookups += 1
        best, best_len = None, 0
        if not self.reuse:
            return None, 0
        for entry in self.entries:
            n = _common_prefix(entry.tokens, ids)
            if n > best_len:
                best, best_len = entry, n
        return best, best_len

    def _make_room(self, need: int, spare) -> bool:
        """Evict kept caches (least recently used first, `spare` last) until `need` fits beside the running."""
        if self.running_bytes + need > self.budget_bytes:
            return False
        while self.entries and self.running_bytes + self.kept_bytes + need > self.budget_bytes:
            victim = next((e for e in reversed(self.entries) if e is not spare), None) or self.entries[-1]
            self.entries.remove(victim)
            self.stats.evictions += 1
        return True

    def _fresh(self, source: _Kept, keep: int, tokens: int):
        """A new cache holding the first `keep` tokens of `source`, which stays as it is."""
        adopt = getattr(self.model, "adopt_prefix", None)
        if adopt is not None:
            return adopt(source.kv, keep)
        kv = self.model.new_kv(tokens)
        self.model.copy_kv(source.kv, kv, keep)
        return kv

    def _lease(self, kv, cached: int, nbytes: int) -> Lease:
        if cached:
            self.stats.hits += 1
            self.stats.reused_tokens += cached
        self.running_bytes += nbytes
        self.stats.peak_bytes = max(self.stats.peak_bytes, self.running_bytes + self.kept_bytes)
        return Lease(kv, cached, nbytes)


def _common_prefix(a: tuple[int, ...], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
