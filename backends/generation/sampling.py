"""Sampling for a whole step's logits at once.

logits: [num_rows, vocab] float32. Greedy rows take one vectorised argmax;
sampled rows filter (top-k, top-p, min-p) with numpy over the vocabulary,
one row at a time, so no Python loop ever walks the 49,152 entries.

Before sampling, `adjust_logits` applies a request's logit processors to
its rows, in this order (each row is one position: the next token, or the
one after each draft token):
1. logit_bias: logit[t] += bias[t];
2. repetition_penalty p (HF/vLLM), over prompt and output tokens: a seen
   token's logit is divided by p when positive, multiplied by p otherwise;
3. frequency and presence penalties (OpenAI), over output tokens only:
   logit[t] -= count[t] * frequency + (count[t] > 0) * presence;
4. min_tokens: end-of-generation and stop_token_ids get -inf until that
   many tokens are out;
then the loop applies a constraint's token mask. A request with none of
these set skips all of it.
"""

from __future__ import annotations

import threading

import numpy as np

from modeld.backends.generation.params import SamplingParams, TokenLogprob


def make_rng(seed: int | None) -> np.random.Generator:
    return np.random.default_rng(seed)


def probabilities(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The filtered distribution a sampled row draws from ([vocab] float64)."""
    # in place where the old expressions made a new array: the same values
    # (x / 1.0 is x), a few vocabulary-sized allocations less a row
    scaled = logits.astype(np.float64)
    if params.temperature != 1.0:
        scaled /= params.temperature
    if params.top_k and params.top_k < scaled.shape[0]:
        kth = np.partition(scaled, -params.top_k)[-params.top_k]
        scaled[scaled < kth] = -np.inf
    scaled -= scaled.max()
    probs = np.exp(scaled, out=scaled)
    probs /= probs.sum()
    if params.min_p > 0.0:
        probs = np.where(probs < params.min_p * probs.max(), 0.0, probs)
    if params.top_p < 1.0:
        order = np.argsort(-probs)
        cumulative = np.cumsum(probs[order])
        # keep the smallest prefix whose mass reaches top_p (at least one token)
        cut = int(np.searchsorted(cumulative, params.top_p)) + 1
        keep = np.zeros_like(probs, dtype=bool)
        keep[order[:cut]] = True
        probs = np.where(keep, probs, 0.0)
    probs /= probs.sum()
    return probs


def draw(probs: np.ndarray, rng: np.random.Generator) -> int:
    """rng.choice(len(probs), p=probs), the same token from the same
    generator state (numpy's own steps: cumulative sum, normalised by its
    last entry, one uniform draw, searchsorted right), without choice's
    checks of p, which cost as much again over a 49,152-token row."""
    cdf = probs.cumsum()
    cdf /= cdf[-1]
    return int(cdf.searchsorted(rng.random(), side="right"))


_SCRATCH = threading.local()  # each loop's worker thread samples into its own buffer


def truncates(params: SamplingParams, vocab: int) -> bool:
    """Whether top-k, top-p or min-p cuts the distribution a row draws from."""
    return bool(params.top_k and params.top_k < vocab) or params.top_p < 1.0 or params.min_p > 0.0


_BLOCK = 256  # weights per block of the two-level search: about the square root of a 49,152-token vocabulary
_LOG2_E = 1.4426950408889634  # log2(e)


def draw_whole(logits: np.ndarray, temperature: float, rng: np.random.Generator) -> int:
    """draw(probabilities(logits, params), rng) for a row no filter
    truncates, without a vocabulary-long running sum or a float64 exp:
    the softmax weights are computed in float32 (numpy's float32 exp is
    vectorised; its float64 exp is a scalar loop here, 386 against 85 us
    over 49,152 tokens), and one uniform draw is scaled by their total
    rather than every weight divided by it. The draw is found in two
    levels, the running sum of per-block totals and then the running sum
    inside the one block it falls in: a cumulative sum is one serial pass
    that numpy cannot vectorise, block totals are. Blocks are summed in
    float32 (rounding of the order of the weights' own), their running sum
    in float64. The same generator step as draw; the two differ only where
    a draw lands within float32 rounding of a boundary between two tokens
    (3 of 20,000 seeded draws here). `logits` may be a view of a runtime's
    own buffer (WholeDraw): it is only read. The buffer is the thread's (a
    fresh array a row is an allocation and its page faults), padded to
    whole blocks with zero weights."""
    vocab = logits.shape[0]
    scratch = getattr(_SCRATCH, "buffer", None)
    if scratch is None or getattr(_SCRATCH, "vocab", None) != vocab:
        scratch = _SCRATCH.buffer = np.zeros(-(-vocab // _BLOCK) * _BLOCK, dtype=np.float32)
        _SCRATCH.vocab = vocab
    weights = scratch[:vocab]  # the padding past it stays 0 and is never picked
    # e^((x - max) / T) as 2^((x - max) log2(e) / T): numpy's float32 exp2
    # takes 11 us over 49,152 weights here against exp's 25. The largest
    # logit is taken off first, so the weights that count are near 2^0,
    # where the product's rounding moves them least (taken off after the
    # product, 8 of 20,000 seeded draws differed from the float64 path)
    np.subtract(logits, logits.max(), out=weights)
    weights *= np.float32(_LOG2_E / temperature)
    np.exp2(weights, out=weights)
    # einsum's row sums, not sum(axis=1): 6 against 16 us over 192 blocks of 256 here
    running = np.cumsum(np.einsum("ij->i", scratch.reshape(-1, _BLOCK)), dtype=np.float64)
    target = rng.random() * running[-1]
    block = min(int(running.searchsorted(target, side="right")), running.shape[0] - 1)
    below = running[block - 1] if block else 0.0
    start = block * _BLOCK
    inner = np.cumsum(scratch[start:start + _BLOCK], dtype=np.float64)
    if running[block] > below:
        # the block's float32 total and the float64 sum inside it round
        # apart: the target goes to the same fraction of the latter, so a
        # draw near a block's end lands on its last token that can be drawn
        target = (target - below) / (running[block] - below) * inner[-1]
    else:
        target -= below
    picked = start + min(int(inner.searchsorted(target, side="right")), _BLOCK - 1)
    if picked >= vocab or scratch[picked] == 0.0:
        # a target that lands on a masked token or the padding past the
        # last token: the last token before it that can be drawn
        picked = int(np.flatnonzero(weights[:min(picked, vocab)])[-1])
    return picked


class WholeDraw:
    """A sampled row that no filter truncates and nothing adjusts, drawn by
    draw_whole from its sequence's own generator where the runtime's logits
    lie (StepExecutor.run_picking): the [vocab] row is read in place, never
    copied out. OpenAI's default request (temperature 1, no top-k, top-p or
    min-p), which aiperf sends."""

    __slots__ = ("rng", "temperature")

    def __init__(self, rng: np.random.Generator, temperature: float) -> None:
        self.rng, self.temperature = rng, temperature

    def draw(self, row: np.ndarray) -> int:
        return draw_whole(row, self.temperature, self.rng)


def adjust_logits(rows: np.ndarray, params: SamplingParams, prompt_ids: list[int], output_ids: list[int],
                  drafts: list[int], end_ids: np.ndarray) -> None:
    """Apply params' logit processors in place to rows [R, vocab] (float32):
    row i follows output_ids + drafts[:i] (see the module docstring)."""
    vocab = rows.shape[1]
    if params.logit_bias:
        ids = np.fromiter((t for t, _ in params.logit_bias), dtype=np.int64, count=len(params.logit_bias))
        bias = np.fromiter((b for _, b in params.logit_bias), dtype=np.float32, count=len(params.logit_bias))
        inside = ids < vocab  # an id past this model's vocabulary biases nothing
        total = np.zeros(vocab, dtype=np.float32)
        np.add.at(total, ids[inside], bias[inside])
        rows += total
    repetition = params.repetition_penalty != 1.0
    additive = params.frequency_penalty != 0.0 or params.presence_penalty != 0.0
    if repetition or additive:
        output = np.asarray(output_ids, dtype=np.int64)
        counts = np.bincount(output[output < vocab], minlength=vocab).astype(np.float32)
        prompt_seen = None
        if repetition:
            prompt = np.asarray(prompt_ids, dtype=np.int64)
            prompt_seen = np.zeros(vocab, dtype=bool)
            prompt_seen[prompt[prompt < vocab]] = True
        for i in range(rows.shape[0]):
            if i:
                previous = drafts[i - 1]
                if previous < vocab:
                    counts[previous] += 1
            row = rows[i]
            if repetition:
                seen = prompt_seen | (counts > 0)
                picked = row[seen]
                row[seen] = np.where(picked > 0, picked / params.repetition_penalty,
                                     picked * params.repetition_penalty)
            if additive:
                row -= counts * params.frequency_penalty + (counts > 0) * np.float32(params.presence_penalty)
    if params.min_tokens:
        held = params.min_tokens - len(output_ids)  # rows still before min_tokens
        if held > 0:
            ends = np.concatenate([end_ids, np.asarray(params.stop_token_ids, dtype=np.int64)])
            ends = ends[ends < vocab]
            if ends.size:
                rows[:held, ends] = -np.inf


def needs_adjusting(params: SamplingParams, num_output: int) -> bool:
    """Whether adjust_logits would change anything for this sequence now."""
    return params.penalised or num_output < params.min_tokens


def sample_rows(logits: np.ndarray, params: list[SamplingParams], rngs: list[np.random.Generator]) -> np.ndarray:
    """One token id per row of logits ([rows, vocab] -> [rows])."""
    tokens = np.empty(logits.shape[0], dtype=np.int64)
    vocab = logits.shape[1]
    for row, (p, rng) in enumerate(zip(params, rngs)):
        if p.is_greedy:
            tokens[row] = logits[row].argmax()
        elif truncates(p, vocab):
            tokens[row] = draw(probabilities(logits[row], p), rng)
        else:
            tokens[row] = draw_whole(logits[row], p.temperature, rng)
    return tokens


def logprobs_of(logits: np.ndarray, token_ids: np.ndarray, top_n: int) -> tuple[list[TokenLogprob], list[tuple[TokenLogprob, ...]]]:
    """Chosen-token log-probabilities and the top_n alternatives per row."""
    shifted = logits.astype(np.float64) - logits.max(axis=1, keepdims=True)
    log_z = np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    logp = shifted - log_z  # [rows, vocab]
    chosen = [TokenLogprob(int(t), float(logp[i, t])) for i, t in enumerate(token_ids)]
    tops = []
    for i in range(logp.shape[0]):
        if top_n:
            best = np.argpartition(-logp[i], top_n)[:top_n]
            best = best[np.argsort(-logp[i, best])]
            tops.append(tuple(TokenLogprob(int(t), float(logp[i, t])) for t in best))
        else:
            tops.append(())
    return chosen, tops
