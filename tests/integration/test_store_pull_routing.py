"""The gateway and a replica pulling a model from the store (issue 31): two
real daemons behind a real gateway, a model ready on one and held mid-pull
on the other (a local server of the Hugging Face Hub's routes that stops
the file's body until released). A model's `while_pulling` setting decides
whether calls route around the pulling replica ("route", the default) or
count it as a home and wait there for its pull ("wait")."""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import tritonclient.grpc as tc

from daemon import metric_sum, start_daemon, start_gateway
from polling import wait_until
from store_servers import HubServer
from test_model_store import infer, model_folder

ROUTE, WAIT, MARKER = "pull-route", "pull-wait", "pull-marker"


def _load(client: tc.InferenceServerClient, name: str, while_pulling: str | None = None) -> None:
    config = {"source": f"hf://org/{name}"}
    if while_pulling:
        config["while_pulling"] = while_pulling
    client.load_model(name, config=json.dumps(config))


def _pulling(gateway, address: str, model: str) -> dict | None:
    return next((e for e in gateway.events("node_pulling") if e["address"] == address and e["model"] == model), None)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    root = tmp_path_factory.mktemp("pull-routing")
    hub = HubServer(root / "hub")
    for i, name in enumerate((ROUTE, WAIT, MARKER)):
        model_folder(root / "hub" / "org" / name, [i + 1.0] * 4, toml=False)
    daemons = []
    for node in ("a", "b"):
        settings = root / f"{node}.toml"
        settings.write_text(f'shutdown_grace_s = 1\nstore_cache_dir = "{root / node / "cache"}"\n')
        daemons.append(start_daemon("--config", str(settings), "--no-preload", repository=None,
                                    env={"HF_ENDPOINT": hub.endpoint, "HF_HUB_OFFLINE": "0"}))
    gateway = start_gateway(*(d.address for d in daemons))
    clients = [tc.InferenceServerClient(d.address) for d in daemons]
    loaders: list[threading.Thread] = []
    try:
        ready, pulling = clients
        _load(ready, ROUTE)
        _load(ready, WAIT, "wait")
        hub.hold, hub.hold_file, hub.hold_after = threading.Event(), "model.onnx", 64
        # A pulls a third model after its two are ready: once the gateway has
        # seen that pull, its view of A has both ready
        jobs = [(ready, MARKER, None), (pulling, ROUTE, None), (pulling, WAIT, "wait")]
        loaders = [threading.Thread(target=_load, args=job, daemon=True) for job in jobs]
        for loader in loaders:
            loader.start()
        for daemon, model in ((daemons[0], MARKER), (daemons[1], ROUTE), (daemons[1], WAIT)):
            wait_until(lambda: _pulling(gateway, daemon.address, model), timeout=120,
                       what=f"the gateway to see {model} pulling on {daemon.address}")
        yield {"daemons": daemons, "gateway": gateway, "hub": hub}
    finally:
        if hub.hold is not None:
            hub.hold.set()
        for loader in loaders:
            loader.join(120)
        for client in clients:
            client.close()
        for process in (gateway, *daemons):
            process.stop()
        hub.stop()


def _gateway_infer(fleet, model: str, calls: int, threads: int = 8) -> list[np.ndarray]:
    address = f"127.0.0.1:{fleet['gateway'].port}"

    def one(_: int) -> np.ndarray:
        client = tc.InferenceServerClient(address)
        try:
            return infer(client, model)
        finally:
            client.close()

    with ThreadPoolExecutor(threads) as pool:
        return list(pool.map(one, range(calls)))


def _picks(fleet, daemon) -> float:
    return metric_sum(fleet["gateway"], "modeld_gateway_picks_total", node=daemon.address)


def test_the_gateway_reports_each_pull_with_its_setting(fleet):
    gateway, (ready, pulling) = fleet["gateway"], fleet["daemons"]
    assert _pulling(gateway, pulling.address, ROUTE)["calls"] == "route"
    assert _pulling(gateway, pulling.address, WAIT)["calls"] == "wait"
    from modeld.clients import Client

    with Client(pulling.address) as client:
        loads = {m.name: m for m in client.node_stats().models}
    assert (loads[ROUTE].state, loads[ROUTE].wait_for_pull) == ("PULLING", False)
    assert (loads[WAIT].state, loads[WAIT].wait_for_pull) == ("PULLING", True)


def test_calls_route_around_a_replica_pulling_a_route_model(fleet):
    ready, pulling = fleet["daemons"]
    before = _picks(fleet, pulling)
    answers = _gateway_infer(fleet, ROUTE, 48)
    assert [a.tolist() for a in answers] == [[[1.0] * 4]] * 48
    assert _picks(fleet, pulling) == before  # every call went to the replica that has it ready
    assert metric_sum(ready, "modeld_requests_total", model=ROUTE) >= 48
    assert fleet["hub"].hold is not None and not fleet["hub"].hold.is_set()  # still pulling throughout


def test_calls_for_a_wait_model_wait_for_the_pulling_replica_and_it_serves_them(fleet):
    ready, pulling = fleet["daemons"]
    hub = fleet["hub"]
    before = _picks(fleet, pulling)
    answers: list[np.ndarray] = []
    stop = threading.Event()

    def keep_calling() -> None:
        while not stop.is_set():
            answers.extend(_gateway_infer(fleet, WAIT, 8, threads=4))

    caller = threading.Thread(target=keep_calling, daemon=True)
    caller.start()
    try:
        # the gateway counts the pulling replica as a home: some call lands there and waits
        wait_until(lambda: _picks(fleet, pulling) > before, timeout=120,
                   what="a call for the wait model to be placed on the replica pulling it")
        assert metric_sum(pulling, "modeld_requests_total", model=WAIT) == 0  # held: none answered there yet
    finally:
        hub.hold.set()
        stop.set()
        caller.join(180)
    assert not caller.is_alive()
    assert answers and all(a.tolist() == [[2.0] * 4] for a in answers)
    # the calls that waited were answered by the replica once its pull ended
    wait_until(lambda: metric_sum(pulling, "modeld_requests_total", model=WAIT) >= 1,
               what="the pulling replica to answer the calls that waited for it")
