"""Shared fixtures: tiny random-weight checkpoints of every family, exported once per session."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

FAMILIES = ("llama", "qwen2", "qwen3", "mistral")
SHARED = Path(__file__).resolve().parents[2] / "shared"
MAX_CONTEXT = 128


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    from specx.export.random_checkpoint import write_random_checkpoint

    root = tmp_path_factory.mktemp("checkpoints")
    return {
        family: write_random_checkpoint(
            root / family, family, "tiny", seed=i, tie_word_embeddings=(family == "qwen2")
        )
        for i, family in enumerate(FAMILIES)
    }


@pytest.fixture(scope="session")
def artifacts(checkpoints, tmp_path_factory) -> dict[str, Path]:
    """Each family exported with eagle3 taps (the widest tap output)."""
    from specx.export.target_export import export_target

    root = tmp_path_factory.mktemp("artifacts")
    return {
        family: export_target(path, root / family, max_context=MAX_CONTEXT, taps="eagle3")
        for family, path in checkpoints.items()
    }


@pytest.fixture(scope="session")
def hf_models(checkpoints):
    from transformers import AutoModelForCausalLM

    return {
        family: AutoModelForCausalLM.from_pretrained(path).eval()
        for family, path in checkpoints.items()
    }


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)
