"""KV-aware routing against the gateway's text guess and round robin, in the
same run on the same three daemons.

24 conversations of 4 turns over 3 long system prompts (8 conversations
each) on smollm2 (llama.cpp, in the daemons' own process so they publish
their slots' blocks), three calls at a time, turns interleaved across
conversations: every conversation's turn t before any turn t + 1, the
conversations coming back in a shuffled order each turn (seeded: the same
order for every mode of a round), as users do. (In index order, with 24
conversations on 3 nodes and system prompt c % 3, round robin sent
conversation c to node c % 3 every turn: the routing by system prompt and
conversation a KV router aims for, by coincidence, and all three modes
measured alike.)

Each node's cache holds 12 slots of 1,024 tokens: 12 conversations, half
of them, so no node can hold everything; the fleet's 36 slots hold them all
only if each node serves its share (8 conversations, with room for the 3
running beside them, whose prompts llama.cpp copies into slots of their
own). A node that is sent every conversation (round robin) keeps each
system prompt but only the most recent conversations' histories; only
routing that keeps a conversation on one node serves its history from
cache. Answers are up to 32 tokens, so a history outgrows a turn's question
and weighs in the prompt as chat histories do. Three ways to route them:

- `kv`: a gateway routing on the daemons' KV events (Node/WatchKvEvents,
  Node/PromptBlocks; the default);
- `guess`: a second gateway on the same daemons with the model in
  `prefix_guess_models`, routing on the prompt-text guess (prefix.py);
- `round_robin`: the client sending each call to the next daemon in turn.

Each mode's prompts start with a salt of their own, so no mode reuses
another's blocks; the modes run one after another in each round, in an
order rotated from round to round. For every call: the cached prompt tokens
the daemon reports, the ideal (the longest token prefix the prompt shares
with any earlier prompt of the same mode and round, with its answer where
that call had ended when this one started, the last prompt token excluded:
what a cache of unbounded size on one node would serve), and the time to the first token seen by the
client. Per mode: cached over ideal (goal: kv >= 0.9), by turn too, the TTFT
p50, the calls each daemon served, the blocks each daemon's cache holds
after the mode (its own WatchKvEvents snapshot), and for the gateway modes
the pick reasons (`kv`: KV events, `prefix`: the text guess).

A report, not a test: nothing is asserted. The machine is shared, so TTFT is
noisy; the cache shares are counts and do not depend on timing, except
through which slot llama.cpp evicts. Results: bench/results/kv_routing.json.

    flock /tmp/coord/bench.lock .venv/bin/python bench/bench_kv_routing.py [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
RESULTS = Path(os.environ.get("KV_BENCH_RESULTS", ROOT / "bench" / "results" / "kv_routing.json"))

from daemon import MODELS, metric_sum, start_daemon, start_gateway  # noqa: E402

from modeld.gen import generation_pb2 as gen  # noqa: E402
from modeld.gen import generation_pb2_grpc as gen_grpc  # noqa: E402
from modeld.gen import node_pb2, node_pb2_grpc  # noqa: E402

MODEL = "smollm2"
MODES = ("kv", "guess", "round_robin")
NUM_CONVERSATIONS, NUM_TURNS, CONCURRENCY, MAX_TOKENS = 24, 4, 3, 32
SLOTS = int(os.environ.get("KV_BENCH_SLOTS", "12"))  # per node (module docstring)
_SYSTEMS = [
    "You are the support assistant of a bicycle shop. You answer in two sentences, you never invent prices, "
    "and you always suggest visiting the workshop for anything involving brakes or gears. ",
    "You are a patient maths tutor for secondary school pupils. You explain each step, you check the pupil's "
    "arithmetic, and you end every answer with one short practice question. ",
    "You are a travel planner for rail journeys across Europe. You give times in the 24-hour clock, mention "
    "seat reservations where trains need them, and keep answers brief. ",
]
_QUESTIONS = ["What should I do first?", "Can you say more about that?", "Thanks. Anything else?", "And then?"]


def _repository(root: Path) -> Path:
    (root / MODEL).mkdir()
    (root / MODEL / "model.gguf").symlink_to((MODELS / MODEL / "model.gguf").resolve())
    # 12 slots of 1,024 tokens (module docstring): a conversation's 4 turns fit one slot
    (root / MODEL / "model.toml").write_text(
        'isolation = "in-process"\nformat = "gguf"\nbackends = ["llamacpp"]\nartifact = "model.gguf"\n'
        f"[llamacpp]\nn_ctx = {1024 * SLOTS}\nn_slots = {SLOTS}\ncontext_length = 1024\nn_threads = 2\n")
    return root


def _lcp(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _cache_blocks(address: str) -> int:
    """Blocks of MODEL the daemon's cache holds now: the snapshot its KV
    event stream opens with."""
    with grpc.insecure_channel(address) as channel:
        call = node_pb2_grpc.NodeStub(channel).WatchKvEvents(node_pb2.WatchKvEventsRequest(), timeout=10)
        first = next(iter(call))
        call.cancel()
    return sum(len(m.stored) for m in first.models if m.model == MODEL)


def _picks(gateway) -> dict[str, float]:
    return {reason: metric_sum(gateway, "modeld_gateway_picks_total", reason=reason)
            for reason in ("kv", "prefix", "p2c", "ring", "spill")}


def _run(mode: str, stubs: dict, salt: str, seed: str, daemons=(), gateway=None) -> dict:
    """One mode's workload: per call (cached, ideal, ttft_s, turn), and the calls each daemon served."""
    served_before = [metric_sum(d, "modeld_requests_total", model=MODEL) for d in daemons]
    picks_before = _picks(gateway) if gateway is not None else {}
    tokenizer = stubs["nodes"][0]
    convs = [{"prompt": f"[{salt}] " * 4 + _SYSTEMS[c % 3] * 6 + f"\nUser {c}: {_QUESTIONS[0]}\nAssistant:"}
             for c in range(NUM_CONVERSATIONS)]
    seen: list[list[int]] = []
    rows: list[tuple[int, int, float, int]] = []
    lock = threading.Lock()
    counter = [0]

    def one(c: int, turn: int) -> None:
        conv = convs[c]
        ids = list(tokenizer.Tokenize(gen.TokenizeRequest(model=MODEL, text=conv["prompt"])).token_ids)
        with lock:
            if mode == "round_robin":
                stub = stubs["nodes"][counter[0] % len(stubs["nodes"])]
            else:
                stub = stubs[mode]
            counter[0] += 1
            # what one cache could hold when the call starts: the prompts
            # and answers of calls that ended, the prompts of those running
            # (a running sequence's computed prefix is shared too)
            before = list(seen)
            mine = len(seen)
            seen.append(ids)
        started = time.perf_counter()
        ttft, replies = None, []
        for reply in stub.Generate(gen.GenerateRequest(
                model=MODEL, prompt=conv["prompt"],
                sampling=gen.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)), timeout=300):
            if ttft is None and reply.token_ids:
                ttft = time.perf_counter() - started
            replies.append(reply)
        answer = [i for r in replies for i in r.token_ids]
        best = max((_lcp(ids, s) for s in before), default=0)
        with lock:
            seen[mine] = ids + answer
            rows.append((replies[-1].usage.cached_prompt_tokens, min(best, len(ids) - 1), ttft or 0.0, turn))
        conv["prompt"] += "".join(r.text for r in replies) + \
            f"\nUser {c}: {_QUESTIONS[(turn + 1) % len(_QUESTIONS)]}\nAssistant:"

    for turn in range(NUM_TURNS):
        order = list(range(NUM_CONVERSATIONS))
        random.Random(f"{seed}-{turn}").shuffle(order)
        with ThreadPoolExecutor(CONCURRENCY) as pool:
            list(pool.map(lambda c: one(c, turn), order))
    served = [metric_sum(d, "modeld_requests_total", model=MODEL) - b for d, b in zip(daemons, served_before)]
    by_turn = [[sum(r[0] for r in rows if r[3] == t), sum(r[1] for r in rows if r[3] == t)] for t in range(NUM_TURNS)]
    picks = {k: v - picks_before[k] for k, v in _picks(gateway).items() if v - picks_before[k]} \
        if gateway is not None else {}
    return {"cached": sum(r[0] for r in rows), "ideal": sum(r[1] for r in rows), "ttft_s": [r[2] for r in rows],
            "served_per_node": served, "cached_ideal_by_turn": by_turn, "picks": picks,
            "blocks_per_node": [_cache_blocks(d.address) for d in daemons],
            "calls_over_ideal": sum(1 for r in rows if r[0] > r[1])}


def main() -> None:
    global NUM_CONVERSATIONS
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--conversations", type=int, default=24)
    parser.add_argument("--seed", default="kv", help="the conversations' order from turn to turn")
    args = parser.parse_args()
    NUM_CONVERSATIONS = args.conversations
    modes = tuple(args.modes.split(","))
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        repo = _repository(Path(tmp))
        with ThreadPoolExecutor(3) as pool:
            daemons = list(pool.map(lambda _: start_daemon("--no-preload", repository=repo), range(3)))
        config = Path(tmp) / "guess.toml"
        config.write_text(f'[gateway]\nprefix_guess_models = ["{MODEL}"]\nreplicas = 3\n')
        kv_config = Path(tmp) / "kv.toml"
        kv_config.write_text("[gateway]\nreplicas = 3\n")
        addresses = [d.address for d in daemons]
        gateways = {"kv": start_gateway(*addresses, args=("--http-port", "-1", "--config", str(kv_config))),
                    "guess": start_gateway(*addresses, args=("--http-port", "-1", "--config", str(config)))}
        try:
            for g in gateways.values():
                deadline = time.monotonic() + 60
                while metric_sum(g, "modeld_gateway_node_serving") < 3 and time.monotonic() < deadline:
                    time.sleep(0.1)
            stubs = {name: gen_grpc.GenerationStub(grpc.insecure_channel(g.address)) for name, g in gateways.items()}
            stubs["nodes"] = [gen_grpc.GenerationStub(grpc.insecure_channel(a)) for a in addresses]
            for node in stubs["nodes"]:  # load the model everywhere first: a load is no routing decision
                list(node.Generate(gen.GenerateRequest(model=MODEL, prompt="warm up",
                                                       sampling=gen.SamplingParams(max_tokens=1)), timeout=300))
            time.sleep(0.5)  # the gateways' KV streams take the loaded model
            runs = {mode: [] for mode in modes}
            for index in range(args.rounds):
                order = modes[index % len(modes):] + modes[:index % len(modes)]
                for mode in order:
                    print(f"round {index}: {mode}", flush=True)
                    runs[mode].append(_run(mode, stubs, salt=f"{index}-{mode}", seed=f"{args.seed}-{index}",
                                           daemons=daemons, gateway=gateways.get(mode)))
        finally:
            for process in [*gateways.values(), *daemons]:
                if process.proc.poll() is None:
                    process.stop()
    summary = {}
    for mode, mode_runs in runs.items():
        cached, ideal = sum(r["cached"] for r in mode_runs), sum(r["ideal"] for r in mode_runs)
        ttfts = [t for r in mode_runs for t in r["ttft_s"]]
        summary[mode] = {"cached_tokens": cached, "ideal_tokens": ideal, "share_of_ideal": round(cached / ideal, 3),
                         "per_round": [round(r["cached"] / r["ideal"], 3) for r in mode_runs],
                         "served_per_node": [r["served_per_node"] for r in mode_runs],
                         "cached_ideal_by_turn": [r["cached_ideal_by_turn"] for r in mode_runs],
                         "share_by_turn": [[round(c / i, 3) if i else None for c, i in r["cached_ideal_by_turn"]]
                                           for r in mode_runs],
                         "blocks_per_node": [r["blocks_per_node"] for r in mode_runs],
                         "picks": [r["picks"] for r in mode_runs],
                         "calls_over_ideal": sum(r["calls_over_ideal"] for r in mode_runs),
                         "ttft_p50_ms": round(statistics.median(ttfts) * 1000, 1),
                         "ttft_p90_ms": round(statistics.quantiles(ttfts, n=10)[-1] * 1000, 1)}
    record = {
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "results": {**summary, "rounds": args.rounds, "conversations": NUM_CONVERSATIONS,
                    "turns": NUM_TURNS, "concurrency": CONCURRENCY, "max_tokens": MAX_TOKENS,
                    "slots_per_node": SLOTS,
                    "goal": "kv: cached prompt tokens >= 0.9 of the ideal",
                    "seconds": round(time.monotonic() - started, 1),
                    "command": f"flock /tmp/coord/bench.lock .venv/bin/python bench/bench_kv_routing.py "
                               f"--rounds {args.rounds} --seed {args.seed}",
                    "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                    "load_avg_1m": os.getloadavg()[0]},
    }
    RESULTS.write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(record["results"], indent=1))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
