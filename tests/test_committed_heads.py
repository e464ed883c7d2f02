"""The drafters committed under benchmarks/heads/: each matches its recorded hash, loads
through its public-format loader, drafts losslessly for pyref-7m and above an acceptance
floor on fixed held-out prompts (a head broken in shipping, e.g. by the fp16 conversion or a
lost tap numbering, falls far below it). The heads distilled against pyref-1b's int4 build
(`pyref-1b-int4`) draft for pyref-7m too: their teacher's predictions are pyref-7m's at 95%
of positions."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from conftest import SHARED

ROOT = Path(__file__).resolve().parents[1] / "benchmarks" / "heads"
HEADS = ROOT / "pyref-7m"
INT4_HEADS = ROOT / "pyref-1b-int4"


def _recorded(heads: Path) -> dict[str, dict[str, str]]:
    return (
        json.loads((heads / "heads.json").read_text()) if (heads / "heads.json").is_file() else {}
    )


RECORDED = _recorded(HEADS)
# Acceptance length (bonus counted) of greedy chains of 4 (Medusa: its default tree) on the
# prompts below, about 80% of what each shipped drafter measured there (EAGLE-3 3.00,
# EAGLE-1 2.52, MTP 1.91, Medusa 2.24, draft model 1.32), far over an untrained one's ~1.05.
FLOORS = {"eagle3": 2.35, "eagle": 2.0, "mtp": 1.5, "medusa": 1.8, "draft-model": 1.15}
TARGET = SHARED / "models" / "pyref-7m"
# (heads folder, kind): every pyref-7m kind, and each int4-distilled head committed.
COMMITTED = [(HEADS, kind) for kind in FLOORS] + [(INT4_HEADS, k) for k in _recorded(INT4_HEADS)]


def test_every_kind_is_committed_with_its_hashes():
    assert set(RECORDED) == set(FLOORS)
    assert {kind for _, kind in COMMITTED} <= set(FLOORS)
    for heads in (HEADS, INT4_HEADS):
        for kind, files in _recorded(heads).items():
            for name, digest in files.items():
                assert hashlib.sha256((heads / kind / name).read_bytes()).hexdigest() == digest


@pytest.fixture(scope="module")
def prompts():
    from specx.runtime.tokenizer import TextTokenizer
    from specx.training.corpus import stdlib_files

    if not (TARGET / "model.safetensors").is_file():
        pytest.skip(f"{TARGET} is absent")
    tokenizer = TextTokenizer(TARGET / "tokenizer.json")
    _, held = stdlib_files()
    return [tokenizer.encode(held[i].read_text()[:600])[:64] for i in (0, 5, 11)]


@pytest.mark.parametrize(("heads", "kind"), COMMITTED, ids=[f"{h.name}-{k}" for h, k in COMMITTED])
def test_a_committed_drafter_drafts_losslessly_above_its_floor(heads, kind, prompts, tmp_path):
    from specx.artifact import load_manifest
    from specx.export.target_export import export_target
    from specx.runtime.drafters import DrafterOptions, make_drafter
    from specx.runtime.plain_decoding import generate_plain
    from specx.runtime.speculative_decoding import generate_speculative
    from specx.runtime.targets.ort import OrtTarget

    if kind == "draft-model":
        draft = export_target(heads / kind, tmp_path / "draft", max_context=256)
        artifact, spec = export_target(TARGET, tmp_path / "a", max_context=256), f"{kind}:{draft}"
    else:
        drafter = f"{kind}:{heads / kind}"
        artifact = export_target(TARGET, tmp_path / "a", max_context=256, drafter=drafter)
        spec = kind
    target = OrtTarget(load_manifest(artifact), threads=2)
    plain = generate_plain(target, prompts, 48)
    options = DrafterOptions(4) if kind != "medusa" else DrafterOptions()
    spec_out = generate_speculative(target, make_drafter(spec, target, options), prompts, 48)
    assert spec_out.tokens == plain.tokens
    assert spec_out.stats.speculative.acceptance.acceptance_length > FLOORS[kind]
