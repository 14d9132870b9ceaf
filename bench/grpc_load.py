"""A bare gRPC (or HTTP) token stream, for a ceiling that carries it.

`streams` concurrent streams of modeld's own GenerateResponse messages
(one token id and its text each), from a grpc.aio server that does nothing
else to a grpc.aio client, in two processes, paced at `rate` messages a
second in all (each stream at rate / streams, as a batch of sequences
whose step yields one token each). `--protocol http`: the same streams as
OpenAI completion chunks over server-sent events, from a bare ASGI app on
uvicorn as the daemon runs it (uvloop, httptools; no framework, no
middleware) to a client that reads the socket and counts the events.
Running llama-batched-bench beside it gives the best a Python gRPC server
can do on the same cores: llama.cpp's bare decode, plus the CPU that
streaming each token over gRPC in Python takes from it. On two cores that
CPU comes out of the decode threads' time, whatever the server does.

    .venv/bin/python bench/grpc_load.py --rate 95 --port 50100               # until terminated
    .venv/bin/python bench/grpc_load.py --rate 140 --streams 8 --port 50100
    .venv/bin/python bench/grpc_load.py --rate 95 --protocol http --port 50100

`GrpcStreamLoad` (protocol="http": the SSE streams) runs it around a block and reports the messages and the
CPU milliseconds each took on the server and the client side.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from racing import process_cpu_seconds  # noqa: E402


def _serve(port: int, interval_s: float) -> None:
    import grpc

    from modeld.gen import generation_pb2 as g
    from modeld.gen import generation_pb2_grpc as gg

    class Stream(gg.GenerationServicer):
        async def Generate(self, request, context):
            i, next_at = 0, time.monotonic()
            while True:  # until the client leaves
                next_at += interval_s
                await asyncio.sleep(max(0.0, next_at - time.monotonic()))
                yield g.GenerateResponse(token_ids=[i % 49152], text=" token")
                i += 1

    async def main() -> None:
        server = grpc.aio.server()
        gg.add_GenerationServicer_to_server(Stream(), server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        await server.wait_for_termination()

    asyncio.run(main())


def _serve_http(port: int, interval_s: float) -> None:
    import orjson
    import uvicorn

    async def app(scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        i, next_at = 0, time.monotonic()
        while True:  # until the client leaves (uvicorn then fails the send)
            next_at += interval_s
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))
            chunk = {"id": "cmpl-load", "object": "text_completion", "created": 0, "model": "load",
                     "choices": [{"index": 0, "text": f" token{i % 49152}", "logprobs": None, "finish_reason": None}]}
            await send({"type": "http.response.body", "body": b"data: " + orjson.dumps(chunk) + b"\n\n",
                        "more_body": True})
            i += 1

    uvicorn.run(app, host="127.0.0.1", port=port, loop="uvloop", http="httptools", lifespan="off",
                access_log=False, log_level="warning")


def _consume(port: int, streams: int, server: multiprocessing.Process, protocol: str = "grpc") -> None:
    """Read the streams until SIGTERM; print the server's pid once the first
    message of every stream is in, and the count of messages at the end."""
    import grpc

    from modeld.gen import generation_pb2 as g
    from modeld.gen import generation_pb2_grpc as gg

    count = 0
    started: set[int] = set()

    async def read(stub, n: int) -> None:
        nonlocal count
        async for response in stub.Generate(g.GenerateRequest(model="load"), wait_for_ready=True):
            if n not in started:
                started.add(n)
                if len(started) == streams:
                    print(f"streaming {server.pid}", flush=True)
            count += len(response.token_ids)

    async def read_http(n: int) -> None:
        nonlocal count
        while True:  # until the server listens
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                break
            except OSError:
                await asyncio.sleep(0.1)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nhost: load\r\ncontent-length: 0\r\n\r\n")
        while data := await reader.read(65536):
            events = data.count(b"data: ")
            if events and n not in started:
                started.add(n)
                if len(started) == streams:
                    print(f"streaming {server.pid}", flush=True)
            count += events

    async def main() -> None:
        if protocol == "http":
            await asyncio.gather(*(read_http(n) for n in range(streams)))
            return
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = gg.GenerationStub(channel)
            await asyncio.gather(*(read(stub, n) for n in range(streams)))

    def stop(*_) -> None:
        server.kill()
        print(f"messages {count}", flush=True)
        os._exit(0)

    signal.signal(signal.SIGTERM, stop)
    asyncio.run(main())


class GrpcStreamLoad:
    """The streams in their own processes around a `with` block; afterwards
    `figures` holds its rate and the CPU ms per message on each side."""

    def __init__(self, rate: float, streams: int = 1, protocol: str = "grpc") -> None:
        self.rate, self.streams, self.protocol = rate, streams, protocol
        self.figures: dict = {}

    def __enter__(self) -> GrpcStreamLoad:
        import psutil
        from bench_llamacpp import free_port

        self.proc = subprocess.Popen([sys.executable, __file__, "--rate", str(self.rate), "--streams", str(self.streams),
                                      "--port", str(free_port()), "--protocol", self.protocol],
                                     stdout=subprocess.PIPE, text=True, cwd=ROOT)
        line = self.proc.stdout.readline()  # "streaming <server pid>": every stream's first message is in
        if not line.startswith("streaming"):
            self.proc.kill()
            raise RuntimeError(f"the {self.protocol} stream load did not start: {line!r}")
        self.sides = (psutil.Process(int(line.split()[1])), psutil.Process(self.proc.pid))
        self.cpu0 = tuple(map(process_cpu_seconds, self.sides))
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        cpu = tuple(map(process_cpu_seconds, self.sides))
        wall = time.perf_counter() - self.start
        self.proc.terminate()
        out, _ = self.proc.communicate(timeout=30)
        messages = max(1, round(wall * self.rate))  # paced by the server: its rate times the block's length
        self.figures = {
            "rate": self.rate, "streams": self.streams, "protocol": self.protocol, "wall_s": round(wall, 2),
            "messages_since_start": int(out.split()[-1]) if out.startswith("messages") else None,
            "server_cpu_ms_per_message": round((cpu[0] - self.cpu0[0]) * 1e3 / messages, 3),
            "client_cpu_ms_per_message": round((cpu[1] - self.cpu0[1]) * 1e3 / messages, 3),
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, required=True, help="messages a second")
    parser.add_argument("--streams", type=int, default=1, help="concurrent streams sharing the rate")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--protocol", choices=["grpc", "http"], default="grpc")
    args = parser.parse_args()
    serve = _serve if args.protocol == "grpc" else _serve_http
    server = multiprocessing.Process(target=serve, args=(args.port, args.streams / args.rate), daemon=True)
    server.start()
    try:
        _consume(args.port, args.streams, server, args.protocol)
    finally:
        server.kill()


if __name__ == "__main__":
    main()
