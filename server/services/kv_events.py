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
kv_block_size, kv_cache_kind), read by name (server/workers/kv_cache.py):
the server imports no backend's insides (tests/unit/test_layering.py). A
model in a worker process has its worker read them: the daemon keeps what
the worker last answered (kv_cache.KvMirror, asked again as watchers read
it) and has the worker hash PromptBlocks' prompts. A LoRA adapter's
prompts hash under its salt (`kv_salt`), as its blocks are stored.

A watch keeps what it last sent (one set of hashes per model) and sends the
difference from the caches as they are when the watcher takes its next
message: a slow watcher never builds a backlog, and a difference larger than
the cache itself goes as a fresh snapshot instead. This is the one place the
Node service reads past the engine into a served model's generation loop
(as DataPlane.context_length does): a backend without one or a remote
engine publishes nothing, and the gateway routes those models on its guess.
"""

from __future__ import annotations

from dataclasses import dataclass

from modeld.backends.errors import InvalidArgument, NotFound, Unavailable
from modeld.gen import generation_pb2, inference_pb2
from modeld.gen import node_pb2 as pb
from modeld.server.workers.kv_cache import model_cache, prompt_hashes

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


def cache_view(name: str, loaded) -> CacheView | None:
    """The model's prefix cache now: read in the daemon, or as its worker
    last told it (kv_cache.KvMirror); None for a model without one. An
    adapter's is its base's (its blocks hash under the adapter's salt)."""
    cache, _ = model_cache(loaded)
    if cache is not None:
        return CacheView(name, cache.kv_cache_kind, cache.kv_block_size, id(cache), cache.kv_block_hashes())
    read = getattr(loaded, "kv_cache_state", None)
    state = read() if read is not None else None
    if state is None:
        return None
    return CacheView(name, state.kind, state.block_size, state.identity, state.hashes)


def cache_views(plane) -> dict[str, CacheView]:
    """Every served language model whose cache this daemon can read."""
    views = {}
    for status in plane.engine.statuses():
        if status.state.value != "READY":
            continue
        served = plane.engine.served(status.name)
        view = cache_view(status.name, served.loaded) if served is not None else None
        if view is not None:
            views[status.name] = view
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
            if before is None:
                # Nothing to clear; sent even with an empty cache, so the
                # gateway routes the model's first prompt on its blocks.
                models.append(_model_events(view, sorted(view.hashes), ()))
                changes += len(view.hashes)
                continue
            if before.identity != view.identity or before.block_size != view.block_size:
                models.append(_model_events(view, sorted(view.hashes), (), cleared=True))
                if not view.hashes:  # a bare clear unloads it; say the empty cache is still there
                    models.append(_model_events(view, (), ()))
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


async def prompt_blocks(plane, request: pb.PromptBlocksRequest) -> pb.PromptBlocksResponse:
    """The prompt's block hashes under its model's cache here (an adapter's
    under its salt, as its blocks are stored): NOT_FOUND for a model this
    daemon does not serve now, UNAVAILABLE for one whose cache it cannot
    read (the gateway then routes on its guess)."""
    generate = _generate_request(request)
    served = plane.engine.served(generate.model_name)
    if served is None:
        raise NotFound(f"model {generate.model_name!r} is not served on this node now")
    loaded = served.loaded
    salt = getattr(loaded, "kv_salt", b"")
    if model_cache(loaded)[0] is not None:
        answer = prompt_hashes(loaded, generate, salt)
    elif hasattr(loaded, "prompt_blocks"):  # in a worker process: it hashes there
        answer = await loaded.prompt_blocks(generate, salt)
    else:
        answer = None
    if answer is None:
        raise Unavailable(f"model {generate.model_name!r} publishes no prefix-cache blocks on this node")
    return pb.PromptBlocksResponse(model=served.config.name, block_size=answer.block_size, hashes=answer.hashes,
                                   num_prompt_tokens=answer.num_prompt_tokens)


def _generate_request(request: pb.PromptBlocksRequest):
    kind = request.WhichOneof("request")
    if kind == "generate":
        from modeld.server.services.generation import request_from_proto

        try:
            message = generation_pb2.GenerateRequest.FromString(request.generate)
        except Exception as exc:  # noqa: BLE001 - protobuf's DecodeError
            raise InvalidArgument(f"generate is not a modeld.v1.GenerateRequest: {exc}") from None
        return request_from_proto(message)
    if kind == "model_infer":
        from modeld.server.services.kserve_text import text_request

        try:
            message = inference_pb2.ModelInferRequest.FromString(request.model_infer)
        except Exception as exc:  # noqa: BLE001
            raise InvalidArgument(f"model_infer is not an inference.ModelInferRequest: {exc}") from None
        return text_request(message, "")[0]
    raise InvalidArgument("PromptBlocks needs a generate or model_infer request")
