"""Shared fixtures: tiny random-weight checkpoints of every family, exported once per session."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "smollm3", "phi3", "gemma2", "gemma3_text")
SHARED = Path(__file__).resolve().parents[2] / "shared"
MAX_CONTEXT = 128
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


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


HEAD_VOCAB = 32


@pytest.fixture(scope="session")
def head_target(tmp_path_factory) -> Path:
    """A small-vocabulary, peaked Llama target (4 layers, so EAGLE-3 taps exist) whose
    checkpoint also carries a DeepSeek-layout MTP module."""
    import json

    from safetensors.torch import load_file, save_file

    from head_checkpoints import mtp_tensors
    from specx.export.random_checkpoint import CheckpointPreset, write_random_checkpoint

    root = tmp_path_factory.mktemp("head-target")
    path = write_random_checkpoint(
        root / "target",
        "llama",
        CheckpointPreset(32, 64, 4, 4, 2, HEAD_VOCAB),
        seed=3,
        tokenizer=False,
    )
    weights = load_file(path / "model.safetensors")
    weights["lm_head.weight"] *= 40.0
    config = json.loads((path / "config.json").read_text())
    weights.update(mtp_tensors("deepseek", config))
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return path


@pytest.fixture(scope="session")
def head_dirs(head_target, tmp_path_factory) -> dict[str, Path]:
    """Random heads in each public layout, for `head_target`."""
    import json

    from safetensors.torch import save_file

    from head_checkpoints import mtp_tensors, write_eagle, write_eagle3, write_medusa

    root = tmp_path_factory.mktemp("heads")
    config = json.loads((head_target / "config.json").read_text())
    dirs = {
        "eagle3": write_eagle3(root / "eagle3", config, draft_vocab=20),
        "eagle3-modelopt": write_eagle3(root / "eagle3-modelopt", config, 20, "modelopt", seed=1),
        "eagle": write_eagle(root / "eagle", config),
        "medusa": write_medusa(root / "medusa", config, num_heads=4),
    }
    for layout in ("qwen3_next", "mimo"):
        (root / layout).mkdir()
        save_file(mtp_tensors(layout, config), root / layout / "model.safetensors")
        dirs[f"mtp-{layout}"] = root / layout
    return dirs


HEAD_SPECS = {
    "eagle3": "eagle3:{eagle3}",
    "eagle3-modelopt": "eagle3:{eagle3-modelopt}",
    "eagle": "eagle:{eagle}",
    "medusa": "medusa:{medusa}",
    "mtp-deepseek": "mtp",
    "mtp-qwen3_next": "mtp:{mtp-qwen3_next}",
    "mtp-mimo": "mtp:{mtp-mimo}",
}


@pytest.fixture(scope="session")
def head_artifacts(head_target, head_dirs, tmp_path_factory) -> dict[str, Path]:
    """`head_target` exported with each head."""
    from specx.export.target_export import export_target

    root = tmp_path_factory.mktemp("head-artifacts")
    specs = {
        name: spec.format(**{k: str(v) for k, v in head_dirs.items()})
        for name, spec in HEAD_SPECS.items()
    }
    return {
        name: export_target(head_target, root / name, max_context=96, drafter=spec)
        for name, spec in specs.items()
    }


@pytest.fixture(scope="session")
def chat_artifact(checkpoints, tmp_path_factory):
    """The llama checkpoint with a chat template in its tokenizer_config.json, exported."""
    import json
    import shutil

    from specx.export.target_export import export_target

    root = tmp_path_factory.mktemp("chat")
    checkpoint = shutil.copytree(checkpoints["llama"], root / "checkpoint")
    config = {
        "chat_template": CHAT_TEMPLATE,
        "bos_token": {"content": "<|endoftext|>"},
        "eos_token": "<|endoftext|>",
    }
    (checkpoint / "tokenizer_config.json").write_text(json.dumps(config))
    return export_target(checkpoint, root / "artifact", max_context=128)


# The slow tier: end-to-end runs (real servers and Ray, training and regeneration, the
# committed drafters, whole-pipeline exports, transformers references, 4,000-sample
# statistical tests). `pytest -m "not slow"` leaves it out for quick local work (691 tests in
# 5.5 minutes on 2 cores, against 845 in 11.4 for the whole suite); CI runs every tier.
SLOW_MODULES = {
    "test_build_choice",
    "test_committed_heads",
    "test_distribution",
    "test_gemma_pipeline",
    "test_progress",
    "test_reference_recipe",
    "test_regenerate",
    "test_server",
    "test_sliding_window",
    "test_training",
    "test_weight_only",
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.module is not None and item.module.__name__ in SLOW_MODULES:
            item.add_marker(pytest.mark.slow)
