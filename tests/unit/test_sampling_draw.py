"""sampling.draw picks what numpy's Generator.choice(n, p=probs) picks from
the same generator state, so seeded sampled outputs stayed as they were
when the loop stopped calling choice (issue 30)."""

from __future__ import annotations

import numpy as np
import pytest

from modeld.backends.generation.params import SamplingParams
from modeld.backends.generation.sampling import draw, probabilities


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
