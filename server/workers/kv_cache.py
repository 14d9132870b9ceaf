"""A language model's prefix cache as a gateway is told of it, wherever the
model runs (server/services/kv_events.py publishes it).

In the daemon, kv_events reads a model's cache (`model_cache`) when it
builds a message. A model in a worker process keeps its cache there, so
the worker answers two calls on its channel instead:

- `kv_delta(since)`: the block hashes stored and removed since the answer
  numbered `since` (`KvDeltaSource`, diffed at the moment of the call from
  what it last answered, so nothing queues up between calls), or a whole
  snapshot when `since` is not the last answer it gave (the daemon's first
  call, a reply lost with a cancelled call) or the difference would be
  larger than the cache. The daemon keeps the result (`KvMirror`) and asks
  again only when a watcher reads it, at most one call in flight: no watcher,
  no traffic; a watcher every 50 ms, one small call per 50 ms.
- `prompt_blocks(request, salt)`: a prompt's hashes under the worker's own
  tokenizer, chat template and block size (`prompt_hashes`).

Both ends cut an answer at MAX_HASHES hashes: a gateway then misses some
blocks (a lost cache hit, never a wrong answer).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Awaitable, Callable

from modeld.backends.errors import ModeldError

MAX_HASHES = 400_000  # as kv_events.MAX_HASHES_PER_MESSAGE: one message's worth
MIN_SNAPSHOT_CHANGES = 64  # a difference of more changes than blocks (and at least this) goes as a snapshot
MIN_REFRESH_S = 0.02  # as the fastest watch interval (node.KV_MIN_INTERVAL_S)


def model_cache(loaded):
    """The loaded model's prefix cache and generation loop, where its
    scheduler keeps one that says what it holds (kv_block_hashes,
    kv_prompt_hashes, kv_block_size, kv_cache_kind); (None, None) elsewhere.
    Read by name: the server imports no backend's insides."""
    loop = getattr(loaded, "loop", None)
    scheduler = getattr(loop, "scheduler", None)
    for attribute in ("blocks", "slots"):
        cache = getattr(scheduler, attribute, None)
        if cache is not None and hasattr(cache, "kv_block_hashes"):
            return cache, loop
    return None, None


@dataclass(frozen=True)
class KvCacheState:
    """A prefix cache as it was last read."""

    kind: str  # "paged" or "slots"
    block_size: int
    identity: int  # the cache object's: a reload (or a new worker) makes a new one
    hashes: frozenset[int]


@dataclass(frozen=True)
class PromptHashes:
    block_size: int
    hashes: tuple[int, ...]
    num_prompt_tokens: int


def prompt_hashes(loaded, request, salt: bytes = b"") -> PromptHashes | None:
    """The prompt's block hashes as the model's cache keys them (`salt`: an
    adapter's namespace); None for a model without a readable cache."""
    cache, loop = model_cache(loaded)
    if cache is None:
        return None
    token_ids = loop.prompt_ids(request)
    return PromptHashes(cache.kv_block_size, tuple(cache.kv_prompt_hashes(token_ids, salt)), len(token_ids))


def _capped(hashes: frozenset[int]) -> frozenset[int]:
    return hashes if len(hashes) <= MAX_HASHES else frozenset(sorted(hashes)[:MAX_HASHES])


@dataclass(frozen=True)
class KvDelta:
    """One answer to kv_delta: numbered, and either a snapshot (`stored` is
    every hash) or the change since the previous answer."""

    sequence: int
    kind: str
    block_size: int
    identity: int
    is_snapshot: bool
    stored: tuple[int, ...]
    removed: tuple[int, ...] = ()


class KvDeltaSource:
    """The worker's end: what it last told the daemon, and the next answer."""

    def __init__(self) -> None:
        self._sent: frozenset[int] = frozenset()
        self._identity: int | None = None
        self._sequence = 0  # of the last answer; the daemon's first `since` (-1) never matches

    def delta(self, cache, since: int) -> KvDelta | None:
        """The answer to `kv_delta(since)` for `cache`; None when nothing
        changed since the answer numbered `since`."""
        hashes = _capped(cache.kv_block_hashes())
        if since != self._sequence or id(cache) != self._identity:
            return self._answer(cache, hashes, True, tuple(hashes), ())
        stored, removed = hashes - self._sent, self._sent - hashes
        if not stored and not removed:
            return None
        if len(stored) + len(removed) > max(MIN_SNAPSHOT_CHANGES, len(hashes)):
            return self._answer(cache, hashes, True, tuple(hashes), ())
        return self._answer(cache, hashes, False, tuple(stored), tuple(removed))

    def _answer(self, cache, hashes: frozenset[int], is_snapshot: bool, stored: tuple, removed: tuple) -> KvDelta:
        self._sent, self._identity = hashes, id(cache)
        self._sequence += 1
        return KvDelta(self._sequence, cache.kv_cache_kind, cache.kv_block_size, id(cache), is_snapshot, stored,
                       removed)


Fetch = Callable[[int], Awaitable["KvDelta | None | bool"]]


class KvMirror:
    """The daemon's end: the worker's cache as its last answer left it.

    `read` returns it at once (kv_events builds its messages synchronously)
    and asks the worker for what changed, in the background, for the next
    read. `fetch(since)` is the worker call; it answers a KvDelta, None
    (nothing changed) or False (the model keeps no cache it can read:
    never asked again)."""

    def __init__(self, fetch: Fetch, clock: Callable[[], float] = time.monotonic) -> None:
        self._fetch, self._clock = fetch, clock
        self.state: KvCacheState | None = None
        self.has_cache = True
        self._sequence = -1
        self._task: asyncio.Task | None = None
        self._asked_at = float("-inf")

    def read(self) -> KvCacheState | None:
        """The cache as last heard (None before the first answer); asks for news."""
        if self.has_cache and (self._task is None or self._task.done()) \
                and self._clock() - self._asked_at >= MIN_REFRESH_S:
            self._asked_at = self._clock()
            self._task = asyncio.get_running_loop().create_task(self.refresh())
        return self.state

    async def refresh(self) -> None:
        try:
            answer = await self._fetch(self._sequence)
        except ModeldError:
            return  # the worker died or is stopping: the engine drops the model, and its mirror with it
        if answer is False:
            self.has_cache = False
        elif answer is not None:
            self.apply(answer)

    def apply(self, delta: KvDelta) -> None:
        if delta.is_snapshot or self.state is None:
            hashes = frozenset(delta.stored)
        else:
            hashes = (self.state.hashes - frozenset(delta.removed)) | frozenset(delta.stored)
        # this mirror's id in the identity: a new worker's cache is a new cache, whatever its object id there
        self.state = KvCacheState(delta.kind, delta.block_size, hash((id(self), delta.identity)), hashes)
        self._sequence = delta.sequence

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
