"""Long steps say what they are doing: numbered once each, and a heartbeat where silent."""

from __future__ import annotations

import re
import time

from specx.progress import heartbeat


def test_a_silent_step_says_it_is_still_running_until_it_ends():
    said: list[str] = []
    with heartbeat(said.append, "tracing", every_s=0.05):
        time.sleep(0.3)
    count = len(said)
    time.sleep(0.15)
    assert count >= 3 and len(said) == count  # nothing after the block
    assert all(re.fullmatch(r"  still tracing: \d+s", line) for line in said)


def test_export_numbers_each_step_once_with_and_without_a_head(
    checkpoints, head_target, head_dirs, tmp_path
):
    from specx.export.target_export import export_target

    for name, drafter in (("plain", None), ("head", f"eagle3:{head_dirs['eagle3']}")):
        said: list[str] = []
        checkpoint = checkpoints["llama"] if drafter is None else head_target
        export_target(checkpoint, tmp_path / name, max_context=64, drafter=drafter,
                      progress=said.append)  # fmt: skip
        steps = [line for line in said if re.match(r"\[\d/\d\]", line)]
        total = 5 if drafter is None else 6
        assert [s[:5] for s in steps] == [f"[{i}/{total}]" for i in range(1, total + 1)], said


def test_export_counts_a_tied_output_projection_once(checkpoints, tmp_path):
    """The parameter count it reports is the checkpoint's: a tied lm_head is the embedding."""
    import numpy as np
    from safetensors import safe_open

    from specx.export.config import load_target_config
    from specx.export.decoder import TargetDecoder
    from specx.export.target_export import export_target

    checkpoint = checkpoints["qwen2"]  # the tied family of the test checkpoints
    held = 0
    for file in checkpoint.glob("*.safetensors"):
        with safe_open(file, "np") as weights:
            held += sum(int(np.prod(weights.get_slice(k).get_shape())) for k in weights.keys())
    config = load_target_config(checkpoint)[0]
    assert config.tie_word_embeddings and TargetDecoder.parameter_count(config) == held
    said: list[str] = []
    export_target(checkpoint, tmp_path / "qwen2", max_context=64, progress=said.append)
    tracing = next(line for line in said if "tracing" in line and "parameters" in line)
    assert f"({held / 1e6:.1f}M parameters" in tracing, (tracing, held)
