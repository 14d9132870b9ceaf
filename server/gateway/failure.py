"""CallFailed: how the gateway carries a node's answer, or its own refusal,
to the client as a gRPC status."""

from __future__ import annotations

import grpc


class CallFailed(Exception):
    """A node's answer that must reach the client as a status (with the
    node's trailing metadata, its request id among them)."""

    def __init__(self, code: grpc.StatusCode, details: str, trailers=()) -> None:
        super().__init__(details)
        self.code, self.details, self.trailers = code, details, tuple(trailers or ())

    @classmethod
    def from_rpc(cls, exc: grpc.aio.AioRpcError) -> CallFailed:
        return cls(exc.code(), exc.details() or exc.code().name, exc.trailing_metadata())

    @classmethod
    def of(cls, exc: BaseException) -> CallFailed:
        """`exc` as a status: a CallFailed as it is; anything else is trouble
        on the way to the node, so UNAVAILABLE."""
        return exc if isinstance(exc, CallFailed) else cls(grpc.StatusCode.UNAVAILABLE, str(exc))

    async def abort(self, context: grpc.aio.ServicerContext) -> None:
        """End the client's call with this status."""
        await context.abort(self.code, self.details, self.trailers)
