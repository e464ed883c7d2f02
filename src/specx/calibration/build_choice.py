"""Which build runs fastest on this machine: measured per build, recorded, made the default.

Calibration's other half: `specx calibrate` measures which draft pays on a build, this which
build pays on the machine. `specx build --backend auto` is `build_fastest` here: it builds
(with `specx.builders.build_each`, which it is handed), then `choose_build` times them. A
default is made only from a timing of every build: where building or timing stops (an
error, Ctrl-C), the default goes back to what it was, as the builds made so far each
became it.

Which CPU backend wins depends on the machine, not only the model: on pyref-1b at int4 one
2-core host ran ONNX Runtime's plain step faster and OpenVINO's verify flatter, so with an
EAGLE-3 head the OpenVINO build decoded 1.54x faster while plain decoding favoured ONNX
Runtime (docs/decisions.md#build-choice). So `specx build --backend auto` builds every CPU
backend installed at the precision asked, times each build here, and makes the fastest the
default, recording the timings (`BuildChoice`) that the stats name as the reason.

Each build is timed in a process of its own (`python -m specx.calibration.build_choice`): a process
holds one build's sessions in use, and ONNX Runtime's pool spinning beside an OpenVINO
target (or a global pool made before it) would time a mix no user runs. Timed at batch 1
over `context` cached tokens: the verify curve t(n) (t(1) stands for the plain step), one
step of the artifact's head, the prompt's forward. The predicted decode rate, per build:

    plain:   t(1)
    a head:  min over chains of K of (t(K + 1) + (K + 1) * h) / E[tokens | K]

with h a head step (a round drafts K steps and catches up on what the last one accepted,
about one more) and E[tokens | K] = 1 + sum_{d <= K} PRIOR_REACH[d], the share of rounds
accepting at least d drafted tokens (a greedy chain's shorter prefix accepts alike). The prior
is the same for every build (one set of weights, one head), so it ranks builds only through
where each build's verify curve bends; `specx calibrate` measures acceptance itself.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from specx.artifact import Manifest, load_manifest, manifest_body, write_manifest
from specx.drafter_name import FEATURE_HEADS
from specx.errors import CalibrationError
from specx.manifest_types import BuildChoice, BuildTiming

__all__ = ["PRIOR_REACH", "build_fastest", "choose_build", "measure_build", "predict"]

# Shares of rounds accepting at least 1, 2, 3, 4 tokens of an EAGLE-3 chain of 4 on pyref-1b
# at int4 (docs/decisions.md#build-choice: the OpenVINO build's run, tau 3.47).
PRIOR_REACH = (0.80, 0.65, 0.57, 0.45)
WIDTHS = (1, 2, 3, 4, 5)
BATCHES = (4, 16)  # a plain step of this many sequences at once: a server's load (`for_load`)

Measure = Callable[[Path, str, int], BuildTiming]


def predict(verify_ms: Sequence[float], draft_step_ms: float | None) -> tuple[float, str]:
    """The decode ms/token a build's timings predict, and what it is the rate of."""
    if draft_step_ms is None:
        return verify_ms[0], "plain decoding"
    rates = {
        k: (verify_ms[k] + (k + 1) * draft_step_ms) / (1 + sum(PRIOR_REACH[:k]))
        for k in range(1, min(len(verify_ms) - 1, len(PRIOR_REACH)) + 1)
    }
    best = min(rates, key=rates.__getitem__)
    return rates[best], f"a head's chain of {best}"


def measure_build(manifest: Manifest, context: int, threads: int | None = None) -> BuildTiming:
    """Times `manifest`'s default build in this process (see the module docstring)."""
    from specx.calibration.costs import measure_verify_curve
    from specx.runtime.targets import build_name, open_decoder

    target = open_decoder(manifest, threads)
    rng = np.random.default_rng(0)
    prompt = [int(t) for t in rng.integers(0, target.vocab_size, context)]
    ttft = []
    for _ in range(3):
        cache = target.allocate_cache(1, context + 1)
        started = time.perf_counter()
        target.feed(cache, [prompt], np.zeros(1, dtype=np.int64))
        ttft.append(time.perf_counter() - started)
    curve = measure_verify_curve(target, WIDTHS, context)
    # t(1) is the curve's one-token forward: on pyref-1b int4 it predicted the loop's plain
    # rate within 2% on both builds (26.0 vs 26.46 ms, 32.7 vs 32.37), while timing plain
    # decoding's own step right after the prompt read OpenVINO's 20-30% high (38.7-42.7 ms).
    verify_ms = tuple(1e3 * s for s in curve.seconds)
    head = None
    spec = manifest.drafter
    if spec is not None and spec.kind in FEATURE_HEADS:
        head = _head_step_ms(open_decoder(manifest, threads, graph="draft_head"), context)
    decode, _ = predict(verify_ms, head)
    batches = {b: 1e3 * measure_verify_curve(target, (1,), context, batch=b).seconds[0]
               for b in BATCHES}  # fmt: skip
    return BuildTiming(build_name(manifest), verify_ms[0], verify_ms, head, 1e3 * min(ttft),
                       decode, batches)  # fmt: skip


def _head_step_ms(head, context: int, repeats: int = 15) -> float:
    """Median time of one head step over `context` cached positions."""
    cache = head.allocate_cache(1, context + 2)
    rng = np.random.default_rng(0)
    features = rng.standard_normal((context, head.tap_width)).astype(np.float32)
    head.feed(cache, [[1] * context], np.zeros(1, dtype=np.int64), [features])
    times = []
    for _ in range(repeats + 1):
        started = time.perf_counter()
        head.feed(cache, [[1]], np.array([context]), [features[:1]])
        times.append(time.perf_counter() - started)
    return 1e3 * float(np.median(times[1:]))  # the first call pays for a new shape


def measure_isolated(root: Path, build: str, context: int) -> BuildTiming:
    """`measure_build` of `build` in a fresh process (see the module docstring)."""
    command = [
        sys.executable,
        "-m",
        "specx.calibration.build_choice",
        str(root),
        build,
        str(context),
    ]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise CalibrationError(f"timing build {build!r} failed:\n{done.stderr[-2000:]}")
    return BuildTiming.from_json(json.loads(done.stdout.strip().splitlines()[-1]))


def choose_build(
    root: Path,
    builds: Sequence[str],
    context: int = 256,
    measure: Measure = measure_isolated,
    progress: Callable[[str], None] = lambda message: None,
) -> BuildChoice:
    """Times each of `builds` here and makes the fastest the default, recording why."""
    manifest = load_manifest(root, verify_hashes=False)
    # The prompt and the widest verify fit the cache (a small artifact times a shorter one).
    context = max(1, min(context, manifest.model.kv_capacity - WIDTHS[-1] - 2))
    timings = []
    for build in builds:
        progress(f"timing {build} (plain step, verify curve, head step, prompt forward)")
        timings.append(measure(root, build, context))
    fastest = min(timings, key=lambda t: t.decode_ms_per_token)
    _, basis = predict(fastest.verify_ms, fastest.draft_step_ms)
    choice = BuildChoice(fastest.build, basis, context, tuple(timings))
    write_manifest(root, manifest_body(manifest.with_build_choice(choice)))
    progress(f"default build: {choice.picked}, {choice.reason}")
    return choice


def build_fastest(
    root: Path,
    build: Callable[[], Sequence[str]],
    context: int = 256,
    measure: Measure = measure_isolated,
    progress: Callable[[str], None] = lambda message: None,
) -> BuildChoice:
    """Runs `build()` (`specx.builders.build_each`), times each build, makes the fastest default.

    Where building or timing does not finish, the default is put back as it was (the
    builds made stay), so no untimed build is left the default.
    """
    before = load_manifest(root, verify_hashes=False).default_build
    try:
        return choose_build(root, build(), context, measure, progress)
    except BaseException:
        now = load_manifest(root, verify_hashes=False)
        if now.default_build != before and (before is None or before in now.builds):
            write_manifest(root, manifest_body(now.with_build(before)))
            progress(f"not every build was timed: the default stays {before or 'exported'}")
        raise


def _main() -> None:
    root, build, context = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    # The parent loaded (and so checked) the artifact; the child need not hash it again.
    timing = measure_build(load_manifest(root, verify_hashes=False).with_build(build), context)
    print(json.dumps(timing.to_json()))


if __name__ == "__main__":
    _main()
