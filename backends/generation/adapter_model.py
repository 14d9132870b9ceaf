"""A LoRA adapter served as a model of its own, on its base's generation
loop: what the torch and llama.cpp adapters share (the runtime decides only
how the adapter's weights are applied and dropped)."""

from __future__ import annotations

import asyncio

from modeld.backends.base import GenerativeModel
from modeld.backends.errors import Unavailable
from modeld.backends.generation.paged_scheduler import REQUEST_ADAPTER, adapter_salt


class LoopAdapterModel(GenerativeModel):
    """Requests naming the adapter run on `base.loop` under its id, in the
    same steps as the base's and other adapters' sequences."""

    def __init__(self, base, adapter_id: int, rank: int, nbytes: int, signature) -> None:
        self.base = base
        self.adapter_id = adapter_id
        # the namespace its prompts' blocks hash under (what a gateway's PromptBlocks reads)
        self.kv_salt = adapter_salt(adapter_id)
        self.rank = rank
        self.nbytes = nbytes
        self.inputs, self.outputs = signature
        self.loop = base.loop
        self.runner = base.runner
        self.num_in_flight = 0
        self._stopping = False

    def set_observer(self, observer) -> None:
        """The base's loop reports the steps, adapters' sequences included."""

    async def start(self) -> None:
        self._stopping = False

    async def stop(self) -> None:
        """Take no new requests and wait for this adapter's to finish."""
        self._stopping = True
        while self.num_in_flight:
            await asyncio.sleep(0.01)

    async def generate(self, request):
        if self._stopping:
            raise Unavailable("the adapter is being unloaded; retry")
        self.num_in_flight += 1
        events = self.base.loop.generate(request)
        try:
            # the base's scheduler reads the adapter in add(), inside this first step of the stream
            token = REQUEST_ADAPTER.set(self.adapter_id)
            try:
                first = await events.__anext__()
            except StopAsyncIteration:
                return  # every event went to the caller's step sink (step_sink.py)
            finally:
                REQUEST_ADAPTER.reset(token)
            yield first
            async for event in events:
                yield event
        finally:
            self.num_in_flight -= 1
            await events.aclose()
