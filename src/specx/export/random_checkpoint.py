"""Random-weight HF checkpoints of every supported family, for demos, tests and benchmarks.

No model hub is reachable where specx is built and tested, so the end-to-end path runs
on checkpoints written here with `transformers` config classes and `save_pretrained`,
plus a byte-level BPE tokenizer trained in about a second on the Python standard
library's own sources (present on every machine).
"""

from __future__ import annotations

import sysconfig
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "PRESETS",
    "CheckpointPreset",
    "train_byte_level_bpe",
    "train_demo_tokenizer",
    "write_random_checkpoint",
]


@dataclass(frozen=True)
class CheckpointPreset:
    """Sizes of a random checkpoint."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int
    max_position_embeddings: int = 4096


PRESETS = {
    "tiny": CheckpointPreset(64, 128, 4, 4, 2, 512),
    "small": CheckpointPreset(256, 688, 4, 8, 4, 2048),
    # The ~27M-parameter Llama-style config the design notes measure peers on.
    "bench-27m": CheckpointPreset(512, 1376, 8, 8, 4, 8192),
}

# family: (transformers config class, model class, extra config fields)
_FAMILY_CONFIGS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": None}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}),
    # Every other layer without RoPE, so a tiny model has both kinds.
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", {"no_rope_layer_interval": 2}),
    # Phi-4-mini's partial rotary (3/4 of each head turns); Phi-3.5's full rotary is the
    # longrope test's.
    "phi3": (
        "Phi3Config",
        "Phi3ForCausalLM",
        {"sliding_window": None, "partial_rotary_factor": 0.75},
    ),
    # Local and global layers alternating (each with its RoPE base), a softmax scale that is
    # not 1/sqrt(head_dim); the window (4096) is longer than any test context.
    # Gemma 2: caps small enough that removing either changes the logits by far more than
    # the tests' 1e-4 (random weights give tiny attention scores and logits).
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        {
            "head_dim": None,
            "query_pre_attn_scalar": 24,
            "attn_logit_softcapping": 0.02,
            "final_logit_softcapping": 1.0,
        },
    ),
    "gemma3_text": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        {"head_dim": None, "query_pre_attn_scalar": 24, "sliding_window_pattern": 2},
    ),
}


def train_byte_level_bpe(files: Sequence[Path], vocab_size: int, path: Path) -> None:
    """Trains a byte-level BPE (`<|endoftext|>` = id 0, no added BOS) and saves tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train([str(f) for f in files], trainer)
    tokenizer.save(str(path))


def train_demo_tokenizer(vocab_size: int, path: Path, max_files: int = 40) -> None:
    """A byte-level BPE trained on the first stdlib modules (token 0 = `<|endoftext|>`)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    train_byte_level_bpe(sorted(stdlib.glob("*.py"))[:max_files], vocab_size, path)


def write_random_checkpoint(
    directory: str | Path,
    family: str = "llama",
    preset: str | CheckpointPreset = "tiny",
    seed: int = 0,
    dtype: str = "float32",
    tokenizer: bool = True,
    tie_word_embeddings: bool | None = None,
) -> Path:
    """Writes a random-weight `family` checkpoint (config, safetensors, tokenizer.json)."""
    import torch
    import transformers

    sizes = PRESETS[preset] if isinstance(preset, str) else preset
    config_name, model_name, extra = _FAMILY_CONFIGS[family]
    kwargs = dict(
        hidden_size=sizes.hidden_size,
        intermediate_size=sizes.intermediate_size,
        num_hidden_layers=sizes.num_layers,
        num_attention_heads=sizes.num_heads,
        num_key_value_heads=sizes.num_kv_heads,
        vocab_size=sizes.vocab_size,
        max_position_embeddings=sizes.max_position_embeddings,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
        **{k: v for k, v in extra.items() if k != "head_dim"},
    )
    if "head_dim" in extra:
        kwargs["head_dim"] = sizes.hidden_size // sizes.num_heads
    if tie_word_embeddings is not None:
        kwargs["tie_word_embeddings"] = tie_word_embeddings
    config = getattr(transformers, config_name)(**kwargs)
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config)
    # HF initialises norms to 1 and biases to 0; perturb them so that tests can tell
    # a dropped norm weight or bias from a loaded one.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                param.add_(torch.randn_like(param) * 0.1)
    model = model.to(getattr(torch, dtype))
    directory = Path(directory)
    model.save_pretrained(directory)
    if tokenizer:
        train_demo_tokenizer(sizes.vocab_size, directory / "tokenizer.json")
    return directory
