"""GenerationMetrics' step and token figures, read at scrape time: the same
exposition prometheus_client's own Gauge, Counter and Histogram give for
the same updates."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client import generate_latest

from modeld.server.metrics import _LATENCY_BUCKETS, GenerationMetrics, Metrics, StepFigures

LABELS = ["model", "backend"]
STEPS = [(1, 0, 40, 2048), (3, 2, 300, 2048), (8, 5, 1900, 2048), (0, 0, 120, 2048)]
# first-token and inter-token times: on a bucket bound (it counts in that bound's
# bucket), between bounds, past the last bound (+Inf only), and a first token
TOKENS = [(1, 0.2, None), (1, None, 0.001), (1, None, 0.0011), (2, None, 0.05), (1, None, 31.0),
          (4, None, 0.0004), (1, None, 0.0005)]


def _samples(registry, names) -> dict:
    out = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in family.samples:
            if any(s.name.startswith(n) for n in names) and not s.name.endswith("_created"):
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _reference(updates_by_labels) -> CollectorRegistry:
    r = CollectorRegistry()
    running = Gauge("modeld_running_sequences", "", LABELS, registry=r)
    waiting = Gauge("modeld_waiting_sequences", "", LABELS, registry=r)
    used = Gauge("modeld_kv_cells_used", "", LABELS, registry=r)
    capacity = Gauge("modeld_kv_cells_capacity", "", LABELS, registry=r)
    tokens = Counter("modeld_generated_tokens", "", LABELS, registry=r)
    inter = Histogram("modeld_inter_token_seconds", "", LABELS, buckets=_LATENCY_BUCKETS, registry=r)
    for labels, steps, token_updates in updates_by_labels:
        for step in steps:
            for gauge, value in zip((running, waiting, used, capacity), step):
                gauge.labels(*labels).set(value)
        for count, _first, gap in token_updates:
            tokens.labels(*labels).inc(count)
            if gap is not None:
                inter.labels(*labels).observe(gap)
    return r


NAMES = ("modeld_running_sequences", "modeld_waiting_sequences", "modeld_kv_cells", "modeld_generated_tokens",
         "modeld_inter_token_seconds")


def test_figures_expose_what_prometheus_clients_metrics_would():
    metrics = Metrics()
    llama, torch = GenerationMetrics(metrics, "smollm2", "llamacpp"), GenerationMetrics(metrics, "tiny", "torch")
    for step in STEPS:
        llama.on_step(*step)
    for update in TOKENS:
        llama.on_tokens(*update)
    torch.on_step(2, 0, 64, 512)
    torch.on_tokens(3, None, 0.02)
    ours = _samples(metrics.registry, NAMES)
    reference = _samples(_reference([(("smollm2", "llamacpp"), STEPS, TOKENS),
                                     (("tiny", "torch"), [(2, 0, 64, 512)], [(3, None, 0.02)])]), NAMES)
    assert ours == reference
    assert ours[("modeld_inter_token_seconds_bucket", (("backend", "llamacpp"), ("le", "0.001"), ("model", "smollm2")))] == 3
    assert ours[("modeld_generated_tokens_total", (("backend", "llamacpp"), ("model", "smollm2")))] == 11
    assert llama.latest == StepFigures(0, 0, 120, 2048)


def test_the_first_token_time_stays_a_histogram():
    metrics = Metrics()
    GenerationMetrics(metrics, "smollm2", "llamacpp").on_tokens(1, 0.2, None)
    ours = _samples(metrics.registry, ("modeld_time_to_first_token_seconds",))
    assert ours[("modeld_time_to_first_token_seconds_count", (("backend", "llamacpp"), ("model", "smollm2")))] == 1


def test_a_reloaded_model_keeps_counting_and_starts_its_step_figures_at_zero():
    metrics = Metrics()
    first = GenerationMetrics(metrics, "smollm2", "llamacpp")
    first.on_step(4, 1, 500, 2048)
    first.on_tokens(5, None, 0.03)
    again = GenerationMetrics(metrics, "smollm2", "llamacpp")  # the model unloaded and loaded again
    assert again.latest == StepFigures()
    again.on_tokens(2, None, 0.03)
    ours = _samples(metrics.registry, NAMES)
    key = (("backend", "llamacpp"), ("model", "smollm2"))
    assert ours[("modeld_generated_tokens_total", key)] == 7  # a counter never goes back
    assert ours[("modeld_inter_token_seconds_count", key)] == 2
    assert ours[("modeld_running_sequences", key)] == 0


def test_a_second_metric_of_one_of_these_names_is_refused():
    metrics = Metrics()
    try:
        Gauge("modeld_kv_cells_used", "", LABELS, registry=metrics.registry)
    except ValueError as exc:
        assert "modeld_kv_cells_used" in str(exc)
    else:
        raise AssertionError("the registry took a duplicate of a collected metric")


def test_a_workers_step_of_token_figures_counts_as_each_would():
    one_by_one, batched = Metrics(), Metrics()
    single = GenerationMetrics(one_by_one, "smollm2", "llamacpp")
    for update in TOKENS:
        single.on_tokens(*update)
    GenerationMetrics(batched, "smollm2", "llamacpp").on_tokens_many(tuple(TOKENS))
    names = NAMES + ("modeld_time_to_first_token_seconds",)
    assert _samples(batched.registry, names) == _samples(one_by_one.registry, names)
