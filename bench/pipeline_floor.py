"""The least Python CPU a generated token costs a server of modeld's shape:
a worker process that decodes, a front process that streams OpenAI chunks.

Nothing else runs: the worker (`worker`) loads SmolLM2 as modeld's
llama.cpp backend does (same GGUF, context and thread settings, from
models/smollm2) and decodes the requests it holds together, a KV slot
each (n_slots at once, the rest waiting): each step one llama_decode of
every running sequence's last token and the prompts of those starting,
each token taken where the logits lie (greedy: the rows' argmax; sampled:
modeld's own whole-vocabulary draw, sampling.draw_whole), its text by a
piece table and an incremental UTF-8 decoder, and the step's tokens in one
write to the front over a socketpair. The front (`serve`) is a bare ASGI
app on uvicorn, uvloop and httptools, as the daemon runs them: it hands
each request to the worker, reads the frames off the socket on its event
loop, and writes each token's text as an OpenAI chat or completion chunk
(orjson), then the usage chunk. No priorities, budgets, prefix cache,
stop strings, events, metrics or logs: what is left is the work no
design with a worker process skips.

bench_token_cpu measures it in the same rounds as modeld's daemon, by the
same clock: the worker's main thread (which is also llama.cpp's first
compute thread) less its CPU inside llama_decode (bench/compute_clock),
plus the front's whole CPU; bench_llama_server races its streams against
llama-server's.

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

# front -> worker: <u32 length> + orjson request; worker -> front: <i32 token><u32 request id><u32 text
# length> + text, and a frame whose token is END once a request has all its tokens (request id 0: loaded)
REQUEST = struct.Struct("<I")
TOKEN = struct.Struct("<iII")
END = -1
MAX_TOKENS = 1024  # what one request may ask (a prompt and its tokens must fit a slot's 2,048 cells)
MAX_IN_FLIGHT = 256  # requests the front holds at once; the worker decodes n_slots of them together


def chatml(prompt: str) -> str:
    """SmolLM2's chat format around one user message: the prompt modeld
    renders from the same request (the model's template), near enough for
    a figure per generated token."""
    return f"<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n"


def take_frames(buffer: bytearray, header: struct.Struct) -> list[tuple[tuple, bytes]]:
    """(header fields, payload) of each whole frame at the front of buffer,
    taken out of it; a header's last field is its payload's length."""
    frames, at = [], 0
    while len(buffer) - at >= header.size:
        fields = header.unpack_from(buffer, at)
        end = at + header.size + fields[-1]
        if len(buffer) < end:
            break
        frames.append((fields, bytes(buffer[at + header.size:end])))
        at = end
    del buffer[:at]
    return frames


class FrameReader:
    """Splits the worker's byte stream into (token, request id, text)
    frames; a frame may arrive in pieces or several in one read."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[tuple[int, int, str]]:
        self._buffer += data
        return [(token, rid, text.decode("utf-8")) for (token, rid, _), text in take_frames(self._buffer, TOKEN)]


def read_requests(buffer: bytearray) -> list[dict]:
    """The whole requests at the front of buffer, taken out of it."""
    import orjson

    return [orjson.loads(job) for _, job in take_frames(buffer, REQUEST)]


# -- the worker ------------------------------------------------------------------------------

def _settings() -> dict:
    return tomllib.loads((MODEL_DIR / "model.toml").read_text())["llamacpp"]


class _Sequence:
    __slots__ = ("rid", "slot", "last", "pos", "left", "temperature", "rng", "text")

    def __init__(self, rid: int, slot: int, max_tokens: int, temperature: float | None, seed: int) -> None:
        import numpy as np

        self.rid, self.slot, self.left, self.temperature = rid, slot, max_tokens, temperature
        self.rng = np.random.default_rng(seed)
        self.text = codecs.getincrementaldecoder("utf-8")("replace")
        self.last = self.pos = 0  # the token to feed next, and its position


class Decoder:
    """Requests decoded together on modeld's own llama.cpp context, one KV
    slot each (models/smollm2's n_slots; the rest wait): each step one
    llama_decode of every running sequence's last token and the prompts of
    those starting, in slot order as modeld feeds them."""

    def __init__(self, threads: int | None = None) -> None:
        from modeld.backends.llamacpp.context import LlamaContext, LlamaModel, _llama, silence_llama_logs

        silence_llama_logs()
        settings = _settings()
        self.llama = _llama()
        self.model = LlamaModel(MODEL_DIR / "model.gguf")
        self.n_batch = settings["max_step_tokens"]
        self.context = LlamaContext(self.model, settings["n_ctx"], settings["n_slots"], self.n_batch,
                                    threads or settings["n_threads"])
        self.cells = settings["n_ctx"] // settings["n_slots"]  # one slot's KV stream
        self.free = list(range(settings["n_slots"] - 1, -1, -1))
        self.waiting: list[dict] = []
        self.running: dict[int, _Sequence] = {}  # slot -> sequence

    @property
    def busy(self) -> bool:
        return bool(self.running or self.waiting)

    def add(self, request: dict) -> None:
        self.waiting.append(request)

    def step(self, emit) -> None:
        """One decode; emit(request id, token, text bytes) for each token
        taken, and emit(request id, END, b"") for each request done."""
        from modeld.backends.generation.sampling import draw_whole
        from modeld.backends.llamacpp.context import logits_rows

        starting: dict[int, list[int]] = {}
        room = self.n_batch - len(self.running)
        while self.waiting and self.free:
            request = self.waiting[0]
            ids = self.model.tokenize(request["prompt"], add_special=False)
            if not ids or len(ids) + request["max_tokens"] > self.cells or len(ids) > self.n_batch:
                del self.waiting[0]
                emit(request["rid"], END, b"")  # more than a slot holds: ended with no token
                continue
            if len(ids) > room:
                break  # the next step takes it
            del self.waiting[0]
            room -= len(ids)
            slot = self.free.pop()
            self.llama.llama_memory_seq_rm(self.context.memory, slot, -1, -1)
            self.running[slot] = _Sequence(request["rid"], slot, request["max_tokens"], request["temperature"],
                                           request["seed"])
            starting[slot] = ids
        if not self.running:
            return
        items, order = [], sorted(self.running)
        for slot in order:
            ids = starting.get(slot)
            if ids is None:
                seq = self.running[slot]
                items.append((seq.last, seq.pos, slot, True))
            else:
                items.extend((t, i, slot, i == len(ids) - 1) for i, t in enumerate(ids))
        self.context.submit(items)
        rows = logits_rows(self.llama, self.context.ctx, len(order), self.model.vocab_size)
        sampled = [self.running[slot] for slot in order if self.running[slot].temperature]
        greedy = rows.argmax(axis=1).tolist() if len(sampled) < len(order) else None
        pieces = self.model.token_bytes
        for i, slot in enumerate(order):
            seq = self.running[slot]
            token = draw_whole(rows[i], seq.temperature, seq.rng) if seq.temperature else greedy[i]
            emit(seq.rid, token, seq.text.decode(pieces(token)).encode("utf-8"))
            seq.left -= 1
            if not seq.left:
                emit(seq.rid, END, b"")
                del self.running[slot]
                self.free.append(slot)
                continue
            seq.pos = seq.pos + 1 if slot not in starting else len(starting[slot])
            seq.last = token


def worker(fd: int, threads: int | None) -> None:
    sock = socket.socket(fileno=fd)
    decoder = Decoder(threads)
    pack = TOKEN.pack
    sock.sendall(pack(END, 0, 0))  # loaded
    buffer, out = bytearray(), []

    def emit(rid: int, token: int, text: bytes) -> None:
        out.append(pack(token, rid, len(text)) + text)

    while True:
        try:  # wait for work only with none in hand
            data = sock.recv(65536, socket.MSG_DONTWAIT if decoder.busy else 0)
        except BlockingIOError:
            data = None
        if data == b"":
            return  # the front is gone
        if data:
            buffer += data
            for request in read_requests(buffer):
                decoder.add(request)
        if decoder.busy:
            decoder.step(emit)
        if out:
            sock.sendall(b"".join(out))  # the step's tokens in one write
            out.clear()


# -- the front -------------------------------------------------------------------------------

def serve(port: int, threads: int | None) -> None:
    import itertools

    import orjson
    import uvicorn

    ours, theirs = socket.socketpair()
    proc = subprocess.Popen([sys.executable, __file__, "worker", "--fd", str(theirs.fileno())]
                            + (["--threads", str(threads)] if threads else []), pass_fds=[theirs.fileno()])
    theirs.close()
    loaded = bytearray()
    while len(loaded) < TOKEN.size and (got := ours.recv(TOKEN.size - len(loaded))):
        loaded += got
    if bytes(loaded) != TOKEN.pack(END, 0, 0):
        proc.kill()
        raise SystemExit("the floor's worker did not load")
    ours.setblocking(False)
    streams: dict[int, asyncio.Queue] = {}
    state: dict = {"lost": False}
    ids = itertools.count(1)

    class Frames(asyncio.Protocol):
        def __init__(self) -> None:
            self.reader = FrameReader()

        def data_received(self, data: bytes) -> None:
            for token, rid, text in self.reader.feed(data):
                queue = streams.get(rid)
                if queue is not None:
                    queue.put_nowait((token, text))

        def connection_lost(self, exc) -> None:
            state["lost"] = True  # the worker died: end the streams in flight, refuse the next
            for queue in streams.values():
                queue.put_nowait((END, ""))

    async def refuse(send, status: int, reason: str) -> None:
        await send({"type": "http.response.start", "status": status, "headers": []})
        await send({"type": "http.response.body", "body": reason.encode()})

    async def app(scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            while (message := await receive())["type"] != "lifespan.shutdown":
                if message["type"] == "lifespan.startup":
                    state["transport"], _ = await asyncio.get_running_loop().connect_accepted_socket(Frames, ours)
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
            return await refuse(send, 400, f"max_tokens must be 1 to {MAX_TOKENS}")
        if state["lost"]:
            return await refuse(send, 503, "the floor's worker has exited")
        if len(streams) >= MAX_IN_FLIGHT:
            return await refuse(send, 429, f"{MAX_IN_FLIGHT} requests in flight already")
        chat = scope["path"].endswith("/chat/completions")  # else /v1/completions: the prompt as it is
        rid, queue = next(ids), asyncio.Queue()
        job = orjson.dumps({"rid": rid, "prompt": chatml(request["messages"][-1]["content"]) if chat
                            else request["prompt"], "max_tokens": max_tokens,
                            "temperature": request.get("temperature", 1.0), "seed": request.get("seed", 0)})
        head = {"id": "cmpl-floor", "object": "chat.completion.chunk" if chat else "text_completion",
                "created": int(time.time()), "model": "smollm2"}
        streams[rid] = queue
        try:
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/event-stream")]})
            state["transport"].write(REQUEST.pack(len(job)) + job)
            count = 0
            while (frame := await queue.get())[0] != END:
                count += 1
                if frame[1]:  # as modeld's stream: no chunk for a token whose text is empty
                    choice = ({"index": 0, "delta": {"content": frame[1]}, "logprobs": None, "finish_reason": None}
                              if chat else {"index": 0, "text": frame[1], "logprobs": None, "finish_reason": None})
                    chunk = {**head, "choices": [choice]}
                    await send({"type": "http.response.body", "body": b"data: " + orjson.dumps(chunk) + b"\n\n",
                                "more_body": True})
            usage = {**head, "choices": [],
                     "usage": {"prompt_tokens": 0, "completion_tokens": count, "total_tokens": count}}
            await send({"type": "http.response.body", "more_body": False,
                        "body": b"data: " + orjson.dumps(usage) + b"\n\ndata: [DONE]\n\n"})
        finally:
            del streams[rid]

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
