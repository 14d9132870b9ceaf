"""The logit processors' formulas written out token by token, in float64:
the reference the engine's vectorised ones (sampling.adjust_logits) are
checked against, in the unit tests and on the backends' own logits."""

from __future__ import annotations

import numpy as np

from modeld.backends.generation.params import SamplingParams


def reference(logits: np.ndarray, params: SamplingParams, prompt: list[int], output: list[int],
              end_ids: list[int]) -> np.ndarray:
    """The formulas one token at a time, in float64 (what the docs state)."""
    out = logits.astype(np.float64).copy()
    for token, bias in params.logit_bias:
        out[token] += bias
    if params.repetition_penalty != 1.0:
        for token in set(prompt) | set(output):
            out[token] = out[token] / params.repetition_penalty if out[token] > 0 else out[token] * params.repetition_penalty
    for token in set(output):
        count = output.count(token)
        out[token] -= count * params.frequency_penalty + params.presence_penalty
    if len(output) < params.min_tokens:
        for token in list(end_ids) + list(params.stop_token_ids):
            out[token] = -np.inf
    return out
