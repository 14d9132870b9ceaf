"""Tenant buckets on a stepped clock, and the token file's tenant settings."""

from __future__ import annotations

import pytest

from modeld.server.auth import Authenticator, Denied, Refusal, TokenFileError, parse_tokens
from modeld.server.tenants import TenantLimits, TokenBucket

TOKEN_A = "tenant-a-0123456789abcdef"
TOKEN_B = "tenant-b-0123456789abcdef"
TOKEN_C = "tenant-c-0123456789abcdef"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_bucket_spends_refills_and_says_how_long_to_wait():
    clock = Clock()
    bucket = TokenBucket(rate=2.0, capacity=4.0, clock=clock)
    assert [bucket.take() for _ in range(4)] == [0.0] * 4
    assert bucket.take() == pytest.approx(0.5)
    clock.now += 0.5
    assert bucket.take() == 0.0
    clock.now += 100
    assert bucket.level == 4.0  # never above its capacity


def test_a_charge_overdraws_and_the_refill_pays_the_debt_first():
    clock = Clock()
    bucket = TokenBucket(rate=1.0, capacity=10.0, clock=clock)
    bucket.charge(25)
    assert bucket.level == -15.0
    assert bucket.wait_for(1.0) == pytest.approx(16.0)
    clock.now += 16
    assert bucket.wait_for(1.0) == 0.0


def test_token_lines_carry_tenants_and_their_limits():
    table = parse_tokens(f"{TOKEN_A} infer tenant=acme rps=5 tokens_per_minute=600 models=a,b streams=2\n"
                         f"{TOKEN_B} admin tenant=acme\n"
                         f"{TOKEN_C} infer fleet=yes\n")
    assert table.identify(TOKEN_A)[1] == "acme" and table.identify(TOKEN_B)[1] == "acme"
    assert table.identify(TOKEN_C)[1] == ""
    assert table.limits["acme"] == TenantLimits(requests_per_s=5.0, tokens_per_minute=600, max_streams=2,
                                                models=frozenset({"a", "b"}), priority=False, update=False)
    assert table.fleet is not None


@pytest.mark.parametrize(("text", "fragment"), [
    (f"{TOKEN_A} infer rps=5\n", "need tenant=NAME"),
    (f"{TOKEN_A} infer tenant=x rps=-1\n", "must be a positive number"),
    (f"{TOKEN_A} infer tenant=x colour=red\n", "'colour' is not a token setting"),
    (f"{TOKEN_A} infer tenant=x rps=1\n{TOKEN_B} infer tenant=x rps=2\n", "differs from"),
    (f"{TOKEN_A} infer fleet=yes\n{TOKEN_B} infer fleet=yes\n", "a fleet has one token"),
    (f"{TOKEN_A} infer tenant=x priority=maybe\n", "must be yes or no"),
])
def test_bad_tenant_settings_are_refused_without_echoing_the_token(text, fragment):
    with pytest.raises(TokenFileError) as caught:
        parse_tokens(text, "tokens.txt")
    assert fragment in str(caught.value) and TOKEN_A not in str(caught.value)


def test_a_tenant_over_its_rate_is_refused_with_a_retry_after_and_another_is_not(tmp_path):
    clock = Clock()
    path = tmp_path / "tokens.txt"
    path.write_text(f"{TOKEN_A} infer tenant=a rps=1 burst=2\n{TOKEN_B} infer tenant=b rps=1 burst=2\n")
    auth = Authenticator(path, clock=clock)
    from modeld.server.auth import Role

    def call(token):
        return auth.authorize(f"Bearer {token}", Role.INFER, "x")

    assert not isinstance(call(TOKEN_A), Denied) and not isinstance(call(TOKEN_A), Denied)
    refused = call(TOKEN_A)
    assert isinstance(refused, Denied) and refused.kind is Refusal.RESOURCE_EXHAUSTED and refused.retry_after == "1"
    assert not isinstance(call(TOKEN_B), Denied)
    clock.now += 1.0
    assert not isinstance(call(TOKEN_A), Denied)
    # a reload keeps what each bucket holds: rereading the file refills nothing
    assert auth.reload()
    assert isinstance(call(TOKEN_A), Denied)


def test_a_tenant_s_streams_are_counted_while_they_run_and_refused_past_its_limit():
    import asyncio

    from modeld.backends.generation.params import TokenEvent
    from modeld.server import tenants
    from modeld.server.tenants import QuotaExceeded, Tenant, TenantMetrics

    tenant = Tenant("t", TenantLimits(max_streams=1, tokens_per_minute=60), TenantMetrics())

    async def events():
        for i in range(3):
            yield TokenEvent(token_ids=(i, i + 1), text="ab")

    async def main():
        tenants.set_current(tenant)
        first = tenants.metered(events())
        assert (await anext(first)).token_ids == (0, 1)
        assert tenant.streams == 1
        with pytest.raises(QuotaExceeded, match="generations in progress"):
            await anext(tenants.metered(events()))
        assert [e.token_ids async for e in first] == [(1, 2), (2, 3)]
        assert tenant.streams == 0

    asyncio.run(main())
    assert tenant.tokens.level == pytest.approx(60 - 6, abs=0.1)  # six tokens charged as they streamed


def test_a_refused_stream_message_is_raised_to_its_reader_and_never_aborted_from_it():
    # ModelStreamInfer reads its messages in a task of its own; an abort from
    # that task while the call's task writes an answer is refused by grpc and
    # the call hangs, so the refusal must reach the reader as an exception
    import asyncio

    import grpc

    from modeld.backends.errors import ErrorKind
    from modeld.server.auth import _tenant_handler
    from modeld.server.tenants import ModelNotAllowed, Tenant, TenantMetrics

    tenant = Tenant("t", TenantLimits(models=frozenset({"allowed"})), TenantMetrics())
    seen: list[str] = []

    class Request:
        def __init__(self, name):
            self.model_name = name

    class Context:
        async def abort(self, *args, **kwargs):
            raise AssertionError(f"aborted from the reader: {args}")

    async def behaviour(requests, context):
        async def read():
            async for request in requests:
                seen.append(request.model_name)
        with pytest.raises(ModelNotAllowed) as caught:
            await asyncio.get_running_loop().create_task(read())
        assert caught.value.kind is ErrorKind.PERMISSION_DENIED
        yield "ended"

    async def messages():
        for name in ("allowed", "other", "allowed"):
            yield Request(name)

    handler = _tenant_handler(grpc.stream_stream_rpc_method_handler(behaviour), tenant,
                              "/inference.GRPCInferenceService/ModelStreamInfer")

    async def main():
        return [reply async for reply in handler.stream_stream(messages(), Context())]

    assert asyncio.run(main()) == ["ended"]
    assert seen == ["allowed"]
