"""Speculative verification: greedy acceptance and the rejection-sampling
rule that keeps the target distribution (checked statistically)."""

from __future__ import annotations

import numpy as np
from scipy.stats import chisquare

from modeld.backends.generation.loop import GenerationLoop
from modeld.backends.generation.ngram import propose_ngram
from modeld.backends.generation.params import SamplingParams
from modeld.backends.generation.sampling import make_rng, probabilities
from modeld.backends.generation.sequence import Sequence


def _loop() -> GenerationLoop:
    return GenerationLoop(runner=None, scheduler=None)


def test_greedy_accepts_while_the_target_agrees():
    seq = Sequence([1, 2, 3], SamplingParams())
    rows = np.full((4, 6), -5.0, dtype=np.float32)
    for row, best in enumerate([4, 2, 0, 5]):
        rows[row, best] = 5.0
    accepted, tokens, _ = _loop()._verify(seq, [4, 2, 1], rows)
    assert accepted == 2 and tokens == [4, 2, 0]  # third draft rejected, target's token instead
    accepted, tokens, _ = _loop()._verify(seq, [4, 2, 0], rows)
    assert accepted == 3 and tokens == [4, 2, 0, 5]  # all accepted plus a bonus token


def test_rejection_sampling_preserves_the_target_distribution():
    params = SamplingParams(temperature=0.8)
    logits = np.log(np.array([0.05, 0.4, 0.25, 0.2, 0.1], dtype=np.float32))[None, :].repeat(2, axis=0)
    target = probabilities(logits[0], params)
    seq = Sequence([0], params)
    seq.rng = make_rng(1234)
    loop = _loop()
    draws = 40_000
    counts = np.zeros(5)
    for _ in range(draws):
        _, tokens, _ = loop._verify(seq, [2], logits)  # the n-gram always proposes token 2
        counts[tokens[0]] += 1
    assert chisquare(counts, target * draws).pvalue > 0.001
    assert abs(counts[2] / draws - target[2]) < 0.01


def test_ngram_proposes_what_followed_the_last_occurrence():
    tokens = [5, 6, 7, 8, 9, 1, 5, 6, 7]
    assert propose_ngram(tokens, 3) == [8, 9, 1]
    assert propose_ngram([1, 2, 3], 3) == []
