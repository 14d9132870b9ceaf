"""A llama.cpp model and context driven through llama-cpp-python's low-level
API: one context holds many sequences (seq ids = KV slots), and each step is
one llama_batch across all of them.

llama-cpp-python's high-level `Llama` runs one sequence at a time, which is
why the batch, decode and memory calls are used directly.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np

from modeld.backends import openmp
from modeld.backends.errors import BackendFailure, InvalidArgument, LoadFailed
from modeld.backends.generation.interface import SlotWork, StepPlan
from modeld.backends.generation.slots import KvOpKind
from modeld.backends.llamacpp.native_sampling import PickCounts, decode_picking, pick_items


_LLAMA = None
MAX_UBATCH = 512  # tokens per llama.cpp micro-batch (n_ubatch)


def _llama():
    """llama_cpp, imported after libgomp's wait settings for it
    (backends/openmp.py). Kept once imported: a step calls this several
    times."""
    global _LLAMA
    if _LLAMA is None:
        openmp.apply(openmp.LLAMACPP_SPIN_COUNT)
        import llama_cpp

        _LLAMA = llama_cpp
    return _LLAMA


_LOGITS_VIEWS: dict[tuple[int, int, int], np.ndarray] = {}


def logits_rows(llama, ctx, num_out: int, vocab: int) -> np.ndarray:
    """[num_out, vocab] float32 view of the context's logits buffer, read in
    place. np.ctypeslib.as_array builds its array interface anew on every
    call (tens of microseconds a step); llama.cpp keeps the buffer where it
    is until it has to grow it, so a view is made once per address and
    shape. The next decode overwrites what it shows."""
    pointer = llama.llama_get_logits(ctx)
    key = (ctypes.addressof(pointer.contents), num_out, vocab)
    view = _LOGITS_VIEWS.get(key)
    if view is None:
        if len(_LOGITS_VIEWS) >= 64:  # contexts come and go with loads: keep the map small
            _LOGITS_VIEWS.clear()
        view = _LOGITS_VIEWS[key] = np.ctypeslib.as_array(pointer, shape=(num_out, vocab))
    return view


_LOG_SINK = None


def silence_llama_logs() -> None:
    """llama.cpp prints every load detail to stderr; modeld logs its own summary."""
    global _LOG_SINK
    llama = _llama()
    if _LOG_SINK is None:
        _LOG_SINK = llama.llama_log_callback(lambda level, text, user_data: None)
        llama.llama_log_set(_LOG_SINK, ctypes.c_void_p(0))
        llama.llama_backend_init()


class LlamaModel:
    """Weights and vocabulary, shareable by several contexts."""

    def __init__(self, path: Path, use_mmap: bool = True) -> None:
        llama = _llama()
        silence_llama_logs()
        params = llama.llama_model_default_params()
        params.use_mmap = use_mmap
        self.model = llama.llama_model_load_from_file(str(path).encode(), params)
        if not self.model:
            raise LoadFailed(f"llama.cpp cannot load {path.name}: not a GGUF model it understands")
        self.path = path
        self.vocab = llama.llama_model_get_vocab(self.model)
        self.vocab_size = llama.llama_vocab_n_tokens(self.vocab)
        self.n_ctx_train = llama.llama_model_n_ctx_train(self.model)
        self._pieces: dict[int, bytes] = {}
        self._special_pieces: dict[int, bytes] = {}
        self._eog_ids: np.ndarray | None = None

    def kv_bytes_per_token(self) -> int:
        """f16 K and V for every layer: 2 * layers * kv_width * 2 bytes."""
        llama = _llama()
        n_head = llama.llama_model_n_head(self.model)
        kv_width = llama.llama_model_n_embd(self.model) // n_head * llama.llama_model_n_head_kv(self.model)
        return 2 * llama.llama_model_n_layer(self.model) * kv_width * 2

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        llama = _llama()
        data = text.encode("utf-8")
        capacity = len(data) + 16
        buffer = (llama.llama_token * capacity)()
        count = llama.llama_tokenize(self.vocab, data, len(data), buffer, capacity, add_special, True)
        if count < 0:
            raise InvalidArgument(f"the prompt cannot be tokenized ({-count} tokens needed)")
        return list(buffer[:count])

    def token_bytes(self, token_id: int) -> bytes:
        return self._piece(token_id, self._pieces, special=False)

    def special_token_bytes(self, token_id: int) -> bytes:
        """token_bytes with control tokens spelled out (`<|im_end|>`)."""
        return self._piece(token_id, self._special_pieces, special=True)

    def _piece(self, token_id: int, cache: dict[int, bytes], special: bool) -> bytes:
        piece = cache.get(token_id)
        if piece is None:
            buffer = ctypes.create_string_buffer(256)
            count = _llama().llama_token_to_piece(self.vocab, token_id, buffer, 256, 0, special)
            piece = buffer.raw[:max(count, 0)]
            cache[token_id] = piece
        return piece

    def is_end_of_generation(self, token_id: int) -> bool:
        return bool(_llama().llama_vocab_is_eog(self.vocab, token_id))

    def end_of_generation_ids(self) -> np.ndarray:
        # llama.cpp keeps its end-of-generation set private: ask per token, once (~0.1 s for 49k)
        if self._eog_ids is None:
            is_eog = _llama().llama_vocab_is_eog
            self._eog_ids = np.array([t for t in range(self.vocab_size) if is_eog(self.vocab, t)], dtype=np.int64)
        return self._eog_ids

    def constraint_tokenizer(self):
        """llguidance's tokenizer over this GGUF vocabulary; every
        end-of-generation token ends a constrained output."""
        import warnings

        from llguidance.llamacpp import lltokenizer_from_vocab

        with warnings.catch_warnings():
            # its helper asks each token's attributes through a deprecated alias: one warning per token
            warnings.simplefilter("ignore", DeprecationWarning)
            return lltokenizer_from_vocab(self.vocab, n_vocab=self.vocab_size,
                                          eos_token=[int(t) for t in self.end_of_generation_ids()])

    def chat_template_source(self) -> str:
        """The GGUF metadata's tokenizer.chat_template ("" when it has none)."""
        template = _llama().llama_model_chat_template(self.model, None)
        return template.decode("utf-8", errors="replace") if template else ""

    def special_tokens(self) -> dict[str, str]:
        """bos_token, eos_token, unk_token and pad_token as text, the names HF's
        special_tokens_map gives chat templates."""
        llama = _llama()
        ids = {"bos_token": llama.llama_vocab_bos(self.vocab), "eos_token": llama.llama_vocab_eos(self.vocab),
               "unk_token": self._meta_int("tokenizer.ggml.unknown_token_id"),
               "pad_token": llama.llama_vocab_pad(self.vocab)}
        return {name: llama.llama_vocab_get_text(self.vocab, i).decode("utf-8", errors="replace")
                for name, i in ids.items() if 0 <= i < self.vocab_size}

    def _meta_int(self, key: str) -> int:
        buffer = ctypes.create_string_buffer(32)
        count = _llama().llama_model_meta_val_str(self.model, key.encode(), buffer, 32)
        try:
            return int(buffer.value) if count > 0 else -1
        except ValueError:
            return -1

    def close(self) -> None:
        if self.model:
            _llama().llama_model_free(self.model)
            self.model = None


class LlamaContext:
    """One context: n_slots sequences, each with its own KV stream of n_ctx / n_slots cells."""

    def __init__(self, model: LlamaModel, n_ctx: int, n_slots: int, n_batch: int, n_threads: int) -> None:
        llama = _llama()
        params = llama.llama_context_default_params()
        # llama.cpp splits a batch into micro-batches of n_ubatch tokens; its
        # compute buffers grow with n_ubatch, and on a CPU a prompt token costs
        # the same in a micro-batch of 32 or 512, so a long step runs as
        # several (llama-server's default, 512)
        params.n_ctx, params.n_batch, params.n_ubatch = n_ctx, n_batch, min(n_batch, MAX_UBATCH)
        params.n_seq_max, params.n_threads, params.n_threads_batch = n_slots, n_threads, n_threads
        # One KV stream per slot. A shared (unified) cache interleaves the
        # slots' cells; after a prefix-cache trim a sequence's new cells can
        # land before its old ones, attention then sums in another order and
        # greedy output drifts from a cold run. Separate streams keep every
        # sequence's cells in position order, so results do not depend on
        # what else is running.
        params.kv_unified = False
        # Flash attention handles each query row alone, so a token's logits do
        # not depend on how many other tokens share its batch; the plain path
        # (a K*Q matmul whose kernel changes with the batch's shape) broke
        # "speculative/concurrent output == plain greedy output" in tests,
        # though it decodes faster at long contexts (55 vs 38 tok/s at 1,600).
        params.flash_attn_type = 1
        params.no_perf = True
        self.ctx = llama.llama_init_from_model(model.model, params)
        if not self.ctx:
            raise LoadFailed(f"llama.cpp cannot create a context of {n_ctx} cells for {n_slots} sequences")
        self.model = model
        self.memory = llama.llama_get_memory(self.ctx)
        self.n_batch = n_batch
        self.batch = llama.llama_batch_init(n_batch, 0, 1)
        self.lora = None  # with LoRA adapters resident: their lora.AdapterSet, which sets each decode's adapter
        self.picks = PickCounts()

    def apply_kv_ops(self, ops) -> None:
        llama = _llama()
        for op in ops:
            if op.kind is KvOpKind.CLEAR:
                llama.llama_memory_seq_rm(self.memory, op.slot, -1, -1)
            elif op.kind is KvOpKind.TRIM:
                llama.llama_memory_seq_rm(self.memory, op.slot, op.pos, -1)
            elif op.kind is KvOpKind.COPY:
                # streams can only be copied whole: copy, then cut to the prefix
                llama.llama_memory_seq_cp(self.memory, op.src, op.slot, -1, -1)
                llama.llama_memory_seq_rm(self.memory, op.slot, op.pos, -1)

    def decode(self, items: list[tuple[int, int, int, bool]], argmax_only: bool = False) -> np.ndarray:
        """items: (token, position, slot, wants_logits) -> [num_logits, vocab]
        in items' order; argmax_only: each such row's argmax [num_logits]
        instead, taken in llama.cpp's own logits buffer (nothing copied)."""
        # With a KV stream per slot, llama.cpp splits a batch into one
        # forward pass per run of consecutive seq ids in batch order: slots
        # fed as 6, 7, 0..5 ran as two passes, each reading every weight.
        # Fed in slot order, each run of consecutive slots is one pass.
        order = sorted(range(len(items)), key=lambda i: items[i][2])  # stable: a slot's positions stay in order
        if any(i != j for j, i in enumerate(order)):
            wanted = [i for i in order if items[i][3]]
            logits = self._decode([items[i] for i in order], argmax_only)
            return logits[np.argsort(wanted, kind="stable")] if len(wanted) > 1 else logits
        return self._decode(items, argmax_only)

    def submit(self, chunk: list[tuple[int, int, int, bool]]) -> None:
        """One llama_decode of at most n_batch items; their logits are then in llama.cpp's buffer."""
        if self.lora is not None:  # the chunk's LoRA adapter set on the context (backends/llamacpp/lora.py)
            self.lora.prepare(chunk)
        batch = self.batch
        batch.n_tokens = len(chunk)
        for i, (token, pos, slot, logits) in enumerate(chunk):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, pos, 1
            batch.seq_id[i][0], batch.logits[i] = slot, logits
        code = _llama().llama_decode(self.ctx, batch)
        if code != 0:
            raise BackendFailure(f"llama_decode failed with code {code} (KV cache full or invalid batch)")

    def _decode(self, items: list[tuple[int, int, int, bool]], argmax_only: bool = False) -> np.ndarray:
        llama = _llama()
        outputs = []
        vocab = self.model.vocab_size
        for start in range(0, len(items), self.n_batch):
            chunk = items[start:start + self.n_batch]
            self.submit(chunk)
            num_out = sum(1 for item in chunk if item[3])
            if num_out:
                rows = logits_rows(llama, self.ctx, num_out, vocab)
                # the buffer is llama.cpp's and the next decode overwrites it
                outputs.append(rows.argmax(axis=1) if argmax_only else rows.copy())
                if argmax_only:
                    self.picks.rows_argmax += num_out
                else:
                    self.picks.rows_copied += num_out
        if not outputs:
            return np.zeros(0, dtype=np.int64) if argmax_only else np.zeros((0, vocab), dtype=np.float32)
        return np.concatenate(outputs) if len(outputs) > 1 else outputs[0]

    def run(self, plan: StepPlan[SlotWork], argmax_only: bool = False) -> np.ndarray:
        """plan's KV ops, then its work in one batch: the logit rows it asks
        for ([rows, vocab]), or with argmax_only their argmax ([rows])."""
        self.apply_kv_ops(plan.kv_ops)
        items = []
        for work in plan.work:
            first_logit = len(work.token_ids) - work.num_logits
            for i, token in enumerate(work.token_ids):
                items.append((token, work.start_pos + i, work.slot, i >= first_logit))
        if items:
            return self.decode(items, argmax_only)
        return np.zeros(0, dtype=np.int64) if argmax_only else np.zeros((0, self.model.vocab_size), dtype=np.float32)

    def run_picking(self, plan: StepPlan[SlotWork], picks: dict) -> tuple[np.ndarray, np.ndarray]:
        """run(plan) where the sequences in picks (seq id -> None: argmax,
        or a NativeSampler) get their tokens in llama.cpp's buffer and only
        the others' logits are copied: (tokens [rows], -1 where copied;
        logits [copied rows, vocab]), native_sampling.decode_picking."""
        self.apply_kv_ops(plan.kv_ops)
        items, item_picks = pick_items(plan, picks)
        return decode_picking(self, items, item_picks)

    def close(self) -> None:
        llama = _llama()
        if self.ctx:
            llama.llama_batch_free(self.batch)
            llama.llama_free(self.ctx)
            self.ctx = None
