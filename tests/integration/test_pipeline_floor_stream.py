"""bench/pipeline_floor.py end to end: its front and worker, with SmolLM2,
stream greedy chat and text completions whose text is what modeld's own
llama.cpp context decodes for the same prompt, alone and ten at once (more
than its eight slots: the rest wait their turn), count every token in the
usage chunk, refuse a size past its limits, and keep serving after it."""

from __future__ import annotations

import json
import sys
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from daemon import MODELS

pytest.importorskip("llama_cpp")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
floor = pytest.importorskip("pipeline_floor")

PROMPT = "Why is the sky blue?"
PROMPTS = [f"Name {i + 2} animals that live in the sea." for i in range(10)]


def _post(url: str, body: dict, path: str = "/v1/chat/completions") -> tuple[list[str], dict]:
    request = urllib.request.Request(f"{url}{path}", data=json.dumps(body).encode(),
                                     headers={"content-type": "application/json"})
    texts, usage = [], {}
    with urllib.request.urlopen(request, timeout=120) as response:
        for line in response:
            if line.startswith(b"data: {"):
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    usage = chunk["usage"]
                texts += [c["delta"]["content"] if "delta" in c else c["text"] for c in chunk["choices"]]
    return texts, usage


@pytest.fixture(scope="module")
def reference():
    """prompt, tokens -> the greedy text of modeld's own context (LlamaContext.decode's argmax), one at a time."""
    from modeld.backends.llamacpp.context import LlamaContext, LlamaModel, _llama

    model = LlamaModel(MODELS / "smollm2/model.gguf")
    context = LlamaContext(model, 1024, 1, 256, 2)

    def decode(prompt: str, tokens: int) -> str:
        _llama().llama_memory_seq_rm(context.memory, 0, -1, -1)
        ids = model.tokenize(prompt, add_special=False)
        out = [int(context.decode([(t, i, 0, i == len(ids) - 1) for i, t in enumerate(ids)], argmax_only=True)[0])]
        while len(out) < tokens:
            out.append(int(context.decode([(out[-1], len(ids) + len(out) - 1, 0, True)], argmax_only=True)[0]))
        return b"".join(model.token_bytes(t) for t in out).decode("utf-8", "replace")

    yield decode
    context.close()
    model.close()


@pytest.fixture(scope="module")
def pipeline():
    with floor.PipelineFloor() as running:
        yield running


def test_greedy_streams_are_modelds_own_decode(pipeline, reference):
    texts, usage = _post(pipeline.http_url, {"messages": [{"role": "user", "content": PROMPT}],
                                             "max_tokens": 24, "temperature": 0})
    assert usage["completion_tokens"] == 24
    assert "".join(texts) == reference(floor.chatml(PROMPT), 24)
    texts, usage = _post(pipeline.http_url, {"prompt": "The capital of France is", "max_tokens": 16,
                                             "temperature": 0}, "/v1/completions")
    assert usage["completion_tokens"] == 16
    assert "".join(texts) == reference("The capital of France is", 16)


def test_ten_streams_at_once_each_get_their_own_greedy_text(pipeline, reference):
    def one(prompt: str):
        return _post(pipeline.http_url, {"messages": [{"role": "user", "content": prompt}], "max_tokens": 12,
                                         "temperature": 0})

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        answers = list(pool.map(one, PROMPTS))
    for prompt, (texts, usage) in zip(PROMPTS, answers):
        assert usage["completion_tokens"] == 12
        assert "".join(texts) == reference(floor.chatml(prompt), 12), prompt


def test_sizes_past_the_limits_are_refused_and_serving_goes_on(pipeline):
    with pytest.raises(urllib.error.HTTPError) as refused:
        _post(pipeline.http_url, {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": floor.MAX_TOKENS + 1})
    assert refused.value.code == 400
    # a prompt and its tokens past a slot's cells: the stream ends with none
    _, usage = _post(pipeline.http_url, {"prompt": "sea " * 1500, "max_tokens": floor.MAX_TOKENS}, "/v1/completions")
    assert usage["completion_tokens"] == 0
    _, usage = _post(pipeline.http_url, {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 5})
    assert usage["completion_tokens"] == 5  # sampled at the default temperature, after both
