"""The drafters committed under benchmarks/heads/pyref-7m: each matches its recorded hash,
loads through its public-format loader, drafts losslessly for pyref-7m and above an
acceptance floor on fixed held-out prompts (a head broken in shipping, e.g. by the fp16
conversion or a lost tap numbering, falls far below it)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from conftest import SHARED

HEADS = Path(__file__).resolve().parents[1] / "benchmarks" / "heads" / "pyref-7m"
RECORDED = (
    json.loads((HEADS / "heads.json").read_text()) if (HEADS / "heads.json").is_file() else {}
)
# Acceptance length (bonus counted) of greedy chains of 4 (Medusa: its default tree) on the
# prompts below, about 80% of what each shipped drafter measured there (EAGLE-3 2.94,
# EAGLE-1 2.52, MTP 1.91, Medusa 2.24, draft model 1.32), far over an untrained one's ~1.05.
FLOORS = {"eagle3": 2.35, "eagle": 2.0, "mtp": 1.5, "medusa": 1.8, "draft-model": 1.15}
TARGET = SHARED / "models" / "pyref-7m"


def test_every_kind_is_committed_with_its_hashes():
    assert set(RECORDED) == set(FLOORS)
    for kind, files in RECORDED.items():
        for name, digest in files.items():
            assert hashlib.sha256((HEADS / kind / name).read_bytes()).hexdigest() == digest


@pytest.fixture(scope="module")
def prompts():
    from specx.runtime.tokenizer import TextTokenizer
    from specx.training.corpus import stdlib_files

    if not (TARGET / "model.safetensors").is_file():
        pytest.skip(f"{TARGET} is absent")
    tokenizer = TextTokenizer(TARGET / "tokenizer.json")
    _, held = stdlib_files()
    return [tokenizer.encode(held[i].read_text()[:600])[:64] for i in (0, 5, 11)]


@pytest.mark.parametrize("kind", list(FLOORS))
def test_a_committed_drafter_drafts_losslessly_above_its_floor(kind, prompts, tmp_path):
    from specx.artifact import load_manifest
    from specx.export.target_export import export_target
    from specx.runtime.drafters import DrafterOptions, make_drafter
    from specx.runtime.ort_target import OrtTarget
    from specx.runtime.plain_decoding import generate_plain
    from specx.runtime.speculative_decoding import generate_speculative

    if kind == "draft-model":
        draft = export_target(HEADS / kind, tmp_path / "draft", max_context=256)
        artifact, spec = export_target(TARGET, tmp_path / "a", max_context=256), f"{kind}:{draft}"
    else:
        drafter = f"{kind}:{HEADS / kind}"
        artifact = export_target(TARGET, tmp_path / "a", max_context=256, drafter=drafter)
        spec = kind
    target = OrtTarget(load_manifest(artifact), threads=2)
    plain = generate_plain(target, prompts, 48)
    options = DrafterOptions(4) if kind != "medusa" else DrafterOptions()
    spec_out = generate_speculative(target, make_drafter(spec, target, options), prompts, 48)
    assert spec_out.tokens == plain.tokens
    assert spec_out.stats.speculative.acceptance.acceptance_length > FLOORS[kind]
