"""One model (smollm2-torch, or smollm2 on llama.cpp with --model smollm2)
under two or more process settings, each side alone on the machine: one
daemon per side, all up at once, and while one side runs its 8 greedy
streams x 64 tokens (--streams, --tokens) the other daemons and their
workers are stopped (SIGSTOP), so an idle side's spinning threads
(OMP_WAIT_POLICY=ACTIVE) cannot take the cores of the side being timed.
Sides run in an order that rotates between rounds; the first round is a
warm-up, unrecorded.

--hog N runs N busy processes (a Python loop each) while a side is timed:
the share of the cores a benchmark harness or a neighbour takes, the case
where a spinning compute thread and a sleeping one differ most.

A side is `unset` (modeld as shipped) or `+`-joined KEY=VALUE environment
entries. INDUCTOR_THREADS=N is not an environment variable of torch's: it
sets torch._inductor.config.cpp.threads to N in that side's processes (a
sitecustomize this script writes): inductor's fused kernels on one thread
against its default (-1: every core).

    .venv/bin/python bench/ab_env.py INDUCTOR_THREADS=1,unset [--rounds 4]
    .venv/bin/python bench/ab_env.py OMP_WAIT_POLICY=ACTIVE,unset
    .venv/bin/python bench/ab_env.py unset,OMP_WAIT_POLICY=+GOMP_SPINCOUNT=20000 --model smollm2 --hog 1

An empty value (`OMP_WAIT_POLICY=`) removes that variable from the side's
environment where modeld would otherwise set a default (llama.cpp's
OpenMP wait policy).

Prints tok/s by round and each side's median and per-round ratio to the
first side; writes nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests"))

SITECUSTOMIZE = """import os
if os.environ.get("INDUCTOR_THREADS"):
    import torch._inductor.config as config
    config.cpp.threads = int(os.environ["INDUCTOR_THREADS"])
"""


def side_env(side: str, hook: Path) -> dict | None:
    if side == "unset":
        return None
    env = dict(entry.split("=", 1) for entry in side.split("+"))
    if "INDUCTOR_THREADS" in env:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(hook), os.environ.get("PYTHONPATH", "")) if p)
    return env


def single_model_repository(model: str) -> Path:
    """The model alone: links to its files, its model.toml without a draft model."""
    repo = Path(tempfile.mkdtemp(prefix="modeld-ab-"))
    source, target = ROOT / "models" / model, repo / model
    target.mkdir()
    for entry in source.iterdir():
        if entry.name != "model.toml":
            (target / entry.name).symlink_to(entry.resolve())
    lines = (source / "model.toml").read_text().splitlines()
    (target / "model.toml").write_text("\n".join(l for l in lines if not l.startswith("draft_model")) + "\n")
    return repo


def hog() -> None:
    while True:
        pass


def family(pid: int):
    import psutil

    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


async def main() -> None:
    import grpc

    from bench_torch_vllm import PROMPTS
    from daemon import start_daemon
    from racing import ratios, round_order
    from modeld.gen import generation_pb2 as g
    from modeld.gen import generation_pb2_grpc as gg

    parser = argparse.ArgumentParser()
    parser.add_argument("sides", help="comma-separated: unset, or KEY=VALUE[+KEY=VALUE...]")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--model", default="smollm2-torch", choices=("smollm2-torch", "smollm2"))
    parser.add_argument("--hog", type=int, default=0, help="busy processes beside the side being timed")
    parser.add_argument("--streams", type=int, default=8, help="concurrent streams (1 to 8)")
    args = parser.parse_args()
    prompts = PROMPTS[:max(1, min(args.streams, len(PROMPTS)))]
    model = args.model
    sides = args.sides.split(",")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    hook = Path(tempfile.mkdtemp(prefix="modeld-ab-"))
    (hook / "sitecustomize.py").write_text(SITECUSTOMIZE)
    repo = single_model_repository(model)
    daemons = {}
    try:
        for side in sides:
            daemons[side] = start_daemon("--http-port", "-1", "--metrics-port", "-1", repository=repo,
                                         timeout=1200, env=side_env(side, hook))
        channels = {side: grpc.aio.insecure_channel(d.address) for side, d in daemons.items()}

        async def stream(stub, prompt: str) -> None:
            request = g.GenerateRequest(model=model, prompt=prompt, sampling=g.SamplingParams(
                max_tokens=args.tokens, temperature=0.0, ignore_eos=True, cache_prompt=False))
            async for _ in stub.Generate(request, timeout=900):
                pass

        rates: dict[str, list[float]] = {side: [] for side in sides}
        for index in range(args.rounds + 1):
            for side in round_order(sides, index):
                for other, daemon in daemons.items():
                    for proc in family(daemon.proc.pid):
                        proc.send_signal(signal.SIGCONT if other == side else signal.SIGSTOP)
                await asyncio.sleep(1)  # the stopped sides' last work drains off the cores
                stub = gg.GenerationStub(channels[side])
                hogs = [multiprocessing.Process(target=hog, daemon=True) for _ in range(args.hog)]
                for proc in hogs:
                    proc.start()
                try:
                    started = time.perf_counter()
                    await asyncio.gather(*(stream(stub, p) for p in prompts))
                    rate = len(prompts) * args.tokens / (time.perf_counter() - started)
                finally:
                    for proc in hogs:
                        proc.kill()
                        proc.join()
                if index:
                    rates[side].append(rate)
                print(f"round {index}{' (warm-up)' if not index else ''}: {side} {rate:.1f} tok/s", flush=True)
        for side in sides:
            paired = ratios(rates[side], rates[sides[0]])
            print(f"{side}: median {statistics.median(rates[side]):.1f} tok/s, per-round ratio to {sides[0]} "
                  f"median {statistics.median(paired):.2f}x ({', '.join(f'{r:.2f}' for r in paired)})")
        for channel in channels.values():
            await channel.close()
    finally:
        for daemon in daemons.values():
            for proc in family(daemon.proc.pid):
                proc.send_signal(signal.SIGCONT)
            daemon.stop()


if __name__ == "__main__":
    asyncio.run(main())
