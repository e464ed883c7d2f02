"""Function-preserving block expansion (LLaMA Pro, Wu et al. 2024): a deeper, same-function target.

A decoder layer adds `o_proj(attention)` and `down_proj(mlp)` to the residual stream. A copy
of a real layer with both output projections (and their biases) zeroed adds exactly 0.0,
so the grown model computes the original function bit for bit (x + 0 = x in float32), while
each added layer still does real attention and MLP work and keeps its own KV cache. Used to
get a target with a realistic cost structure (a one-layer draft head a few percent of the
target) and the predictions of a trained small model.

With `distinct_copies`, a copy instead has its two norm weights zeroed (its attention and
MLP then read zeros, and attention over zero values adds zero too) and every matrix drawn
afresh: it still adds exactly 0.0, and no two layers share weights. Measured reason: an
OpenVINO export of the zeroed-output expansion of pyref-7m (pyref-1b, 1.085B parameters)
was a fraction of onnxruntime-genai's size at int4, because OpenVINO stores identical
constants once, so it would read only part of a real model's weights per token
(docs/decisions.md#distinct-copies).

The stream entering layer i is the stream after the real layers placed before i, which
decides what a hidden-state tap at layer i reads (EAGLE-3 reads layers 2, N//2, N-3).
"""

from __future__ import annotations

import json
import shutil
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["ExpansionLayout", "expand_checkpoint"]

_ZEROED = ("self_attn.o_proj.", "mlp.down_proj.")
_SILENCING_NORMS = ("input_layernorm.weight", "post_attention_layernorm.weight")


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


def expand_checkpoint(
    source_dir: Path,
    output_dir: Path,
    layout: ExpansionLayout,
    distinct_copies: bool = False,
    seed: int = 0,
) -> Path:
    """Writes the expanded HF checkpoint (config, weights, tokenizer) to `output_dir`.

    `distinct_copies`: copies silenced by their norms, matrices redrawn (see above; `seed`).

    Raises:
        SpecxError: the source checkpoint does not load (see `load_checkpoint`).
    """
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
            if not real:
                value = _copy(value, name, distinct_copies, generator=(seed, layer))
            expanded[f"model.layers.{layer}.{name}"] = value
    output_dir.mkdir(parents=True, exist_ok=False)
    save_file(expanded, output_dir / "model.safetensors", metadata={"format": "pt"})
    config = dict(checkpoint.raw_config, num_hidden_layers=len(layout.source))
    (output_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (source_dir / name).is_file():
            shutil.copyfile(source_dir / name, output_dir / name)
    return output_dir


def _copy(value, name: str, distinct: bool, generator: tuple[int, int]):
    """A copied layer's tensor (see the module docstring).

    Output projections zeroed; or, `distinct`, norms zeroed and matrices redrawn with the
    source's spread (seeded by the seed, the layer and the name).
    """
    import torch

    if not distinct:
        return torch.zeros_like(value) if name.startswith(_ZEROED) else value
    if name in _SILENCING_NORMS:
        return torch.zeros_like(value)
    if value.ndim < 2:
        return value
    g = torch.Generator().manual_seed(hash((*generator, zlib.crc32(name.encode()))) % 2**63)
    noise = torch.randn(value.shape, generator=g, dtype=torch.float32) * value.float().std()
    return noise.to(value.dtype)
