"""Rebuild the reference target (a pyref-7m equivalent) from the Python standard library.

    python -m benchmarks.models.reference_target [--out DIR] [--steps 3562] [--no-compile]
    python -m benchmarks.models.reference_target --tiny --steps 3   # a seconds-long smoke run
    python -m benchmarks.models.reference_target --layers 12 --out ~/.cache/specx/pyref-12l

The recipe of `shared/models/pyref-7m/README.md`, fixed and seeded: every stdlib .py file
of the running Python (no test/, tests/, site-packages, __pycache__); files whose
`md5(relative path) % 100 < 3` are held out; a 4096-token byte-level BPE trained with
`tokenizers` (`<|endoftext|>` = 0); a Llama with hidden 320, 5 layers, 4 heads, 2 KV heads,
intermediate 864, tied embeddings; 3562 steps of 8 x 512 tokens, AdamW (0.9, 0.95), weight
decay 0.1 on matrices, peak LR 2e-3, 150 warmup steps, cosine to 10%, clip 1.0, bf16
autocast (+ torch.compile), seed 1234. Resumable (a state file every 250 steps). Writes an
HF checkpoint with tokenizer.json, held_out_files.json and report.json (held-out loss in
nats/token, bits/byte, top-1 accuracy). About 40 minutes on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

from specx.export.random_checkpoint import train_byte_level_bpe
from specx.training.corpus import stdlib_files

DEFAULT_OUT = Path.home() / ".cache" / "specx" / "pyref-rebuild"


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def encode(files: list[Path], tokenizer_path: Path) -> tuple[np.ndarray, int]:
    """All files as one stream, each followed by <|endoftext|>; and the byte count."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    texts = [f.read_text(encoding="utf-8", errors="replace") for f in files]
    ids = [np.array(e.ids + [0], dtype=np.int64) for e in tokenizer.encode_batch(texts)]
    return np.concatenate(ids), sum(len(t.encode()) for t in texts)


def model_config(tiny: bool, layers: int = 5):
    from transformers import LlamaConfig

    sizes = (
        dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=512,
        )
        if tiny
        else dict(
            hidden_size=320,
            intermediate_size=864,
            num_hidden_layers=layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=4096,
        )
    )
    return LlamaConfig(
        **sizes,
        max_position_embeddings=1024,
        rope_theta=1e4,
        tie_word_embeddings=True,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )


def learning_rate(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


@torch.no_grad()
def evaluate(model, stream: np.ndarray, n_bytes: int, seq_len: int, batch: int) -> dict:
    model.eval()
    count = (len(stream) - 1) // seq_len
    inputs = stream[: count * seq_len].reshape(count, seq_len)
    labels = stream[1 : count * seq_len + 1].reshape(count, seq_len)
    nats, correct = 0.0, 0
    for start in range(0, count, batch):
        x = torch.from_numpy(inputs[start : start + batch])
        y = torch.from_numpy(labels[start : start + batch])
        logits = model(x).logits.float()
        nats += torch.nn.functional.cross_entropy(
            logits.flatten(0, 1), y.flatten(), reduction="sum"
        ).item()
        correct += (logits.argmax(-1) == y).sum().item()
    tokens = count * seq_len
    model.train()
    return {
        "held_out_tokens": tokens,
        "nats_per_token": nats / tokens,
        "bits_per_byte": nats / math.log(2) / (n_bytes * tokens / len(stream)),
        "top1_accuracy": correct / tokens,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--steps", type=int, default=3562)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--warmup", type=int, default=150)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--tiny", action="store_true", help="Smoke-test sizes (seconds).")
    parser.add_argument(
        "--layers", type=int, default=5, help="Decoder layers (pyref-7m: 5; pyref-12l: 12)."
    )
    args = parser.parse_args()
    from transformers import LlamaForCausalLM

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    started = time.perf_counter()
    train_files, held_files = stdlib_files()
    if args.tiny:
        train_files, held_files = train_files[:30], held_files[:3]
    args.out.mkdir(parents=True, exist_ok=True)
    tokenizer_path = args.out / "tokenizer.json"
    config = model_config(args.tiny, args.layers)
    if not tokenizer_path.is_file():
        log(f"[1/4] training a {config.vocab_size}-token BPE on {len(train_files)} files")
        train_byte_level_bpe(train_files, config.vocab_size, tokenizer_path)
    train_stream, _ = encode(train_files, tokenizer_path)
    held_stream, held_bytes = encode(held_files, tokenizer_path)
    log(f"[2/4] {len(train_stream)} training tokens, {len(held_stream)} held-out tokens")
    model = LlamaForCausalLM(config)
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    others = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": matrices, "weight_decay": 0.1}, {"params": others, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
    )
    state_path, start = args.out / "train_state.pt", 0
    if state_path.is_file():
        state = torch.load(state_path, weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = int(state["step"])
        log(f"resuming at step {start}")
    step_fn = model if args.no_compile else torch.compile(model)
    log(
        f"[3/4] training {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters "
        f"for {args.steps} steps of {args.batch} x {args.seq_len} tokens"
    )
    clock = time.perf_counter()
    for step in range(start, args.steps):
        rng = np.random.default_rng([args.seed, step])
        offsets = rng.integers(0, len(train_stream) - args.seq_len - 1, args.batch)
        rows = np.stack([train_stream[o : o + args.seq_len + 1] for o in offsets])
        x, y = torch.from_numpy(rows[:, :-1]), torch.from_numpy(rows[:, 1:])
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, args.steps, args.lr, args.warmup)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = step_fn(x).logits
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        done = step + 1
        if done % 50 == 0 or done == args.steps:
            rate = (done - start) * args.batch * args.seq_len / (time.perf_counter() - clock)
            log(f"step {done}/{args.steps} loss {loss.item():.3f} ({rate:.0f} tokens/s)")
        if done % 250 == 0 and done < args.steps:
            torch.save(
                {"step": done, "model": model.state_dict(), "optimizer": optimizer.state_dict()},
                state_path,
            )
    log("[4/4] evaluating on the held-out files")
    report = {
        "recipe": "benchmarks/models/reference_target.py",
        "steps": args.steps,
        "seed": args.seed,
        "tiny": args.tiny,
        "layers": config.num_hidden_layers,
        "train_files": len(train_files),
        "held_out_files": len(held_files),
        **evaluate(model, held_stream, held_bytes, args.seq_len, args.batch),
        "wall_s": time.perf_counter() - started,
    }
    model.save_pretrained(args.out)
    root = Path(__import__("sysconfig").get_paths()["stdlib"])
    (args.out / "held_out_files.json").write_text(
        json.dumps(
            {"held_out_files": [p.relative_to(root).as_posix() for p in held_files]}, indent=2
        )
    )
    (args.out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    state_path.unlink(missing_ok=True)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
