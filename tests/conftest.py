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


def perturbed_copy(source: Path, destination: Path, noise: float, seed: int = 0) -> Path:
    """A copy of a checkpoint with Gaussian noise on every weight: a draft that agrees often."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, destination)
    generator = torch.Generator().manual_seed(seed)
    tensors = load_file(destination / "model.safetensors")
    for name, tensor in tensors.items():
        scale = noise * tensor.float().std().clamp(min=1e-3)
        tensors[name] = tensor + scale * torch.randn(tensor.shape, generator=generator)
    save_file(tensors, destination / "model.safetensors", metadata={"format": "pt"})
    return destination


@pytest.fixture(scope="session")
def draft_artifacts(checkpoints, tmp_path_factory) -> dict[str, Path]:
    """A noisy copy of the llama and qwen3 targets, exported as draft models."""
    from specx.export.target_export import export_target

    root = tmp_path_factory.mktemp("drafts")
    return {
        family: export_target(
            perturbed_copy(checkpoints[family], root / f"{family}-ckpt", noise=0.3),
            root / family,
            max_context=MAX_CONTEXT,
        )
        for family in ("llama", "qwen3")
    }


@pytest.fixture(scope="session")
def pyref_artifact(tmp_path_factory) -> Path:
    """The trained reference target, exported once; skipped where shared/ lacks it."""
    from specx.export.target_export import export_target

    source = SHARED / "models" / "pyref-7m"
    if not (source / "model.safetensors").is_file():
        pytest.skip(f"{source} is absent")
    return export_target(source, tmp_path_factory.mktemp("pyref") / "artifact", max_context=512)
