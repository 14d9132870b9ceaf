"""The data plane: what every front asks of the daemon, answered in one place.

MLServer's DataPlane is the shape: the gRPC services (services/), KServe
REST and the OpenAI API (http/) decode their protocol's request, call one
method here, and encode its answer. Which model and version, whether the
name is known, loading it inline, its statistics and metadata, whether it
is a tensor or a language model, the request size cap, failure counting
and the node's load figures are each decided here once, so two fronts
cannot answer the same question two ways.

Knows no protocol: nothing here imports grpc, protobuf or starlette. What
it returns are frozen views (ModelMetadata, ModelStatistics, ModelLoad,
MemoryFigures), never the engine's live ServedModel.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.metadata
from dataclasses import dataclass
from typing import AsyncIterator, Mapping

from modeld.backends.errors import ErrorKind, InvalidArgument, ModeldError, ResourceExhausted
from modeld.backends.generation.params import MAX_N, FinalEvent, GenerateRequest, TokenEvent
from modeld.backends.model_config import ModelConfig, ModelKind, TensorSpec
from modeld.backends.sizes import format_size
from modeld.server import tenants
from modeld.server.backend_health import UnhealthyBackend
from modeld.server.engine import MODEL_VERSION, Engine, ServedModel
from modeld.server.lifecycle import Lifecycle
from modeld.server.limits import RequestLimits
from modeld.server.requests import InferRequest, InferResult, ModelState, ModelStatus
from modeld.server.stats import ModelStats
from modeld.server.versions import model_of, version_of

__all__ = ["DataPlane", "MemoryFigures", "ModelLoad", "ModelMetadata", "ModelStatistics", "ServerMetadata",
           "MODEL_VERSION", "UnhealthyBackend"]

DRAINING_MESSAGE = "the daemon is shutting down; retry on another node"


@dataclass(frozen=True)
class ServerMetadata:
    name: str
    version: str
    extensions: tuple[str, ...]


SERVER = ServerMetadata("modeld", importlib.metadata.version("modeld"),
                        ("model_repository", "model_repository(unload_dependents)", "statistics", "parameters"))


@dataclass(frozen=True)
class ModelMetadata:
    """A served model as a front describes it: its signature and what serves it."""

    name: str
    backend: str
    kind: ModelKind
    is_generative: bool
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    max_batch_size: int  # 0: not batched
    version: str = MODEL_VERSION  # the version these figures describe
    versions: tuple[str, ...] = (MODEL_VERSION,)  # every version the model serves, ascending
    matryoshka_dimensions: tuple[int, ...] = ()  # shorter vector lengths an embedding model declares

    @property
    def platform(self) -> str:
        return f"modeld_{self.backend}"


@dataclass(frozen=True)
class ModelStatistics:
    name: str
    stats: ModelStats  # the live counters, read as the front encodes them
    nbytes: int | None  # what the served model holds; None while not served
    version: str = MODEL_VERSION


@dataclass(frozen=True)
class ModelLoad:
    """One model's load, as modeld.v1.Node reports it to a gateway."""

    status: ModelStatus
    stats: ModelStats
    memory_bytes: int  # held in the budget, a load's estimate included
    queue_depth: int = 0
    kv_cells_used: int = 0
    kv_cells_capacity: int = 0


@dataclass(frozen=True)
class MemoryFigures:
    used_bytes: int
    budget_bytes: int
    daemon_bytes: int  # the daemon's own share of used_bytes


class DataPlane:
    def __init__(self, engine: Engine, lifecycle: Lifecycle | None = None,
                 max_request_bytes: int | None = None, limits: RequestLimits | None = None) -> None:
        self.engine = engine
        self.lifecycle = lifecycle if lifecycle is not None else Lifecycle()
        self.max_request_bytes = max_request_bytes  # a model's cap unless its [limits] sets one
        self._tokenizers: dict[tuple[str, int], object] = {}  # count_text_tokens', by model and load
        self.limits = limits if limits is not None else RequestLimits()  # what one caller may ask, every front

    # -- the server -----------------------------------------------------------

    @property
    def is_draining(self) -> bool:
        return self.lifecycle.is_draining

    def is_ready(self) -> bool:
        return not self.is_draining

    def server_metadata(self) -> ServerMetadata:
        return SERVER

    # -- which model ----------------------------------------------------------

    def check_known(self, name: str, version: str = "") -> str:
        """The key of a known model's version (server/versions.py): NOT_FOUND
        for a version it does not serve, or a name that is neither served,
        loading nor in the repository."""
        key = self._dispatch.key_for(name, version)
        if not self.engine.is_known(name):
            self.engine.repository.resolve(name)  # raises NOT_FOUND (or INVALID_ARGUMENT for a bad name)
        return key

    def served_version(self, name: str, version: str = "") -> str:
        """The version a call for `version` of `name` runs on, as the wire
        spells it ("" the default: the highest the policy serves)."""
        return version_of(self.check_known(name, version))

    def is_model_ready(self, name: str, version: str = "") -> bool:
        return self.engine.models.state_of(self._dispatch.key_for(name, version)) is ModelState.READY

    def model_state(self, name: str, version: str = "") -> ModelState:
        """The state of a known model's version; NOT_FOUND for any other name or version."""
        return self.engine.models.state_of(self.check_known(name, version))

    def statuses(self) -> list[ModelStatus]:
        """One status per model, its default version's (the OpenAI list)."""
        names = {model_of(k) for k in self._dispatch.all_keys()}
        return [self._status(self._dispatch.canonical(n)) for n in sorted(names)]

    def version_statuses(self) -> list[ModelStatus]:
        """Every version of every model (RepositoryIndex): each entry's served
        versions, and any other version still loaded."""
        return [self._status(k) for k in self._dispatch.all_keys()]

    def _status(self, key: str) -> ModelStatus:
        """A version's status; a LoRA adapter not loaded names its base from its config."""
        status = self.engine.models.status(key)
        if status.base:
            return status
        source = self._dispatch.versions.source(model_of(key))  # cached: a listing reads no file again
        base = getattr(source.config, "base", "") if source is not None else ""
        return dataclasses.replace(status, base=base) if base else status

    def find_status(self, name: str) -> ModelStatus | None:
        """A known model's status (its default version's), None for any other
        name, however it is spelled."""
        try:
            if not self.engine.is_known(name):
                return None
            return self._status(self._dispatch.key_for(name))
        except ModeldError:
            return None

    async def model(self, name: str, version: str = "") -> ModelMetadata:
        """The model version's metadata, loading it first where it is not served."""
        served = await self.engine.ensure_loaded(name, version)
        versions = tuple(version_of(k) for k in self._dispatch.version_keys(name))
        return _metadata(served, versions)

    async def is_language_model(self, name: str, version: str = "") -> bool:
        # on every ModelInfer: asks the served model, without building its metadata
        return (await self.engine.ensure_loaded(name, version)).is_generative

    def statistics(self, name: str = "", version: str = "") -> list[ModelStatistics]:
        """One model version's figures; every served version of a model
        without `version` (Triton's); every known model's when `name` is empty."""
        if name and version:
            keys = [self.check_known(name, version)]
        elif name:
            self.check_known(name)
            keys = sorted(set(self._dispatch.version_keys(name)) | set(self._dispatch.loaded_keys(name)),
                          key=lambda k: int(version_of(k)))
        else:
            keys = self._dispatch.all_keys()
        return [ModelStatistics(model_of(k), self.engine.models.stats(k), _nbytes(self.engine.models.get(k)),
                                version_of(k)) for k in keys]

    # -- the repository -------------------------------------------------------

    async def load(self, name: str, config: object = None, files: Mapping[str, bytes] | None = None) -> None:
        """Load by name from the repository, or inline: `config` the model's
        configuration as JSON text, `files` its files by `file:<path>` key,
        each front having decoded their contents. Every version its policy
        serves loads (Triton's); a version that left the policy unloads."""
        files = dict(files or {})
        if config is not None and not isinstance(config, str):
            raise InvalidArgument("load parameter 'config' must be a string holding the model configuration as JSON "
                                  "(a string_param over gRPC)")
        if files and config is None:
            raise InvalidArgument("model files in a load request need a 'config' parameter as well")
        repository = self.engine.repository
        if files:  # checked before a byte is written; add_inline then writes without yielding
            self.limits.check_inline_upload(repository.inline_root, name, sum(len(v) for v in files.values()))
        source = repository.add_inline(name, config, files) if config is not None else None
        self._dispatch.versions.forget(name)
        try:
            keys = self._keys_to_load(name)
            for key in keys:
                await self.engine.load(key, None if source is None else repository.resolve(key))
        except ModeldError:  # not a cancelled caller: its load runs on, shielded
            if source is not None and not self._dispatch.loaded_keys(name):
                repository.remove_inline(name)  # uploaded files no model serves would only hold the disk
                self._dispatch.versions.forget(name)
            raise
        for stale in set(self._dispatch.loaded_keys(name)) - set(keys):
            await self.engine.unload(stale, forget_inline=False)

    def _keys_to_load(self, name: str) -> list[str]:
        keys = self._dispatch.version_keys(name)
        if not keys:  # the policy matches no folder: say so, naming the policy
            self._dispatch.key_for(name)
        return keys

    async def unload(self, name: str) -> None:
        """Every version of the model, the entry's own name last (which
        forgets an inline model's files)."""
        model = self._dispatch.model_name(name)
        for key in self._dispatch.loaded_keys(model):
            if key != model:
                await self.engine.unload(key, forget_inline=False)
        await self.engine.unload(model)
        self._dispatch.versions.forget(model)

    @property
    def _dispatch(self):
        return self.engine.dispatch

    def _served(self, name: str) -> ServedModel | None:
        """The served default version of the model `name` means (an alias's, too)."""
        return self.engine.models.get(self._dispatch.canonical(name))

    # -- requests -------------------------------------------------------------

    def check_request_size(self, model: str, nbytes: int) -> None:
        """RESOURCE_EXHAUSTED for a request larger than its model's cap:
        `[limits] max_request_bytes` in its config, else the daemon's
        `max_request_bytes`. A model not loaded yet is judged by its config
        in the repository, so an oversized request never triggers a load."""
        if not nbytes:
            return
        cap = self._config(model).max_request_bytes
        if cap is not None:
            if nbytes > cap:
                raise ResourceExhausted(
                    f"request of {nbytes} bytes exceeds model {model!r}'s request size limit {cap} "
                    f"({format_size(cap)}, limits.max_request_bytes in its config); send a smaller request or batch")
            return
        default_cap = self.max_request_bytes
        if default_cap is not None and nbytes > default_cap:
            raise ResourceExhausted(
                f"request of {nbytes} bytes exceeds the daemon's request size limit {default_cap} "
                f"({format_size(default_cap)}, max_request_bytes); send a smaller request, or raise the limit for "
                f"this model with limits.max_request_bytes in its config")

    def model_config(self, name: str) -> ModelConfig:
        """A model's parsed configuration (how a language model's answers are
        read back, say); NotFound for an unknown model."""
        return self._config(name)

    def _config(self, model: str) -> ModelConfig:
        served = self._served(model)
        return served.config if served is not None else self.engine.repository.resolve(model).config

    async def infer(self, request: InferRequest) -> InferResult:
        return await self.engine.infer(tenants.with_allowed_priority(request))

    def generate(self, request: GenerateRequest,
                 timeout_s: float | None = None) -> AsyncIterator[TokenEvent | FinalEvent]:
        # the call's tenant (set by the token check) is charged each token as it streams
        return tenants.metered(self.engine.generate(tenants.with_allowed_priority(request), timeout_s))

    def generate_choices(self, request: GenerateRequest, n: int,
                         timeout_s: float | None = None) -> AsyncIterator[tuple[int, TokenEvent | FinalEvent]]:
        """`n` generations of one request, their events merged as they come
        and tagged with the choice's index. Choice i samples with seed + i
        (so each is reproducible; a request without a seed gets independent
        choices). The n sequences reach the engine together, so it computes
        their shared prompt once. A failure of any choice fails them all;
        closing the iterator (a client that left) cancels every one."""
        if not 1 <= n <= MAX_N:
            raise InvalidArgument(f"n must be in [1, {MAX_N}] (choices per request), got {n}")
        if n == 1:
            return _Tagged(self.generate(request, timeout_s))
        seed = request.params.seed
        requests = [dataclasses.replace(
            request, request_id=f"{request.request_id}-{i}" if request.request_id else "",
            params=request.params if seed is None else dataclasses.replace(request.params, seed=(seed + i) % 2**64))
            for i in range(n)]
        return _merged([self.generate(r, timeout_s) for r in requests])

    async def tokenize(self, name: str, text: str) -> list[int]:
        return await self.engine.tokenize(name, text)

    async def prompt_ids(self, request: GenerateRequest) -> list[int]:
        """The token ids generation would feed for `request` (its chat
        template, tools and template arguments rendered): /tokenize with messages."""
        return await self.engine.prompt_ids(request)

    def context_length(self, name: str) -> int | None:
        """The most tokens one sequence of a served language model may hold;
        None where the model runs elsewhere (a worker process, a remote
        engine) and has not said."""
        served = self._served(name)
        loop = getattr(served.loaded, "loop", None) if served is not None else None
        config = getattr(getattr(loop, "scheduler", None), "config", None)
        return getattr(config, "context_length", None)

    def count_text_tokens(self, name: str, texts: list[str]) -> int | None:
        """Tokens a text model's `[text]` tokenizer makes of `texts`, as its
        graph sees them (truncated to max_length); None for a model without
        one. The backend tokenizes inside itself (a worker process, maybe)
        and reports no count, so the front's usage counts here."""
        served = self._served(name)
        spec = served.config.text if served is not None else None
        if spec is None:
            return None
        key = (name, id(served))
        tokenizer = self._tokenizers.get(key)
        if tokenizer is None:
            from tokenizers import Tokenizer

            tokenizer = Tokenizer.from_file(str(served.source.model_dir / spec.tokenizer))
            tokenizer.enable_truncation(max_length=spec.max_length)
            self._tokenizers = {k: v for k, v in self._tokenizers.items() if k[0] != name}  # a reload's replaces it
            self._tokenizers[key] = tokenizer
        return sum(len(e.ids) for e in tokenizer.encode_batch(texts))

    async def detokenize(self, name: str, token_ids: list[int]) -> str:
        return await self.engine.detokenize(name, token_ids)

    def count_failure(self, model: str, kind: ErrorKind) -> None:
        """One failed call, whatever front it came in by."""
        self.engine.count_failure(model, kind)

    # -- the node's load --------------------------------------------------------

    def memory(self) -> MemoryFigures:
        memory = self.engine.memory
        return MemoryFigures(memory.used, memory.budget, memory.daemon_bytes)

    def model_loads(self) -> list[ModelLoad]:
        """Each version's load (a gateway reads a model as here while any of them is ready)."""
        held = self._bytes_by_model()
        models = self.engine.models
        # _status: an adapter names its base whether loaded or not (a gateway places it by the base)
        return [_load_of(self._status(k), models.stats(k), held.get(k, 0), models.get(k))
                for k in self._dispatch.all_keys()]

    def _bytes_by_model(self) -> dict[str, int]:
        """What the budget holds per model version (by its key), summed over
        its backends; a model being loaded holds its estimate here before it
        is served."""
        memory, held = self.engine.memory, {}
        for key in memory.keys_lru_first():
            held[key.model] = held.get(key.model, 0) + memory.entry(key).nbytes
        return held

    def unhealthy_backends(self) -> list[UnhealthyBackend]:
        return self.engine.unhealthy_backends()


def _metadata(served: ServedModel, versions: tuple[str, ...]) -> ModelMetadata:
    config = served.config
    return ModelMetadata(model_of(config.name), served.backend.name, config.kind, served.is_generative,
                         tuple(served.loaded.inputs), tuple(served.loaded.outputs), config.max_batch_size,
                         version=version_of(config.name), versions=versions or (version_of(config.name),),
                         matryoshka_dimensions=config.matryoshka_dimensions)


def _nbytes(served: ServedModel | None) -> int | None:
    return served.loaded.nbytes if served is not None else None


def _load_of(status: ModelStatus, stats: ModelStats, memory_bytes: int, served: ServedModel | None) -> ModelLoad:
    if served is not None and served.batcher is not None:
        return ModelLoad(status, stats, memory_bytes, queue_depth=served.batcher.num_waiting)
    if served is not None and served.generation is not None:
        step = served.generation.latest
        return ModelLoad(status, stats, memory_bytes, step.num_waiting, step.kv_used, step.kv_capacity)
    return ModelLoad(status, stats, memory_bytes)


class _Tagged:
    """One choice's events tagged 0: a plain iterator, not an async
    generator, since each generator layer is resumed again for every token."""

    __slots__ = ("_events",)

    def __init__(self, events: AsyncIterator[TokenEvent | FinalEvent]) -> None:
        self._events = events

    def __aiter__(self) -> _Tagged:
        return self

    async def __anext__(self) -> tuple[int, TokenEvent | FinalEvent]:
        return 0, await self._events.__anext__()

    async def aclose(self) -> None:
        await self._events.aclose()


_DONE = object()


async def _merged(streams: list[AsyncIterator[TokenEvent | FinalEvent]]) -> AsyncIterator[tuple[int, TokenEvent | FinalEvent]]:
    """Each stream read by its own task into one queue, so a slow choice
    never holds back another; the first failure is raised and ends all."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, events: AsyncIterator[TokenEvent | FinalEvent]) -> None:
        try:
            async for event in events:
                await queue.put((index, event))
            await queue.put((index, _DONE))
        except Exception as exc:  # noqa: BLE001 - handed to the reader, who raises it
            await queue.put((index, exc))
        finally:
            await events.aclose()

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        running = len(tasks)
        while running:
            index, item = await queue.get()
            if item is _DONE:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
