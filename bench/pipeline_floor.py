"""The least Python CPU a generated token costs a server of modeld's shape:
a worker process that decodes, a front process that streams OpenAI chunks.

Nothing else runs: the worker (`worker`) loads SmolLM2 as modeld's
llama.cpp backend does (same GGUF, context and thread settings, from
models/smollm2) and, for each request, decodes one sequence: the batch's
two changing fields written, llama_decode, the token taken where the logits
lie (greedy: the row's argmax; sampled: modeld's own whole-vocabulary draw,
sampling.draw_whole), its text by a piece table and an incremental UTF-8
decoder, and one small frame to the front over a socketpair. The front
(`serve`) is a bare ASGI app on uvicorn, uvloop and httptools, as the
daemon runs them: it hands a request to the worker, reads the frames off
the socket on its event loop, and writes each token's text as an OpenAI
chat or completion chunk (orjson), then the usage chunk. No scheduler, batching,
detokenising of stop strings, events, metrics or logs: what is left is
the work no design with a worker process skips.

bench_token_cpu measures it at one stream in the same rounds as modeld's
daemon, by the same clock: the worker's main thread (which is also
llama.cpp's first compute thread) less its CPU inside llama_decode
(bench/compute_clock), plus the front's whole CPU. One stream only: at 8
and 32 streams the bare HTTP floor already sits at the goal.

    .venv/bin/python bench/pipeline_floor.py serve --port 50200 [--threads 2]   # until terminated
"""

from __future__ import annotations

import argparse
import asyncio
import codecs
import os
import socket
import struct
import subprocess
import sys
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODEL_DIR = ROOT / "models" / "smollm2"

# front -> worker: <u32 length> + orjson request; worker -> front: <i32 token><u32 text length> + text,
# and a last frame whose token is END
REQUEST = struct.Struct("<I")
TOKEN = struct.Struct("<iI")
END = -1
MAX_TOKENS = 4096  # what one request may ask of the floor's worker


def chatml(prompt: str) -> str:
    """SmolLM2's chat format around one user message: the prompt modeld
    renders from the same request (the model's template), near enough for
    a figure per generated token."""
    return f"<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n"


class FrameReader:
    """Splits the worker's byte stream into (token, text) frames; a frame
    may arrive in pieces or several in one read."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[tuple[int, str]]:
        self._buffer += data
        frames, at = [], 0
        while len(self._buffer) - at >= TOKEN.size:
            token, length = TOKEN.unpack_from(self._buffer, at)
            end = at + TOKEN.size + length
            if len(self._buffer) < end:
                break
            frames.append((token, bytes(self._buffer[at + TOKEN.size:end]).decode("utf-8")))
            at = end
        del self._buffer[:at]
        return frames


# -- the worker ------------------------------------------------------------------------------

def _settings() -> dict:
    return tomllib.loads((MODEL_DIR / "model.toml").read_text())["llamacpp"]


def _recv_exactly(sock: socket.socket, n: int) -> bytes | None:
    data = bytearray()
    while len(data) < n:
        got = sock.recv(n - len(data))
        if not got:
            return None
        data += got
    return bytes(data)


class Decoder:
    """One sequence at a time on modeld's own llama.cpp context."""

    def __init__(self, threads: int | None = None) -> None:
        from modeld.backends.llamacpp.context import LlamaContext, LlamaModel, _llama, silence_llama_logs

        silence_llama_logs()
        settings = _settings()
        self.llama = _llama()
        self.model = LlamaModel(MODEL_DIR / "model.gguf")
        self.context = LlamaContext(self.model, settings["n_ctx"], settings["n_slots"],
                                    settings["max_step_tokens"], threads or settings["n_threads"])
        self.cells = settings["n_ctx"] // settings["n_slots"]  # one slot's KV stream

    def generate(self, prompt: str, max_tokens: int, temperature: float | None, seed: int, emit) -> None:
        """Decodes max_tokens tokens of prompt (end of generation ignored), calling
        emit(token, text bytes) for each."""
        import numpy as np

        from modeld.backends.generation.sampling import draw_whole
        from modeld.backends.llamacpp.context import logits_rows

        llama, ctx, model = self.llama, self.context.ctx, self.model
        vocab = model.vocab_size
        ids = model.tokenize(prompt, add_special=False)
        if len(ids) + max_tokens > self.cells:
            raise ValueError(f"{len(ids)} prompt tokens and {max_tokens} more exceed {self.cells} cells")
        llama.llama_memory_seq_rm(self.context.memory, 0, -1, -1)
        self.context.submit([(t, i, 0, i == len(ids) - 1) for i, t in enumerate(ids)])
        rng = np.random.default_rng(seed)
        text = codecs.getincrementaldecoder("utf-8")("replace")
        pieces = model.token_bytes
        batch = self.context.batch
        batch.n_tokens, batch.n_seq_id[0], batch.seq_id[0][0], batch.logits[0] = 1, 1, 0, 1
        pos = len(ids)
        for left in range(max_tokens - 1, -1, -1):
            row = logits_rows(llama, ctx, 1, vocab)[0]
            token = int(row.argmax()) if not temperature else draw_whole(row, temperature, rng)
            emit(token, text.decode(pieces(token)).encode("utf-8"))
            if not left:
                return
            batch.token[0], batch.pos[0] = token, pos
            pos += 1
            if llama.llama_decode(ctx, batch) != 0:
                raise RuntimeError("llama_decode failed")


def worker(fd: int, threads: int | None) -> None:
    import orjson

    sock = socket.socket(fileno=fd)
    decoder = Decoder(threads)
    sock.sendall(TOKEN.pack(END, 0))  # loaded
    pack, send = TOKEN.pack, sock.sendall
    while (header := _recv_exactly(sock, REQUEST.size)) is not None:
        request = orjson.loads(_recv_exactly(sock, REQUEST.unpack(header)[0]))
        decoder.generate(request["prompt"], request["max_tokens"], request["temperature"], request["seed"],
                         lambda token, text: send(pack(token, len(text)) + text))
        send(pack(END, 0))


# -- the front -------------------------------------------------------------------------------

def serve(port: int, threads: int | None) -> None:
    import orjson
    import uvicorn

    ours, theirs = socket.socketpair()
    proc = subprocess.Popen([sys.executable, __file__, "worker", "--fd", str(theirs.fileno())]
                            + (["--threads", str(threads)] if threads else []), pass_fds=[theirs.fileno()])
    theirs.close()
    if _recv_exactly(ours, TOKEN.size) != TOKEN.pack(END, 0):
        proc.kill()
        raise SystemExit("the floor's worker did not load")
    ours.setblocking(False)
    state: dict = {}

    class Frames(asyncio.Protocol):
        def __init__(self) -> None:
            self.reader = FrameReader()

        def data_received(self, data: bytes) -> None:
            put = state["queue"].put_nowait
            for frame in self.reader.feed(data):
                put(frame)

        def connection_lost(self, exc) -> None:
            state["lost"] = True  # the worker died: end the stream in flight, refuse the next
            state["queue"].put_nowait((END, ""))

    async def start() -> None:
        state["queue"] = asyncio.Queue()
        state["lock"] = asyncio.Lock()
        state["transport"], _ = await asyncio.get_running_loop().connect_accepted_socket(Frames, ours)

    async def app(scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            while (message := await receive())["type"] != "lifespan.shutdown":
                if message["type"] == "lifespan.startup":
                    await start()
                    await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        request = orjson.loads(body)
        max_tokens = int(request.get("max_tokens", 16))
        if not 0 < max_tokens <= MAX_TOKENS:
            await send({"type": "http.response.start", "status": 400, "headers": []})
            await send({"type": "http.response.body", "body": f"max_tokens must be 1 to {MAX_TOKENS}".encode()})
            return
        chat = scope["path"].endswith("/chat/completions")  # else /v1/completions: the prompt as it is
        prompt = chatml(request["messages"][-1]["content"]) if chat else request["prompt"]
        job = orjson.dumps({"prompt": prompt, "max_tokens": max_tokens,
                            "temperature": request.get("temperature", 1.0), "seed": request.get("seed", 0)})
        created, queue = int(time.time()), state["queue"]
        kind = "chat.completion.chunk" if chat else "text_completion"
        async with state["lock"]:  # one sequence at a time
            if state.get("lost"):
                await send({"type": "http.response.start", "status": 503, "headers": []})
                await send({"type": "http.response.body", "body": b"the floor's worker has exited"})
                return
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/event-stream")]})
            state["transport"].write(REQUEST.pack(len(job)) + job)
            count = 0
            while (frame := await queue.get())[0] != END:
                count += 1
                if frame[1]:  # as modeld's stream: no chunk for a token whose text is empty
                    choice = ({"index": 0, "delta": {"content": frame[1]}, "logprobs": None, "finish_reason": None}
                              if chat else {"index": 0, "text": frame[1], "logprobs": None, "finish_reason": None})
                    chunk = {"id": "cmpl-floor", "object": kind, "created": created, "model": "smollm2",
                             "choices": [choice]}
                    await send({"type": "http.response.body", "body": b"data: " + orjson.dumps(chunk) + b"\n\n",
                                "more_body": True})
            usage = {"id": "cmpl-floor", "object": kind, "created": created,
                     "model": "smollm2", "choices": [],
                     "usage": {"prompt_tokens": 0, "completion_tokens": count, "total_tokens": count}}
            await send({"type": "http.response.body", "more_body": False,
                        "body": b"data: " + orjson.dumps(usage) + b"\n\ndata: [DONE]\n\n"})

    try:
        uvicorn.run(app, host="127.0.0.1", port=port, loop="uvloop", http="httptools", lifespan="on",
                    access_log=False, log_level="warning")
    finally:
        proc.kill()
        proc.wait()


class PipelineFloor:
    """The front and its worker as processes, around a `with` block:
    `http_url`, `pid` (the front) and `worker` (the worker's pid); the
    environment names the compute clock's folder for the worker."""

    def __init__(self, env: dict[str, str] | None = None, threads: int | None = None) -> None:
        self.env, self.threads = env or {}, threads

    def __enter__(self) -> PipelineFloor:
        import psutil
        from bench_llamacpp import free_port

        port = free_port()
        self.proc = subprocess.Popen([sys.executable, __file__, "serve", "--port", str(port)]
                                     + (["--threads", str(self.threads)] if self.threads else []),
                                     cwd=ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1", **self.env})
        self.http_url, self.pid = f"http://127.0.0.1:{port}", self.proc.pid
        deadline = time.monotonic() + 120
        while True:  # listening once its worker has loaded
            if self.proc.poll() is not None:
                raise RuntimeError(f"the pipeline floor exited with {self.proc.returncode}")
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    self.__exit__()
                    raise RuntimeError("the pipeline floor did not start in 120 s") from None
                time.sleep(0.2)
        children = psutil.Process(self.pid).children()
        self.worker = children[0].pid
        return self

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("role", choices=["serve", "worker"])
    parser.add_argument("--port", type=int, default=50200)
    parser.add_argument("--fd", type=int, help="the worker's end of the socketpair")
    parser.add_argument("--threads", type=int, help="llama.cpp compute threads (default: models/smollm2's)")
    args = parser.parse_args()
    if args.role == "worker":
        worker(args.fd, args.threads)
    else:
        serve(args.port, args.threads)


if __name__ == "__main__":
    main()
