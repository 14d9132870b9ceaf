"""What each language model's prefix cache holds, for gateways that route on
it (modeld.v1.Node/WatchKvEvents and PromptBlocks).

The figures are read from the schedulers' own bookkeeping at the moment a
message is built, never counted here:
- the torch runtime's paged cache (backends/generation/block_manager.py):
  the chain hashes of its cached blocks, exactly the keys a prompt's lookup
  can hit;
- llama.cpp's slots (backends/generation/slots.py): each cached slot's
  tokens, and each running slot's computed ones, cut into 16-token blocks
  and chain-hashed the same way. A slot reuses any common prefix, so a
  prompt matching k of these blocks reuses at least k blocks.

Both caches answer the same four names (kv_block_hashes, kv_prompt_hashes,
kv_block_size, kv_cache_kind), read here by name: the server imports no
backend's insides (tests/unit/test_layering.py).

A watch keeps what it last sent (one set of hashes per model) and sends the
difference from the caches as they are when the watcher takes its next
message: a slow watcher never builds a backlog, and a difference larger than
the cache itself goes as a fresh snapshot instead. This is the one place the
Node service reads past the engine into a served model's generation loop
(as DataPlane.context_length does): a backend without one, a worker process
or a remote engine publishes nothing, and the gateway routes those models on
its guess.
"""

from __future__ import annotations

from dataclasses import dataclass

from modeld.backends.errors import InvalidArgument, NotFound, Unavailable
from modeld.gen import generation_pb2, inference_pb2
from modeld.gen import node_pb2 as pb

# one message never holds more hashes than this; a snapshot past it is cut
# (a gateway then misses some blocks: a lost cache hit, never a wrong answer)
MAX_HASHES_PER_MESSAGE = 400_000
# a difference with more changes than the caches hold blocks (and at least
# this many) is sent as the snapshot it costs less than
MIN_SNAPSHOT_CHANGES = 64


@dataclass(frozen=True)
class CacheView:
    """One model's prefix cache as it is now."""

    model: str
    cache: str  # "paged" or "slots"
    block_size: int
    identity: int  # the cache object's id: a reload makes a new one
    hashes: frozenset[int]


def prefix_cache(plane, name: str):
    """The served model's prefix cache and generation loop, where its
    scheduler keeps one that says what it holds (kv_block_hashes,
    kv_prompt_hashes, kv_block_size, kv_cache_kind); (None, None) elsewhere."""
    served = plane.engine.served(name)
    loop = getattr(getattr(served, "loaded", None), "loop", None)
    scheduler = getattr(loop, "scheduler", None)
    for attribute in ("blocks", "slots"):
        cache = getattr(scheduler, attribute, None)
        if cache is not None and hasattr(cache, "kv_block_hashes"):
            return cache, loop
    return None, None


def cache_views(plane) -> dict[str, CacheView]:
    """Every served language model whose cache this daemon can read."""
    views = {}
    for status in plane.engine.statuses():
        if status.state.value != "READY":
            continue
        cache, _ = prefix_cache(plane, status.name)
        if cache is not None:
            views[status.name] = CacheView(status.name, cache.kv_cache_kind, cache.kv_block_size, id(cache),
                                           cache.kv_block_hashes())
    return views


class KvWatch:
    """One watcher's stream: a snapshot, then differences from what it was sent."""

    def __init__(self) -> None:
        self._sent: dict[str, CacheView] = {}
        self._sequence = 0
        self._started = False

    def message(self, views: dict[str, CacheView]) -> pb.KvEvents | None:
        """The next message; None when nothing changed since the last one."""
        if not self._started:
            self._started = True
            return self._snapshot(views)
        models, changes = [], 0
        for name, view in views.items():
            before = self._sent.get(name)
            if before is None or before.identity != view.identity or before.block_size != view.block_size:
                models.append(_model_events(view, sorted(view.hashes), (), cleared=True))
                changes += len(view.hashes)
                continue
            stored, removed = view.hashes - before.hashes, before.hashes - view.hashes
            if stored or removed:
                models.append(_model_events(view, sorted(stored), sorted(removed)))
                changes += len(stored) + len(removed)
        for name in self._sent.keys() - views.keys():
            models.append(pb.ModelKvEvents(model=name, cleared=True, cache=self._sent[name].cache,
                                           block_size=self._sent[name].block_size))
        if changes > max(MIN_SNAPSHOT_CHANGES, sum(len(v.hashes) for v in views.values())):
            return self._snapshot(views)
        if not models:
            return None
        self._sent = dict(views)
        return self._numbered(pb.KvEvents(snapshot=False, models=models))

    def _snapshot(self, views: dict[str, CacheView]) -> pb.KvEvents:
        budget, models = MAX_HASHES_PER_MESSAGE, []
        sent = {}
        for name, view in views.items():
            hashes = sorted(view.hashes)[:budget]
            budget -= len(hashes)
            models.append(_model_events(view, hashes, ()))
            sent[name] = view if len(hashes) == len(view.hashes) else CacheView(
                view.model, view.cache, view.block_size, view.identity, frozenset(hashes))
        self._sent = sent
        return self._numbered(pb.KvEvents(snapshot=True, models=models))

    def _numbered(self, message: pb.KvEvents) -> pb.KvEvents:
        message.sequence = self._sequence
        self._sequence += 1
        return message


def _model_events(view: CacheView, stored, removed, cleared: bool = False) -> pb.ModelKvEvents:
    return pb.ModelKvEvents(model=view.model, block_size=view.block_size, stored=stored, removed=removed,
                            cleared=cleared, cache=view.cache)


def prompt_blocks(plane, request: pb.PromptBlocksRequest) -> pb.PromptBlocksResponse:
    """The prompt's block hashes under its model's cache here: NOT_FOUND for
    a model this daemon does not serve now, UNAVAILABLE for one whose cache
    it cannot read (the gateway then routes on its guess)."""
    kind = request.WhichOneof("request")
    if kind == "generate":
        from modeld.server.services.generation import request_from_proto

        try:
            message = generation_pb2.GenerateRequest.FromString(request.generate)
        except Exception as exc:  # noqa: BLE001 - protobuf's DecodeError
            raise InvalidArgument(f"generate is not a modeld.v1.GenerateRequest: {exc}") from None
        generate = request_from_proto(message)
    elif kind == "model_infer":
        from modeld.server.services.kserve_text import text_request

        try:
            message = inference_pb2.ModelInferRequest.FromString(request.model_infer)
        except Exception as exc:  # noqa: BLE001
            raise InvalidArgument(f"model_infer is not an inference.ModelInferRequest: {exc}") from None
        generate, _ = text_request(message, "")
    else:
        raise InvalidArgument("PromptBlocks needs a generate or model_infer request")
    served = plane.engine.served(generate.model_name)
    if served is None:
        raise NotFound(f"model {generate.model_name!r} is not served on this node now")
    cache, loop = prefix_cache(plane, generate.model_name)
    if cache is None:
        raise Unavailable(f"model {generate.model_name!r} publishes no prefix-cache blocks on this node")
    token_ids = loop.prompt_ids(generate)
    return pb.PromptBlocksResponse(model=served.config.name, block_size=cache.kv_block_size,
                                   hashes=cache.kv_prompt_hashes(token_ids), num_prompt_tokens=len(token_ids))
