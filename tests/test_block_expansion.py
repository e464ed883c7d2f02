"""Block expansion: a deeper checkpoint that computes the same function, bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import SHARED
from specx.training.block_expansion import ExpansionLayout, expand_checkpoint

# pyref-deep: pyref-7m's 5 layers at these positions of 32 (benchmarks/models/pyref_deep.py
# writes it with this placement; a test checks the library, never imports a benchmark).
PYREF_DEEP_LAYERS = 32
PYREF_DEEP_REAL = (0, 1, 15, 28, 31)


def logits(path: Path, prompts: list[list[int]]) -> list[torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        return [model(torch.tensor([p])).logits[0] for p in prompts]


def greedy(path: Path, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path).eval()
    out = []
    for prompt in prompts:
        ids = model.generate(
            torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False, pad_token_id=0
        )
        out.append(ids[0, len(prompt) :].tolist())
    return out


def test_layout_places_real_layers_and_copies():
    layout = ExpansionLayout.placing(10, (0, 1, 5, 9))
    assert layout.real == tuple(i in (0, 1, 5, 9) for i in range(10))
    assert layout.source == (0, 1, 2, 2, 2, 2, 3, 3, 3, 3)
    with pytest.raises(ValueError, match="must increase"):
        ExpansionLayout.placing(4, (0, 3, 2))
    with pytest.raises(ValueError, match="must increase"):
        ExpansionLayout.placing(4, (0, 4))


def test_pyref_deep_taps_read_the_streams_after_real_layers_1_2_3():
    layout = ExpansionLayout.placing(PYREF_DEEP_LAYERS, PYREF_DEEP_REAL)
    n = PYREF_DEEP_LAYERS
    for tap, real_before in zip((2, n // 2, n - 3), (2, 3, 4), strict=True):
        assert sum(layout.real[:tap]) == real_before  # the stream after R1, R2, R3
    assert sum(layout.real) == 5 and layout.real[-1]


def test_the_stream_after_i_real_blocks_enters_the_layer_after_the_ith():
    """What pyref-1b's renumbered EAGLE-3 taps (and OpenVINO's `hidden_layers_list`) read:
    benchmarks/models/pyref_wide.py places R0..R4 at 0, 1, L/2 - 1, L - 3, L - 1 and names
    the stream entering pyref-7m's layer i by the wide layer after R(i - 1)."""
    for layers in (20, 32):
        real = (0, 1, layers // 2 - 1, layers - 3, layers - 1)
        layout = ExpansionLayout.placing(layers, real)
        entering = [0, *(p + 1 for p in real)]
        for i in range(6):
            assert sum(layout.real[: entering[i]]) == i
        assert entering[5] == layers  # the last real block is the last layer


def test_expanded_checkpoint_computes_the_same_logits(checkpoints, tmp_path, rng):
    out = expand_checkpoint(
        checkpoints["llama"], tmp_path / "deep", ExpansionLayout.placing(10, (0, 1, 5, 9))
    )
    prompts = [rng.integers(1, 500, n).tolist() for n in (5, 17)]
    for a, b in zip(logits(checkpoints["llama"], prompts), logits(out, prompts), strict=True):
        assert torch.equal(a, b)
    with pytest.raises(FileExistsError):
        expand_checkpoint(checkpoints["llama"], out, ExpansionLayout.placing(10, (0, 1, 5, 9)))


def test_pyref_deep_greedy_equals_pyref_7m(tmp_path):
    source = SHARED / "models" / "pyref-7m"
    if not (source / "model.safetensors").is_file():
        pytest.skip(f"{source} is absent")
    layout = ExpansionLayout.placing(PYREF_DEEP_LAYERS, PYREF_DEEP_REAL)
    deep = expand_checkpoint(source, tmp_path / "pyref-deep", layout)
    prompts = [[1, 2, 3, 4], list(range(10, 40))]
    assert greedy(deep, prompts, 24) == greedy(source, prompts, 24)


def test_a_small_teacher_with_mapped_taps_gives_the_deep_targets_eagle3_features(
    checkpoints, tmp_path, rng
):
    """Heads for a block-expanded target train against the original with mapped taps."""
    from specx.export.checkpoint import load_checkpoint
    from specx.training.teacher import Teacher

    layout = ExpansionLayout.placing(10, (0, 2, 5, 8))  # taps 2, 5, 7 read after R0, R1, R2
    deep = load_checkpoint(expand_checkpoint(checkpoints["llama"], tmp_path / "deep", layout))
    small = load_checkpoint(checkpoints["llama"])
    windows = torch.tensor(rng.integers(1, 500, (2, 12)))
    expected = Teacher(deep.config, deep.state_dict)(windows)
    mapped = Teacher(small.config, small.state_dict, tap_layers=(1, 2, 3))(windows)
    assert torch.equal(mapped.eagle3, expected.eagle3)
    assert torch.equal(mapped.last, expected.last) and torch.equal(mapped.probs, expected.probs)


def test_distinct_copies_compute_the_same_logits_with_no_shared_weights(checkpoints, tmp_path, rng):
    """Copies silenced by their norms, matrices redrawn: the function bit for bit, and no
    two layers hold the same matrix (a runtime that stores equal constants once would read
    fewer weights than a real model of that size)."""
    from safetensors.torch import load_file

    layout = ExpansionLayout.placing(10, (0, 1, 5, 9))
    out = expand_checkpoint(checkpoints["llama"], tmp_path / "deep", layout, distinct_copies=True)
    prompts = [rng.integers(1, 500, n).tolist() for n in (5, 17)]
    for a, b in zip(logits(checkpoints["llama"], prompts), logits(out, prompts), strict=True):
        assert torch.equal(a, b)
    matrices = [v for v in load_file(out / "model.safetensors").values() if v.ndim == 2]
    digests = {hash(m.numpy().tobytes()) for m in matrices}
    assert len(digests) == len(matrices)
