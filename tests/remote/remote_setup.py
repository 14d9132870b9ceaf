"""The remote model's configuration, shared by the fixtures and the rows."""

from __future__ import annotations

import json

from modeld.gen import generation_pb2 as g
from vllm_server import SERVED_NAME

REMOTE_MODEL = "smollm2-vllm"


def remote_config(url: str, engine: str = "vllm", fallback: bool = True) -> dict:
    """model.toml's keys as a dict: the same shape loads inline as JSON."""
    config = {
        "format": "remote",
        "backends": [engine, "llamacpp"] if fallback else [engine],
        # probes every half second while healthy and at most every 2 s while down, so the
        # failover rows see the engine return within seconds, not the 30 s default
        "remote": {"engine": engine, "url": url, "model": SERVED_NAME, "timeout_s": 600, "max_in_flight": 64,
                   "probe_interval_s": 0.5, "max_probe_interval_s": 2.0},
    }
    if fallback:
        config["artifact"] = "model.gguf"
        # the same table as models/smollm2/model.toml, smaller: it only has to answer while vLLM is down
        config["llamacpp"] = {"n_ctx": 4096, "n_slots": 4, "context_length": 1024, "n_threads": 2}
    return config


def toml_text(config: dict) -> str:
    lines, tables = [], []
    for key, value in config.items():
        (tables if isinstance(value, dict) else lines).append((key, value))
    out = [f"{k} = {json.dumps(v)}" for k, v in lines]
    for name, table in tables:
        out += ["", f"[{name}]", *(f"{k} = {json.dumps(v)}" for k, v in table.items())]
    return "\n".join(out) + "\n"


def direct_completion(direct, prompt, **body) -> dict:
    request = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": 32, "temperature": 0.0, **body}
    response = direct.post("/v1/completions", json=request)
    assert response.status_code == 200, response.text
    return response.json()


def direct_stream(direct, prompt, **body) -> list[dict]:
    """The SSE chunks of a streamed direct call, [DONE] excluded."""
    request = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": 32, "temperature": 0.0, "stream": True,
               "stream_options": {"include_usage": True}, **body}
    chunks = []
    with direct.stream("POST", "/v1/completions", json=request) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    return chunks


def generate(stub, prompt=None, token_ids=None, model=REMOTE_MODEL, timeout=120, **sampling):
    """(token ids, text, every response) of one Generate call."""
    params = g.SamplingParams(**{"max_tokens": 32, "temperature": 0.0, **sampling})
    if token_ids is not None:
        request = g.GenerateRequest(model=model, token_ids=g.TokenIds(ids=token_ids), sampling=params)
    else:
        request = g.GenerateRequest(model=model, prompt=prompt, sampling=params)
    responses = list(stub.Generate(request, timeout=timeout))
    return [t for r in responses for t in r.token_ids], "".join(r.text for r in responses), responses
