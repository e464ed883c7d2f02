"""The server's /metrics text: the families it always had, one registry per server."""

from __future__ import annotations

from types import SimpleNamespace

from prometheus_client import REGISTRY, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from specx.server.metrics import Metrics

# The hand-written exposition's families, in its order: (name, type, labels).
FAMILIES = [
    ("specx_requests_total", "counter", ("endpoint", "status")),
    ("specx_finished_total", "counter", ("reason",)),
    *(
        (f"specx_{name}", kind, ())
        for name, kind in [
            ("prompt_tokens_total", "counter"),
            ("generation_tokens_total", "counter"),
            ("rounds_total", "counter"),
            ("draft_tokens_total", "counter"),
            ("accepted_tokens_total", "counter"),
            ("acceptance_length", "gauge"),
            ("draft_seconds_total", "counter"),
            ("draft_prefill_seconds_total", "counter"),
            ("verify_seconds_total", "counter"),
            ("round_seconds_total", "counter"),
            ("queue_wait_seconds_total", "counter"),
            ("queue_depth", "gauge"),
            ("batch_running", "gauge"),
            ("batch_slots", "gauge"),
            ("batch_occupancy", "gauge"),
            ("prefix_cache_hits_total", "counter"),
            ("prefix_cache_reused_tokens_total", "counter"),
            ("prefix_cache_evictions_total", "counter"),
            ("prefix_cache_bytes", "gauge"),
            ("prefix_cache_max_bytes", "gauge"),
        ]
    ),
    ("specx_acceptance_by_position", "gauge", ("position",)),
    ("specx_build_info", "gauge", ("build", "reason")),  # which build serves, and why
]


def _busy() -> Metrics:
    metrics = Metrics()
    metrics.build, metrics.build_reason = "cpu-int4", "fastest measured here at 4 rows"
    metrics.request("/v1/completions", 200)
    metrics.request("/v1/completions", 200)
    metrics.request("/v1/chat/completions", 400)
    metrics.admitted(0.25)
    metrics.round(2, 0.5, 0.125, 0.0625, 0.25)
    metrics.round(1, 0.5, 0.125, 0.0, 0.25)
    for reason, prompt, tokens, accepted, by_position in [
        ("stop", 5, 3, 3, [1.0, 0.5]),
        ("length", 7, 2, 0, [0.0]),
    ]:
        done = SimpleNamespace(
            finish_reason=reason,
            prompt_tokens=prompt,
            tokens=[1] * tokens,
            rounds=2,
            drafted=5,
            accepted=accepted,
            acceptance_by_position=by_position,
        )
        metrics.finished(done)
    metrics.queue_depth, metrics.slots = 3, 4
    metrics.prefix_cache = SimpleNamespace(
        hits=2, reused_tokens=64, evictions=1, bytes=1024, max_bytes=4096
    )
    return metrics


def _samples(text: str) -> dict[str, float]:
    return {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if not line.startswith("#")
    }


def test_the_exposition_keeps_every_family_name_label_and_type():
    text = _busy().render()
    types = [line.split()[2:] for line in text.splitlines() if line.startswith("# TYPE")]
    assert types == [[name, kind] for name, kind, _ in FAMILIES]
    parsed = {f.name: f for f in text_string_to_metric_families(text)}
    for name, kind, labels in FAMILIES:
        family = parsed[name.removesuffix("_total") if kind == "counter" else name]
        assert family.type == kind and all(tuple(s.labels) == labels for s in family.samples)
    assert _samples(text) == {
        'specx_requests_total{endpoint="/v1/chat/completions",status="400"}': 1,
        'specx_requests_total{endpoint="/v1/completions",status="200"}': 2,
        'specx_finished_total{reason="length"}': 1,
        'specx_finished_total{reason="stop"}': 1,
        "specx_prompt_tokens_total": 12,
        "specx_generation_tokens_total": 5,
        "specx_rounds_total": 4,
        "specx_draft_tokens_total": 10,
        "specx_accepted_tokens_total": 3,
        "specx_acceptance_length": 1.75,  # (4 rounds + 3 accepted) / 4 rounds
        "specx_draft_seconds_total": 0.25,
        "specx_draft_prefill_seconds_total": 0.0625,
        "specx_verify_seconds_total": 0.5,
        "specx_round_seconds_total": 1.0,
        "specx_queue_wait_seconds_total": 0.25,
        "specx_queue_depth": 3,
        "specx_batch_running": 1,
        "specx_batch_slots": 4,
        "specx_batch_occupancy": 1.5,
        "specx_prefix_cache_hits_total": 2,
        "specx_prefix_cache_reused_tokens_total": 64,
        "specx_prefix_cache_evictions_total": 1,
        "specx_prefix_cache_bytes": 1024,
        "specx_prefix_cache_max_bytes": 4096,
        'specx_acceptance_by_position{position="1"}': 0.5,
        'specx_acceptance_by_position{position="2"}': 0.5,
        'specx_build_info{build="cpu-int4",reason="fastest measured here at 4 rows"}': 1,
    }


def test_each_server_has_its_own_registry():
    busy, idle = _busy(), Metrics()
    assert busy.registry is not idle.registry
    assert _samples(idle.render())["specx_rounds_total"] == 0
    assert _samples(busy.render())["specx_rounds_total"] == 4
    assert "specx_rounds_total" not in _samples(generate_latest(REGISTRY).decode())
    assert "specx_prefix_cache_bytes" not in idle.render()  # no cache, no cache families
