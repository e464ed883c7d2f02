"""`specx build --backend auto`: every CPU backend built, each timed here, the fastest kept."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import shutil
from pathlib import Path

import pytest

from specx.artifact import load_manifest
from specx.calibration.build_choice import PRIOR_REACH, choose_build, predict
from specx.manifest_types import BuildChoice, BuildTiming


def test_a_plain_artifact_is_predicted_at_its_step():
    assert predict((20.0, 30.0, 40.0), None) == (20.0, "plain decoding")


def test_a_flat_verify_curve_pays_for_a_longer_chain_than_a_steep_one():
    flat = (30.0, 31.0, 32.0, 33.0, 34.0)  # OpenVINO's shape: ~3% a token
    steep = (20.0, 32.0, 44.0, 56.0, 68.0)  # steeper than ONNX Runtime int4's ~25% a token
    flat_rate, flat_basis = predict(flat, 2.0)
    steep_rate, steep_basis = predict(steep, 2.0)
    assert flat_basis == "a head's chain of 4" and steep_basis == "a head's chain of 1"
    # A chain of K costs t(K + 1) + (K + 1) head steps for 1 + the first K reaches.
    assert flat_rate == pytest.approx((34.0 + 5 * 2.0) / (1 + sum(PRIOR_REACH)))
    assert steep_rate == pytest.approx((32.0 + 2 * 2.0) / (1 + PRIOR_REACH[0]))


def _timing(build: str, step: float, draft: float | None = None) -> BuildTiming:
    verify = tuple(step * (1 + 0.1 * n) for n in range(5))
    return BuildTiming(build, step, verify, draft, 100.0, predict(verify, draft)[0])


def test_the_record_reads_back_and_names_the_faster_build_first():
    choice = BuildChoice("b", "plain decoding", 64, (_timing("a", 30.0), _timing("b", 20.0)))
    again = BuildChoice.from_json("here", json.loads(json.dumps(choice.to_json())))
    assert again == choice
    assert choice.reason.index("b 20.0") < choice.reason.index("a 30.0")


@pytest.fixture(scope="module")
def two_builds(artifacts, tmp_path_factory) -> Path:
    """A tiny artifact with ort-fp32 (export's) and an ort-int8 build."""
    from specx.builders import BuildOptions, build_artifact
    from specx.graphs.weight_only import WeightOnlyConfig

    root = shutil.copytree(artifacts["llama"], tmp_path_factory.mktemp("choice") / "llama")
    build_artifact(root, BuildOptions("ort", "fp32"))
    build_artifact(root, BuildOptions("ort", "int8", weight_only=WeightOnlyConfig(bits=8)))
    return root


@pytest.mark.parametrize("slower", ["ort-fp32", "ort-int8"])
def test_the_build_timed_fastest_becomes_the_default_never_a_slower_one(two_builds, slower):
    """A fake measurement makes one build slower: it is never picked, whichever it is,
    and the record and the stats say why the other runs."""
    import specx

    def measure(root, build, context):
        return _timing(build, 40.0 if build == slower else 10.0)

    faster = "ort-int8" if slower == "ort-fp32" else "ort-fp32"
    choice = choose_build(two_builds, [slower, faster], context=32, measure=measure)
    manifest = load_manifest(two_builds)
    assert choice.picked == faster == manifest.default_build
    assert manifest.build_choice == choice
    stats = specx.load(two_builds).generate([1, 2, 3], max_new_tokens=2).stats
    assert stats.build == faster and stats.build_reason == choice.reason
    named = specx.load(two_builds, build=slower).generate([1, 2, 3], max_new_tokens=2).stats
    assert named.build_reason == f"named; the build timed fastest here was {faster}"


def _loaded(build: str, step: float, batch_ms: dict[int, float]) -> BuildTiming:
    return dataclasses.replace(_timing(build, step), batch_step_ms=batch_ms)


def test_the_build_for_a_load_is_the_one_fastest_per_token_at_that_many_rows():
    """One row: the batch-1 pick; more: the plain step of the largest timed batch up to the
    rows, per token; a record without batch timings keeps its pick at any load."""
    fast_alone = _loaded("cpu-int4", 20.0, {4: 60.0, 16: 200.0})  # 15.0 / 12.5 ms a token
    flat = _loaded("openvino-int4", 30.0, {4: 40.0, 16: 96.0})  # 10.0 / 6.0
    choice = BuildChoice("cpu-int4", "plain decoding", 64, (fast_alone, flat))
    assert choice.for_load(1) == ("cpu-int4", choice.reason)
    build, reason = choice.for_load(8)  # batch 4's step
    assert build == "openvino-int4" and reason.startswith("fastest measured here at 8 rows")
    assert "openvino-int4 10.00, cpu-int4 15.00" in reason
    assert choice.for_load(2)[0] == "openvino-int4"  # below every timed batch: the smallest
    again = BuildChoice.from_json("here", json.loads(json.dumps(choice.to_json())))
    assert again == choice
    older = BuildChoice("cpu-int4", "plain decoding", 64, (_timing("cpu-int4", 20.0), flat))
    assert older.for_load(16) == ("cpu-int4", older.reason)


def test_a_server_s_slots_load_the_build_timed_fastest_at_that_load(two_builds, tmp_path):
    """`specx.load(rows=N)` (what `specx serve --slots N` calls) runs the build timed
    fastest at N rows and says why; a named build still wins; one row keeps the default."""
    import specx

    root = shutil.copytree(two_builds, tmp_path / "load")
    timings = {"ort-fp32": _loaded("ort-fp32", 30.0, {4: 40.0, 16: 96.0}),
               "ort-int8": _loaded("ort-int8", 10.0, {4: 60.0, 16: 200.0})}  # fmt: skip
    choose_build(root, ["ort-fp32", "ort-int8"], 32, lambda r, b, c: timings[b])
    assert load_manifest(root).default_build == "ort-int8"
    assert specx.load(root).build == "ort-int8"
    served = specx.load(root, rows=4)
    assert served.build == "ort-fp32" and "at 4 rows" in served.build_reason
    stats = served.generate([1, 2, 3], max_new_tokens=2).stats
    assert stats.build == "ort-fp32" and stats.build_reason == served.build_reason
    assert specx.load(root, build="ort-int8", rows=4).build == "ort-int8"


@pytest.mark.parametrize(
    "record", [{"picked": 3}, {"picked": "a", "basis": "b", "context": 1, "timings": ["x"]}]
)
def test_a_broken_record_costs_the_reason_not_the_run(two_builds, tmp_path, record):
    import specx
    from specx.artifact import manifest_body, write_manifest

    root = shutil.copytree(two_builds, tmp_path / "broken")
    manifest = load_manifest(root)
    write_manifest(root, {**manifest_body(manifest), "build_choice": record})
    stats = specx.load(root).generate([1, 2, 3], max_new_tokens=2).stats
    assert "build_choice is malformed" in stats.build_reason


def test_a_later_build_retires_the_recorded_choice(two_builds, tmp_path):
    """A build made after the choice outranks it (it is the default now): the record goes."""
    import specx
    from specx.builders import BuildOptions, build_artifact

    root = shutil.copytree(two_builds, tmp_path / "later")
    choose_build(root, ["ort-fp32", "ort-int8"], 32, lambda r, b, c: _timing(b, 10.0))
    assert load_manifest(root).build_choice is not None
    build_artifact(root, BuildOptions("ort", "int4"))
    assert load_manifest(root).build_choice is None
    reason = specx.load(root).generate([1, 2, 3], max_new_tokens=2).stats.build_reason
    assert reason.startswith("the artifact's default build, the newest")


def test_without_openvino_or_the_kernels_auto_builds_onnx_runtime_alone_saying_so(
    artifacts, monkeypatch
):
    from specx.builders import BuildOptions, cpu_backends
    from specx.runtime import kernels

    found = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "openvino" else found(name)
    )
    monkeypatch.setattr(kernels, "library", lambda: None)
    said: list[str] = []
    manifest = load_manifest(artifacts["llama"])
    assert cpu_backends(manifest, BuildOptions("auto", "int4"), said.append) == ["ort"]
    assert len(said) == 2 and "OpenVINO is not installed" in said[0]
    assert "no cpu build" in said[1] and "kernels" in said[1]


def test_auto_leaves_out_the_kernels_for_a_target_they_do_not_compute_saying_why(artifacts):
    from specx.builders import BuildOptions, cpu_backends

    said: list[str] = []
    manifest = load_manifest(artifacts["gemma2"])
    assert "cpu" not in cpu_backends(manifest, BuildOptions("auto", "int4"), said.append)
    assert any("Llama-form" in line and "gemma2" in line for line in said)


def test_auto_times_each_build_in_its_own_process_and_records_the_fastest(artifacts, tmp_path):
    """End to end on the CLI: int8 on every CPU backend installed, each timed for real."""
    from click.testing import CliRunner

    from specx.builders import BuildOptions, cpu_backends
    from specx.cli import main

    root = shutil.copytree(artifacts["llama"], tmp_path / "llama")
    done = CliRunner().invoke(
        main, ["build", str(root), "--backend", "auto", "--precision", "int8"]
    )
    assert done.exit_code == 0, done.output
    manifest = load_manifest(root)
    choice = manifest.build_choice
    assert choice is not None and choice.basis == "plain decoding"
    backends = {manifest.builds[t.build].backend for t in choice.timings}
    assert backends == set(cpu_backends(manifest, BuildOptions("auto", "int8")))
    fastest = min(choice.timings, key=lambda t: t.decode_ms_per_token)
    assert manifest.default_build == choice.picked == fastest.build
    assert all(t.step_ms == t.verify_ms[0] > 0 and t.ttft_ms > 0 for t in choice.timings)
    assert all(set(t.batch_step_ms) == {4, 16} and min(t.batch_step_ms.values()) > 0
               for t in choice.timings)  # fmt: skip


def test_auto_refuses_onnx_runtime_only_options_before_building(artifacts, tmp_path):
    from click.testing import CliRunner

    from specx.cli import main

    root = shutil.copytree(artifacts["llama"], tmp_path / "llama")
    before = sorted(load_manifest(root).builds)
    args = ["build", str(root), "--backend", "auto", "--precision", "int4", "--accuracy-level", "0"]
    done = CliRunner().invoke(main, args)
    assert done.exit_code == 2 and "--backend ort" in done.output
    assert sorted(load_manifest(root).builds) == before


def test_a_heads_step_is_timed_where_the_artifact_has_one(head_artifacts):
    from specx.calibration.build_choice import measure_build
    from specx.runtime.targets import build_name

    manifest = load_manifest(head_artifacts["eagle3"])
    timing = measure_build(manifest, context=16, threads=1)
    assert timing.draft_step_ms is not None and timing.draft_step_ms > 0
    assert timing.build == build_name(manifest)  # "exported": the artifact has no build
    assert timing.decode_ms_per_token == predict(timing.verify_ms, timing.draft_step_ms)[0]


def test_auto_times_builds_over_the_context_it_is_told_and_only_auto_takes_one(
    artifacts, tmp_path, monkeypatch
):
    from click.testing import CliRunner

    import specx.builders
    import specx.calibration.build_choice as build_choice
    from specx.cli import main

    root = shutil.copytree(artifacts["llama"], tmp_path / "llama")
    told: list[int] = []
    monkeypatch.setattr(specx.builders, "build_each", lambda *a, **k: ["ort-int8"])
    monkeypatch.setattr(build_choice, "choose_build", lambda r, b, c, *a, **k: told.append(c))
    command = ["build", str(root), "--precision", "int8", "--context", "512"]
    done = CliRunner().invoke(main, [*command, "--backend", "auto"])
    assert done.exit_code == 0, done.output
    assert told == [512]
    refused = CliRunner().invoke(main, [*command, "--backend", "ort"])
    assert refused.exit_code != 0 and "--context applies only to --backend auto" in refused.output


def test_an_interrupted_auto_build_leaves_the_default_as_it_was(artifacts, tmp_path):
    """Ctrl-C while the builds are timed: the builds made stay, none of them untimed
    becomes the default."""
    from specx.builders import BuildOptions, build_artifact, build_each
    from specx.calibration.build_choice import build_fastest

    root = shutil.copytree(artifacts["llama"], tmp_path / "llama")
    build_artifact(root, BuildOptions("ort", "fp32"))

    def interrupted(root, build, context):
        raise KeyboardInterrupt

    said = []
    with pytest.raises(KeyboardInterrupt):
        build = lambda: build_each(root, BuildOptions("auto", "int8"), ["ort"])  # noqa: E731
        build_fastest(root, build, measure=interrupted, progress=said.append)
    manifest = load_manifest(root)
    assert manifest.default_build == "ort-fp32" and "ort-int8" in manifest.builds
    assert manifest.build_choice is None and "the default stays ort-fp32" in said[-1]
