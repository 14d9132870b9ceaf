"""bench_llama_server's summary: goals as medians of per-round ratios, and
each server's single stream against batched-bench's one-sequence decode."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
bench = pytest.importorskip("bench_llama_server")


def _side(single: float, fresh: float, warm: float) -> dict:
    cpu = {"front": 0.8, "children": 20.0, "client": 0.5}
    return {"single": {"tok_s": single, "ttft_s": 0.05, "cpu_ms_per_token": cpu},
            "fresh": {"tok_s": fresh, "median_ttft_s": 1.0},
            "warm": {"tok_s": warm, "median_ttft_s": 1.2}}


def _round(single: float, peer_single: float, ceiling1: float, grpc1: float = 90, plain1: float | None = None,
           fresh: float = 100, peer_fresh: float = 100, grpc8: float = 104, plain8: float = 110) -> dict:
    load = {"server_cpu_ms_per_message": 0.8, "client_cpu_ms_per_message": 0.5}
    load8 = {"server_cpu_ms_per_message": 0.2, "client_cpu_ms_per_message": 0.25}
    return {"modeld": _side(single, fresh, 95), "llama-server": _side(peer_single, peer_fresh, 100),
            "ceiling": {1: {"decode_tok_s": ceiling1}, 8: {"decode_tok_s": 110}},
            "ceiling_grpc": {"decode_tok_s": grpc1, "plain_decode_tok_s": plain1 or ceiling1, "load": load},
            "ceiling_grpc8": {"decode_tok_s": grpc8, "plain_decode_tok_s": plain8, "load": load8}}


def test_single_stream_is_set_against_the_one_sequence_ceiling():
    runs = [_round(80, 90, 100), _round(90, 95, 100), _round(88, 99, 110)]
    summary = bench.summarise(runs)
    assert summary["single_over_ceiling"]["modeld"] == pytest.approx(0.8)
    assert summary["single_over_ceiling"]["llama-server"] == pytest.approx(0.9)
    single = summary["goals"]["1 stream vs llama-server"]
    assert single["ratio"] == pytest.approx(80 / 90) and not single["met"]
    assert summary["goals"]["8 streams fresh vs llama-server"]["met"]
    assert not summary["goals"]["8 streams warm vs llama-server"]["met"]
    assert summary["goals"]["8 streams vs llama-batched-bench decode"]["ratio"] == pytest.approx(100 / 110)


def test_single_stream_is_set_against_the_decode_beside_a_grpc_stream():
    # the plain decode beside it is timed in the same turn, apart from the 1,8 run
    runs = [_round(80, 90, 100, grpc1=81, plain1=90), _round(90, 95, 100, grpc1=95, plain1=100),
            _round(88, 99, 110, grpc1=88, plain1=110)]
    summary = bench.summarise(runs)
    assert summary["grpc_ceiling_over_ceiling"] == pytest.approx(0.9)  # not 0.81: against plain, not the 1,8 run
    assert summary["single_over_grpc_ceiling"] == pytest.approx(80 / 81)
    assert summary["grpc_stream_cpu_ms_per_message"] == {"server": 0.8, "client": 0.5}


def test_pipeline_floor_streams_are_set_against_both_servers_and_the_ceiling():
    runs = [_round(80, 90, 100), _round(90, 95, 100), _round(88, 99, 110)]
    for run, floor in zip(runs, (85, 100, 99)):
        run["pipeline"] = {"single": _side(floor, 0, 0)["single"], "fresh": _side(0, floor + 10, 0)["fresh"]}
    got = bench.summarise(runs)["pipeline_floor"]
    # 8 fresh streams: 95, 110, 109 tok/s against llama-server's and modeld's 100, against batched-bench's 110
    assert got["streams8"]["tok_s"] == 109
    assert got["streams8"]["over_llama_server"] == pytest.approx(1.09)
    assert got["streams8"]["over_ceiling"] == pytest.approx(109 / 110)
    assert got["streams8"]["modeld_over_it"] == pytest.approx(100 / 109)
    assert got["single_tok_s"] == 99
    assert got["over_llama_server"] == pytest.approx(1.0)  # per round 0.94, 1.05, 1.0
    assert got["over_ceiling"] == pytest.approx(0.9)  # 0.85, 1.0, 0.9
    assert got["modeld_over_it"] == pytest.approx(90 / 100)  # 0.94, 0.9, 0.89
    assert got["cpu_ms_per_token"] == {"front": 0.8, "children": 20.0, "client": 0.5}
    assert "pipeline_floor" not in bench.summarise([_round(80, 90, 100)])  # the gRPC race runs none


def test_eight_streams_are_set_against_the_decode_beside_eight_grpc_streams():
    runs = [_round(80, 90, 100, fresh=90, peer_fresh=100, grpc8=95, plain8=100),
            _round(80, 90, 100, fresh=99, peer_fresh=90, grpc8=99, plain8=110),
            _round(80, 90, 100, fresh=96, peer_fresh=96, grpc8=120, plain8=120)]
    summary = bench.summarise(runs)
    # per-round ratios, then the median: 0.95, 0.9, 1.0
    assert summary["grpc8_ceiling_over_ceiling"] == pytest.approx(0.95)
    # 90/95, 99/99, 96/120
    assert summary["fresh_over_grpc8_ceiling"] == pytest.approx(90 / 95)
    # 95/100, 99/90, 120/96
    assert summary["grpc8_ceiling_over_peer_fresh"] == pytest.approx(1.1)
    assert summary["grpc8_stream_cpu_ms_per_message"] == {"server": 0.2, "client": 0.25}


class _Sse:
    """A loopback server answering /v1/completions with the given SSE lines."""

    def __init__(self, lines: list[bytes]) -> None:
        import http.server
        import threading

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's name
                self.rfile.read(int(self.headers["content-length"]))
                self.send_response(200)
                self.send_header("content-type", "text/event-stream")
                self.end_headers()
                for line in lines:
                    self.wfile.write(line + b"\n\n")

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


def _chunk(text: str, usage: dict | None = None) -> bytes:
    import json

    return b"data: " + json.dumps({"choices": [{"index": 0, "text": text}] if text else [], "usage": usage}).encode()


def test_openai_stream_counts_tokens_from_the_usage_chunk():
    lines = [_chunk(""), _chunk("Hel"), _chunk("lo"), _chunk("", {"completion_tokens": 2}), b"data: [DONE]"]
    with _Sse(lines) as server:
        got = bench.openai_stream(server.url, "Hi", 2)
    assert got["tokens"] == 2
    assert 0 <= got["ttft"] <= got["total_s"] and got["decode_s"] >= 0


def test_openai_stream_refuses_a_stream_shorter_than_asked():
    lines = [_chunk("Hel"), _chunk("", {"completion_tokens": 1}), b"data: [DONE]"]
    with _Sse(lines) as server, pytest.raises(RuntimeError, match="1 tokens streamed, 2 asked for"):
        bench.openai_stream(server.url, "Hi", 2)


def test_threads_repository_changes_only_n_threads_and_links_the_prepared_weights(tmp_path, monkeypatch):
    models = tmp_path / "root/models"
    for name in ("smollm2", "smollm2-draft"):
        (models / name).mkdir(parents=True)
        (models / name / "model.gguf").write_bytes(name.encode())
    (models / "smollm2/model.toml").write_text('format = "gguf"\n[llamacpp]\nn_slots = 8\nn_threads = 2\n')
    (models / "smollm2-draft/model.toml").write_text('format = "gguf"\n[llamacpp]\nn_threads = 2\n')
    monkeypatch.setattr(bench, "ROOT", tmp_path / "root")
    made = bench.repository_with_threads(1, tmp_path / "scratch")
    assert (made / "smollm2/model.toml").read_text() == 'format = "gguf"\n[llamacpp]\nn_slots = 8\nn_threads = 1\n'
    # the draft is the peer of nothing here: its config stays as shipped
    assert (made / "smollm2-draft/model.toml").read_text().endswith("n_threads = 2\n")
    assert (made / "smollm2/model.gguf").is_symlink()
    assert (made / "smollm2/model.gguf").read_bytes() == b"smollm2"


def test_threads_repository_refuses_a_config_without_the_line(tmp_path, monkeypatch):
    for name in ("smollm2", "smollm2-draft"):
        (tmp_path / "models" / name).mkdir(parents=True)
        (tmp_path / "models" / name / "model.toml").write_text("[llamacpp]\n")
    monkeypatch.setattr(bench, "ROOT", tmp_path)
    with pytest.raises(RuntimeError, match="n_threads"):
        bench.repository_with_threads(1, tmp_path / "scratch")
