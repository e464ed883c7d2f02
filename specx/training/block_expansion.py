"""Function-preserving block expansion (LLaMA Pro, Wu et al. 2024): a deeper, same-function target.

A decoder layer adds `o_proj(attention)` and `down_proj(mlp)` to the residual stream. A copy
of a real layer with both output projections (and their biases) zeroed adds exactly 0.0,
so the grown model computes the original function bit for bit (x + 0 = x in float32), while
each added layer still does real attention and MLP work and keeps its own KV cache. Used to
get a target with a realistic cost structure (a one-layer draft head a few percent of the
target) and the predictions of a trained small model.

The stream entering layer i is the stream after the real layers placed before i, which
decides what a hidden-state tap at layer i reads (EAGLE-3 reads layers 2, N//2, N-3).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["ExpansionLayout", "expand_checkpoint"]

_ZEROED = ("self_attn.o_proj.", "mlp.down_proj.")


@dataclass(frozen=True)
class ExpansionLayout:
    """Which source layer each new layer copies; `real[i]` keeps its output projections."""

    source: tuple[int, ...]
    real: tuple[bool, ...]

    @classmethod
    def placing(cls, num_layers: int, real_positions: Sequence[int]) -> ExpansionLayout:
        """Source layer k at `real_positions[k]`; every other layer copies the next real one.

        Raises:
            ValueError: positions out of range or not increasing.
        """
        positions = list(real_positions)
        if positions != sorted(set(positions)) or positions[0] < 0 or positions[-1] >= num_layers:
            raise ValueError(f"real positions must increase within [0, {num_layers}): {positions}")
        source, real = [], []
        for layer in range(num_layers):
            k = next((k for k, p in enumerate(positions) if p >= layer), len(positions) - 1)
            source.append(k)
            real.append(positions[k] == layer)
        return cls(tuple(source), tuple(real))


def expand_checkpoint(source_dir: Path, output_dir: Path, layout: ExpansionLayout) -> Path:
    """Writes the expanded HF checkpoint (config, weights, tokenizer) to `output_dir`.

    Raises:
        SpecxError: the source checkpoint does not load (see `load_checkpoint`).
    """
    import torch
    from safetensors.torch import save_file

    from specx.export.checkpoint import load_checkpoint

    checkpoint = load_checkpoint(source_dir)
    tensors = checkpoint.state_dict
    layer_keys = [k for k in tensors if k.startswith("model.layers.")]
    outside = {k: tensors[k] for k in tensors if k not in layer_keys}
    if checkpoint.config.tie_word_embeddings:
        outside.pop("lm_head.weight", None)
    expanded = dict(outside)
    for layer, (k, real) in enumerate(zip(layout.source, layout.real, strict=True)):
        prefix = f"model.layers.{k}."
        for key in [key for key in layer_keys if key.startswith(prefix)]:
            name = key[len(prefix) :]
            value = tensors[key].clone()
            if not real and name.startswith(_ZEROED):
                value = torch.zeros_like(value)
            expanded[f"model.layers.{layer}.{name}"] = value
    output_dir.mkdir(parents=True, exist_ok=False)
    save_file(expanded, output_dir / "model.safetensors", metadata={"format": "pt"})
    config = dict(checkpoint.raw_config, num_hidden_layers=len(layout.source))
    (output_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (source_dir / name).is_file():
            shutil.copyfile(source_dir / name, output_dir / name)
    return output_dir
