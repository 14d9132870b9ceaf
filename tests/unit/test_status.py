"""grpc_errors: statuses, the request id, and the failure counter, with a
stand-in for grpc.aio's servicer context."""

from __future__ import annotations

import asyncio
import gc
import weakref

import grpc
import pytest

from modeld.backends.errors import ErrorKind, InvalidArgument, NotFound, ResourceExhausted
from modeld.server.dataplane import DataPlane
from modeld.server.engine import Engine as RealEngine
from modeld.server.metrics import Metrics
from modeld.server.services.status import STATUS_BY_KIND, current_request_id, grpc_errors


class Aborted(Exception):
    pass


class Context:
    def __init__(self, metadata=()) -> None:
        self.metadata = tuple(metadata)
        self.trailing = ()
        self.code = self.details = None

    def invocation_metadata(self):
        return self.metadata

    def set_trailing_metadata(self, metadata) -> None:
        self.trailing = tuple(metadata)

    async def abort(self, code, details="", trailing_metadata=()):
        self.code, self.details = code, details
        if trailing_metadata:
            self.trailing = tuple(trailing_metadata)
        raise Aborted()

    def set_code(self, code) -> None:
        self.code = code

    def set_details(self, details: str) -> None:
        self.details = details


class Repository:
    def names(self):
        return ["known"]


class Engine:
    def __init__(self) -> None:
        self.metrics = Metrics()
        self.repository = Repository()

    def served(self, name):
        return None

    def is_known(self, name):
        return name in self.repository.names()

    count_failure = RealEngine.count_failure
    _served: dict = {}


class Request:
    def __init__(self, model_name: str) -> None:
        self.model_name = model_name


class Servicer:
    def __init__(self, outcome) -> None:
        self.engine, self.outcome, self.seen_ids = Engine(), outcome, []
        self.plane = DataPlane(self.engine)

    @grpc_errors
    async def Unary(self, request, context):
        self.seen_ids.append(current_request_id())
        if isinstance(self.outcome, BaseException):
            raise self.outcome
        return self.outcome

    @grpc_errors
    async def Stream(self, request, context):
        self.seen_ids.append(current_request_id())
        yield 1
        raise self.outcome


def failures(servicer: Servicer, model: str, status: str) -> float:
    value = servicer.engine.metrics.registry.get_sample_value(
        "modeld_request_failures_total", {"model": model, "status": status, "protocol": "grpc"})
    return value or 0.0


@pytest.mark.parametrize("kind", [k for k in ErrorKind])
def test_every_error_kind_has_the_grpc_status_of_the_same_name(kind):
    assert STATUS_BY_KIND[kind] is getattr(grpc.StatusCode, kind.value)


async def test_the_clients_request_id_is_used_bound_and_returned():
    servicer, context = Servicer("ok"), Context([("x-request-id", "trace-42.a")])
    assert await servicer.Unary(Request("known"), context) == "ok"
    assert servicer.seen_ids == ["trace-42.a"]
    assert context.trailing == (("x-request-id", "trace-42.a"),)


@pytest.mark.parametrize("sent", ["", "has space", "x" * 129, "line\nbreak"])
async def test_an_unusable_request_id_is_replaced_by_a_fresh_one(sent):
    servicer, context = Servicer("ok"), Context([("x-request-id", sent)])
    await servicer.Unary(Request("known"), context)
    made = servicer.seen_ids[0]
    assert made != sent and len(made) == 16 and context.trailing == (("x-request-id", made),)


async def test_each_call_without_an_id_gets_its_own():
    servicer = Servicer("ok")
    await servicer.Unary(Request("known"), Context())
    await servicer.Unary(Request("known"), Context())
    assert len(set(servicer.seen_ids)) == 2


async def test_a_modeld_error_ends_the_call_with_its_status_and_is_counted_by_model():
    servicer, context = Servicer(ResourceExhausted("queue full; retry later")), Context([("x-request-id", "r1")])
    assert await servicer.Unary(Request("known"), context) is None  # no message: the status alone
    assert context.code is grpc.StatusCode.RESOURCE_EXHAUSTED and context.details == "queue full; retry later"
    assert context.trailing == (("x-request-id", "r1"),)
    assert failures(servicer, "known", "RESOURCE_EXHAUSTED") == 1


async def test_failures_for_made_up_model_names_share_one_series():
    servicer = Servicer(NotFound("unknown model"))
    for name in ("nope-1", "nope-2"):
        context = Context()
        await servicer.Unary(Request(name), context)
        assert context.code is grpc.StatusCode.NOT_FOUND
    assert failures(servicer, "", "NOT_FOUND") == 2
    assert failures(servicer, "nope-1", "NOT_FOUND") == 0


async def test_a_bug_is_internal_with_the_request_id_and_counted():
    servicer, context = Servicer(KeyError("oops")), Context([("x-request-id", "r2")])
    assert await servicer.Unary(Request("known"), context) is None
    assert context.code is grpc.StatusCode.INTERNAL and "r2" in context.details and "oops" not in context.details
    assert failures(servicer, "known", "INTERNAL") == 1


async def test_a_stream_that_fails_after_a_message_ends_with_the_status():
    servicer, context = Servicer(InvalidArgument("bad")), Context([("x-request-id", "r3")])
    got = [item async for item in servicer.Stream(Request("known"), context)]
    assert got == [1] and context.code is grpc.StatusCode.INVALID_ARGUMENT
    assert servicer.seen_ids == ["r3"] and failures(servicer, "known", "INVALID_ARGUMENT") == 1


class Upload:
    """Stands for what a failed call held (an inline load's uploaded files): weakly referable."""


class TaskServicer:
    """Fails the way the engine's loads fail: the method awaits a task that
    raises, so its frame holds the task and the task its exception, a cycle."""

    def __init__(self) -> None:
        self.engine = Engine()
        self.plane = DataPlane(self.engine)
        self.held: list = []

    @grpc_errors
    async def Unary(self, request, context):
        upload = Upload()
        self.held.append(weakref.ref(upload))

        task = asyncio.get_running_loop().create_task(self.load(upload))
        await task

    async def load(self, upload: Upload) -> None:
        raise ResourceExhausted(f"no room for the {type(upload).__name__}")


async def test_a_failed_call_frees_what_its_frames_held_without_the_cycle_collector():
    servicer = TaskServicer()
    gc.collect()
    gc.disable()  # a busy daemon runs the cycle collector rarely: what a cycle holds stays
    try:
        for _ in range(3):
            context = Context()
            await servicer.Unary(Request("known"), context)
            assert context.code is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert [ref() for ref in servicer.held] == [None, None, None]
    finally:
        gc.enable()


class AbortingServicer:
    def __init__(self) -> None:
        self.engine = Engine()
        self.plane = DataPlane(self.engine)

    @grpc_errors
    async def Unary(self, request, context):
        context.set_code(grpc.StatusCode.PERMISSION_DENIED)
        raise grpc.aio.AbortError()  # what grpc's context.abort raises once it has set the status


async def test_a_status_the_method_set_with_abort_is_kept_not_made_internal():
    servicer, context = AbortingServicer(), Context()
    with pytest.raises(grpc.aio.AbortError):
        await servicer.Unary(Request("known"), context)
    assert context.code is grpc.StatusCode.PERMISSION_DENIED
    assert failures(servicer, "known", "INTERNAL") == 0
