"""KV-aware routing through `modeld gateway` in front of three real daemons
on loopback: the daemons publish their llama.cpp prefix caches
(Node/WatchKvEvents), the gateway hashes each prompt as they do
(Node/PromptBlocks) and sends it where its blocks are. A conversation and a
shared system prompt land on the node that holds them, with the cached
prompt tokens the daemon reports growing turn by turn, also after that node
restarts; KServe text calls route the same way."""

from __future__ import annotations

import signal
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import tritonclient.grpc as tc

from daemon import add_small_smollm2, metric_sum, start_daemon, start_gateway
from modeld.gen import generation_pb2 as gen
from modeld.gen import generation_pb2_grpc as gen_grpc
from modeld.gen import inference_pb2 as pb
from modeld.gen import inference_pb2_grpc as pb_grpc
from modeld.gen import node_pb2, node_pb2_grpc
from polling import wait_until

MODEL = "smollm2"
SYSTEM = ("You are the routing assistant of the modeld fleet tests. Answer in one short sentence, "
          "name no numbers, and keep to the topic of key-value caches. ") * 6


@pytest.fixture(scope="module")
def kv_fleet(tmp_path_factory):
    repo = tmp_path_factory.mktemp("repo")
    add_small_smollm2(repo)
    # in the daemon's own process (models in worker processes publish too:
    # tests/integration/test_kv_events_workers.py)
    toml = repo / MODEL / "model.toml"
    toml.write_text('isolation = "in-process"\n' + toml.read_text())
    with ThreadPoolExecutor(3) as pool:
        daemons = list(pool.map(lambda _: start_daemon("--no-preload", repository=repo), range(3)))
    gateway = start_gateway(*(d.address for d in daemons), args=("--http-port", "-1"))
    state = {"daemons": daemons, "gateway": gateway, "repo": repo}
    client = tc.InferenceServerClient(f"127.0.0.1:{gateway.port}")
    wait_until(lambda: metric_sum(gateway, "modeld_gateway_node_serving") == 3, 30, "every node serving")
    client.load_model(MODEL)  # on both ring homes: residency alone then splits calls between them
    homes = wait_until(lambda: [d for d in daemons if _holds_model(d)][1:] and
                       [d for d in daemons if _holds_model(d)], 30, "both homes holding the model")
    state["homes"] = homes
    # each home publishes the model's cache, and the gateway's index has taken it: from then
    # on every prompt of the model is routed on the daemons' blocks, the first turn included
    for home in homes:
        wait_until(lambda: _publishes_model(home), 30, "the home's KV event stream")
        wait_until(lambda: metric_sum(gateway, "modeld_gateway_node_kv_models", node=home.address) >= 1, 30,
                   "the gateway's KV index holding the home's model")
    yield state
    for process in [state["gateway"], *state["daemons"]]:
        if process.proc.poll() is None:
            process.stop()


def _holds_model(daemon) -> bool:
    with grpc.insecure_channel(daemon.address) as channel:
        stats = node_pb2_grpc.NodeStub(channel).Stats(node_pb2.NodeStatsRequest(), timeout=60)
    return any(m.name == MODEL and m.state == "READY" for m in stats.models)


def _publishes_model(daemon) -> bool:
    with grpc.insecure_channel(daemon.address) as channel:
        stream = node_pb2_grpc.NodeStub(channel).WatchKvEvents(node_pb2.WatchKvEventsRequest(), timeout=60)
        snapshot = next(stream)
        stream.cancel()
    return snapshot.snapshot and any(m.model == MODEL and m.cache == "slots" for m in snapshot.models)


def _served(daemon) -> float:
    return metric_sum(daemon, "modeld_requests_total", model=MODEL) if daemon.proc.poll() is None else 0.0


def _kv_picks(gateway) -> float:
    return metric_sum(gateway, "modeld_gateway_picks_total", reason="kv")


def _turn(stub, messages) -> tuple[str, gen.Usage]:
    replies = list(stub.Generate(gen.GenerateRequest(
        model=MODEL, messages=gen.ChatMessages(messages=messages),
        sampling=gen.SamplingParams(max_tokens=4, temperature=0.0)), timeout=60))
    return "".join(r.text for r in replies), replies[-1].usage


def _conversation(stub, daemons, opening: str, turns: int) -> tuple[list[int], list[dict]]:
    """Cached prompt tokens per turn, and which daemon served each turn."""
    messages = [gen.ChatMessage(role="system", content=SYSTEM), gen.ChatMessage(role="user", content=opening)]
    cached, where = [], []
    for turn in range(turns):
        before = {d.address: _served(d) for d in daemons}
        reply, usage = _turn(stub, messages)
        cached.append(usage.cached_prompt_tokens)
        where.append({a for a in before if _served(next(d for d in daemons if d.address == a)) > before[a]})
        messages += [gen.ChatMessage(role="assistant", content=reply),
                     gen.ChatMessage(role="user", content=f"And what about step {turn + 1}?")]
    return cached, where


def test_a_conversation_stays_on_the_node_holding_its_blocks(kv_fleet):
    daemons, gateway = kv_fleet["daemons"], kv_fleet["gateway"]
    stub = gen_grpc.GenerationStub(grpc.insecure_channel(f"127.0.0.1:{gateway.port}"))
    picks_before = _kv_picks(gateway)
    cached, where = _conversation(stub, daemons, "What does a prefix cache keep?", 3)
    assert all(len(w) == 1 for w in where), where
    assert len(set.union(*where)) == 1, where  # one node took every turn
    assert cached[1] > 100 and cached[2] > cached[1], cached
    assert _kv_picks(gateway) - picks_before == 3  # every turn, on the daemons' events
    kv_fleet["holder"] = next(iter(where[0]))


@pytest.mark.slow
def test_after_the_holding_node_restarts_the_conversation_warms_up_elsewhere(kv_fleet):
    daemons, gateway = kv_fleet["daemons"], kv_fleet["gateway"]
    stub = gen_grpc.GenerationStub(grpc.insecure_channel(f"127.0.0.1:{gateway.port}"))
    cached, where = _conversation(stub, daemons, "Where do my blocks live?", 2)
    holder = next(d for d in daemons if d.address in where[0])
    # the node holding the conversation restarts: its index goes with its stream
    holder.proc.send_signal(signal.SIGKILL)
    holder.proc.wait(10)
    revived = start_daemon("--no-preload", "--grpc-port", str(holder.port), repository=kv_fleet["repo"])
    daemons[daemons.index(holder)] = revived
    wait_until(lambda: metric_sum(gateway, "modeld_gateway_node_serving", node=revived.address) == 1, 30,
               "the restarted node rejoining")
    cached, where = _conversation(stub, daemons, "Where do my blocks live?", 3)
    # the other home serves it now (the revived node holds neither the model
    # nor the blocks), and the conversation stays there, warmer each turn
    assert len(set.union(*where)) == 1 and revived.address not in set.union(*where), where
    assert cached[1] > 100 and cached[2] > cached[1], cached


def test_a_shared_system_prompt_lands_where_it_is_cached(kv_fleet):
    daemons, gateway = kv_fleet["daemons"], kv_fleet["gateway"]
    stub = gen_grpc.GenerationStub(grpc.insecure_channel(f"127.0.0.1:{gateway.port}"))
    firsts = [f"Question {i}: why would a router {word}?" for i, word in
              enumerate(["care about caches", "count blocks", "prefer warm nodes", "hash prompts"])]
    results = [_conversation(stub, daemons, opening, 1) for opening in firsts]
    cached = [r[0][0] for r in results]
    where = [next(iter(r[1][0])) for r in results]
    system_tokens = 100  # the system prompt alone is several hundred tokens; its whole blocks are shared
    # after the first call, every call finds the system prompt cached where it lands
    assert all(c > system_tokens for c in cached[1:]), (cached, where)
    assert len(set(where[1:])) == 1, where


@pytest.mark.slow
def test_kserve_text_calls_route_on_the_cache_too(kv_fleet):
    gateway = kv_fleet["gateway"]
    stub = pb_grpc.GRPCInferenceServiceStub(grpc.insecure_channel(f"127.0.0.1:{gateway.port}"))
    prompt = SYSTEM + " Tell me about blocks."
    picks_before = _kv_picks(gateway)
    cached = []
    for _ in range(2):
        request = pb.ModelInferRequest(model_name=MODEL)
        tensor = request.inputs.add(name="text_input", datatype="BYTES", shape=[1])
        encoded = prompt.encode()
        request.raw_input_contents.append(len(encoded).to_bytes(4, "little") + encoded)
        request.parameters["max_tokens"].int64_param = 4
        reply = stub.ModelInfer(request, timeout=60)
        cached.append(reply.parameters["cached_prompt_tokens"].int64_param)
        assert tensor.name == "text_input"
    assert cached[1] > 100, cached
    assert _kv_picks(gateway) - picks_before >= 1
