"""The worker channel's frame codec and the restart backoff, without processes."""

from __future__ import annotations

import asyncio
import socket

import numpy as np
import pytest

from modeld.backends.errors import InvalidArgument, LoadFailed
from modeld.backends.generation.params import FinalEvent, FinishReason, TokenEvent, Usage
from modeld.server.workers.backoff import RestartBackoff
from modeld.server.workers.frames import FrameError, FrameProtocol, connect, decode_bytes, encode, encode_bytes
from modeld.server.workers.main import error_reply
from modeld.server.workers.stand_in import _remote_error, describe_exit
from polling import wait_until_async


def test_arrays_travel_out_of_band_and_come_back_writable():
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    text = np.array([b"a", b"bc"], dtype=object)
    parts = encode(("execute", 7, {"x": x, "text": text}, ("y",)))
    # header, pickle, then the array's own memory: not copied into the pickle
    assert len(parts) == 3 and parts[2].nbytes == x.nbytes
    message, used = decode_bytes(encode_bytes(("execute", 7, {"x": x, "text": text}, ("y",))))
    assert used == sum(memoryview(p).nbytes for p in parts)
    op, rid, inputs, names = message
    np.testing.assert_array_equal(inputs["x"], x)
    assert inputs["x"].flags.writeable and inputs["text"].tolist() == [b"a", b"bc"] and names == ("y",)


def test_non_contiguous_and_empty_arrays_round_trip():
    x = np.arange(20, dtype=np.int64).reshape(4, 5)[:, ::2]
    empty = np.zeros((0, 384), np.float32)
    message, _ = decode_bytes(encode_bytes({"x": x, "empty": empty}))
    np.testing.assert_array_equal(message["x"], x)
    assert message["empty"].shape == (0, 384)


async def _pair(received: list, lost: list):
    ours, theirs = socket.socketpair()
    a = await connect(FrameProtocol(lambda m: None, lambda e: None), ours)
    b = await connect(FrameProtocol(received.append, lost.append), theirs)
    return a, b


async def test_frames_split_across_reads_and_coalesced_in_one_write():
    received, lost = [], []
    a, b = await _pair(received, lost)
    big = np.random.default_rng(0).random((512, 1024))  # 4 MiB: many reads
    events = [TokenEvent((i,), str(i)) for i in range(5)]
    for event in events:
        a.send(("event", 1, event))  # one write for the turn
    a.send_now(("ok", 2, {"y": big}))
    a.send(("event", 1, FinalEvent(FinishReason.STOP, Usage(completion_tokens=5))))
    await wait_until_async(lambda: len(received) == 7, what="all seven messages")
    assert [m[2] for m in received[:5]] == events
    np.testing.assert_array_equal(received[5][2]["y"], big)
    assert received[6][2].usage.completion_tokens == 5
    await a.close()
    await asyncio.wait_for(b.lost, 30)
    assert lost == [None]


async def test_a_corrupt_header_ends_the_channel_with_a_reason():
    received, lost = [], []
    ours, theirs = socket.socketpair()
    b = await connect(FrameProtocol(received.append, lost.append), theirs)
    ours.sendall(b"\xff\xff\xff\xff\x01\x00\x00\x00")
    await asyncio.wait_for(b.lost, 30)
    assert received == [] and isinstance(lost[0], FrameError)
    ours.close()


def test_errors_keep_their_kind_across_the_channel():
    _, _, name, kind, message = error_reply(3, InvalidArgument("input 'text' is not UTF-8"))
    error = _remote_error(name, kind, message)
    assert isinstance(error, InvalidArgument) and str(error) == "input 'text' is not UTF-8"
    assert isinstance(_remote_error(*error_reply(3, LoadFailed("bad file"))[2:]), LoadFailed)
    bug = _remote_error(*error_reply(3, KeyError("x"))[2:])
    assert bug.kind.value == "INTERNAL" and "KeyError" in str(bug)


def test_exit_descriptions_name_the_signal():
    assert describe_exit(-11) == "signal SIGSEGV"
    assert describe_exit(-9) == "signal SIGKILL"
    assert describe_exit(3) == "exit code 3"


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_backoff_doubles_while_workers_die_young_and_is_capped():
    clock = _Clock()
    backoff = RestartBackoff(initial_s=1.0, max_s=8.0, clock=clock)
    assert backoff.retry_in("m") == 0
    waits = [backoff.record_death("m", uptime_s=0.5, reason="signal SIGABRT") for _ in range(6)]
    assert waits == [1, 2, 4, 8, 8, 8]
    assert backoff.retry_in("m") == 8 and backoff.deaths("m") == 6 and backoff.last_reason("m") == "signal SIGABRT"
    clock.now += 3
    assert backoff.retry_in("m") == pytest.approx(5)
    clock.now += 5
    assert backoff.retry_in("m") == 0
    assert backoff.retry_in("other") == 0  # per model


def test_a_worker_that_lived_long_starts_the_count_afresh():
    backoff = RestartBackoff(initial_s=1.0, max_s=8.0, clock=_Clock())
    for _ in range(3):
        backoff.record_death("m", uptime_s=1, reason="x")
    assert backoff.record_death("m", uptime_s=60, reason="x") == 1
    backoff.forget("m")
    assert backoff.deaths("m") == 0 and backoff.retry_in("m") == 0



def test_isolation_is_checked_like_every_model_key():
    from modeld.backends.errors import InvalidArgument as Invalid
    from modeld.backends.model_config import config_from_dict, config_from_json

    assert config_from_dict("m", {"isolation": "process"}).isolation == "process"
    assert config_from_dict("m", {}).isolation is None  # the daemon's default applies
    assert config_from_json("m", '{"isolation": "in-process"}').isolation == "in-process"
    with pytest.raises(Invalid, match="config key isolation must be one of process, in-process, got 'thread'"):
        config_from_dict("m", {"isolation": "thread"})


def test_the_daemon_default_and_its_refusal():
    from modeld.server.config import ConfigError, load_settings

    settings = load_settings({"model_repository": "", "memory_budget": "1GiB"}, environ={})
    assert settings.isolation == "auto" and settings.worker_policy().default_isolation == "auto"
    with pytest.raises(ConfigError, match="isolation 'thread' must be auto, process or in-process"):
        load_settings({"model_repository": "", "memory_budget": "1GiB", "isolation": "thread"}, environ={})
    backoff = load_settings({"model_repository": "", "memory_budget": "1GiB"},
                            environ={"MODELD_WORKER_RESTART_BACKOFF_S": "0.5"})
    assert backoff.worker_policy().restart_backoff_s == 0.5


def test_auto_puts_native_llm_runtimes_in_a_worker():
    from modeld.backends.model_config import config_from_dict
    from modeld.backends.registry import BACKENDS
    from modeld.server.metrics import Metrics
    from modeld.server.workers.supervisor import WorkerPolicy, WorkerSupervisor

    class Named:
        def __init__(self, name):
            self.name = name

    auto = WorkerSupervisor(WorkerPolicy("auto"), Metrics())
    plain = config_from_dict("m", {})
    assert {b for b in BACKENDS if auto.isolates(Named(b), plain)} == {"llamacpp", "torch", "onnx-genai"}
    # the model's own key wins; a remote engine never gets a worker
    assert auto.isolates(Named("onnx"), config_from_dict("m", {"isolation": "process"}))
    assert not auto.isolates(Named("llamacpp"), config_from_dict("m", {"isolation": "in-process"}))
    assert not auto.isolates(Named("vllm"), config_from_dict("m", {"isolation": "process"}))
    assert not WorkerSupervisor(WorkerPolicy("in-process"), Metrics()).isolates(Named("torch"), plain)


async def test_thread_channel_answers_inline_and_hands_the_rest_to_the_loop():
    from modeld.server.workers.frames import ThreadChannel

    ours, theirs = socket.socketpair()
    received, lost, loop_msgs = [], [], []
    daemon_end = await connect(FrameProtocol(received.append, lost.append), ours)
    channel = None

    def inline(message) -> bool:
        if message[0] != "execute":
            return False
        channel.send_now(("ok", message[1], {"y": message[2]["x"] * 2}))
        return True

    channel = ThreadChannel(theirs, asyncio.get_running_loop(), inline, loop_msgs.append, lost.append)
    channel.start()
    x = np.arange(6, dtype=np.int64).reshape(2, 3)
    daemon_end.send_now(("execute", 1, {"x": x}, ("y",)))
    daemon_end.send_now(("generate", 2, "prompt"))
    await wait_until_async(lambda: received and loop_msgs, what="both requests to arrive")
    np.testing.assert_array_equal(received[0][2]["y"], x * 2)
    assert loop_msgs == [("generate", 2, "prompt")]
    channel.send(("event", 2, "token"))  # coalesced, flushed on the next turn
    await wait_until_async(lambda: len(received) == 2, what="the coalesced event")
    assert received[1] == ("event", 2, "token")
    await daemon_end.close()  # the daemon goes away: the worker's end reports it
    await wait_until_async(lambda: len(lost) == 2, what="both ends to report the loss")
    assert lost == [None, None]
    await channel.close()


async def test_a_turns_messages_from_the_worker_go_as_one_frame_and_arrive_one_by_one():
    """A generation step's events for every stream travel in one batch frame;
    the daemon's end hands them on singly, in order."""
    from modeld.server.workers.frames import BATCH, ThreadChannel, decode_bytes

    ours, theirs = socket.socketpair()
    received, lost = [], []
    daemon_end = await connect(FrameProtocol(received.append, lost.append), ours)
    channel = ThreadChannel(theirs, asyncio.get_running_loop(), lambda m: False, lambda m: None, lambda e: None)
    writes = []
    write = channel._write
    channel._write = lambda parts: (writes.append(b"".join(bytes(p) for p in parts)), write(parts))
    events = [("event", rid, TokenEvent((rid,), str(rid))) for rid in range(8)] + [("obs", "on_step", (8, 0, 1, 2))]
    for message in events:
        channel.send(message)
    await wait_until_async(lambda: len(received) == len(events), what="every message of the turn")
    assert received == events
    assert len(writes) == 1
    frame, used = decode_bytes(writes[0])
    assert used == len(writes[0]) and frame == (BATCH, tuple(events))
    channel.send(("event", 9, TokenEvent((9,), "9")))  # alone in its turn: a plain frame
    await wait_until_async(lambda: len(received) == len(events) + 1, what="the lone event")
    assert decode_bytes(writes[1])[0] == ("event", 9, TokenEvent((9,), "9"))
    await daemon_end.close()
    await channel.close()


def test_a_plain_token_event_travels_as_a_tuple_and_arrives_as_the_same_event():
    """Nearly every message of a generation: no dataclass in its pickle. The
    stand-in's reader makes the TokenEvent again; an event with logprobs (or
    a final event) travels as itself."""
    from modeld.backends.generation.params import TokenLogprob
    from modeld.server.workers.frames import TOKEN, token_message
    from modeld.server.workers.stand_in import WorkerProcess

    plain = TokenEvent((791, 13), " the")
    message, _ = decode_bytes(encode_bytes(token_message(4, plain)))
    assert message == (TOKEN, 4, (791, 13), " the")
    with_logprobs = TokenEvent((791,), " the", (TokenLogprob(791, -0.25),), ((TokenLogprob(791, -0.25),),))
    final = FinalEvent(FinishReason.LENGTH, Usage(completion_tokens=2))
    assert token_message(4, with_logprobs) == ("event", 4, with_logprobs)
    assert token_message(4, final) == ("event", 4, final)

    stand_in = WorkerProcess.__new__(WorkerProcess)  # its reader's dispatch alone
    stand_in._streams = {4: asyncio.Queue()}
    for sent in (plain, with_logprobs, final):
        stand_in._dispatch(decode_bytes(encode_bytes(token_message(4, sent)))[0])
    stand_in._dispatch(token_message(5, plain))  # a stream that already left: dropped
    got = [stand_in._streams[4].get_nowait() for _ in range(3)]
    assert got == [plain, with_logprobs, final] and type(got[0]) is TokenEvent


def test_a_steps_token_figures_go_to_the_daemon_as_one_message_after_its_events():
    from modeld.server.workers.frames import BATCH, TOKEN
    from modeld.server.workers.main import _StepThreadSender

    class Out:
        def __init__(self):
            self.sent = []

        def send_now(self, message):
            self.sent.append(message)

    out = Out()
    sender = _StepThreadSender(out)
    for rid in (1, 2):
        sender.event(rid, TokenEvent((rid,), str(rid)))
        sender.on_tokens(1, None, 0.04)
    sender.on_step(2, 0, 30, 64)
    sender.flush()
    sender.flush()  # nothing new: nothing sent
    assert out.sent == [(BATCH, ((TOKEN, 1, (1,), "1"), (TOKEN, 2, (2,), "2"), ("obs", "on_step", (2, 0, 30, 64)),
                                 ("obs", "on_tokens_many", (((1, None, 0.04), (1, None, 0.04)),))))]
