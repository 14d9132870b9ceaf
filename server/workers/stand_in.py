"""The engine's side of a worker process: a stand-in for the loaded model.

`WorkerTensorModel` and `WorkerGenerativeModel` implement the contract the
engine and the batcher use (execute / generate / tokenize / start / stop /
unload, `nbytes`, `inputs`, `outputs`) by sending requests to the worker and
awaiting its answers, multiplexed by request id over one socket. When the
worker dies every call in flight fails with UNAVAILABLE naming the model,
the pid and the signal, and the engine is told (`on_death`) so it can drop
the model; the next request loads it again. `WorkerAdapterModel` is a LoRA
adapter resident on a base in its worker: its requests name it on the
base's channel.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import structlog

from modeld.backends.base import GenerativeModel, LoadedModel
from modeld.backends.errors import (
    BackendFailure, ErrorKind, LoadFailed, ModeldError, Unavailable, error_for,
)
from modeld.backends.generation.params import FinalEvent, GenerateRequest, TokenEvent
from modeld.server.os_memory import process_rss
from modeld.server.workers.frames import TOKEN, FrameProtocol, connect, token_event
from modeld.server.workers.kv_cache import KvCacheState, KvMirror, PromptHashes

log = structlog.get_logger("modeld.workers")

_ERROR_CLASSES = {"LoadFailed": LoadFailed, "BackendFailure": BackendFailure}


def describe_exit(returncode: int | None) -> str:
    if returncode is None:
        return "its channel closed"
    if returncode < 0:
        try:
            return f"signal {signal.Signals(-returncode).name}"
        except ValueError:
            return f"signal {-returncode}"
    return f"exit code {returncode}"


class WorkerCrashedOnLoad(LoadFailed):
    """The worker died while loading (a runtime that aborts on a bad file):
    a failed load, and a death the restart backoff counts."""


def _remote_error(name: str, kind: str, message: str) -> ModeldError:
    cls = _ERROR_CLASSES.get(name)
    if cls is not None:
        return cls(message)
    try:
        return error_for(ErrorKind(kind), message)
    except ValueError:
        return error_for(ErrorKind.INTERNAL, message)


class ChildProcess:
    """A worker process started by subprocess.Popen and awaited on the event
    loop, whichever loop that is.

    Not the loop's own subprocess_exec: under uvloop that is libuv's spawn,
    and there a worker died with SIGSEGV within a millisecond of its start,
    before it ran any code of ours, in 13 of 280 loads here (0 of 40 on
    asyncio's loop). Started by Popen (CPython's own fork and exec), 0 of
    160 on uvloop. Its exit is read from a pidfd the loop watches, or by
    polling where the platform has none."""

    def __init__(self, popen: subprocess.Popen) -> None:
        self._popen = popen
        self.pid = popen.pid
        self._exited: asyncio.Future | None = None

    @property
    def returncode(self) -> int | None:
        """The exit status once wait() has seen it, None before (as asyncio's Process)."""
        return self._popen.returncode

    def kill(self) -> None:
        self._popen.kill()  # a no-op once the exit has been collected

    async def wait(self) -> int:
        # one pidfd and one future for every waiter
        if self._exited is None:
            self._exited = asyncio.get_running_loop().create_future()
            self._watch(self._exited)
        return await asyncio.shield(self._exited)

    def _watch(self, exited: asyncio.Future) -> None:
        loop = asyncio.get_running_loop()
        if self._popen.poll() is not None:
            exited.set_result(self._popen.returncode)
            return
        try:
            fd = os.pidfd_open(self.pid)  # readable once the process has exited, reaped or not
        except (AttributeError, OSError):  # no pidfds here (macOS, old kernels): poll
            fd = None

        def check() -> None:
            if self._popen.poll() is None:
                if fd is None:
                    loop.call_later(0.05, check)
                return
            if fd is not None:
                loop.remove_reader(fd)
                os.close(fd)
            if not exited.done():
                exited.set_result(self._popen.returncode)

        if fd is None:
            loop.call_later(0.05, check)
        else:
            loop.add_reader(fd, check)


class WorkerProcess:
    """One worker: the process, its socket, and the calls in flight on it."""

    def __init__(self, model: str, proc: ChildProcess) -> None:
        self.model = model
        self.proc = proc
        self.pid = proc.pid
        self.started = time.monotonic()
        self._out = FrameProtocol(self._dispatch, self._lost)
        self._ids = itertools.count(1)
        self._calls: dict[int, asyncio.Future] = {}
        self._streams: dict[int, _Inbox] = {}
        self.death: Unavailable | None = None  # set once the worker is gone
        self.exiting = False  # we asked it to end: its end is no death
        self.on_death: Callable[[str], None] | None = None
        self.on_observe: Callable[[str, tuple], None] | None = None
        self._ended_task: asyncio.Task | None = None

    @classmethod
    async def spawn(cls, model: str, log_level: str = "info", log_format: str = "json") -> WorkerProcess:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            proc = ChildProcess(subprocess.Popen(
                [sys.executable, "-m", "modeld.server.workers.main", "--fd", str(theirs.fileno()),
                 "--model", model, "--log-level", log_level, "--log-format", log_format],
                pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL))
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()  # the child holds its own copy; ours must go so EOF means it died
        worker = cls(model, proc)
        await connect(worker._out, ours)
        log.info("worker_started", model=model, pid=proc.pid)
        return worker

    @property
    def is_alive(self) -> bool:
        return self.death is None

    # -- requests ------------------------------------------------------------------

    async def _raise_death(self):
        """The channel is closed: wait for the exit status, raise why."""
        if self._ended_task is None:
            self._lost(None)
        await asyncio.shield(self._ended_task)
        raise self.death

    async def call(self, op: str, *args, urgent: bool = False):
        if self.death is not None or self._out.closed:
            await self._raise_death()
        rid = next(self._ids)
        future = asyncio.get_running_loop().create_future()
        self._calls[rid] = future
        try:
            message = (op, rid, *args)
            self._out.send_now(message) if urgent else self._out.send(message)
            return await future
        finally:
            self._calls.pop(rid, None)

    def stream(self, request: GenerateRequest, adapter: str = "") -> _WorkerStream:
        """A generation in the worker, on its base or (`adapter`) a LoRA
        adapter resident there: its events, as an async iterator. Nothing
        is sent before the first read; leaving it (aclose, an error or a
        cancel while waiting, or dropping it) cancels the sequence there."""
        return _WorkerStream(self, request, adapter)

    # -- the reader ------------------------------------------------------------------

    def _lost(self, exc: BaseException | None) -> None:
        """The socket closed: the worker exited, was killed, or broke the stream."""
        if exc is not None:
            log.warning("worker_channel_lost", model=self.model, pid=self.pid, reason=str(exc))
        if self._ended_task is None:
            self._ended_task = asyncio.get_running_loop().create_task(self._ended())

    def _dispatch(self, message: tuple) -> None:
        kind = message[0]
        if kind == TOKEN:  # first: nearly every message of a generation
            queue = self._streams.get(message[1])
            if queue is not None:
                queue.put_nowait(token_event(message))
        elif kind == "ok":
            self._settle(message[1], result=message[2])
        elif kind == "error":
            error = _remote_error(*message[2:5])
            if message[1] in self._streams:
                self._streams[message[1]].put_nowait(error)
            else:
                self._settle(message[1], error=error)
        elif kind == "event":
            queue = self._streams.get(message[1])
            if queue is not None:
                queue.put_nowait(message[2])
        elif kind == "obs" and self.on_observe is not None:
            try:
                self.on_observe(message[1], message[2])
            except Exception:  # noqa: BLE001 - statistics must never stop the channel
                log.exception("worker_observer_failed", model=self.model)

    def _settle(self, rid: int, result=None, error: BaseException | None = None) -> None:
        future = self._calls.get(rid)
        if future is None or future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    async def _ended(self) -> None:
        if self._out.transport is not None:
            self._out.transport.abort()
        try:
            returncode = await asyncio.wait_for(self.proc.wait(), 5.0)
        except TimeoutError:  # its socket broke but it lives on: it is of no use
            self.proc.kill()
            returncode = await self.proc.wait()
        how = describe_exit(returncode)
        if self.exiting:
            self.death = Unavailable(f"the worker for model {self.model!r} was stopped; retry and it is loaded again")
        else:
            self.death = Unavailable(f"worker for model {self.model!r} (pid {self.pid}) died: {how}; "
                                     "its calls in flight failed, and the next request loads it again")
            log.error("worker_died", model=self.model, pid=self.pid, exit=how,
                      uptime_s=round(time.monotonic() - self.started, 3),
                      calls_in_flight=len(self._calls) + len(self._streams))
        for future in self._calls.values():
            if not future.done():
                future.set_exception(self.death)
        for inbox in self._streams.values():
            inbox.put_nowait(self.death)
        if not self.exiting and self.on_death is not None:
            self.on_death(how)

    # -- ending ----------------------------------------------------------------------

    async def shutdown(self, timeout_s: float = 30.0) -> None:
        """Ask the worker to unload and exit; kill it if it does not in time."""
        if self.death is None:
            self.exiting = True
            try:
                await asyncio.wait_for(self.call("exit"), timeout_s)
            except (ModeldError, TimeoutError) as exc:
                log.warning("worker_exit_failed", model=self.model, pid=self.pid, reason=str(exc))
        await self.kill()

    async def kill(self) -> None:
        self.exiting = self.exiting or self.death is None
        if self.proc.returncode is None:
            try:
                await asyncio.wait_for(asyncio.shield(self.proc.wait()), 5.0)
            except TimeoutError:
                self.proc.kill()
        await self.proc.wait()
        if self._ended_task is None:  # its socket may not have reported the end yet
            self._lost(None)
        await asyncio.gather(self._ended_task, return_exceptions=True)


class _Inbox:
    """What the channel's reader hands one generation (put_nowait, on the
    event loop) until its stream reads it: lighter than an asyncio.Queue,
    whose get is one more coroutine for every token. The worker's table
    holds this, not the stream, so a stream its caller dropped is collected
    (and cancels its sequence)."""

    __slots__ = ("items", "waiter")

    def __init__(self) -> None:
        self.items: collections.deque = collections.deque()
        self.waiter: asyncio.Future | None = None

    def put_nowait(self, item: TokenEvent | FinalEvent | BaseException) -> None:
        self.items.append(item)
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


class _WorkerStream:
    """One generation's events from the worker: an async iterator object
    rather than an async generator, whose every layer is resumed again for
    each token, and this one sits under every token a worker streams."""

    __slots__ = ("_worker", "_request", "_adapter", "_rid", "_inbox", "_state", "_loop")

    _NEW, _OPEN, _DONE = 0, 1, 2

    def __init__(self, worker: WorkerProcess, request: GenerateRequest, adapter: str) -> None:
        self._worker, self._request, self._adapter = worker, request, adapter
        self._rid = 0
        self._inbox = _Inbox()
        self._state = self._NEW
        self._loop: asyncio.AbstractEventLoop | None = None

    def __del__(self) -> None:
        # dropped while open: cancel the sequence from the loop, as asyncio
        # finalizes an async generator left suspended
        if self._state == self._OPEN and self._loop is not None and not self._loop.is_closed():
            try:
                self._loop.call_soon_threadsafe(_end_stream, self._worker, self._rid, False)
            except RuntimeError:  # the loop closed meanwhile
                pass

    def __aiter__(self) -> _WorkerStream:
        return self

    async def __anext__(self) -> TokenEvent | FinalEvent:
        if self._state != self._OPEN:
            if self._state == self._DONE:
                raise StopAsyncIteration
            await self._open()
        inbox = self._inbox
        items = inbox.items
        while not items:
            inbox.waiter = waiter = self._loop.create_future()
            try:
                await waiter
            except BaseException:  # cancelled while waiting: the sequence ends in the worker too
                self._end(False)
                raise
            finally:
                inbox.waiter = None
        item = items.popleft()
        if isinstance(item, BaseException):
            self._end(True)
            raise item
        if isinstance(item, FinalEvent):
            self._end(True)
        return item

    async def aclose(self) -> None:
        if self._state == self._NEW:
            self._state = self._DONE
        self._end(False)

    async def _open(self) -> None:
        worker = self._worker
        if worker.death is not None or worker._out.closed:
            self._state = self._DONE
            await worker._raise_death()
        self._rid = rid = next(worker._ids)
        worker._streams[rid] = self._inbox
        self._loop = asyncio.get_running_loop()
        self._state = self._OPEN
        request, self._request = self._request, None  # held no longer than needed
        try:
            worker._out.send(("generate", rid, request, self._adapter) if self._adapter else ("generate", rid, request))
        except BaseException:
            self._end(False)
            raise

    def _end(self, finished: bool) -> None:
        if self._state == self._OPEN:
            self._state = self._DONE
            _end_stream(self._worker, self._rid, finished)


def _end_stream(worker: WorkerProcess, rid: int, finished: bool) -> None:
    """A stream's end: off the worker's table, and cancelled there unless it finished."""
    worker._streams.pop(rid, None)
    if not finished and worker.death is None:
        try:
            worker._out.send(("cancel", rid))  # the caller left: free the sequence in the worker
        except ConnectionError:
            pass


class _WorkerModelMixin:
    """What both stand-ins share: the worker, measured memory, ending."""

    worker: WorkerProcess
    backend_nbytes: int

    def _init_worker(self, worker: WorkerProcess, info: dict) -> None:
        self.worker = worker
        self.inputs, self.outputs = info["inputs"], info["outputs"]
        self.backend_nbytes = info["nbytes"]
        self.nbytes = self.measure()

    @property
    def pid(self) -> int:
        return self.worker.pid

    def measure(self) -> int:
        """The worker's resident memory, and never less than the backend's own
        figure: mapped weights become resident on first use, and the budget
        must hold for when they are. Less what its LoRA adapters hold: each
        has a budget entry of its own, of its measured bytes."""
        return max(process_rss(self.worker.pid) - self.adapter_bytes(), self.backend_nbytes)

    def adapter_bytes(self) -> int:
        return 0

    def watch_memory(self, on_change: Callable[[int], None], interval_s: float) -> None:
        """Re-measure every `interval_s` while the worker lives; report changes
        of more than 1% (a KV cache filling, mapped weights paged in)."""
        async def watch() -> None:
            while self.worker.is_alive:
                await asyncio.sleep(interval_s)
                nbytes = self.measure() if self.worker.is_alive else 0
                if nbytes and abs(nbytes - self.nbytes) > self.nbytes // 100:
                    self.nbytes = nbytes
                    on_change(nbytes)

        self._watch = asyncio.get_running_loop().create_task(watch())

    def unload(self) -> None:
        raise RuntimeError("a worker model is unloaded with unload_async on the event loop")

    async def unload_async(self) -> None:
        watch = getattr(self, "_watch", None)
        if watch is not None:
            watch.cancel()
        await self.worker.shutdown()


class WorkerTensorModel(_WorkerModelMixin, LoadedModel):
    def __init__(self, worker: WorkerProcess, info: dict) -> None:
        self._init_worker(worker, info)

    def execute(self, inputs, output_names):
        raise RuntimeError("a worker model runs batches with execute_async on the event loop")

    async def execute_async(self, inputs, output_names):
        return await self.worker.call("execute", inputs, output_names, urgent=True)


class WorkerGenerativeModel(_WorkerModelMixin, GenerativeModel):
    def __init__(self, worker: WorkerProcess, info: dict) -> None:
        self.adapters: dict[str, WorkerAdapterModel] = {}  # LoRA adapters resident in the worker, by name
        self._init_worker(worker, info)
        self.loop = self.runner = None  # both live in the worker: the methods below ask it
        self.observer = None  # where the worker loop's figures go (the engine's metrics)
        worker.on_observe = self._observe
        # the worker's prefix cache, as its last kv_delta answer left it (kv_cache.py)
        self.kv_mirror = KvMirror(lambda since: self.worker.call("kv_delta", since))

    def _observe(self, method: str, args: tuple) -> None:
        if self.observer is not None:
            getattr(self.observer, method)(*args)

    def set_observer(self, observer) -> None:
        self.observer = observer

    async def start(self) -> None:
        await self.worker.call("start")

    async def stop(self) -> None:
        if self.worker.is_alive:
            try:
                await self.worker.call("stop")
            except Unavailable:
                pass  # it died meanwhile: nothing left to stop

    def generate(self, request: GenerateRequest):
        return self.worker.stream(request)

    def tokenize(self, text: str):
        return self.worker.call("tokenize", text)

    def detokenize(self, token_ids: list[int]):
        return self.worker.call("detokenize", list(token_ids))

    def prompt_ids(self, request: GenerateRequest):
        """The prompt's token ids as the worker's loop makes them (chat template included)."""
        return self.worker.call("prompt_ids", request)

    # -- the prefix cache, for gateways (server/services/kv_events.py) ---------------

    def kv_cache_state(self) -> KvCacheState | None:
        """The worker's prefix cache as last heard; None before the first
        answer or for a model without one."""
        return self.kv_mirror.read() if self.worker.is_alive else None

    async def prompt_blocks(self, request: GenerateRequest, salt: bytes = b"") -> PromptHashes | None:
        return await self.worker.call("prompt_blocks", request, salt)

    async def unload_async(self) -> None:
        self.kv_mirror.close()
        await super().unload_async()

    # -- LoRA adapters ---------------------------------------------------------------

    def adapter_bytes(self) -> int:
        return sum(a.nbytes for a in self.adapters.values())

    async def load_adapter_async(self, config, model_dir: Path) -> WorkerAdapterModel:
        """Make a LoRA adapter resident on this base in its worker (the
        backend's own load_adapter there); InvalidArgument and the rest as
        in-process, naming the adapter."""
        info = await self.worker.call("load_adapter", config, str(model_dir))
        adapter = WorkerAdapterModel(self, config.name, info)
        self.adapters[config.name] = adapter
        return adapter


class WorkerAdapterModel(GenerativeModel):
    """A LoRA adapter resident on a base in a worker process: its requests
    run there, on the base's generation loop, in the same steps as the
    base's and the other adapters' sequences. Its bytes are its matrices as
    the worker measured them at load (the base's figure leaves them out);
    it dies with the base's worker, and the engine drops it with its base."""

    def __init__(self, base: WorkerGenerativeModel, name: str, info: dict) -> None:
        self.base, self.name = base, name
        self.worker = base.worker  # in the base's process: the daemon's own memory holds none of it
        self.nbytes = info["nbytes"]
        self.adapter_id = info["adapter_id"]
        self.kv_salt = info["kv_salt"]
        self.inputs, self.outputs = base.inputs, base.outputs
        self.loop = self.runner = None
        self.num_in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._stopping = False

    def set_observer(self, observer) -> None:
        """The base's loop reports the steps, adapters' sequences included."""

    def watch_memory(self, on_change: Callable[[int], None], interval_s: float) -> None:
        """Nothing to follow: its matrices do not grow."""

    async def start(self) -> None:
        self._stopping = False

    async def stop(self) -> None:
        """Take no new requests and wait for this adapter's to finish."""
        self._stopping = True
        await self._idle.wait()

    async def generate(self, request: GenerateRequest):
        if self._stopping:
            raise Unavailable("the adapter is being unloaded; retry")
        self.num_in_flight += 1
        self._idle.clear()
        try:
            async with contextlib.aclosing(self.worker.stream(request, adapter=self.name)) as events:
                async for event in events:
                    yield event
        finally:
            self.num_in_flight -= 1
            if not self.num_in_flight:
                self._idle.set()

    def tokenize(self, text: str):
        return self.base.tokenize(text)

    def detokenize(self, token_ids: list[int]):
        return self.base.detokenize(token_ids)

    def prompt_ids(self, request: GenerateRequest):
        return self.base.prompt_ids(request)

    def kv_cache_state(self) -> KvCacheState | None:
        """The base's cache (its blocks of this adapter hash under kv_salt)."""
        return self.base.kv_cache_state()

    async def prompt_blocks(self, request: GenerateRequest, salt: bytes = b"") -> PromptHashes | None:
        return await self.base.prompt_blocks(request, salt or self.kv_salt)

    def unload(self) -> None:
        raise RuntimeError("a worker adapter is unloaded with unload_async on the event loop")

    async def unload_async(self) -> None:
        """Drop its matrices in the worker; nothing to do once the worker is
        gone (they went with it)."""
        self.base.adapters.pop(self.name, None)
        if not self.worker.is_alive:
            return
        try:
            await self.worker.call("unload_adapter", self.name)
        except Unavailable:
            pass  # it died meanwhile, taking the adapter with it


async def load_in_worker(backend_name: str, config, model_dir: Path, timeout_s: float,
                         log_level: str = "info", log_format: str = "json") -> WorkerTensorModel | WorkerGenerativeModel:
    """Start a worker for `config.name` and load the model in it.

    LoadFailed when the backend refuses the model, the worker dies while
    loading, or the load takes longer than `timeout_s` (the worker is killed).
    """
    worker = await WorkerProcess.spawn(config.name, log_level, log_format)
    try:
        info = await asyncio.wait_for(worker.call("load", backend_name, config, str(model_dir)), timeout_s)
    except TimeoutError:
        worker.exiting = True
        worker.proc.kill()
        await worker.kill()
        raise LoadFailed(f"the worker for model {config.name!r} (pid {worker.pid}) did not finish loading within "
                         f"{timeout_s:g} s and was killed; raise worker_load_timeout_s if the model is that slow "
                         "to load") from None
    except Unavailable as exc:  # it died while loading
        raise WorkerCrashedOnLoad(f"worker for model {config.name!r} (pid {worker.pid}) died while loading: "
                         f"{describe_exit(worker.proc.returncode)}") from exc
    except BaseException:
        await worker.shutdown(5.0)
        raise
    model_cls = WorkerGenerativeModel if info["generative"] else WorkerTensorModel
    return model_cls(worker, info)
