"""Gemma 2 and 3 beyond the family tests: draft heads on them, and their fp16 builds.

Heads keep Llama's layer form on any target (`TargetConfig.llama_layers`): an EAGLE-1, an
EAGLE-3 and a Medusa head in the official layouts export next to the Gemma target, and greedy
speculation with chains and trees equals plain decoding.
"""

from __future__ import annotations

import json
import shutil

import pytest

from head_checkpoints import write_eagle, write_eagle3, write_medusa
from specx.artifact import load_manifest
from specx.builders import BuildOptions, build_artifact
from specx.export.target_export import export_target
from specx.runtime.drafters import DrafterOptions, make_drafter
from specx.runtime.plain_decoding import generate_plain
from specx.runtime.speculative_decoding import generate_speculative
from specx.runtime.targets.ort import OrtTarget
from specx.runtime.tree_shapes import DynamicTree, StaticTree

GEMMA = ["gemma2", "gemma3_text"]


# Each head kind once, each family under at least one: the heads read the taps alike.
@pytest.mark.parametrize(
    ("kind", "family"), [("eagle", "gemma3_text"), ("eagle3", "gemma2"), ("medusa", "gemma2")]
)
def test_heads_on_a_gemma_target_keep_greedy_identity(kind, family, checkpoints, tmp_path, rng):
    path = checkpoints[family]
    config = json.loads((path / "config.json").read_text())
    # The heads' own config is Llama's, with one RoPE base.
    llama_like = {**config, "rope_parameters": {"rope_theta": 10000.0}}
    head = tmp_path / kind
    if kind == "eagle":
        write_eagle(head, llama_like)
    elif kind == "eagle3":
        write_eagle3(head, llama_like, draft_vocab=64)
    else:
        write_medusa(head, config)
    artifact = export_target(path, tmp_path / "artifact", max_context=96, drafter=f"{kind}:{head}")
    target = OrtTarget(load_manifest(artifact), threads=2)
    prompts = [rng.integers(1, target.vocab_size, n).tolist() for n in (3, 9, 5, 12)]
    second = StaticTree.from_choices([[0], [1], [0, 0], [0, 1], [0, 0, 0]])
    for tree in (StaticTree.chain(3), second if kind == "medusa" else DynamicTree(9, 3, 2)):
        drafter = make_drafter(kind, target, DrafterOptions(tree=tree))
        for batch in (1, 2):
            for start in range(0, len(prompts), batch):
                chunk = prompts[start : start + batch]
                plain = generate_plain(target, chunk, 24).tokens
                assert generate_speculative(target, drafter, chunk, 24).tokens == plain, chunk


@pytest.mark.parametrize("family", GEMMA)
def test_the_fp16_build_of_a_gemma_target_stays_close_to_fp32(family, artifacts, tmp_path, rng):
    artifact = shutil.copytree(artifacts[family], tmp_path / "artifact")
    build_artifact(artifact, BuildOptions("ort", "fp16"))
    half = OrtTarget(load_manifest(artifact), threads=2)
    full = OrtTarget(load_manifest(artifacts[family]), threads=2)
    prompts = [rng.integers(1, full.vocab_size, 16).tolist() for _ in range(6)]
    first = [generate_plain(t, prompts, 1).tokens for t in (half, full)]
    assert sum(a == b for a, b in zip(*first, strict=True)) >= 5  # near-ties may flip one
