"""Sampling for a whole step's logits at once.

logits: [num_rows, vocab] float32. Greedy rows take one vectorised argmax;
sampled rows filter (top-k, top-p, min-p) with numpy over the vocabulary,
one row at a time, so no Python loop ever walks the 49,152 entries.
"""

from __future__ import annotations

import numpy as np

from modeld.backends.generation.params import SamplingParams, TokenLogprob


def make_rng(seed: int | None) -> np.random.Generator:
    return np.random.default_rng(seed)


def probabilities(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The filtered distribution a sampled row draws from ([vocab] float64)."""
    scaled = logits.astype(np.float64) / params.temperature
    if params.top_k and params.top_k < scaled.shape[0]:
        kth = np.partition(scaled, -params.top_k)[-params.top_k]
        scaled = np.where(scaled < kth, -np.inf, scaled)
    scaled -= scaled.max()
    probs = np.exp(scaled)
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
    return probs / probs.sum()


def sample_rows(logits: np.ndarray, params: list[SamplingParams], rngs: list[np.random.Generator]) -> np.ndarray:
    """One token id per row of logits ([rows, vocab] -> [rows])."""
    tokens = logits.argmax(axis=1)
    for row, (p, rng) in enumerate(zip(params, rngs)):
        if not p.is_greedy:
            probs = probabilities(logits[row], p)
            tokens[row] = rng.choice(probs.shape[0], p=probs)
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
