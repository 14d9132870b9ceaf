"""bench/pipeline_floor.py end to end: its front and worker, with SmolLM2,
stream greedy chat and text completions whose text is what modeld's own
llama.cpp context decodes for the same prompt, count every token in the usage
chunk, refuse a size past its limit, and keep serving after it."""

from __future__ import annotations

import json
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from daemon import MODELS

pytest.importorskip("llama_cpp")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
floor = pytest.importorskip("pipeline_floor")

PROMPT = "Why is the sky blue?"


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


def _reference(prompt: str, tokens: int) -> str:
    """Greedy tokens by modeld's own context (LlamaContext.decode's argmax)."""
    from modeld.backends.llamacpp.context import LlamaContext, LlamaModel

    model = LlamaModel(MODELS / "smollm2/model.gguf")
    context = LlamaContext(model, 1024, 1, 256, 2)
    try:
        ids = model.tokenize(prompt, add_special=False)
        out = [int(context.decode([(t, i, 0, i == len(ids) - 1) for i, t in enumerate(ids)], argmax_only=True)[0])]
        while len(out) < tokens:
            out.append(int(context.decode([(out[-1], len(ids) + len(out) - 1, 0, True)], argmax_only=True)[0]))
        return b"".join(model.token_bytes(t) for t in out).decode("utf-8", "replace")
    finally:
        context.close()
        model.close()


def test_greedy_stream_is_modelds_own_decode_and_bad_sizes_are_refused():
    with floor.PipelineFloor() as pipeline:
        texts, usage = _post(pipeline.http_url, {"messages": [{"role": "user", "content": PROMPT}],
                                                 "max_tokens": 24, "temperature": 0})
        assert usage["completion_tokens"] == 24
        assert "".join(texts) == _reference(floor.chatml(PROMPT), 24)
        texts, usage = _post(pipeline.http_url, {"prompt": "The capital of France is", "max_tokens": 16,
                                                 "temperature": 0}, "/v1/completions")
        assert usage["completion_tokens"] == 16
        assert "".join(texts) == _reference("The capital of France is", 16)
        with pytest.raises(urllib.error.HTTPError) as refused:
            _post(pipeline.http_url, {"messages": [{"role": "user", "content": PROMPT}],
                                      "max_tokens": floor.MAX_TOKENS + 1})
        assert refused.value.code == 400
        _, usage = _post(pipeline.http_url, {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 5})
        assert usage["completion_tokens"] == 5  # sampled at the default temperature, after the refusal
