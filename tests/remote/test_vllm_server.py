"""The test server itself: vLLM answers on the HF SmolLM2, greedily and
repeatably. If these fail, the rows in test_vllm_backend.py say nothing."""

from __future__ import annotations

import pytest

from vllm_server import SERVED_NAME

pytestmark = pytest.mark.remote


def test_vllm_serves_the_converted_smollm2(direct):
    models = direct.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == [SERVED_NAME]
    body = {"model": SERVED_NAME, "prompt": "The capital of France is", "max_tokens": 16, "temperature": 0.0}
    first = direct.post("/v1/completions", json=body).json()
    again = direct.post("/v1/completions", json=body).json()
    # a bad conversion (wrong rope, untied head) gives fluent-looking garbage or a repeated token,
    # never the right capital
    assert "Paris" in first["choices"][0]["text"], first
    assert first["choices"][0]["text"] == again["choices"][0]["text"]
    assert first["usage"]["completion_tokens"] == 16


def test_vllm_exports_the_running_request_gauge(vllm):
    # the cancellation row reads it
    assert vllm.metric("vllm:num_requests_running") == 0
