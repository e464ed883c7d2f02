"""`train_drafter`: distil a draft head or draft model against a frozen target.

Deterministic for a seed (batch order is a function of (seed, step)), resumable from the
last saved state, and it reports the held-out acceptance estimate `sum_x min(p, q)` of the
first draft position before and after training.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from specx.artifact import atomic_write_text, check_parents
from specx.errors import SpecxError
from specx.export.checkpoint import load_checkpoint
from specx.export.config import load_target_config
from specx.export.heads.eagle3 import Eagle3Head
from specx.training.corpus import read_texts, token_windows
from specx.training.heads import HEAD_KINDS, new_head, save_head
from specx.training.objectives import draft_model_loss, eagle_loss, medusa_loss, unrolled_loss
from specx.training.teacher import Teacher, TeacherOutput

__all__ = ["DRAFTER_KINDS", "TrainConfig", "TrainResult", "check_output", "train_drafter"]

DRAFTER_KINDS = (*HEAD_KINDS, "draft-model")
STATE_FILE = "train_state.pt"
REPORT_FILE = "train_report.json"


@dataclass(frozen=True)
class TrainConfig:
    """What to train and how long; defaults suit a few minutes on 2 CPU cores."""

    kind: str
    steps: int = 300
    batch: int = 8
    seq_len: int = 128
    lr: float = 1e-3
    seed: int = 0
    ttt_steps: int = 3  # EAGLE-3 / MTP unrolled steps
    draft_vocab: int | None = None  # EAGLE-3 draft vocabulary (None = the full vocabulary)
    medusa_heads: int = 4
    draft_model_layers: int = 2
    held_out_fraction: float = 0.1
    max_held_out_windows: int = 64  # the acceptance estimate needs no more
    on_policy_windows: int = 0  # extra windows continued by sampling from the target
    on_policy_prompt: int = 16  # corpus tokens that start each on-policy window
    tap_layers: tuple[int, ...] | None = None  # EAGLE-3 taps of the teacher (None: 2, N//2, N-3)
    save_every: int = 100


@dataclass(frozen=True)
class TrainResult:
    """The trained model (eval mode) and the report also written to train_report.json."""

    model: torch.nn.Module
    report: dict[str, Any]


def _draft_vocab(windows: np.ndarray, size: int, vocab: int) -> np.ndarray:
    """The `size` most frequent target tokens of the training windows (ties: lower id)."""
    counts = np.bincount(windows.reshape(-1), minlength=vocab)
    return np.sort(np.argsort(-counts, kind="stable")[:size])


def _on_policy(target_dir: Path, windows: np.ndarray, cfg: TrainConfig) -> np.ndarray:
    """Windows started from corpus tokens and continued by sampling the target (T=1).

    The drafter then learns the target's own continuations (DistillSpec's on-policy data).
    """
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    rng = np.random.default_rng([cfg.seed, 1])
    starts = windows[rng.choice(len(windows), cfg.on_policy_windows), : cfg.on_policy_prompt]
    torch.manual_seed(cfg.seed)
    out = []
    for start in range(0, len(starts), cfg.batch):
        prompt = torch.from_numpy(starts[start : start + cfg.batch])
        new = cfg.seq_len - cfg.on_policy_prompt
        with torch.no_grad():
            sampled = model.generate(
                prompt,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                max_new_tokens=new,
                min_new_tokens=new,
                pad_token_id=0,
            )
        out.append(sampled.numpy())
    return np.concatenate(out)


def _new_draft_model(config, seed: int, layers: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    d = max(32, config.hidden_size // 2)
    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=config.vocab_size,
            hidden_size=d,
            intermediate_size=2 * d + d // 2,
            num_hidden_layers=layers,
            num_attention_heads=max(1, config.num_heads // 2),
            num_key_value_heads=max(1, config.num_kv_heads // 2),
            tie_word_embeddings=True,
            max_position_embeddings=config.max_position_embeddings,
            bos_token_id=config.bos_token_id,
            eos_token_id=list(config.eos_token_ids) or None,
        )
    )


def _loss(kind: str, model, windows: torch.Tensor, teacher: TeacherOutput, cfg: TrainConfig):
    if kind == "eagle3":
        keep = torch.arange(len(model.d2t)) + model.d2t

        def on_draft_vocab(probs):
            restricted = probs[..., keep]
            return restricted / restricted.sum(-1, keepdim=True).clamp_min(1e-12)

        return unrolled_loss(
            model, windows, teacher, model.project(teacher.eagle3), cfg.ttt_steps, on_draft_vocab
        )
    if kind == "mtp":
        return unrolled_loss(model, windows, teacher, teacher.last, cfg.ttt_steps)
    if kind == "eagle":
        return eagle_loss(model, windows, teacher)
    if kind == "medusa":
        return medusa_loss(model, teacher)
    return draft_model_loss(model, windows, teacher)


@torch.no_grad()
def _first_position_q(kind: str, model, windows: torch.Tensor, teacher: TeacherOutput):
    """The drafter's distribution for x_{t+2} given x_<=t+1 (full vocab), and its labels."""
    batch, n = windows.shape
    if kind == "draft-model":
        return torch.softmax(model(windows).logits[:, 1:-1], -1), teacher.probs[:, 1:-1]
    if kind == "medusa":
        return torch.softmax(model(teacher.last)[:, :-2, 0], -1), teacher.probs[:, 1:-1]
    features = model.project(teacher.eagle3) if kind == "eagle3" else teacher.last
    c = model.config
    cache = [torch.zeros(batch, c.num_kv_heads, n, c.head_dim) for _ in range(2)]
    tokens = torch.cat([windows[:, 1:], windows.new_zeros(batch, 1)], 1)
    mask = torch.ones(n, n, dtype=torch.bool).tril()[None, None].expand(batch, 1, n, n)
    logits = model(
        tokens,
        features,
        torch.arange(n).expand(batch, n),
        mask,
        torch.zeros(batch, dtype=torch.int64),
        cache,
    )[0][:, :-2]
    q = torch.softmax(logits, -1)
    if isinstance(model, Eagle3Head):
        full = q.new_zeros(*q.shape[:-1], teacher.probs.shape[-1])
        full[..., torch.arange(len(model.d2t)) + model.d2t] = q
        q = full
    return q, teacher.probs[:, 1:-1]


def _acceptance(kind, model, windows: np.ndarray, teacher: Teacher, batch: int) -> float:
    was_training = model.training
    model.eval()
    rates = []
    for start in range(0, len(windows), batch):
        chunk = torch.from_numpy(windows[start : start + batch])
        q, p = _first_position_q(kind, model, chunk, teacher(chunk))
        rates.append(torch.minimum(p, q).sum(-1).mean().item())
    model.train(was_training)
    return float(np.mean(rates))


def check_output(output_dir: Path, sources: Sequence[Path]) -> None:
    """Refuses an output directory whose files training could overwrite but did not write.

    Training writes config.json, weights and a report into `output_dir`: it must be new,
    empty, or an earlier training output (holding its state or report), and must not be or
    hold the target checkpoint or a corpus path.

    Raises:
        SpecxError: naming the directory and the reason.
    """
    check_parents(output_dir)
    resolved = output_dir.resolve()
    for source in sources:
        source = source.resolve()
        if source == resolved or resolved in source.parents:
            raise SpecxError(f"-o {output_dir} is or holds {source}, an input of this training")
    if not output_dir.exists():
        return
    if not output_dir.is_dir():
        raise SpecxError(f"-o {output_dir} is a file, not a directory")
    ours = (output_dir / STATE_FILE).is_file() or (output_dir / REPORT_FILE).is_file()
    if any(output_dir.iterdir()) and not ours:
        raise SpecxError(
            f"-o {output_dir} is not empty and is not an earlier training output: give a new "
            "or empty directory (training would overwrite its config.json and weights)"
        )


def _check_request(
    target_dir: Path, corpus: Sequence[str | Path], output_dir: Path, cfg: TrainConfig
) -> Path:
    """The checks that need no weights; returns the target's tokenizer.json."""
    if cfg.kind not in DRAFTER_KINDS:
        raise SpecxError(f"unknown drafter {cfg.kind!r}; choose one of {', '.join(DRAFTER_KINDS)}")
    tokenizer_path = target_dir / "tokenizer.json"
    if not tokenizer_path.is_file():
        raise SpecxError(f"{target_dir} has no tokenizer.json to tokenize the corpus with")
    config, _ = load_target_config(target_dir)
    if cfg.kind == "eagle3" and config.num_layers < 3:
        raise SpecxError(
            f"EAGLE-3 needs a target with at least 3 layers; it has {config.num_layers}"
        )
    if cfg.tap_layers is not None and not all(0 <= t < config.num_layers for t in cfg.tap_layers):
        raise SpecxError(
            f"--tap-layers {list(cfg.tap_layers)} must be layers of the {config.num_layers}-layer "
            "target"
        )
    if cfg.draft_vocab is not None and not 1 <= cfg.draft_vocab <= config.vocab_size:
        raise SpecxError(
            f"--draft-vocab {cfg.draft_vocab} must be in [1, {config.vocab_size}], the "
            "target's vocabulary"
        )
    check_output(output_dir, [target_dir, *map(Path, corpus)])
    return tokenizer_path


def train_drafter(
    target_dir: str | Path,
    corpus: Sequence[str | Path],
    output_dir: str | Path,
    cfg: TrainConfig,
    progress: Callable[[str], None] = lambda message: None,
) -> TrainResult:
    """Trains and saves a drafter in its public format (resuming a saved state).

    Raises:
        SpecxError: unknown kind, a target without tokenizer.json, a draft vocabulary
            larger than the target's, an output directory that holds other data or the
            inputs (`check_output`), or too little text.
    """
    from specx.runtime.tokenizer import TextTokenizer

    target_dir, output_dir = Path(target_dir), Path(output_dir)
    tokenizer_path = _check_request(target_dir, corpus, output_dir, cfg)
    checkpoint = load_checkpoint(target_dir)
    config = checkpoint.config
    tokenizer = TextTokenizer(tokenizer_path)
    windows = token_windows([tokenizer.encode(t) for t in read_texts(corpus)], cfg.seq_len)
    held = max(1, int(len(windows) * cfg.held_out_fraction))
    train_windows, held_windows = windows[:-held], windows[-held:][: cfg.max_held_out_windows]
    if len(train_windows) == 0:
        raise SpecxError(f"the corpus gives {len(windows)} windows; need more than {held}")
    if cfg.on_policy_windows:
        progress(f"sampling {cfg.on_policy_windows} on-policy windows from the target")
        train_windows = np.concatenate([train_windows, _on_policy(target_dir, train_windows, cfg)])
    teacher = Teacher(config, checkpoint.state_dict, cfg.tap_layers)
    torch.manual_seed(cfg.seed)
    if cfg.kind == "draft-model":
        model = _new_draft_model(config, cfg.seed, cfg.draft_model_layers)
    else:
        draft_ids = None
        if cfg.kind == "eagle3" and cfg.draft_vocab:
            draft_ids = _draft_vocab(train_windows, cfg.draft_vocab, config.vocab_size)
        model = new_head(cfg.kind, config, checkpoint.state_dict, draft_ids, cfg.medusa_heads)
    model.train()
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=cfg.lr, weight_decay=0.0
    )
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / 20) * max(0.1, 1 - s / max(cfg.steps, 1))
    )
    output_dir.mkdir(parents=True, exist_ok=True)
    state_path = output_dir / STATE_FILE
    start, losses = 0, []
    if state_path.is_file():
        state = torch.load(state_path, weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        schedule.load_state_dict(state["schedule"])
        start, losses = int(state["step"]), list(state["losses"].tolist())
        progress(f"resuming {cfg.kind} training at step {start}")
    before = _acceptance(cfg.kind, model, held_windows, teacher, cfg.batch) if start == 0 else None
    started = time.perf_counter()
    for step in range(start, cfg.steps):
        order = np.random.default_rng([cfg.seed, step]).choice(len(train_windows), cfg.batch)
        batch = torch.from_numpy(train_windows[order])
        loss = _loss(cfg.kind, model, batch, teacher(batch), cfg)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
        done = step + 1
        if done % 20 == 0 or done == cfg.steps:
            rate = (done - start) * cfg.batch * cfg.seq_len / (time.perf_counter() - started)
            progress(
                f"{cfg.kind} step {done}/{cfg.steps} loss {np.mean(losses[-20:]):.4f} "
                f"({rate:.0f} tokens/s)"
            )
        if done % cfg.save_every == 0 and done < cfg.steps:
            torch.save(
                {
                    "step": done,
                    "model": model.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "schedule": schedule.state_dict(),
                    "losses": torch.tensor(losses),
                },
                state_path,
            )
    after = _acceptance(cfg.kind, model, held_windows, teacher, cfg.batch)
    model.eval()
    if cfg.kind == "draft-model":
        model.save_pretrained(output_dir)
        (output_dir / "tokenizer.json").write_bytes(tokenizer_path.read_bytes())
    else:
        save_head(model, output_dir, checkpoint.raw_config)
    report = {
        "kind": cfg.kind,
        "config": cfg.__dict__,
        "train_windows": len(train_windows),
        "held_out_windows": len(held_windows),
        "first_loss": losses[0] if losses else None,
        "final_loss": float(np.mean(losses[-20:])) if losses else None,
        "held_out_acceptance_before": before,
        "held_out_acceptance_after": after,
    }
    atomic_write_text(output_dir / REPORT_FILE, json.dumps(report, indent=2) + "\n")
    state_path.unlink(missing_ok=True)
    progress(f"saved {output_dir}: held-out acceptance {before} -> {after:.3f}")
    return TrainResult(model, report)
