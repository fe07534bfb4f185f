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

# Room a cache that a sequence outgrows gets beyond the call's own need, where the budget has it spare: a request
# that verifies a few tokens per call would otherwise copy its cache into a new one at every key block it crosses
# (a copy into fresh memory costs about a millisecond per MB on a CPU).
GROWTH_TOKENS = 256


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
        best, keep, whole = self._lookup(ids, max_cached, tokens)
        if whole:
            self.entries.remove(best)  # the usual next call of the same sequence: take it over
            return self._lease(best.kv, keep, max(best.nbytes, need))
        if not self._make_room(need, spare=best):
            return None
        if best is None or keep == 0 or best not in self.entries:  # no prefix, or it had to be evicted
            return self._lease(self.model.new_kv(tokens), 0, need)
        outgrown = keep == len(best.tokens)  # its sequence goes on in a larger cache
        grown = self.bytes_for(tokens + GROWTH_TOKENS)
        if outgrown and self.running_bytes + self.kept_bytes + grown <= self.budget_bytes:
            tokens, need = tokens + GROWTH_TOKENS, grown
        kv = self._fresh(best, keep, tokens)
        if outgrown:
            self.entries.remove(best)  # its content now lives in the larger cache
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
    def _lookup(self, ids: list[int], max_cached: int, tokens: int):
        """(the kept cache with the longest usable prefix of `ids`, that length, whether the call takes it over).
        Of those that tie, one that holds exactly that prefix and has room for the call is taken over as it is; any
        other costs a new cache and a copy (about a millisecond per MB of fresh memory on a CPU: 3 decode steps of
        the demo target at 700 tokens). Ties are the rule when the same text was generated before: a longer kept
        cache of an earlier request matches a call as far as the request's own cache does."""
        self.stats.lookups += 1
        best, best_len, whole = None, 0, False
        if not self.reuse:
            return None, 0, False
        ids = tuple(ids)
        for entry in self.entries:
            n = min(_common_prefix(entry.tokens, ids), max_cached)
            entry_whole = n == len(entry.tokens) and self.model.kv_room(entry.kv) >= tokens
            if n > best_len or (n == best_len and n and entry_whole and not whole):
                best, best_len, whole = entry, n, entry_whole
        return best, best_len, whole

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


def _common_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """The length of the longest common prefix, compared in C a window at a time: windows that grow from the
    front, so that a cache of another request (which differs after the shared template, a few dozen tokens in)
    costs little, then halves of the window that differs."""
    n = min(len(a), len(b))
    lo, width = 0, 32
    while lo < n:
        hi = min(n, lo + width)
        if a[lo:hi] != b[lo:hi]:
            break
        lo, width = hi, width * 4
    else:
        return n
    while hi - lo > 1:  # a[:lo] == b[:lo] and a[:hi] != b[:hi]
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo
