"""`LOOKUP+KIND` drafters (`ngram+eagle3`, `suffix+eagle3`): names, greedy identity with both
drafters taking rounds, calibration. (The sampled rule's distribution:
tests/test_distribution.py, `ngram+draft`.)"""

from __future__ import annotations

import pytest

from specx.drafter_name import DrafterName
from specx.errors import SpecxError

# Each prompt repeats, so the n-gram finds continuations; its first tokens do not.
PROMPTS = [[5, 9, 13, 2, 7, 5, 9, 13, 2, 7, 5, 9], [3, 8, 1, 3, 8, 1, 6, 3, 8], [4, 11, 6, 2]]


@pytest.mark.parametrize(
    ("spec", "match"),
    [("ngram+suffix", r"LOOKUP\+KIND"), ("eagle3+ngram", r"LOOKUP\+KIND"),
     ("ngram+bogus", r"LOOKUP\+KIND"), ("ngram+", r"LOOKUP\+KIND")],
)  # fmt: skip
def test_a_combination_that_is_not_lookup_plus_a_model_is_refused(spec, match):
    with pytest.raises(SpecxError, match=match):
        DrafterName.known(spec)


def test_a_combined_name_keeps_its_argument():
    name = DrafterName.known("ngram+draft-model:artifacts/small")
    assert name.combined == ("ngram", "draft-model") and name.argument == "artifacts/small"
    assert str(name) == "ngram+draft-model:artifacts/small"


@pytest.mark.parametrize("spec", ["ngram+eagle3", "suffix+eagle3"])
def test_greedy_combined_drafting_equals_plain_with_both_drafting(head_artifacts, spec):
    from specx.artifact import load_manifest
    from specx.runtime.drafters import DrafterOptions, make_drafter
    from specx.runtime.plain_decoding import generate_plain
    from specx.runtime.speculative_decoding import generate_speculative
    from specx.runtime.targets.ort import OrtTarget

    target = OrtTarget(load_manifest(head_artifacts["eagle3"]), threads=2)
    plain = generate_plain(target, PROMPTS, 24)
    drafter = make_drafter(spec, target, DrafterOptions(3))
    assert drafter.name == spec and drafter.taps == "eagle3"
    speculative = generate_speculative(target, drafter, PROMPTS, 24)
    assert speculative.tokens == plain.tokens
    assert drafter.looked_up > 0 and drafter.modelled > 0  # each drafted some rows' rounds


def test_a_combined_drafter_calibrates_end_to_end(head_artifacts, tmp_path):
    """Its head's probe tree counted, its candidates timed whole, its entry under its name."""
    import shutil

    from specx.artifact import load_manifest
    from specx.calibration.calibrate import CalibrationOptions, calibrate_artifact

    artifact = shutil.copytree(head_artifacts["eagle3"], tmp_path / "eagle3")
    options = CalibrationOptions(
        drafter="ngram+eagle3", probe_top_k=2, probe_depth=3, max_new_tokens=12, batches=(1,),
        repeats=1,
    )  # fmt: skip
    entry = calibrate_artifact(artifact, PROMPTS, options)
    assert entry.report["drafter"] == "ngram+eagle3"
    acceptance = entry.report["acceptance"]
    assert acceptance["top_k"] == 2 and acceptance["rounds_reaching_depth"][0] > 0
    assert "ngram+eagle3" in load_manifest(artifact).calibration_keys
