"""Prefix-cache events and prompt block hashes of models that run in worker
processes (the daemon's default isolation, auto, puts llama.cpp and torch
there): Node/WatchKvEvents reports the blocks a generation stored in the
worker, and their removal when the model unloads; Node/PromptBlocks, hashed
in the worker, equals the in-process model's answer for the same prompt;
and a gateway in front routes the model's calls on those events (pick
reason kv, not the text guess)."""

from __future__ import annotations

import grpc
import pytest

from daemon import MODELS, add_small_smollm2, metric_sum, start_daemon, start_gateway
from modeld.gen import generation_pb2 as g
from modeld.gen import generation_pb2_grpc as gg
from modeld.gen import inference_pb2 as pb
from modeld.gen import inference_pb2_grpc as pb_grpc
from modeld.gen import node_pb2, node_pb2_grpc
from modeld.server.gateway.kv_index import NodeKvIndex
from polling import wait_until
from test_workers import worker_pids

WORKER, IN_PROCESS, TORCH = "smollm2", "smollm2-inproc", "smollm2-torch"
PROMPT = ("A prefix cache keeps the key and value tensors of prompts it has seen, so that a later prompt "
          "starting the same way skips that part of its prefill. ") * 3

TORCH_TOML = """format = "gguf"
backends = ["torch"]
artifact = "model.gguf"

[torch]
compile = false
num_blocks = 128
context_length = 1024
"""


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    root = tmp_path_factory.mktemp("kv-workers-repo")
    add_small_smollm2(root)  # no isolation key: auto, a worker
    (root / IN_PROCESS).mkdir()
    (root / IN_PROCESS / "model.gguf").symlink_to((MODELS / "smollm2" / "model.gguf").resolve())
    (root / IN_PROCESS / "model.toml").write_text('isolation = "in-process"\n'
                                                  + (root / WORKER / "model.toml").read_text())
    (root / TORCH).mkdir()
    (root / TORCH / "model.gguf").symlink_to((MODELS / TORCH / "model.gguf").resolve())
    (root / TORCH / "model.toml").write_text(TORCH_TOML)
    # loads at the normal priority: on a shared test machine a nice-10 load of
    # the torch model in a fresh worker took over 300 s (its load timeout)
    proc = start_daemon("--no-preload", repository=root, env={"MODELD_LOAD_NICENESS": "0"})
    yield proc
    proc.stop()


def _generate(address: str, model: str, prompt: str = PROMPT) -> g.Usage:
    with grpc.insecure_channel(address) as channel:
        replies = list(gg.GenerationStub(channel).Generate(g.GenerateRequest(
            model=model, prompt=prompt, sampling=g.SamplingParams(max_tokens=4, temperature=0.0)), timeout=300))
    return replies[-1].usage


def _prompt_blocks(daemon, model: str, prompt: str = PROMPT) -> node_pb2.PromptBlocksResponse:
    request = node_pb2.PromptBlocksRequest(generate=g.GenerateRequest(model=model, prompt=prompt).SerializeToString())
    with grpc.insecure_channel(daemon.address) as channel:
        return node_pb2_grpc.NodeStub(channel).PromptBlocks(request, timeout=60)


def _watch_until(daemon, done, what: str) -> NodeKvIndex:
    """The daemon's KV event stream applied to a gateway's own index until
    done(index, cache kinds by model) holds; fails after a generous bound."""
    index, kinds = NodeKvIndex(), {}
    with grpc.insecure_channel(daemon.address) as channel:
        stream = node_pb2_grpc.NodeStub(channel).WatchKvEvents(node_pb2.WatchKvEventsRequest(interval_ms=50),
                                                                timeout=60)
        try:
            for message in stream:
                index.apply(message)  # KvEventError: the stream said something no cache can mean
                kinds.update({m.model: m.cache for m in message.models if m.cache})
                if done(index, kinds):
                    return index
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED, exc
        finally:
            stream.cancel()
    raise AssertionError(f"the KV event stream never showed {what}")


def _holds(model: str, hashes, kind: str):
    return lambda index, kinds: (model in index.models and set(hashes) <= index.models[model].hashes
                                 and kinds.get(model) == kind)


def test_a_worker_models_blocks_are_published_and_its_prompt_hashes_match_in_process(daemon):
    usage = _generate(daemon.address, WORKER)
    assert len(worker_pids(daemon, WORKER)) == 1  # the model runs in a worker process
    _generate(daemon.address, IN_PROCESS)
    assert not worker_pids(daemon, IN_PROCESS)
    in_worker, in_process = _prompt_blocks(daemon, WORKER), _prompt_blocks(daemon, IN_PROCESS)
    # hashed in the worker, by its own tokenizer and cache: the in-process answer exactly
    assert len(in_worker.hashes) >= 4 and list(in_worker.hashes) == list(in_process.hashes)
    assert in_worker.block_size == in_process.block_size == 16
    assert in_worker.num_prompt_tokens == in_process.num_prompt_tokens == usage.prompt_tokens
    # the generation's blocks, stored in the worker's slots, reach the event stream
    _watch_until(daemon, _holds(WORKER, in_worker.hashes, "slots"), "the worker model's prompt blocks")


def test_a_worker_models_blocks_leave_the_stream_when_it_unloads(daemon):
    _generate(daemon.address, WORKER)
    hashes = _prompt_blocks(daemon, WORKER).hashes
    _watch_until(daemon, _holds(WORKER, hashes, "slots"), "the blocks")
    with grpc.insecure_channel(daemon.address) as channel:
        pb_grpc.GRPCInferenceServiceStub(channel).RepositoryModelUnload(
            pb.RepositoryModelUnloadRequest(model_name=WORKER), timeout=60)
    _watch_until(daemon, lambda index, _: WORKER not in index.models and IN_PROCESS in index.models,
                 "the unloaded model gone (and the in-process one still there)")


def test_a_gateway_routes_a_worker_model_on_its_kv_events(daemon):
    gateway = start_gateway(daemon.address, args=("--http-port", "-1"))
    try:
        wait_until(lambda: metric_sum(gateway, "modeld_gateway_node_serving") == 1, 30, "the node serving")
        _generate(daemon.address, WORKER)  # loaded, with the prompt's blocks in its worker's cache
        _watch_until(daemon, _holds(WORKER, _prompt_blocks(daemon, WORKER).hashes, "slots"), "the blocks")
        address = f"127.0.0.1:{gateway.port}"

        def kv_pick() -> bool:  # the gateway's own stream catches up within its 50 ms interval
            before = metric_sum(gateway, "modeld_gateway_picks_total", reason="kv")
            _generate(address, WORKER)
            return metric_sum(gateway, "modeld_gateway_picks_total", reason="kv") > before
        wait_until(kv_pick, 60, "a pick on the node's KV events", interval=0.2)
        kv = metric_sum(gateway, "modeld_gateway_picks_total", reason="kv")
        prefix = metric_sum(gateway, "modeld_gateway_picks_total", reason="prefix")
        usages = [_generate(address, WORKER) for _ in range(2)]
        assert metric_sum(gateway, "modeld_gateway_picks_total", reason="kv") == kv + 2
        assert metric_sum(gateway, "modeld_gateway_picks_total", reason="prefix") == prefix
        assert all(u.cached_prompt_tokens >= 64 for u in usages), usages
    finally:
        gateway.stop()


@pytest.mark.slow
def test_a_torch_worker_models_paged_blocks_are_published(daemon):
    usage = _generate(daemon.address, TORCH)
    assert len(worker_pids(daemon, TORCH)) == 1
    blocks = _prompt_blocks(daemon, TORCH)
    assert blocks.block_size == 16 and len(blocks.hashes) == (usage.prompt_tokens - 1) // 16
    _watch_until(daemon, _holds(TORCH, blocks.hashes, "paged"), "the torch worker's cached blocks")
    # the published blocks are the ones a lookup hits: the same prompt again is served from them
    assert _generate(daemon.address, TORCH).cached_prompt_tokens == 16 * len(blocks.hashes)

