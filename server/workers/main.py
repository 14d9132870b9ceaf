"""The worker process: `python -m modeld.server.workers.main --fd N --model NAME`.

Loads one model with its backend's own `load` (the same code an in-process
model runs) and serves the daemon's requests over the inherited socket until
told to exit or the daemon goes away. Tensor batches run inline on the
channel's reader thread, one at a time (the daemon's batcher sends one at a
time), with no event-loop hop on the way in or out; generation runs in the
backend's own loop and streams its events back, and a cancel from the
daemon closes the stream, which frees the sequence at the next step.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import os
import signal
import socket
import sys
import threading
from pathlib import Path

import structlog

from modeld.backends.base import GenerativeModel
from modeld.backends.errors import BackendFailure, FailedPrecondition, LoadFailed, ModeldError, Unavailable
from modeld.backends.generation.step_sink import STEP_SINK
from modeld.server.workers.frames import BATCH, ThreadChannel, token_message
from modeld.server.workers.kv_cache import KvDeltaSource, model_cache, prompt_hashes

log = structlog.get_logger("modeld.worker")

def error_reply(rid: int, exc: BaseException) -> tuple:
    if isinstance(exc, ModeldError):
        return ("error", rid, type(exc).__name__, exc.kind.value, str(exc))
    # a bug in a backend: in-process it would answer INTERNAL too
    return ("error", rid, "Exception", "INTERNAL", f"{type(exc).__name__}: {exc}")


class _ForwardingObserver:
    """The generation loop's figures, sent to the observer the daemon set on
    the stand-in (its GenerationMetrics), from the event loop."""

    def __init__(self, out: ThreadChannel) -> None:
        self.out = out

    def _add(self, message: tuple) -> None:
        self.out.send(message)

    def on_step(self, num_running: int, num_waiting: int, kv_used: int, kv_capacity: int) -> None:
        self._add(("obs", "on_step", (num_running, num_waiting, kv_used, kv_capacity)))

    def on_tokens(self, count: int, first_token_s, inter_token_s) -> None:
        self._add(("obs", "on_tokens", (count, first_token_s, inter_token_s)))

    def on_finish(self, usage, reason) -> None:
        self._add(("obs", "on_finish", (usage, reason)))


class _StepThreadSender(_ForwardingObserver):
    """A model's events and figures sent to the daemon from its generation
    loop's step thread (a step sink and the loop's observer, step_sink.py):
    a step's messages for every stream go out as one frame, written by that
    thread, with no hop through this process's event loop (a wake-up, a
    task and an async-generator hop per stream per step)."""

    on_step_thread = True

    def __init__(self, out: ThreadChannel) -> None:
        super().__init__(out)
        self._pending: list[tuple] = []
        # this step's on_tokens figures, one per stream: one message at the
        # flush (GenerationMetrics.on_tokens_many), not one each
        self._token_figures: list[tuple] = []
        self._lock = threading.Lock()  # the step thread, and the event loop when a failing loop abandons all

    def _add(self, message: tuple) -> None:
        with self._lock:
            self._pending.append(message)

    def event(self, rid: int, event) -> None:
        self._add(token_message(rid, event))

    def on_tokens(self, count: int, first_token_s, inter_token_s) -> None:
        with self._lock:
            self._token_figures.append((count, first_token_s, inter_token_s))

    def flush(self) -> None:
        with self._lock:
            messages, self._pending = self._pending, []
            if self._token_figures:
                messages.append(("obs", "on_tokens_many", (tuple(self._token_figures),)))
                self._token_figures = []
            if not messages:
                return
            try:  # under the lock: two threads' flushes keep their order
                self.out.send_now(messages[0] if len(messages) == 1 else (BATCH, tuple(messages)))
            except ConnectionResetError:
                pass  # the daemon is gone; the channel's reader reports it


class Worker:
    def __init__(self, model: str, sock: socket.socket) -> None:
        self.model = model
        self.out = ThreadChannel(sock, asyncio.get_running_loop(), self.inline, self.dispatch, self.channel_lost)
        self.loaded = None
        self.adapters: dict[str, object] = {}  # LoRA adapters resident on the loaded base, by name
        self.kv_source = KvDeltaSource()  # what the daemon was last told of the prefix cache
        self._model_lock = threading.Lock()  # a batch never runs while the model unloads
        self.streams: dict[int, asyncio.Task] = {}
        self.sender = _StepThreadSender(self.out)
        self.done = asyncio.Event()

    def channel_lost(self, exc: BaseException | None) -> None:
        if not self.done.is_set():
            log.info("worker_daemon_gone", model=self.model, reason=str(exc or "end of stream"))
            self.done.set()  # the daemon exited or closed the channel: nothing left to serve

    def inline(self, message: tuple) -> bool:
        """On the channel's reader thread: run a tensor batch there and answer
        at once (the daemon sends one batch at a time; a hop to the event
        loop would only add latency). False: the loop takes the message."""
        if message[0] != "execute":
            return False
        rid = message[1]
        try:
            with self._model_lock:
                reply = ("ok", rid, self.loaded.execute(message[2], message[3]))
        except Exception as exc:  # noqa: BLE001 - sent back as its status
            reply = error_reply(rid, exc)
        try:
            self.out.send_now(reply)
        except ConnectionResetError:
            pass  # the daemon is gone; the reader reports it
        except Exception as exc:  # noqa: BLE001 - outputs that cannot be sent: their status instead
            self.out.send_now(error_reply(rid, exc))
        return True

    def dispatch(self, message: tuple) -> None:
        op, rid = message[0], message[1]
        if op == "generate":
            adapter = message[3] if len(message) > 3 else ""
            self.streams[rid] = asyncio.get_running_loop().create_task(self.generate(rid, message[2], adapter))
        elif op == "cancel":
            task = self.streams.pop(rid, None)
            if task is not None:
                task.cancel()
        else:
            asyncio.get_running_loop().create_task(self.call(op, rid, message[2:]))

    async def call(self, op: str, rid: int, args: tuple) -> None:
        try:
            value = await getattr(self, f"op_{op}")(*args)
            reply = ("ok", rid, value)
        except Exception as exc:  # noqa: BLE001 - sent back as its status
            log.warning("worker_call_failed", model=self.model, op=op, reason=str(exc))
            reply = error_reply(rid, exc)
        if op == "exit":
            self.done.set()  # before the close: its end of stream is expected, not news
            self.out.send_now(reply)
            await self.out.close()
            return
        self.out.send(reply)

    async def generate(self, rid: int, request, adapter: str = "") -> None:
        # the shared generation loop sends this stream's events from its step
        # thread (self.sender); other loops yield them here
        STEP_SINK.set((self.sender, rid))  # this task's own context
        try:
            async with contextlib.aclosing(self._model_for(adapter).generate(request)) as events:
                async for event in events:
                    self.out.send(token_message(rid, event))
        except asyncio.CancelledError:
            pass  # the daemon's caller left; leaving the stream freed the sequence
        except Exception as exc:  # noqa: BLE001 - sent back as its status
            self.out.send(error_reply(rid, exc))
        finally:
            self.streams.pop(rid, None)

    def _model_for(self, adapter: str):
        """The base, or the resident adapter a request names."""
        if not adapter:
            return self.loaded
        model = self.adapters.get(adapter)
        if model is None:  # unloaded here meanwhile: the daemon loads it again on the next request
            raise Unavailable(f"adapter {adapter!r} is not loaded in the worker of its base {self.model!r}; retry")
        return model

    # -- operations --------------------------------------------------------------

    async def op_load(self, backend_name: str, config, model_dir: str) -> dict:
        from modeld.backends.registry import BackendRegistry
        from modeld.server.load_priority import run_lowered

        backend = BackendRegistry([backend_name]).get(backend_name)
        try:
            # at a lower priority: a load (llama.cpp's, torch.compile's) must not starve serving
            self.loaded = await asyncio.to_thread(run_lowered, backend.load, config, Path(model_dir))
        except ModeldError:
            raise
        except Exception as exc:  # a backend's unexpected fault is still a failed load
            raise LoadFailed(f"{type(exc).__name__}: {exc}") from exc
        generative = isinstance(self.loaded, GenerativeModel)
        if generative:
            takes_sinks = getattr(getattr(self.loaded, "loop", None), "takes_step_sinks", False)
            self.loaded.set_observer(self.sender if takes_sinks else _ForwardingObserver(self.out))
        log.info("worker_model_loaded", model=self.model, backend=backend_name, nbytes=self.loaded.nbytes)
        return {"nbytes": self.loaded.nbytes, "inputs": self.loaded.inputs, "outputs": self.loaded.outputs,
                "generative": generative}

    async def op_load_adapter(self, config, model_dir: str) -> dict:
        """Make a LoRA adapter resident on the loaded base (its matrices only),
        as an in-process base does; its requests then name it on `generate`."""
        load = getattr(self.loaded, "load_adapter", None)
        if load is None:
            raise FailedPrecondition(f"adapter {config.name!r}: the backend of {self.model!r} applies no adapters")
        adapter = await asyncio.to_thread(load, config, Path(model_dir))
        await adapter.start()
        self.adapters[config.name] = adapter
        log.info("worker_adapter_loaded", model=self.model, adapter=config.name, nbytes=adapter.nbytes)
        return {"nbytes": adapter.nbytes, "adapter_id": getattr(adapter, "adapter_id", 0),
                "kv_salt": getattr(adapter, "kv_salt", b"")}

    async def op_unload_adapter(self, name: str) -> None:
        """Let the adapter's sequences finish, then drop its matrices."""
        adapter = self.adapters.pop(name, None)
        if adapter is None:
            return
        await adapter.stop()
        await asyncio.to_thread(adapter.unload)
        log.info("worker_adapter_unloaded", model=self.model, adapter=name)

    async def op_kv_delta(self, since: int):
        """The prefix cache's change since the answer numbered `since`
        (kv_cache.KvDeltaSource); False for a model without a readable cache."""
        cache, _ = model_cache(self.loaded)
        if cache is None:
            return False
        return self.kv_source.delta(cache, since)

    async def op_prompt_blocks(self, request, salt: bytes):
        """A prompt's block hashes under this model's cache (kv_cache.prompt_hashes)."""
        return prompt_hashes(self.loaded, request, salt)

    async def op_start(self) -> None:
        await self.loaded.start()

    async def op_stop(self) -> None:
        await self.loaded.stop()

    async def op_tokenize(self, text: str) -> list[int]:
        return self.loaded.tokenize(text)

    async def op_detokenize(self, token_ids: list[int]) -> str:
        return self.loaded.detokenize(token_ids)

    async def op_prompt_ids(self, request) -> list[int]:
        return self.loaded.prompt_ids(request)

    async def op_exit(self) -> None:
        """Unload and end: the process's memory goes back with it."""
        for task in list(self.streams.values()):
            task.cancel()
        if self.loaded is not None:
            try:
                await asyncio.to_thread(self._unload)
            except Exception as exc:  # noqa: BLE001 - the process ends anyway
                raise BackendFailure(f"unload failed: {exc}") from exc

    def _unload(self) -> None:
        with self._model_lock:
            self.loaded.unload()


def _die_with_parent() -> None:
    """SIGKILL this worker if the daemon dies, even while a load hangs."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: the end of the socket still ends an idle worker
    if os.getppid() == 1:
        os._exit(1)  # the daemon died before prctl took effect


async def _amain(fd: int, model: str) -> None:
    worker = Worker(model, socket.socket(fileno=fd))
    worker.out.start()
    await worker.done.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="modeld-worker")
    parser.add_argument("--fd", type=int, required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--log-level", default="info")
    parser.add_argument("--log-format", default="json")
    args = parser.parse_args(argv)
    _die_with_parent()
    import setproctitle

    # `ps` and /proc/<pid>/cmdline say which model a worker serves
    setproctitle.setproctitle(f"modeld-worker {args.model}")
    from modeld.server.logging import configure_logging

    configure_logging(args.log_level, args.log_format)
    structlog.contextvars.bind_contextvars(worker_pid=os.getpid())
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a ^C to the daemon's group: the daemon decides
    from modeld.server.event_loop import run

    run(_amain(args.fd, args.model))  # uvloop where installed, as the daemon
    # os._exit: skip interpreter teardown (native runtimes' atexit handlers
    # can take seconds); the model is already unloaded
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
