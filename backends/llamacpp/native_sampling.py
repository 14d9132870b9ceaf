"""Sampling on llama.cpp's own sampler chain, where the logits lie.

A sampled row in numpy costs a [vocab] float32 copy out of llama.cpp's
logits buffer (192 KiB for SmolLM2's 49,152 tokens) and a float64
softmax over it, about 0.5 ms a row here. For a request whose sampling
llama.cpp's samplers express exactly, each sequence gets its own
llama_sampler chain instead, and `llama_sampler_sample(chain, ctx, i)`
draws the token from batch row i in C, with the GIL released: nothing
vocabulary-sized reaches Python.

The chain applies what sampling.adjust_logits and sampling.probabilities
apply, in their order, with the same formulas:

    logit_bias -> repetition penalty (prompt and output tokens)
      -> frequency/presence penalties (output tokens) -> min_tokens mask
      -> top-k -> temperature -> top-p -> min-p -> draw

top-k before the temperature keeps the same tokens (dividing by a positive
temperature keeps their order) and scales k logits, not the vocabulary.
top-p before min-p gives the set numpy's order gives: numpy measures top-p
over the mass before min-p's cut, and both keep a prefix of the tokens by
probability, so either order keeps the shorter prefix.

llama.cpp's penalties sampler counts one window for all three penalties,
where modeld's repetition penalty sees the prompt and the output and the
additive ones the output only: two penalties samplers, the first fed the
prompt as well. The min_tokens mask is a logit_bias of -inf on the end of
generation ids and stop_token_ids, removed from the chain once min_tokens
tokens are out.

What stays in numpy (samples_natively is False): greedy requests (the loop
takes their argmax in the buffer already, and a greedy request with
penalties keeps numpy's float32 arithmetic, so its tokens stay exactly as
they were), logprobs (they are read off the whole row), constraints (the
grammar's token mask is llguidance's) and speculative decoding (a draft's
acceptance needs the target's probabilities).

Seeds: llama.cpp's dist sampler draws from a std::mt19937 seeded with 32
bits, and 0xFFFFFFFF asks it for a random seed, so a request's seed s
seeds it with s mod (2^32 - 1): the same seed gives the same tokens, run
after run, and choice i's seed + i differs from choice j's. The draws are
not numpy's: the same seed gives other tokens than a build that sampled
in numpy.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np

from modeld.backends.generation.params import SamplingParams, SpeculativeMode
from modeld.backends.generation.sampling import WholeDraw

# the seeds a 32-bit std::mt19937 takes, 0xFFFFFFFF (LLAMA_DEFAULT_SEED: "pick one at random") left out
_SEED_MODULUS = 2**32 - 1


def samples_natively(params: SamplingParams) -> bool:
    """Whether llama.cpp's sampler chain can draw this request's tokens
    exactly as the numpy path would (see the module docstring), and
    cheaper: with top-k, top-p or min-p the chain draws from the few tokens
    they keep (74 us a row at top-k 40, numpy 1,870 us), but over the whole
    vocabulary its scalar softmax cost 509 us a row where numpy's vectorised
    one cost 365 (bench_token_cpu --only sampling), so those rows stay in numpy."""
    truncated = params.top_k > 0 or params.top_p < 1.0 or params.min_p > 0.0
    return (truncated and not params.is_greedy and not params.logprobs and params.constraint is None
            and params.speculative is SpeculativeMode.NONE)


def native_seed(seed: int | None) -> int:
    """The dist sampler's 32-bit seed for a request's seed; None: llama.cpp picks one."""
    from modeld.backends.llamacpp.context import _llama

    return _llama().LLAMA_DEFAULT_SEED if seed is None else seed % _SEED_MODULUS


@dataclass
class PickCounts:
    """How a context's logit rows left it, for tests and benchmarks: the
    native path is taken when sampled rows are counted here and not copied."""

    rows_sampled: int = 0  # drawn by a sequence's llama.cpp sampler chain
    rows_drawn: int = 0  # drawn over the whole vocabulary in llama.cpp's buffer (sampling.WholeDraw)
    rows_argmax: int = 0  # argmax taken in llama.cpp's buffer
    rows_copied: int = 0  # copied out as [vocab] float32 for numpy


class NativeSampler:
    """One sequence's llama.cpp sampler chain. It sees every token the
    sequence outputs (llama_sampler_sample accepts the token it draws), so
    one chain serves one sequence for its whole life."""

    def __init__(self, model, params: SamplingParams, prompt_ids: list[int], output_ids: list[int]) -> None:
        """model: the LlamaModel (vocabulary size, end-of-generation ids)."""
        from modeld.backends.llamacpp.context import _llama

        self._llama = llama = _llama()
        chain_params = llama.llama_sampler_chain_default_params()
        chain_params.no_perf = True
        self.chain = llama.llama_sampler_chain_init(chain_params)
        self.vocab_size = vocab = model.vocab_size
        self.num_output = len(output_ids)
        self._min_tokens = params.min_tokens
        self._mask_index: int | None = None  # the min_tokens mask's place in the chain while it holds
        window = len(prompt_ids) + params.max_tokens + 1  # the penalties forget nothing a sequence holds
        if params.logit_bias:
            self._add_bias([(t, b) for t, b in params.logit_bias if t < vocab])
        if params.repetition_penalty != 1.0:
            repetition = self._add(llama.llama_sampler_init_penalties(vocab, window, params.repetition_penalty,
                                                                      0.0, 0.0))
            for token in prompt_ids:
                llama.llama_sampler_accept(repetition, token)
        if params.frequency_penalty or params.presence_penalty:
            self._add(llama.llama_sampler_init_penalties(vocab, window, 1.0, params.frequency_penalty,
                                                         params.presence_penalty))
        if self.num_output < params.min_tokens:
            ends = set(model.end_of_generation_ids().tolist()) | set(params.stop_token_ids)
            held = sorted(t for t in ends if t < vocab)
            if held:
                self._mask_index = llama.llama_sampler_chain_n(self.chain)
                self._add_bias([(t, float("-inf")) for t in held])
        if params.top_k and params.top_k < vocab:
            self._add(llama.llama_sampler_init_top_k(params.top_k))
        if params.temperature != 1.0:
            self._add(llama.llama_sampler_init_temp(params.temperature))
        if params.top_p < 1.0:
            self._add(llama.llama_sampler_init_top_p(params.top_p, 1))
        if params.min_p > 0.0:
            self._add(llama.llama_sampler_init_min_p(params.min_p, 1))
        self._add(llama.llama_sampler_init_dist(native_seed(params.seed)))
        for token in output_ids:  # a sequence that already has output (none today: chains start at its first row)
            llama.llama_sampler_accept(self.chain, token)

    def _add(self, sampler):
        self._llama.llama_sampler_chain_add(self.chain, sampler)  # the chain owns it from here
        return sampler

    def _add_bias(self, biases: list[tuple[int, float]]) -> None:
        if not biases:
            return
        llama = self._llama
        table = (llama.llama_logit_bias * len(biases))(*(llama.llama_logit_bias(t, b) for t, b in biases))
        self._add(llama.llama_sampler_init_logit_bias(self.vocab_size, len(biases), table))

    def sample(self, ctx, batch_index: int) -> int:
        """The token drawn from the logits of batch position batch_index of
        the context's last decode, accepted into the chain."""
        token = self._llama.llama_sampler_sample(self.chain, ctx, batch_index)
        self._took_one()
        return token

    def sample_row(self, logits: np.ndarray) -> int:
        """sample() from a [vocab] float32 row given here rather than the
        context's buffer, by llama_sampler_sample's own steps (every token
        a candidate, the chain applied, its pick accepted): how the unit
        tests hold the chain to numpy's semantics without a model."""
        llama = self._llama
        data = (llama.llama_token_data * logits.shape[0])()
        view = np.ctypeslib.as_array(data)
        view["id"] = np.arange(logits.shape[0])
        view["logit"] = logits
        candidates = llama.llama_token_data_array(data, logits.shape[0], -1, False)
        llama.llama_sampler_apply(self.chain, ctypes.byref(candidates))
        token = int(data[candidates.selected].id)
        llama.llama_sampler_accept(self.chain, token)
        self._took_one()
        return token

    def _took_one(self) -> None:
        self.num_output += 1
        if self._mask_index is not None and self.num_output >= self._min_tokens:
            # removed, the chain no longer owns it
            self._llama.llama_sampler_free(self._llama.llama_sampler_chain_remove(self.chain, self._mask_index))
            self._mask_index = None

    def close(self) -> None:
        if self.chain:
            self._llama.llama_sampler_free(self.chain)
            self.chain = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # at interpreter exit the bindings may be gone already
            pass


def decode_picking(context, items: list[tuple[int, int, int, bool]], picks: list) -> tuple[np.ndarray, np.ndarray]:
    """LlamaContext.decode for a step whose rows leave the buffer three ways.

    items: (token, position, slot, wants_logits); picks[i], for a wanted
    item: False (copy its logits out), None (its argmax), a WholeDraw (a
    token drawn from the row in place) or a NativeSampler (a token drawn
    by it). Returns (tokens [wanted rows] int64, -1 where
    copied; logits [copied rows, vocab] float32), both in items' order.
    """
    from modeld.backends.llamacpp.context import _llama, logits_rows

    llama = _llama()
    vocab = context.model.vocab_size
    counts = context.picks
    wanted = [i for i, item in enumerate(items) if item[3]]
    rank = {item: r for r, item in enumerate(wanted)}
    tokens = np.full(len(wanted), -1, dtype=np.int64)
    copied: list[tuple[int, np.ndarray]] = []
    # slot order, as decode() feeds them: one forward pass per run of consecutive slots
    order = sorted(range(len(items)), key=lambda i: items[i][2])
    for start in range(0, len(order), context.n_batch):
        chunk = order[start:start + context.n_batch]
        context.submit([items[i] for i in chunk])
        num_out = sum(1 for i in chunk if items[i][3])
        if not num_out:
            continue
        rows = logits_rows(llama, context.ctx, num_out, vocab)
        out = 0
        for position, i in enumerate(chunk):
            if not items[i][3]:
                continue
            pick = picks[i]
            if pick is False:
                copied.append((rank[i], rows[out].copy()))  # the next decode overwrites the buffer
                counts.rows_copied += 1
            elif pick is None:
                tokens[rank[i]] = rows[out].argmax()
                counts.rows_argmax += 1
            elif isinstance(pick, WholeDraw):
                tokens[rank[i]] = pick.draw(rows[out])  # read in place, before the next decode
                counts.rows_drawn += 1
            else:
                tokens[rank[i]] = pick.sample(context.ctx, position)
                counts.rows_sampled += 1
            out += 1
    copied.sort(key=lambda pair: pair[0])
    logits = np.stack([row for _, row in copied]) if copied else np.zeros((0, vocab), dtype=np.float32)
    return tokens, logits


def pick_items(plan, picks: dict) -> tuple[list[tuple[int, int, int, bool]], list]:
    """A plan's decode items (as LlamaContext.run builds them) and each
    one's pick: picks maps seq id -> None (argmax) or a NativeSampler;
    a sequence not in it is copied out (False)."""
    items, item_picks = [], []
    for work in plan.work:
        pick = picks.get(work.seq_id, False)
        first_logit = len(work.token_ids) - work.num_logits
        for i, token in enumerate(work.token_ids):
            items.append((token, work.start_pos + i, work.slot, i >= first_logit))
            item_picks.append(pick)
    return items, item_picks

