"""LoRA adapters on the llama.cpp backend: GGUF LoRA files (what llama.cpp's
convert_lora_to_gguf.py writes from a PEFT adapter) applied to a loaded
base model, with no merge and no copy of the base's weights.

llama.cpp applies adapters to a whole context: `llama_set_adapters_lora`
names the set every sequence of the next llama_decode runs under. So, as
llama-server does, a step only carries sequences of one adapter set (one
adapter, or the base alone), and when sets mix, steps take them in turn
(AdapterSlotScheduler). Before each llama_decode the context is switched
to the chunk's set (AdapterSet.prepare, from LlamaContext.submit, which
every decode path goes through). What mixing costs: a step over k sets'
sequences becomes k steps, each reading every base weight again, and each
change of set makes llama.cpp reserve its compute graph again
(sched_reserve); bench/bench_lora_llamacpp.py measures both together.

Each sequence's adapter is known to the scheduler (from the request's
REQUEST_ADAPTER) and to the slot pool (AdapterSlotPool: slot -> the adapter
its KV was computed under), which the context reads by slot. The pool keys
the prefix cache by adapter: a slot's tokens are offered for reuse only to
a sequence of the same adapter, never to another adapter or to the base;
and it places a sequence next to active slots of its own adapter, since
llama.cpp runs one forward pass per run of consecutive slots in a decode.

Adapters are checked with the `gguf` package before llama.cpp sees them, so
a corrupt file or an adapter of another architecture or hidden size is
refused naming the adapter and the reason (llama.cpp only logs its own).
"""

from __future__ import annotations

import ctypes
import hashlib
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from modeld.backends.artifact_paths import scrub_paths
from modeld.backends.compute_thread import COMPUTE_THREAD
from modeld.backends.errors import BackendFailure, FailedPrecondition, InvalidArgument
from modeld.backends.generation.block_manager import chain_hash, salt_seed
from modeld.backends.generation.paged_scheduler import REQUEST_ADAPTER, adapter_salt
from modeld.backends.generation.adapter_model import LoopAdapterModel
from modeld.backends.generation.interface import SlotWork, StepPlan
from modeld.backends.generation.sequence import Sequence
from modeld.backends.generation.slot_scheduler import SlotConfig, SlotScheduler
from modeld.backends.generation.slots import KV_BLOCK_TOKENS, SlotPool
from modeld.backends.model_config import LoraSettings

BASE = 0  # the adapter id of the base model alone


_LORA_SUFFIXES = (".lora_a", ".lora_b")


# -- the scheduler and its slots ---------------------------------------------------


class AdapterSlotPool(SlotPool):
    """SlotPool whose prefix cache and placement are per adapter."""

    def __init__(self, num_slots: int, min_copy: int, adapter_for) -> None:
        super().__init__(num_slots, min_copy)
        self.adapter_for = adapter_for  # a slot user (Sequence) -> its adapter id
        # slot -> the adapter its KV (running or cached) was computed under; absent: the base
        self.slot_adapter: dict[int, int] = {}
        self._granting = BASE  # the adapter of the sequence grant() is placing

    def grant(self, prompt: list[int], user, use_cache: bool, round_wants: dict[int, int] | None = None):
        # round_wants comes only for rounds of the base's sequences alone
        # (AdapterSlotScheduler._filling_round): with adapters in play, each
        # adapter's slots form runs of their own however full the pool is
        self._granting = self.adapter_for(user)
        try:
            grant = super().grant(prompt, user, use_cache, round_wants)
        finally:
            adapter, self._granting = self._granting, BASE
        if adapter == BASE:
            self.slot_adapter.pop(grant.slot, None)
        else:
            self.slot_adapter[grant.slot] = adapter
        return grant

    def _reusable(self, prompt: list[int]) -> dict[int, int]:
        # KV computed under another adapter (or the base) is other KV for the same tokens
        return {slot: n for slot, n in super()._reusable(prompt).items()
                if self.slot_adapter.get(slot, BASE) == self._granting}

    def _reusable_cached(self, prompt: list[int]) -> dict[int, int]:
        return {slot: n for slot, n in super()._reusable_cached(prompt).items()
                if self.slot_adapter.get(slot, BASE) == self._granting}

    def _splits(self, slot: int) -> int:
        if self._round is not None:  # a round of the base's sequences that fills every slot
            return 0
        # one llama_decode per adapter: a slot joins the run of its own adapter's slots
        return 1 - self._same_adapter(slot - 1) - self._same_adapter(slot + 1)

    def _same_adapter(self, slot: int) -> bool:
        return slot in self.active and self.slot_adapter.get(slot, BASE) == self._granting

    def _placement(self, keep: int | None) -> int:
        """SlotPool's choice, and among equals the slot farthest from other
        adapters' active slots: it leaves each adapter room to grow its run."""
        others = [s for s in self.active if self.slot_adapter.get(s, BASE) != self._granting]
        if not others:
            return super()._placement(keep)
        lru = {slot: rank for rank, slot in enumerate(self.cached)}
        candidates = [*self.free, *(s for s in self.cached if s != keep)]

        def distance(slot: int) -> int:
            return min(abs(slot - other) for other in others)
        return min(candidates, key=lambda s: (self._splits(s), -distance(s), s in lru, lru.get(s, 0), s))

    def _slot_hashes(self, slot: int, tokens: list[int], num_tokens: int) -> list[int]:
        """An adapter's slot reports its blocks hashed in the adapter's
        namespace, as kv_prompt_hashes(prompt, salt=adapter_salt(adapter))
        hashes a prompt for it; the base's keep SlotPool's memoised hashes."""
        adapter = self.slot_adapter.get(slot, BASE)
        if adapter == BASE:
            return super()._slot_hashes(slot, tokens, num_tokens)
        hashes, previous = [], salt_seed(adapter_salt(adapter))
        for index in range(min(num_tokens, len(tokens)) // KV_BLOCK_TOKENS):
            previous = chain_hash(previous, tuple(tokens[index * KV_BLOCK_TOKENS:(index + 1) * KV_BLOCK_TOKENS]))
            hashes.append(previous)
        return hashes

    def release(self, slot: int, num_valid: int, keep: bool):
        ops = super().release(slot, num_valid, keep)
        if slot not in self.cached:
            self.slot_adapter.pop(slot, None)
        return ops

    def evict_lru(self):
        ops = super().evict_lru()
        for op in ops:
            self.slot_adapter.pop(op.slot, None)
        return ops


class AdapterSlotScheduler(SlotScheduler):
    """SlotScheduler whose sequences each run under an adapter (0: the base),
    one adapter set per step.

    A step (one StepPlan, one llama_decode per n_batch tokens) carries the
    sequences of one set only, because llama.cpp applies adapters to the
    whole context; with several sets in play, steps take them in turn (the
    next set in id order after the last step's), and a set with nothing to
    run passes its turn within the same call. At most
    lora.max_loras_per_batch distinct adapters hold running sequences at
    once; a waiting sequence of a further adapter waits until one of them
    has none left. The base's sequences never wait for that.
    """

    def __init__(self, config: SlotConfig, lora: LoraSettings) -> None:
        super().__init__(config)
        self.lora = lora
        self.adapter_of: dict[int, int] = {}  # seq id -> adapter id, for sequences not of the base
        self.slots = AdapterSlotPool(config.num_slots, config.min_copy_tokens,
                                     lambda seq: self.adapter_of.get(seq.seq_id, BASE))
        self._last_group = -1  # the adapter set the last step ran
        self._everyone: list[Sequence] | None = None  # every running sequence, while one set's step is planned

    def add(self, seq: Sequence) -> None:
        super().add(seq)
        adapter = REQUEST_ADAPTER.get()
        if adapter:
            self.adapter_of[seq.seq_id] = adapter

    def num_sequences_of(self, adapter: int) -> int:
        """Sequences waiting or running under an adapter."""
        return sum(1 for a in self.adapter_of.values() if a == adapter)

    def schedule(self, drafts: Mapping[int, list[int]] | None = None) -> StepPlan[SlotWork]:
        if not self.adapter_of:  # the base's sequences only: one set, nothing to choose
            return super().schedule(drafts)
        groups = self._groups()
        start = next((i for i, group in enumerate(groups) if group > self._last_group), 0)
        kv_ops: tuple = ()
        work: tuple = ()
        for group in groups[start:] + groups[:start]:
            plan = self._schedule_group(group, drafts or {})
            kv_ops += plan.kv_ops  # a turn passed on still hands out the KV operations it took
            if plan.work:
                self._last_group, work = group, plan.work
                break
        return StepPlan(kv_ops, work)

    def _filling_round(self, quota: int) -> dict[int, int] | None:
        # only the base's sequences live: one run whatever the placement, once every slot is taken
        return super()._filling_round(quota) if not self.adapter_of else None

    def _groups(self) -> list[int]:
        """The adapter sets with live sequences, in id order (0, the base, first)."""
        live = (s for s in (*self.running, *self.waiting) if not s.is_cancelled)
        return sorted({self.adapter_of.get(s.seq_id, BASE) for s in live})

    def _schedule_group(self, group: int, drafts: Mapping[int, list[int]]) -> StepPlan[SlotWork]:
        """SlotScheduler.schedule seeing only group's sequences; the KV room,
        the batch policy and the adapter cap still count every running one."""
        running, waiting = self.running, self.waiting
        self._everyone = running
        self.running = [s for s in running if self.adapter_of.get(s.seq_id, BASE) == group]
        self.waiting = [s for s in waiting if self.adapter_of.get(s.seq_id, BASE) == group]
        try:
            return super().schedule({k: v for k, v in drafts.items() if self.adapter_of.get(k, BASE) == group})
        finally:
            known = {s.seq_id for s in running}
            started = [s for s in self.running if s.seq_id not in known]  # admitted now (_start appends)
            started_ids = {s.seq_id for s in started}
            self.running = running + started
            self.waiting = [s for s in waiting if s.seq_id not in started_ids]
            self._everyone = None

    def _everyone_running(self) -> list[Sequence]:
        return self.running if self._everyone is None else self._everyone

    @property
    def num_reserved_cells(self) -> int:
        return sum(s.num_reserved for s in self._everyone_running())

    def _admission_quota(self) -> int:
        admission = getattr(self.config, "admission", None)
        if admission is not None and admission.policy != "continuous" and self._everyone_running():
            return 0  # a batch policy: the running batch, of every adapter, finishes first
        return super()._admission_quota()

    def _next_waiting(self) -> Sequence | None:
        running = {self.adapter_of.get(s.seq_id, BASE) for s in self._everyone_running()} - {BASE}
        full = len(running) >= self.lora.max_loras_per_batch
        for seq in self.waiting:
            if seq.is_cancelled or self._waits_for_prefix(seq):
                continue
            adapter = self.adapter_of.get(seq.seq_id, BASE)
            if full and adapter and adapter not in running:
                continue  # max_loras_per_batch adapters run already
            return seq
        return None

    def _shares_cache(self, a: Sequence, b: Sequence) -> bool:
        return self.adapter_of.get(a.seq_id, BASE) == self.adapter_of.get(b.seq_id, BASE)

    def _finish(self, seq: Sequence, reason) -> None:
        super()._finish(seq, reason)
        self.adapter_of.pop(seq.seq_id, None)


# -- applying adapters per llama_decode -------------------------------------------


class AdapterSet:
    """The adapters resident on one base context, and which one the context
    runs under now. Touched only on the compute thread."""

    def __init__(self, llama_model, context, pool: AdapterSlotPool) -> None:
        self.llama_model, self.context, self.pool = llama_model, context, pool
        self.handles: dict[int, ctypes.c_void_p] = {}  # adapter id -> llama_adapter_lora *
        self.current = BASE  # the adapter set on the context
        self.num_switches = 0  # changes of the context's adapter set (each one a graph reserve in llama.cpp)
        self._base_shapes: BaseShapes | None = None

    def base_shapes(self) -> BaseShapes:
        if self._base_shapes is None:
            self._base_shapes = base_shapes(self.llama_model.path)
        return self._base_shapes

    def add(self, adapter_id: int, handle) -> None:
        self.handles[adapter_id] = handle
        self.context.lora = self  # from now on every llama_decode of the base asks prepare() first

    def remove(self, adapter_id: int) -> None:
        handle = self.handles.pop(adapter_id, None)
        if handle is None:
            return
        if self.current == adapter_id:
            self._use(BASE)  # the context must not keep a pointer to a freed adapter
        from modeld.backends.llamacpp.context import _llama

        _llama().llama_adapter_lora_free(handle)

    def close(self) -> None:
        """Free every adapter, before the base model is freed (llama.cpp
        frees the adapters left with the model: a later free would be a second)."""
        for adapter_id in list(self.handles):
            self.remove(adapter_id)
        self.context.lora = None

    def prepare(self, chunk: list[tuple[int, int, int, bool]]) -> None:
        """Before a llama_decode of chunk (token, position, slot, wants_logits):
        the context runs under the adapter of the chunk's sequences, which
        the scheduler made one set."""
        slot_adapter = self.pool.slot_adapter
        adapter = slot_adapter.get(chunk[0][2], BASE)
        if any(slot_adapter.get(item[2], BASE) != adapter for item in chunk):
            raise BackendFailure("one llama_decode would mix sequences of different LoRA adapters (a scheduling bug)")
        self._use(adapter)

    def _use(self, adapter_id: int) -> None:
        if adapter_id == self.current:
            return
        from modeld.backends.llamacpp.context import _llama

        llama = _llama()
        if adapter_id == BASE:
            llama.llama_set_adapters_lora(self.context.ctx, None, 0, None)
        else:
            handle = self.handles.get(adapter_id)
            if handle is None:
                raise BackendFailure(f"adapter {adapter_id} was unloaded while a sequence of it ran")
            adapters = (llama.llama_adapter_lora_p_ctypes * 1)(handle)
            # 1.0: llama.cpp scales by the file's lora_alpha / rank itself, as PEFT does
            scales = (ctypes.c_float * 1)(1.0)
            llama.llama_set_adapters_lora(self.context.ctx, adapters, 1, scales)
        self.current = adapter_id
        self.num_switches += 1


# -- reading and checking a GGUF LoRA ---------------------------------------------


@dataclass(frozen=True)
class GgufAdapterSpec:
    rank: int
    alpha: float
    num_tensors: int
    nbytes: int  # what llama.cpp allocates for it: every lora_a / lora_b tensor's data


@dataclass(frozen=True)
class BaseShapes:
    architecture: str
    shapes: dict[str, tuple[int, ...]]  # tensor name -> ggml ne (ne[0]: the input width)


def base_shapes(path: Path) -> BaseShapes:
    """The base GGUF's architecture and tensor shapes, from its header alone."""
    from modeld.backends.gguf_header import GGUFHeader

    header = GGUFHeader(path)
    architecture = header.get("general.architecture", "")
    return BaseShapes(architecture if isinstance(architecture, str) else "",
                      {t.name: t.shape for t in header.tensors})


def _field_str(reader, key: str) -> str:
    field = reader.fields.get(key)
    if field is None or not field.data:
        return ""
    value = field.parts[field.data[0]]
    try:
        return bytes(value).decode("utf-8", errors="replace")
    except (TypeError, ValueError):
        return ""


def _field_float(reader, key: str) -> float | None:
    field = reader.fields.get(key)
    if field is None or not field.data:
        return None
    value = field.parts[field.data[0]]
    try:
        return float(value[0])
    except (TypeError, ValueError, IndexError):
        return None


def read_gguf_adapter(name: str, path: Path, artifact: str, base: BaseShapes, max_rank: int) -> GgufAdapterSpec:
    """Check a GGUF LoRA against the base it will run on; InvalidArgument
    names the adapter, what is wrong and why."""
    from gguf import GGUFReader

    def fail(reason: str) -> InvalidArgument:
        return InvalidArgument(f"adapter {name!r}: {artifact} {reason}")

    size = path.stat().st_size
    try:
        reader = GGUFReader(str(path), "r")
        tensors = list(reader.tensors)
    except Exception as exc:  # the reader raises whatever its parse hits: bad magic, short reads, bad types
        detail = scrub_paths(str(exc), (path.parent,))[:120]  # a reader's OSError names the file's path
        raise fail(f"is not a readable GGUF file, corrupt or truncated ({type(exc).__name__}: {detail})") from None
    for tensor in tensors:
        if int(tensor.data_offset) + int(tensor.n_bytes) > size:
            raise fail(f"is truncated: tensor {tensor.name[:80]} ends past the end of the file ({size} bytes)")
    kind, adapter_type = _field_str(reader, "general.type"), _field_str(reader, "adapter.type")
    if kind != "adapter" or adapter_type != "lora":
        raise fail(f"is not a LoRA adapter (general.type = {kind[:40]!r}, adapter.type = {adapter_type[:40]!r}); "
                   "convert a PEFT adapter with llama.cpp's convert_lora_to_gguf.py")
    architecture = _field_str(reader, "general.architecture")
    if architecture != base.architecture:
        raise fail(f"is an adapter of architecture {architecture[:40]!r}, its base is {base.architecture!r}")
    alpha = _field_float(reader, "adapter.lora.alpha")
    if alpha is not None and not math.isfinite(alpha):
        raise fail("has a lora_alpha that is not a finite number")
    rank, pairs, nbytes = _check_tensors(tensors, base, fail)
    if not pairs:
        raise fail("holds no lora_a / lora_b tensors")
    if rank > max_rank:
        raise fail(f"has rank {rank}, above the base's limit of {max_rank} (lora.max_lora_rank in the base's "
                   "model.toml)")
    return GgufAdapterSpec(rank, alpha or 0.0, 2 * pairs, nbytes)


def _check_tensors(tensors, base: BaseShapes, fail) -> tuple[int, int, int]:
    """(highest rank, lora pairs, their bytes) after checking each pair's
    shapes against the base weight it adapts."""
    halves: dict[str, dict[str, tuple[int, ...]]] = {}
    nbytes = 0
    for tensor in tensors:
        name = tensor.name
        suffix = next((s for s in _LORA_SUFFIXES if name.endswith(s)), None)
        if suffix is None:
            if name.endswith("_norm.weight"):
                continue  # llama.cpp skips the norms some exporters add
            raise fail(f"holds tensor {name[:80]!r}, not a LoRA lora_a / lora_b tensor")
        halves.setdefault(name[:-len(suffix)], {})[suffix] = tuple(int(d) for d in tensor.shape)
        nbytes += int(tensor.n_bytes)
    rank = 0
    for weight, pair in halves.items():
        if len(pair) != 2:
            raise fail(f"lacks half of the pair for {weight[:80]} (a lora_a needs its lora_b)")
        want = base.shapes.get(weight)
        if want is None:
            raise fail(f"adapts {weight[:80]}, which the base does not have (an adapter of another model, "
                       "or a layer out of range)")
        a, b = pair[".lora_a"], pair[".lora_b"]
        # ggml ne order: weight [in, out], lora_a [in, r], lora_b [r, out]
        if len(a) != 2 or len(b) != 2 or a[0] != want[0] or b[1] != want[1] or a[1] != b[0]:
            raise fail(f"has {weight[:80]} lora_a {list(a)} and lora_b {list(b)}, the base's weight is {list(want)} "
                       "(an adapter of another hidden size, or not a LoRA pair)")
        rank = max(rank, a[1])
    return rank, len(halves), nbytes


# -- an adapter as a model ---------------------------------------------------------


def load_adapter(base, config, model_dir: Path) -> LlamaAdapterModel:
    """Check a GGUF LoRA of base (a LlamaGenerativeModel) and make it
    resident on base's context. Raises InvalidArgument or FailedPrecondition
    naming the adapter and the reason; base is left as it was."""
    name, artifact = config.name, config.artifact_path
    if not artifact.endswith(".gguf"):
        raise FailedPrecondition(
            f"adapter {name!r}: the llamacpp backend applies GGUF LoRA adapters, and {artifact} is not one; convert a "
            "PEFT adapter with llama.cpp's convert_lora_to_gguf.py and set artifact = \"<file>.gguf\" in its "
            "model.toml")
    path = model_dir / artifact
    if not path.is_file():
        raise InvalidArgument(f"adapter {name!r}: {artifact} is missing")
    if base.adapters is None:
        base.adapters = AdapterSet(base.llama_model, base.context, base.scheduler.slots)
    spec = read_gguf_adapter(name, path, artifact, base.adapters.base_shapes(), base.scheduler.lora.max_lora_rank)
    adapter_id = adapter_identity(name, path)
    if adapter_id in base.adapters.handles:
        # the engine unloads an adapter before loading it again: only a 64-bit digest collision gets here
        raise InvalidArgument(f"adapter {name!r}: another resident adapter has the same identity digest")
    COMPUTE_THREAD.submit(_make_resident, base.adapters, name, artifact, path, adapter_id).result()
    return LlamaAdapterModel(base, adapter_id, spec)


def adapter_identity(name: str, path: Path) -> int:
    """The adapter's id on its base (never 0, the base's): a digest of its
    name and its GGUF file. The same adapter gets the same id wherever it
    loads, so its prefix-cache salt (paged_scheduler.adapter_salt) hashes a
    prompt alike on every node a gateway compares; an adapter loaded again
    with other weights gets another id, so no slot cached under the old
    weights is offered to it."""
    digest = hashlib.blake2b(name.encode("utf-8") + b"\0", digest_size=8)
    with path.open("rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return int.from_bytes(digest.digest(), "little") & ((1 << 63) - 1) or 1


def _make_resident(adapters: AdapterSet, name: str, artifact: str, path: Path, adapter_id: int) -> None:
    """On the compute thread: llama.cpp registers the adapter with the model,
    which a llama_decode running meanwhile would read."""
    from modeld.backends.llamacpp.context import _llama

    handle = _llama().llama_adapter_lora_init(adapters.llama_model.model, str(path).encode())
    if not handle:
        raise InvalidArgument(f"adapter {name!r}: llama.cpp refused {artifact} (its tensors do not fit the base)")
    adapters.add(adapter_id, handle)


def release_adapters(base) -> None:
    """On the compute thread, before the base's context and model are freed."""
    if base.adapters is not None:
        base.adapters.close()


class LlamaAdapterModel(LoopAdapterModel):
    """A GGUF LoRA served as a model of its own: requests naming it run on
    its base's generation loop and KV slots, under the adapter."""

    def __init__(self, base, adapter_id: int, spec: GgufAdapterSpec) -> None:
        from modeld.backends.llamacpp.backend import TEXT_SIGNATURE

        super().__init__(base, adapter_id, spec.rank, spec.nbytes, TEXT_SIGNATURE)

    def unload(self) -> None:
        base = self.base
        if base.adapters is not None:
            COMPUTE_THREAD.submit(base.adapters.remove, self.adapter_id).result()
