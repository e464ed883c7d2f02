"""A random-weight checkpoint shaped like Llama-3.2-1B, written without a download.

hidden 2048, 16 layers, 32 query / 8 KV heads (head_dim 64), intermediate 8192, vocab 128256,
llama3 RoPE scaling, untied lm_head: 1.50B parameters, bf16, 2.8 GB. Weights are N(0, 0.02)
(norms 1 + N(0, 0.02)), written tensor by tensor into one safetensors file; the tokenizer is
the demo byte-level BPE (benchmarks feed token ids). Near-uniform logits: compare speed on
it, not identity.

    python -m benchmarks.models.real_size_checkpoint DIR
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

LLAMA_1B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "factor": 32.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "hidden_act": "silu",
    "attention_bias": False,
    "mlp_bias": False,
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 0,
    "torch_dtype": "bfloat16",
}


def write(directory: Path, seed: int = 0) -> Path:
    """Writes config.json, model.safetensors (bf16) and tokenizer.json into `directory`."""
    import torch
    from safetensors.torch import save_file

    from specx.export.config import load_target_config
    from specx.export.decoder import TargetDecoder
    from specx.export.random_checkpoint import train_demo_tokenizer

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(LLAMA_1B, indent=2) + "\n")
    config, _ = load_target_config(directory)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in TargetDecoder.parameter_shapes(config).items():
        values = torch.randn(shape, generator=generator) * 0.02
        if name.endswith("norm.weight"):
            values += 1.0
        tensors[name] = values.to(torch.bfloat16)
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    train_demo_tokenizer(4096, directory / "tokenizer.json")
    return directory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    print(write(parser.parse_args().directory, parser.parse_args().seed))


if __name__ == "__main__":
    main()
