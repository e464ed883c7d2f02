"""The decoding loops' typed stats, and the JSON they print (`specx generate --json`)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from specx.runtime.calibrated import CalibratedChoice
from specx.runtime.metrics import (
    AcceptanceStats,
    ControllerSummary,
    RunStats,
    SpeculativeStats,
)
from specx.runtime.results import Stats


def _acceptance(rounds: list[tuple[int, int]]) -> AcceptanceStats:
    stats = AcceptanceStats()
    for depth, accepted in rounds:
        stats.record(depth, accepted)
    return stats


def test_acceptance_summary_counts_rounds_and_positions():
    summary = _acceptance([(2, 2), (2, 0), (0, 0), (1, 1)]).summary()
    assert (summary.rounds, summary.rounds_with_draft, summary.accepted_tokens) == (4, 3, 3)
    assert summary.acceptance_length == pytest.approx(1.75)
    assert summary.acceptance_by_position == pytest.approx((2 / 3, 1 / 2))
    assert summary.conditional_acceptance_by_position == pytest.approx((2 / 3, 1.0))
    assert AcceptanceStats().summary().acceptance_length == 0.0


def test_plain_run_json_keeps_its_keys():
    run = RunStats.measure([[1, 2], [3]], [[4, 5, 6], [7]], 0.5, 2.5, 2)
    assert run.mode == "plain" and run.ms_per_token == pytest.approx(1e3 * 2.0 / 2)
    assert run.to_json() == {
        "mode": "plain",
        "batch": 2,
        "prompt_tokens": 3,
        "new_tokens": 4,
        "prefill_s": 0.5,
        "target_forwards": 2,
        "decode_s": 2.0,
        "total_s": 2.5,
        "tokens_per_s": 4 / 2.5,
        "ms_per_token": 1e3,
        "ms_per_step": 1e3,
    }
    off = replace(run, speculation_off="off: batch 2 > max_batch_spec 1")
    assert off.to_json()["speculation"] == "off: batch 2 > max_batch_spec 1"


def test_speculative_run_json_keeps_its_keys_and_order():
    rows = [_acceptance([(2, 1)]), _acceptance([(2, 2), (0, 0)])]
    speculative = SpeculativeStats(
        drafter="ngram",
        draft_s=0.25,
        draft_prefill_s=0.125,
        verify_s=1.5,
        acceptance=AcceptanceStats.merge(rows).summary(),
        controller=ControllerSummary("adaptive", {0: 1, 2: 2}),
        per_request=tuple(r.summary() for r in rows),
    )
    run = RunStats.measure([[1]] * 2, [[2, 3], [4, 5, 6, 7]], 0.25, 2.0, 2, speculative)
    out = run.to_json()
    assert list(out) == [
        *("mode", "drafter", "batch", "prompt_tokens", "new_tokens", "prefill_s"),
        *("draft_s", "draft_prefill_s", "verify_s", "target_forwards", "decode_s", "total_s"),
        "tokens_per_s",
        *("ms_per_token", "ms_per_step", "rounds", "rounds_with_draft", "acceptance_length"),
        *("accepted_tokens", "acceptance_by_position", "conditional_acceptance_by_position"),
        *("controller", "sizes_chosen", "per_request"),
    ]
    assert (out["mode"], out["drafter"], out["controller"]) == ("speculative", "ngram", "adaptive")
    assert out["sizes_chosen"] == {0: 1, 2: 2} and out["per_request"][1]["rounds"] == 2
    assert out["acceptance_by_position"] == [1.0, 0.5]
    assert json.loads(json.dumps(out))["sizes_chosen"] == {"0": 1, "2": 2}


def test_engine_stats_json_adds_build_calibration_and_its_reason():
    run = RunStats.measure([[1]], [[2, 3]], 0.5, 1.5, 1)
    fell_back = replace(run, speculation_off="off: batch 1 > max_batch_spec 0")
    calibrated = CalibratedChoice(None, 8, 0, 1.0, "suffix (8 nodes)", "suffix", "ort-fp32")
    reason = "fastest measured here for plain decoding (decode ms/token: ort-fp32 1.0)"
    stats = Stats(fell_back, "ort-fp32", "ort", "off: the calibration says so", calibrated, reason)
    out = stats.to_json()
    assert out["speculation"] == "off: the calibration says so"
    assert out["calibration"] == {
        "entry": "suffix",
        "tree": "suffix (8 nodes)",
        "max_batch_spec": 0,
        "predicted_speedup": 1.0,
        "measured_on": "ort-fp32",
    }
    assert list(out)[-4:] == ["calibration", "build", "backend", "build_reason"]
    assert out["build_reason"] == reason
    assert (stats.mode, stats.drafter, stats.calibration) == ("plain", None, "suffix")
    assert (stats.acceptance_length, stats.draft_s) == (1.0, 0.0)
    plain = Stats(run, "exported", "ort", "off").to_json()
    assert "speculation" not in plain and "calibration" not in plain
