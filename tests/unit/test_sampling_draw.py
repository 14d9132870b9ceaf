"""sampling.draw picks what numpy's Generator.choice(n, p=probs) picks from
the same generator state, so seeded sampled outputs stayed as they were
when the loop stopped calling choice (issue 30)."""

from __future__ import annotations

import numpy as np
import pytest

from modeld.backends.generation.params import SamplingParams
from modeld.backends.generation.sampling import draw, draw_whole, probabilities, truncates


@pytest.mark.parametrize("temperature,top_k,top_p,min_p", [
    (1.0, 0, 1.0, 0.0), (0.7, 0, 1.0, 0.0), (1.3, 40, 0.9, 0.0), (1.0, 0, 0.95, 0.05),
])
def test_draw_is_choice_from_the_same_state(temperature, top_k, top_p, min_p):
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, max_tokens=1)
    logits = (np.random.default_rng(3).standard_normal(49152) * 4).astype(np.float32)
    probs = probabilities(logits, params)
    ours, numpy_s = np.random.default_rng(11), np.random.default_rng(11)
    picked = [draw(probs, ours) for _ in range(300)]
    assert picked == [int(numpy_s.choice(probs.shape[0], p=probs)) for _ in range(300)]
    assert len(set(picked)) > 1  # a real draw, not one token every time
    assert ours.random() == numpy_s.random()  # and both generators moved alike


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.3])
def test_whole_vocabulary_draw_picks_what_the_filtered_path_picks(temperature):
    params = SamplingParams(temperature=temperature, max_tokens=1)
    logits = (np.random.default_rng(5).standard_normal(49152) * 4).astype(np.float32)
    ours, reference = np.random.default_rng(13), np.random.default_rng(13)
    picked = [draw_whole(logits, temperature, ours) for _ in range(300)]
    assert picked == [draw(probabilities(logits, params), reference) for _ in range(300)]
    assert len(set(picked)) > 1
    assert ours.random() == reference.random()


@pytest.mark.parametrize("shift", [-60.0, -20.0, 0.0, 70.0, 100.0])
def test_whole_vocabulary_draw_is_the_same_wherever_the_logits_lie(shift):
    # at temperature 1 a row whose largest logit is moderate is drawn from
    # exp(logit) as it is, others from exp(logit - max): both pick what the
    # filtered path picks, with no overflow at the top or underflow below
    params = SamplingParams(temperature=1.0, max_tokens=1)
    logits = (np.random.default_rng(7).standard_normal(49152) * 4 + shift).astype(np.float32)
    ours, reference = np.random.default_rng(17), np.random.default_rng(17)
    picked = [draw_whole(logits, 1.0, ours) for _ in range(300)]
    assert picked == [draw(probabilities(logits, params), reference) for _ in range(300)]
    assert len(set(picked)) > 1


def test_sample_rows_takes_the_whole_vocabulary_path_only_without_filters():
    vocab = 49152
    assert not truncates(SamplingParams(temperature=1.0, max_tokens=1), vocab)
    assert not truncates(SamplingParams(temperature=1.0, top_k=vocab, max_tokens=1), vocab)
    assert truncates(SamplingParams(temperature=1.0, top_k=40, max_tokens=1), vocab)
    assert truncates(SamplingParams(temperature=1.0, top_p=0.9, max_tokens=1), vocab)
    assert truncates(SamplingParams(temperature=1.0, min_p=0.05, max_tokens=1), vocab)


@pytest.mark.parametrize("vocab", [49152, 1000, 7])
def test_whole_vocabulary_draw_never_picks_a_masked_token_or_the_padding(vocab):
    # a draw of (almost) 1 lands at the very end of the running sum, where the
    # last tokens are masked (-inf) and the block has padding past the vocabulary
    class Edge(np.random.Generator):
        def random(self, *args, **kwargs):
            return np.nextafter(1.0, 0.0)

    logits = (np.random.default_rng(2).standard_normal(vocab) * 4).astype(np.float32)
    logits[-3:] = -np.inf
    assert draw_whole(logits, 1.0, Edge(np.random.PCG64(0))) == vocab - 4
    logits[: vocab - 4] = -np.inf  # one token left to draw
    assert draw_whole(logits, 0.8, np.random.default_rng(1)) == vocab - 4
