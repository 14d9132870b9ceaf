"""One memory budget and one LRU over every loaded model of every backend.

Pure bookkeeping, no I/O: the engine asks `plan` which models to evict for a
load, unloads them, then `add`s the new one. Keys are ModelKey values.
Invariants: the sum of `nbytes`, plus the daemon's own share, never passes
the budget; a pinned entry or one with requests in flight is never chosen for
eviction. A LoRA adapter's entry names its base's: the base is never chosen
while one of its adapters is pinned or busy, and choosing the base chooses
its adapters first (they cannot outlive it). The daemon's share (its resident memory outside every in-process
model: interpreter, gRPC, imported runtimes) is in the books so the budget
holds for the whole process tree, not only for the models in it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from modeld.backends.errors import ResourceExhausted
from modeld.backends.sizes import format_size


@dataclass(frozen=True)
class ModelKey:
    """One (backend, model) pair: the unit the budget accounts for."""

    backend: str
    model: str

    def __str__(self) -> str:
        return f"{self.backend}/{self.model}"


@dataclass
class MemoryEntry:
    key: ModelKey
    nbytes: int
    is_pinned: bool = False
    num_in_flight: int = 0
    base: ModelKey | None = None  # a LoRA adapter's base model

    @property
    def is_evictable(self) -> bool:
        return not self.is_pinned and self.num_in_flight == 0


class MemoryManager:
    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.daemon_bytes = 0  # the daemon's own share, never evicted (Engine.refresh_daemon_bytes)
        # least recently used first
        self._entries: OrderedDict[ModelKey, MemoryEntry] = OrderedDict()

    @property
    def used(self) -> int:
        return self.daemon_bytes + self.models_used

    @property
    def models_used(self) -> int:
        return sum(e.nbytes for e in self._entries.values())

    @property
    def free(self) -> int:
        return self.budget - self.used

    def __contains__(self, key: ModelKey) -> bool:
        return key in self._entries

    def keys_lru_first(self) -> list[ModelKey]:
        return list(self._entries)

    def entry(self, key: ModelKey) -> MemoryEntry:
        return self._entries[key]

    def plan(self, nbytes: int, exclude: frozenset[ModelKey] = frozenset()) -> list[ModelKey]:
        """Keys to evict, least recently used first, so that `nbytes` fits.

        Raises ResourceExhausted, changing nothing, when even evicting every
        idle unpinned model would not make room.
        """
        need = nbytes - self.free
        victims: list[ModelKey] = []
        for key, entry in self._entries.items():
            if need <= 0:
                break
            # a model holding no bytes (a remote engine's) frees nothing: never a victim
            if key in victims or not self._can_evict(entry, exclude) or entry.nbytes <= 0:
                continue
            for adapter in self.adapters_of(key):  # they go before their base
                if adapter not in victims:
                    victims.append(adapter)
                    need -= self._entries[adapter].nbytes
            victims.append(key)
            need -= entry.nbytes
        if need > 0:
            raise ResourceExhausted(self.refusal(nbytes))
        return victims

    def adapters_of(self, base: ModelKey) -> list[ModelKey]:
        """The LoRA adapters whose base is `base`, least recently used first."""
        return [key for key, entry in self._entries.items() if entry.base == base]

    def _can_evict(self, entry: MemoryEntry, exclude: frozenset[ModelKey]) -> bool:
        if not entry.is_evictable or entry.key in exclude:
            return False
        return all(self._entries[a].is_evictable and a not in exclude for a in self.adapters_of(entry.key))

    def refusal(self, nbytes: int) -> str:
        """Why a load of nbytes cannot fit, and what to change."""
        busy = [str(k) for k, e in self._entries.items() if not e.is_evictable]
        return (
            f"needs {format_size(nbytes)} but the memory budget is {format_size(self.budget)} "
            f"with {format_size(self.used)} in use"
            + (f" (the daemon itself holds {format_size(self.daemon_bytes)})" if self.daemon_bytes else "")
            + (f", of which {', '.join(busy)} are pinned or busy" if busy else "")
            + "; raise --memory-budget or unload a model"
        )

    def add(self, key: ModelKey, nbytes: int, is_pinned: bool = False, base: ModelKey | None = None) -> None:
        if nbytes > self.free:
            raise ResourceExhausted(self.refusal(nbytes))
        self._entries[key] = MemoryEntry(key, nbytes, is_pinned, base=base)

    def resize(self, key: ModelKey, nbytes: int) -> None:
        """Replace an estimate with the measured figure; may pass the budget.

        The caller checks `free` afterwards and evicts or refuses.
        """
        self._entries[key].nbytes = nbytes

    def remove(self, key: ModelKey) -> None:
        self._entries.pop(key, None)

    def touch(self, key: ModelKey) -> None:
        if key in self._entries:
            self._entries.move_to_end(key)

    def acquire(self, key: ModelKey) -> None:
        """A request starts using the model: it becomes most recent and busy."""
        entry = self._entries[key]
        entry.num_in_flight += 1
        if entry.base is not None:
            self.touch(entry.base)  # an adapter's work is its base's too
        self._entries.move_to_end(key)

    def release(self, key: ModelKey) -> None:
        if key in self._entries:
            self._entries[key].num_in_flight -= 1
