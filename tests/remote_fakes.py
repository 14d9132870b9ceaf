"""Small servers that speak the remote engines' documented wire formats, on
loopback (and, at the end, a launcher for llama-cpp-python's real one), for the adapters' tests where the real engine cannot run here
(SGLang and TGI need CUDA; vLLM's CPU build takes minutes to start).

They follow the engines' published API documentation, not modeld's
adapters: vLLM's OpenAI-compatible server (/v1/models, /v1/completions,
/v1/chat/completions with `return_tokens_as_token_ids`, /tokenize,
/detokenize, /health, /metrics), SGLang's native API (/generate with
cumulative text and meta_info, /get_model_info, /tokenize, /detokenize,
/metrics), TGI's (/generate_stream with per-token events and final
details, /info, /tokenize, /metrics). An `openai` server is the vLLM one
without its extensions' endpoints, and no /openapi.json (like llama.cpp's
own server): an OpenAI-compatible server modeld knows nothing about.

The model behind them is a toy, deterministic one: prompts are tokenized
per byte, the continuation is the words of SCRIPT in order (one token each),
then an end-of-sequence token after `eos_after` words unless ignore_eos.
Faults are scripted per server (`fault`), and every request and every
client that left a stream early are recorded.

LoRA adapters (vLLM and SGLang): `loras` maps the names served from the
start (--lora-modules / --lora-paths) to their paths; with `runtime_lora`
the engine's load/unload routes exist, and a load reads the path as the
engine would (a folder with adapter_config.json). A request run under an
adapter continues the script from an offset of the adapter's own
(`adapter_shift`), so its text tells which adapter ran.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

SCRIPT = " one two three four five six seven eight nine ten eleven twelve".split(" ")[1:]
WORD_BASE = 1000  # token id of SCRIPT[i] is WORD_BASE + i
EOS_ID = 2
EOS_TEXT = "</s>"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- the toy model -----------------------------------------------------------------------


def tokenize(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def token_text(token_id: int) -> str:
    if token_id == EOS_ID:
        return EOS_TEXT
    if token_id >= WORD_BASE:
        return " " + SCRIPT[(token_id - WORD_BASE) % len(SCRIPT)]
    return bytes([token_id]).decode("utf-8", errors="replace")


def detokenize(ids: list[int]) -> str:
    words = [token_text(i) for i in ids if i >= WORD_BASE or i == EOS_ID]
    data = bytes(i for i in ids if i < 256 and i != EOS_ID)
    return data.decode("utf-8", errors="replace") + "".join(words)


def logprob_of(step: int) -> float:
    return round(-0.05 * (step + 1), 4)


def alternatives(token_id: int, step: int, n: int) -> list[tuple[int, float]]:
    """The chosen token first (greedy), then made-up runners-up."""
    return [(token_id, logprob_of(step))] + [(token_id + 100 + k, logprob_of(step) - 1.0 - k) for k in range(n - 1)]


@dataclass
class Step:
    token_id: int
    text: str  # "" for the end-of-sequence token
    index: int


@dataclass
class Generation:
    prompt_ids: list[int]
    steps: list[Step]
    finish: str  # "stop" (eos or a stop string), "length"
    stop_matched: str | None = None
    cached: int = 0


def adapter_shift(name: str) -> int:
    """Where an adapter's continuation starts in SCRIPT (never the base's 0)."""
    return 1 + sum(name.encode()) % (len(SCRIPT) - 1)


def generate(prompt_ids: list[int], max_tokens: int, stop: list[str], ignore_eos: bool, eos_after: int,
             cached: int = 0, shift: int = 0) -> Generation:
    """Greedy and deterministic. A stop string ends the text where it begins
    (the fake matches it only within the word that completes it, which is
    all the tests ask of it)."""
    steps: list[Step] = []
    for i in range(max_tokens):
        if i == eos_after and not ignore_eos:
            steps.append(Step(EOS_ID, "", i))
            return Generation(prompt_ids, steps, "stop", cached=cached)
        word = (i + shift) % len(SCRIPT)
        piece = " " + SCRIPT[word]
        hits = sorted((piece.find(s), s) for s in stop if s in piece)
        if hits:
            cut, matched = hits[0]
            steps.append(Step(WORD_BASE + word, piece[:cut], i))
            return Generation(prompt_ids, steps, "stop", stop_matched=matched, cached=cached)
        steps.append(Step(WORD_BASE + word, piece, i))
    return Generation(prompt_ids, steps, "length", cached=cached)


# -- the server -----------------------------------------------------------------------------


@dataclass
class Fault:
    """One scripted misbehaviour. kind: http (answer `status` with `message`),
    die_after (break the connection after `after` events), malformed (an
    event that is not JSON after `after`), truncated (end cleanly after
    `after` events, without saying why), stall (wait `seconds` before the
    first byte), error_event (an error event after `after`)."""

    kind: str
    status: int = 500
    message: str = "scripted failure"
    after: int = 1
    seconds: float = 0.0
    paths: tuple[str, ...] = ()  # only these paths; () every generation path


@dataclass
class FakeEngine:
    engine: str  # vllm, openai, sglang, tgi
    model: str = "fake-model"
    port: int = field(default_factory=free_port)
    eos_after: int = 8
    token_delay_s: float = 0.0
    fault: Fault | None = None
    has_tokenize: bool = True
    has_metrics: bool = True
    requests: list[tuple[str, Any]] = field(default_factory=list)
    num_disconnects: int = 0  # streams whose client left before the end
    num_running: int = 0
    prompts_seen: list[list[int]] = field(default_factory=list)
    loras: dict[str, str] = field(default_factory=dict)  # adapter name -> path, as served now
    runtime_lora: bool = False  # vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING; SGLang's /load_lora_adapter

    def __post_init__(self) -> None:
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def bodies(self, path: str) -> list[Any]:
        return [body for p, body in self.requests if p == path]

    # -- lifecycle ------------------------------------------------------------------------

    def start(self) -> FakeEngine:
        config = uvicorn.Config(self.app(), host="127.0.0.1", port=self.port, log_level="warning",
                                lifespan="off", timeout_graceful_shutdown=1)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError(f"fake {self.engine} server did not start on port {self.port}")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        """Go away, as a crashed engine does: the port stops answering."""
        if self._server is not None:
            self._server.should_exit = True
            self._thread.join(10)
            self._server = None

    def __enter__(self) -> FakeEngine:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- routes ------------------------------------------------------------------------

    def app(self) -> Starlette:
        routes = [Route("/health", self.health), Route("/metrics", self.metrics)]
        if self.engine in ("vllm", "openai"):
            routes += [Route("/v1/models", self.models), Route("/v1/completions", self.openai, methods=["POST"]),
                       Route("/v1/chat/completions", self.openai, methods=["POST"])]
            if self.engine == "vllm":
                routes += [Route("/tokenize", self.vllm_tokenize, methods=["POST"]),
                           Route("/detokenize", self.vllm_detokenize, methods=["POST"])]
                if self.runtime_lora:
                    routes += [Route("/v1/load_lora_adapter", self.vllm_load_lora, methods=["POST"]),
                               Route("/v1/unload_lora_adapter", self.vllm_unload_lora, methods=["POST"])]
        elif self.engine == "sglang":
            routes += [Route("/get_model_info", self.sglang_info), Route("/generate", self.sglang, methods=["POST"]),
                       Route("/tokenize", self.sglang_tokenize, methods=["POST"]),
                       Route("/detokenize", self.sglang_detokenize, methods=["POST"])]
            if self.runtime_lora:
                routes += [Route("/load_lora_adapter", self.sglang_load_lora, methods=["POST"]),
                           Route("/unload_lora_adapter", self.sglang_unload_lora, methods=["POST"])]
        elif self.engine == "tgi":
            routes += [Route("/info", self.tgi_info), Route("/generate_stream", self.tgi, methods=["POST"]),
                       Route("/tokenize", self.tgi_tokenize, methods=["POST"])]
        return Starlette(routes=routes)

    async def health(self, request: Request) -> Response:
        return Response(status_code=200)

    async def metrics(self, request: Request) -> Response:
        if not self.has_metrics or self.engine == "openai":
            return PlainTextResponse("not found", status_code=404)
        lines = {
            "vllm": [
                "# TYPE vllm:num_requests_running gauge",
                f'vllm:num_requests_running{{model_name="{self.model}"}} {self.num_running}',
                "# TYPE vllm:num_requests_waiting gauge",
                f'vllm:num_requests_waiting{{model_name="{self.model}"}} 1.0',
                "# TYPE vllm:kv_cache_usage_perc gauge",
                f'vllm:kv_cache_usage_perc{{model_name="{self.model}"}} 0.25',
                "# TYPE vllm:cache_config_info gauge",
                'vllm:cache_config_info{block_size="16",num_gpu_blocks="100"} 1.0',
                "# TYPE vllm:prefix_cache_queries counter",
                f'vllm:prefix_cache_queries_total{{model_name="{self.model}"}} 200.0',
                "# TYPE vllm:prefix_cache_hits counter",
                f'vllm:prefix_cache_hits_total{{model_name="{self.model}"}} 50.0',
            ],
            "sglang": [
                "# TYPE sglang:num_running_reqs gauge", f'sglang:num_running_reqs{{model_name="{self.model}"}} {self.num_running}',
                "# TYPE sglang:num_queue_reqs gauge", f'sglang:num_queue_reqs{{model_name="{self.model}"}} 2.0',
                "# TYPE sglang:token_usage gauge", f'sglang:token_usage{{model_name="{self.model}"}} 0.5',
                "# TYPE sglang:cache_hit_rate gauge", f'sglang:cache_hit_rate{{model_name="{self.model}"}} 0.75',
            ],
            "tgi": ["# TYPE tgi_batch_current_size gauge", f"tgi_batch_current_size {self.num_running}",
                    "# TYPE tgi_queue_size gauge", "tgi_queue_size 3"],
        }[self.engine]
        return PlainTextResponse("\n".join(lines) + "\n")

    async def _record(self, request: Request) -> Any:
        body = await request.json()
        self.requests.append((request.url.path, body))
        return body

    def _http_fault(self, path: str) -> Fault | None:
        fault = self.fault
        if fault is not None and fault.kind == "http" and (not fault.paths or path in fault.paths):
            return fault
        return None

    def _stream_fault(self) -> Fault | None:
        return self.fault if self.fault is not None and self.fault.kind != "http" else None

    def _cached(self, prompt_ids: list[int]) -> int:
        best = 0
        for seen in self.prompts_seen:
            n = 0
            while n < min(len(seen), len(prompt_ids)) and seen[n] == prompt_ids[n]:
                n += 1
            best = max(best, n)
        self.prompts_seen.append(prompt_ids)
        return best

    async def _events(self, payloads: list[str], done: str | None) -> AsyncIterator[bytes]:
        """Server-sent events, paced and faulted as scripted."""
        fault = self._stream_fault()
        finished = False
        self.num_running += 1
        try:
            if fault is not None and fault.kind == "stall":
                await asyncio.sleep(fault.seconds)
            for i, payload in enumerate(payloads):
                if fault is not None and i == fault.after:
                    if fault.kind == "die_after":
                        raise ConnectionAbortedError("scripted: the engine died mid-stream")
                    if fault.kind == "malformed":
                        yield b"data: {this is not json\n\n"
                    if fault.kind == "error_event":
                        yield f"data: {json.dumps(self._error_event(fault))}\n\n".encode()
                    if fault.kind in ("truncated", "malformed", "error_event"):
                        finished = True
                        return
                if self.token_delay_s:
                    await asyncio.sleep(self.token_delay_s)
                yield f"data: {payload}\n\n".encode()
            if done:
                yield f"data: {done}\n\n".encode()
            finished = True
        finally:
            self.num_running -= 1
            if not finished:
                self.num_disconnects += 1

    def _error_event(self, fault: Fault) -> Any:
        if self.engine == "tgi":
            return {"error": fault.message, "error_type": "generation"}
        return {"error": {"message": fault.message, "type": "InternalServerError", "code": 500}}

    def _error_response(self, fault: Fault) -> Response:
        if self.engine == "tgi":
            body = {"error": fault.message, "error_type": "validation" if fault.status == 422 else "generation"}
        elif self.engine == "sglang":
            body = {"error": {"message": fault.message}}
        else:  # vLLM's ErrorResponse
            body = {"object": "error", "message": fault.message, "type": "BadRequestError", "code": fault.status}
        return JSONResponse(body, status_code=fault.status)

    def _sse(self, payloads: list[Any], done: str | None = "[DONE]") -> StreamingResponse:
        return StreamingResponse(self._events([json.dumps(p) for p in payloads], done),
                                 media_type="text/event-stream")

    # -- vLLM / OpenAI ------------------------------------------------------------------------

    async def models(self, request: Request) -> Response:
        cards = [{"id": self.model, "object": "model", "owned_by": "fake", "root": f"/models/{self.model}",
                  "parent": None, "max_model_len": 2048}]
        if self.engine == "vllm":  # vLLM lists its adapters with the base as their parent
            cards += [{"id": name, "object": "model", "owned_by": "vllm", "root": path, "parent": self.model}
                      for name, path in self.loras.items()]
        return JSONResponse({"object": "list", "data": cards})

    def _vllm_error(self, message: str, kind: str, status: int) -> Response:
        return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": status}},
                            status_code=status)

    async def vllm_load_lora(self, request: Request) -> Response:
        body = await self._record(request)
        name, path = body.get("lora_name"), body.get("lora_path")
        if not name or not path:
            return self._vllm_error("Both 'lora_name' and 'lora_path' must be provided.", "InvalidUserInput", 400)
        if name == self.model:
            return self._vllm_error(f"The lora adapter '{name}' conflicts with a served base model.",
                                    "InvalidUserInput", 400)
        if name in self.loras and not body.get("load_inplace"):
            return self._vllm_error(f"The lora adapter '{name}' has already been loaded. If you want to load the "
                                    "adapter in place, set 'load_inplace' to True.", "InvalidUserInput", 400)
        if not (Path(path) / "adapter_config.json").is_file():
            return self._vllm_error(f"Loading lora {name} failed: No adapter found for {path}", "NotFoundError", 404)
        self.loras[name] = path
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    async def vllm_unload_lora(self, request: Request) -> Response:
        body = await self._record(request)
        name = body.get("lora_name")
        if name not in self.loras:
            return self._vllm_error(f"The lora adapter '{name}' cannot be found.", "NotFoundError", 404)
        del self.loras[name]
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    async def openai(self, request: Request) -> Response:
        body = await self._record(request)
        fault = self._http_fault(request.url.path)
        if fault is not None:
            return self._error_response(fault)
        if body.get("model") != self.model and (self.engine != "vllm" or body.get("model") not in self.loras):
            return JSONResponse({"object": "error", "message": f"The model `{body.get('model')}` does not exist.",
                                 "type": "NotFoundError", "code": 404}, status_code=404)
        shift = adapter_shift(body["model"]) if body["model"] in self.loras else 0
        chat = request.url.path.endswith("chat/completions")
        if chat:
            prompt = "".join(f"<{m['role']}>{m['content']}" for m in body["messages"]) + "<assistant>"
            prompt_ids = tokenize(prompt)
        else:
            prompt = body["prompt"]
            prompt_ids = list(prompt) if isinstance(prompt, list) else tokenize(prompt)
        stop = body.get("stop") or []
        stop = [stop] if isinstance(stop, str) else stop
        gen = generate(prompt_ids, body.get("max_tokens", 16), stop, bool(body.get("ignore_eos")), self.eos_after,
                       self._cached(prompt_ids), shift)
        as_ids = self.engine == "vllm" and body.get("return_tokens_as_token_ids")
        num_logprobs = body.get("top_logprobs") if chat else body.get("logprobs")
        chunks = [self._openai_chunk(step, chat, as_ids, num_logprobs if (not chat or body.get("logprobs")) else None)
                  for step in gen.steps if step.text or step.token_id == EOS_ID]
        chunks = [c for c in chunks if c is not None]
        chunks.append(self._openai_finish(gen, chat))
        if (body.get("stream_options") or {}).get("include_usage"):
            details = {"prompt_tokens_details": {"cached_tokens": gen.cached}} if self.engine == "vllm" else {}
            chunks.append({"id": "cmpl-fake", "object": "text_completion", "choices": [], "usage": {
                "prompt_tokens": len(prompt_ids), "completion_tokens": len(gen.steps),
                "total_tokens": len(prompt_ids) + len(gen.steps), **details}})
        return self._sse(chunks)

    def _openai_chunk(self, step: Step, chat: bool, as_ids: bool, num_logprobs: int | None) -> dict | None:
        if step.token_id == EOS_ID and num_logprobs is None:
            return None  # no text, nothing to say about it
        name = (lambda i: f"token_id:{i}") if as_ids else token_text
        choice: dict[str, Any] = {"index": 0, "finish_reason": None, "logprobs": None}
        if chat:
            choice["delta"] = {"content": step.text}
        else:
            choice["text"] = step.text
        if num_logprobs is not None:
            alts = alternatives(step.token_id, step.index, max(num_logprobs, 1))
            if chat:
                choice["logprobs"] = {"content": [{
                    "token": name(step.token_id), "logprob": logprob_of(step.index), "bytes": None,
                    "top_logprobs": [{"token": name(i), "logprob": lp} for i, lp in alts[:num_logprobs]]}]}
            else:
                choice["logprobs"] = {"text_offset": [0], "token_logprobs": [logprob_of(step.index)],
                                      "tokens": [name(step.token_id)],
                                      # vLLM lists the chosen token besides the top n
                                      "top_logprobs": [{name(i): lp for i, lp in alts[:max(num_logprobs, 1)]}]}
        return {"id": "cmpl-fake", "object": "chat.completion.chunk" if chat else "text_completion",
                "model": self.model, "choices": [choice]}

    def _openai_finish(self, gen: Generation, chat: bool) -> dict:
        choice: dict[str, Any] = {"index": 0, "finish_reason": gen.finish, "logprobs": None}
        choice.update({"delta": {}} if chat else {"text": ""})
        return {"id": "cmpl-fake", "object": "chat.completion.chunk" if chat else "text_completion",
                "model": self.model, "choices": [choice]}

    async def vllm_tokenize(self, request: Request) -> Response:
        body = await self._record(request)
        ids = tokenize(body["prompt"])
        return JSONResponse({"count": len(ids), "max_model_len": 2048, "tokens": ids})

    async def vllm_detokenize(self, request: Request) -> Response:
        body = await self._record(request)
        return JSONResponse({"prompt": detokenize(body["tokens"])})

    # -- SGLang ---------------------------------------------------------------------------------

    async def sglang_info(self, request: Request) -> Response:
        return JSONResponse({"model_path": f"/models/{self.model}", "tokenizer_path": f"/models/{self.model}",
                             "is_generation": True, "preferred_sampling_params": None})

    async def sglang(self, request: Request) -> Response:
        body = await self._record(request)
        fault = self._http_fault("/generate")
        if fault is not None:
            return self._error_response(fault)
        sampling = body.get("sampling_params") or {}
        lora = body.get("lora_path")
        if lora is not None and lora not in self.loras:
            return JSONResponse({"error": {"message": f"The following requested LoRA adapters are not loaded: "
                                                      f"{lora}"}}, status_code=400)
        prompt_ids = body["input_ids"] if "input_ids" in body else tokenize(body["text"])
        stop = sampling.get("stop") or []
        stop = [stop] if isinstance(stop, str) else stop
        gen = generate(prompt_ids, sampling.get("max_new_tokens", 128), stop, bool(sampling.get("ignore_eos")),
                       self.eos_after, self._cached(prompt_ids), adapter_shift(lora) if lora else 0)
        events, text, ids, lps, tops = [], "", [], [], []
        n_top = body.get("top_logprobs_num", 0) if body.get("return_logprob") else 0
        for k, step in enumerate(gen.steps):
            text += step.text
            ids.append(step.token_id)
            lps.append([logprob_of(step.index), step.token_id, None])
            tops.append([[lp, i, None] for i, lp in alternatives(step.token_id, step.index, n_top)] if n_top else None)
            last = k == len(gen.steps) - 1
            meta: dict[str, Any] = {"id": "fake", "prompt_tokens": len(prompt_ids), "completion_tokens": len(ids),
                                    "cached_tokens": gen.cached, "finish_reason": None}
            if body.get("return_logprob"):
                meta["output_token_logprobs"] = list(lps)
                meta["output_top_logprobs"] = list(tops)
            if last:
                meta["finish_reason"] = ({"type": "length", "length": len(ids)} if gen.finish == "length" else
                                         {"type": "stop", "matched": gen.stop_matched or EOS_ID})
            # cumulative, as SGLang streams by default
            events.append({"text": text, "output_ids": list(ids), "meta_info": meta, "index": 0})
        if body.get("stream") is False:
            return JSONResponse(events[-1])
        return self._sse(events)

    async def sglang_load_lora(self, request: Request) -> Response:
        body = await self._record(request)
        name, path = body.get("lora_name"), body.get("lora_path")
        if name in self.loras:
            return self._sglang_lora_reply(False, f"LoRA adapter {name} is already loaded")
        if not path or not (Path(path) / "adapter_config.json").is_file():
            return self._sglang_lora_reply(False, f"Failed to load LoRA adapter {name}: no adapter at {path}")
        self.loras[name] = path
        return self._sglang_lora_reply(True, "")

    async def sglang_unload_lora(self, request: Request) -> Response:
        body = await self._record(request)
        if self.loras.pop(body.get("lora_name"), None) is None:
            return self._sglang_lora_reply(False, f"LoRA adapter {body.get('lora_name')} is not loaded")
        return self._sglang_lora_reply(True, "")

    def _sglang_lora_reply(self, success: bool, message: str) -> Response:
        return JSONResponse({"success": success, "error_message": message, "loaded_adapters": dict(self.loras)},
                            status_code=200 if success else 400)

    async def sglang_tokenize(self, request: Request) -> Response:
        if not self.has_tokenize:
            return JSONResponse({"detail": "Not Found"}, status_code=404)
        body = await self._record(request)
        ids = tokenize(body["prompt"])
        return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": 2048})

    async def sglang_detokenize(self, request: Request) -> Response:
        if not self.has_tokenize:
            return JSONResponse({"detail": "Not Found"}, status_code=404)
        body = await self._record(request)
        return JSONResponse({"text": detokenize(body["tokens"])})

    # -- TGI --------------------------------------------------------------------------------------

    async def tgi_info(self, request: Request) -> Response:
        return JSONResponse({"model_id": f"org/{self.model}", "model_dtype": "torch.float16",
                             "max_input_tokens": 1024, "max_total_tokens": 2048, "version": "3.0.0"})

    async def tgi(self, request: Request) -> Response:
        body = await self._record(request)
        fault = self._http_fault("/generate_stream")
        if fault is not None:
            return self._error_response(fault)
        parameters = body.get("parameters") or {}
        prompt_ids = tokenize(body["inputs"])
        gen = generate(prompt_ids, parameters.get("max_new_tokens", 20), [], False, self.eos_after)
        # TGI stops on a stop sequence and keeps it in the text
        stop = parameters.get("stop") or []
        events, text = [], ""
        n_top = parameters.get("top_n_tokens") or 0
        finish = gen.finish
        steps = []
        for step in gen.steps:
            steps.append(step)
            if step.token_id != EOS_ID:
                text += token_text(step.token_id)
            if any(s in text for s in stop):
                finish = "stop_sequence"
                break
        for k, step in enumerate(steps):
            last = k == len(steps) - 1
            token = {"id": step.token_id, "text": token_text(step.token_id), "logprob": logprob_of(step.index),
                     "special": step.token_id == EOS_ID}
            event: dict[str, Any] = {"index": k + 1, "token": token, "generated_text": None, "details": None,
                                     "top_tokens": [{"id": i, "text": token_text(i), "logprob": lp, "special": False}
                                                    for i, lp in alternatives(step.token_id, step.index, n_top)]
                                     if n_top else None}
            if last:
                event["generated_text"] = text
                event["details"] = {"finish_reason": {"stop": "eos_token"}.get(finish, finish),
                                    "generated_tokens": len(steps), "seed": None,
                                    "input_length": len(prompt_ids)}
            events.append(event)
        return self._sse(events, done=None)

    async def tgi_tokenize(self, request: Request) -> Response:
        if not self.has_tokenize:
            return JSONResponse({"error": "not found"}, status_code=404)
        body = await self._record(request)
        text = body["inputs"]
        return JSONResponse([{"id": b, "text": chr(b), "start": i, "stop": i + 1}
                             for i, b in enumerate(text.encode("utf-8"))])


# -- a real OpenAI-compatible server ------------------------------------------------------------------


class LlamaCppPythonServer:
    """llama-cpp-python's own OpenAI-compatible server (`python -m
    llama_cpp.server`) on a GGUF: the real server the openai backend is
    tested against. `kill` and `start` again keep the port, as an engine that
    crashed and came back would. Its output goes to `log_path` (unbuffered),
    where it prints "Disconnected from client" when a client leaves a stream.

    `--interrupt_requests False`: by default it ends a running generation
    whenever another request arrives (see bench/peers notes); queued requests
    are what a real engine does."""

    def __init__(self, model: Path, log_path: Path, port: int | None = None) -> None:
        self.model = str(model)
        self.log_path = log_path
        self.port = port or free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def model_id(self) -> str:
        """The name /v1/models lists: the --model argument as given."""
        return self.model

    def start(self, timeout: float = 120) -> LlamaCppPythonServer:
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "llama_cpp.server", "--model", self.model, "--host", "127.0.0.1",
             "--port", str(self.port), "--n_ctx", "2048", "--interrupt_requests", "False"],
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama_cpp.server exited with {self.proc.returncode}:\n{self.log()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{self.url}/v1/models", timeout=2) as response:
                    if response.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(0.2)
        self.kill()
        raise RuntimeError(f"llama_cpp.server did not answer within {timeout} s:\n{self.log()[-3000:]}")

    def kill(self) -> None:
        """SIGKILL: a crash, not a shutdown."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def post(self, path: str, body: dict) -> Any:
        """A direct call, for comparing modeld's answers with the server's own."""
        request = urllib.request.Request(f"{self.url}{path}", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as response:
            return json.loads(response.read())
