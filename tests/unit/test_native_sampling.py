"""llama.cpp's sampler chain (backends/llamacpp/native_sampling.py) holds to
the sampling semantics modeld documents, the ones numpy's path
(sampling.probabilities, sampling.adjust_logits) implements: checked on
synthetic logit rows, so no model weights are needed; the chain is
llama.cpp's own, from llama-cpp-python."""

from __future__ import annotations

import numpy as np
import pytest

from modeld.backends.generation.params import Constraint, ConstraintKind, SamplingParams, SpeculativeMode
from modeld.backends.generation.sampling import adjust_logits, probabilities

pytest.importorskip("llama_cpp")

from modeld.backends.llamacpp.native_sampling import NativeSampler, native_seed, samples_natively  # noqa: E402

VOCAB = 64
END = 3  # the vocabulary's one end-of-generation token


class Vocabulary:
    """What a chain reads of its model: the vocabulary's size and end ids."""

    vocab_size = VOCAB

    def end_of_generation_ids(self) -> np.ndarray:
        return np.array([END], dtype=np.int64)


def _rows(seed: int, n: int, scale: float = 3.0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((n, VOCAB)) * scale).astype(np.float32)


def _sampler(prompt=(10, 11, 12), **params) -> NativeSampler:
    return NativeSampler(Vocabulary(), SamplingParams(**{"temperature": 1.0, "max_tokens": 64, **params}),
                         list(prompt), [])


def _draws(sampler: NativeSampler, rows: np.ndarray) -> list[int]:
    try:
        return [sampler.sample_row(row) for row in rows]
    finally:
        sampler.close()


def test_the_same_seed_draws_the_same_tokens_and_another_seed_others():
    rows = _rows(1, 40)
    first = _draws(_sampler(seed=1234), rows)
    assert _draws(_sampler(seed=1234), rows) == first
    assert _draws(_sampler(seed=1235), rows) != first
    assert len(set(first)) > 5  # a real draw, not one token every time


def test_seeds_fold_into_the_32_bits_llamas_generator_takes():
    from llama_cpp import LLAMA_DEFAULT_SEED

    assert native_seed(None) == LLAMA_DEFAULT_SEED  # no seed: llama.cpp picks one
    assert native_seed(7) == 7 and native_seed(2**32 - 2) == 2**32 - 2
    assert native_seed(2**32 - 1) == 0  # never 0xFFFFFFFF, which would mean "random"
    assert all(native_seed(s) != LLAMA_DEFAULT_SEED for s in (2**32 - 1, 2**33 - 2, 2**64 - 1))
    rows = _rows(2, 20)
    assert _draws(_sampler(seed=2**32 - 1), rows) == _draws(_sampler(seed=2**32 - 1), rows)


def test_without_a_seed_two_sequences_draw_independently():
    rows = _rows(3, 40, scale=0.5)  # flat rows: two equal 40-token runs would be a shared generator
    assert _draws(_sampler(), rows) != _draws(_sampler(), rows)


def test_top_k_1_is_greedy_at_any_temperature():
    rows = _rows(4, 50)
    for temperature in (0.5, 1.0, 2.0):
        assert _draws(_sampler(top_k=1, temperature=temperature, seed=5), rows) == rows.argmax(axis=1).tolist()


@pytest.mark.parametrize("params", [
    dict(top_p=0.6), dict(min_p=0.2), dict(top_k=5, top_p=0.8), dict(temperature=0.7, top_p=0.7, min_p=0.1),
    dict(temperature=1.5, top_k=12, min_p=0.05),
])
def test_every_draw_lies_in_the_set_numpy_allows(params):
    rows = _rows(5, 200)
    drawn = _draws(_sampler(seed=9, **params), rows)
    reference = SamplingParams(temperature=params.get("temperature", 1.0), top_k=params.get("top_k", 0),
                               top_p=params.get("top_p", 1.0), min_p=params.get("min_p", 0.0))
    allowed = [probabilities(row, reference) > 0 for row in rows]
    assert all(allowed[i][t] for i, t in enumerate(drawn))
    # the filters bite: most rows allow far fewer tokens than the vocabulary
    assert np.median([a.sum() for a in allowed]) < VOCAB / 4


def test_draws_follow_numpys_distribution():
    """Many draws from one row: the frequencies match sampling.probabilities
    (temperature, top-k, top-p and min-p together) within sampling noise."""
    params = dict(temperature=0.8, top_k=20, top_p=0.9, min_p=0.02)
    row = _rows(6, 1)[0]
    n = 4000
    sampler = _sampler(seed=21, **params)
    try:
        counts = np.bincount([sampler.sample_row(row) for _ in range(n)], minlength=VOCAB)
    finally:
        sampler.close()
    probs = probabilities(row, SamplingParams(**params))
    assert set(np.flatnonzero(counts)) <= set(np.flatnonzero(probs))
    # 5 standard deviations of a binomial count, per token
    sigma = np.sqrt(n * probs * (1 - probs))
    assert np.all(np.abs(counts - n * probs) <= 5 * sigma + 1), (counts, n * probs)
    assert (probs > 0).sum() >= 3  # several tokens to tell apart


@pytest.mark.parametrize("params", [
    dict(repetition_penalty=1.8), dict(frequency_penalty=1.5), dict(presence_penalty=2.0),
    dict(frequency_penalty=0.7, presence_penalty=-0.5, repetition_penalty=1.3),
    dict(logit_bias=((7, 9.0), (20, -100.0), (7, 2.0), (VOCAB + 5, 50.0))),
    dict(logit_bias=((30, 4.0),), repetition_penalty=0.6, frequency_penalty=-1.0),
])
def test_penalties_and_logit_bias_are_numpys(params):
    """top_k=1 makes each draw the argmax of the adjusted row: it must be
    the argmax of adjust_logits' row after the same history."""
    prompt = [10, 11, 12, 40]
    rows = _rows(7, 40, scale=1.0)
    rows[:, prompt] += 3.0  # the prompt's tokens lead: the repetition penalty has something to move
    sampler = _sampler(prompt=prompt, top_k=1, seed=1, **params)
    reference = SamplingParams(**params)
    output: list[int] = []
    changed = 0
    try:
        for row in rows:
            adjusted = row[None].copy()
            adjust_logits(adjusted, reference, prompt, output, [], np.array([END]))
            expected = int(adjusted[0].argmax())
            got = sampler.sample_row(row)
            assert got == expected, (len(output), got, expected)
            changed += expected != int(row.argmax())
            output.append(got)
    finally:
        sampler.close()
    assert changed > 0, "the penalties never changed a pick: the test checks nothing"


def test_min_tokens_holds_back_the_end_until_then():
    rows = _rows(8, 12)
    rows[:, END] = 50.0  # the end of generation is every row's best by far
    stop_id = 9
    rows[:, stop_id] = 49.0
    drawn = _draws(_sampler(min_tokens=5, stop_token_ids=(stop_id,), top_k=1, seed=3), rows)
    assert END not in drawn[:5] and stop_id not in drawn[:5]
    assert drawn[5:] == [END] * 7  # from the min_tokens-th token on, nothing holds it


@pytest.mark.parametrize("params,native", [
    (dict(temperature=1.0), False),  # the whole vocabulary: numpy's vectorised softmax is cheaper
    (dict(temperature=0.7, top_k=40, top_p=0.9, min_p=0.05, seed=3), True),
    (dict(temperature=1.0, top_p=0.95), True), (dict(temperature=1.0, min_p=0.05), True),
    (dict(temperature=1.0, top_k=40, repetition_penalty=1.2, frequency_penalty=0.5, presence_penalty=0.5), True),
    (dict(temperature=1.0, top_k=40, logit_bias=((5, 1.0),), min_tokens=3, stop_token_ids=(4,)), True),
    (dict(temperature=0.0), False),  # greedy: the argmax is taken in the buffer already
    (dict(temperature=0.0, frequency_penalty=1.0), False),  # greedy keeps numpy's float32 arithmetic
    (dict(temperature=1.0, logprobs=2), False),
    (dict(temperature=1.0, constraint=Constraint(ConstraintKind.REGEX, "[a-z]+")), False),
    (dict(temperature=1.0, speculative=SpeculativeMode.NGRAM), False),
])
def test_which_requests_sample_natively(params, native):
    assert samples_natively(SamplingParams(**params)) is native
