"""`train_drafter`: distil a draft head or draft model against a frozen target.

Deterministic for a seed (batch order is a function of (seed, step)), resumable from the
last saved state (learning curve included), and it reports the held-out acceptance estimate
`sum_x min(p, q)` by draft depth (1..5) before, during (`eval_every`) and after training,
with the chain-5 acceptance length those rates imply.
"""

from __future__ import annotations

import json
import time
import warnings
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
from specx.training.config import Inputs, TrainConfig, Windows
from specx.training.corpus import read_texts, token_windows
from specx.training.kinds import DrafterKind, drafter_kind
from specx.training.regenerate import continue_windows, is_regenerated, read_windows
from specx.training.teacher import Teacher

__all__ = ["TrainConfig", "TrainResult", "check_output", "train_drafter"]

STATE_FILE = "train_state.pt"
REPORT_FILE = "train_report.json"


@dataclass(frozen=True)
class TrainResult:
    """The trained model (eval mode) and the report also written to train_report.json."""

    model: torch.nn.Module
    report: dict[str, Any]


def _on_policy(target_dir: Path, windows: np.ndarray, cfg: TrainConfig) -> np.ndarray:
    """Windows started from corpus tokens and continued by the target itself.

    Half greedy, half sampled at T=0.7: the continuations a head meets at inference
    (DistillSpec's on-policy data). `specx regenerate` makes such data at scale, on disk.
    """
    import tempfile

    from specx.artifact import load_manifest
    from specx.export.target_export import export_target
    from specx.runtime.targets.ort import OrtTarget

    rng = np.random.default_rng([cfg.seed, 1])
    starts = windows[rng.choice(len(windows), cfg.on_policy_windows), : cfg.on_policy_prompt]
    new = cfg.seq_len - cfg.on_policy_prompt
    with tempfile.TemporaryDirectory(prefix="specx-on-policy-") as scratch:
        artifact = export_target(target_dir, Path(scratch) / "target", max_context=cfg.seq_len)
        target = OrtTarget(load_manifest(artifact))
        out = [
            continue_windows(
                target, starts[start : start + _GENERATE_BATCH], new, 0.7 * (i % 2), cfg.seed + i
            )
            for i, start in enumerate(range(0, len(starts), _GENERATE_BATCH))
        ]
    return np.concatenate(out).astype(windows.dtype)


_GENERATE_BATCH = 32


EVAL_DEPTH = 5  # held-out acceptance is measured for chains this deep


@torch.no_grad()
def _acceptance(
    kind: DrafterKind, model, windows: np.ndarray, teacher: Teacher, batch: int
) -> list[float]:
    """Held-out acceptance estimate `sum min(p, q)` by draft depth (first = depth 1).

    A draft model reads real tokens at every depth, so its one estimate stands for all.
    """
    was_training = model.training
    model.eval()
    sums: dict[int, list[float]] = {}
    for start in range(0, len(windows), batch):
        chunk = torch.from_numpy(windows[start : start + batch])
        for depth, (q, p) in enumerate(kind.depths(model, chunk, teacher(chunk), EVAL_DEPTH)):
            sums.setdefault(depth, []).append(torch.minimum(p, q).sum(-1).mean().item())
    model.train(was_training)
    return [float(np.mean(sums[d])) for d in sorted(sums)]


def chain_tau(by_depth: Sequence[float], length: int) -> float:
    """Tokens a round emits on a chain of `length` (bonus counted), if depths were independent.

    A draft model's one estimate stands for every depth.
    """
    rates = [by_depth[min(d, len(by_depth) - 1)] for d in range(length)]
    return 1.0 + float(sum(np.cumprod(rates)))


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
) -> tuple[DrafterKind, Path]:
    """The checks that need no weights; returns the kind and the target's tokenizer.json."""
    kind = drafter_kind(cfg.kind)
    tokenizer_path = target_dir / "tokenizer.json"
    if not tokenizer_path.is_file():
        raise SpecxError(f"{target_dir} has no tokenizer.json to tokenize the corpus with")
    config, _ = load_target_config(target_dir)
    kind.check(config)
    if cfg.tap_layers is not None and not all(1 <= t <= config.num_layers for t in cfg.tap_layers):
        raise SpecxError(
            f"--tap-layers {list(cfg.tap_layers)} must be in [1, {config.num_layers}] (the states "
            f"entering those layers; {config.num_layers} = the last layer's output)"
        )
    if cfg.draft_vocab is not None and not 1 <= cfg.draft_vocab <= config.vocab_size:
        raise SpecxError(
            f"--draft-vocab {cfg.draft_vocab} must be in [1, {config.vocab_size}], the "
            "target's vocabulary"
        )
    if cfg.init is not None:
        if not Path(cfg.init).is_dir():
            raise SpecxError(f"--init {cfg.init}: no such directory")
        given = {"--tap-layers": cfg.tap_layers, "--draft-vocab": cfg.draft_vocab}
        shaped = [flag for flag, value in given.items() if value]
        if shaped:
            raise SpecxError(
                f"{' and '.join(shaped)}: the --init drafter keeps the shape it was trained with"
            )
    check_output(
        output_dir, [target_dir, *map(Path, corpus), *([Path(cfg.init)] if cfg.init else [])]
    )
    return kind, tokenizer_path


def _windows(
    tokenizer_path: Path,
    corpus: Sequence[str | Path],
    data: Sequence[Path],
    held_out: Path | None,
    cfg: TrainConfig,
) -> Windows:
    """Corpus windows (last `held_out_fraction` held out) plus regenerated ones (`data`).

    With `held_out` (a regenerated directory) acceptance is measured there, on the target's
    own continuations of prompts never trained on, and the corpus is not split.
    """
    from specx.runtime.tokenizer import TextTokenizer

    corpus_windows = np.zeros((0, cfg.seq_len), np.int64)
    if corpus:
        tokenizer = TextTokenizer(tokenizer_path)
        texts = [tokenizer.encode(t) for t in read_texts(corpus)]
        corpus_windows = token_windows(texts, cfg.seq_len)
    regenerated = [read_windows(d, cfg.seq_len) for d in data]
    if held_out is not None:
        train, held = corpus_windows, read_windows(held_out, cfg.seq_len)
    else:
        cut = max(1, int(len(corpus_windows) * cfg.held_out_fraction)) if corpus else 0
        train, held = corpus_windows[: len(corpus_windows) - cut], corpus_windows[-cut:]
        if corpus and len(train) == 0:
            raise SpecxError(
                f"the corpus gives {len(corpus_windows)} windows; need more than {cut}"
            )
        if not len(held):
            raise SpecxError("training on --data alone needs --held-out data to measure on")
    count = sum(len(r) for r in regenerated)
    train = np.concatenate([train, *regenerated])
    return Windows(train, held[: cfg.max_held_out_windows], count)


def train_drafter(
    target_dir: str | Path,
    corpus: Sequence[str | Path],
    output_dir: str | Path,
    cfg: TrainConfig,
    progress: Callable[[str], None] = lambda message: None,
    data: Sequence[str | Path] = (),
    held_out: str | Path | None = None,
) -> TrainResult:
    """Trains and saves a drafter in its public format (resuming a saved state).

    `data` are directories of target-generated windows (`specx regenerate`), trained on
    with the corpus; `held_out` one such directory to measure acceptance on.

    Raises:
        SpecxError: unknown kind, a target without tokenizer.json, a draft vocabulary
            larger than the target's, an output directory that holds other data or the
            inputs (`check_output`), too little text, or a `data` directory that is not a
            complete regeneration.
    """
    target_dir, output_dir = Path(target_dir), Path(output_dir)
    data_dirs = [Path(d) for d in data]
    held_dir = None if held_out is None else Path(held_out)
    inputs = [*map(Path, corpus), *data_dirs, *([held_dir] if held_dir else [])]
    kind, tokenizer_path = _check_request(target_dir, inputs, output_dir, cfg)
    for directory in inputs[len(corpus) :]:
        if not is_regenerated(directory):
            raise SpecxError(f"{directory} is not a directory written by `specx regenerate`")
    windows = _windows(tokenizer_path, corpus, data_dirs, held_dir, cfg)
    checkpoint = load_checkpoint(target_dir)
    if cfg.on_policy_windows:
        progress(f"sampling {cfg.on_policy_windows} on-policy windows from the target")
        extra = _on_policy(target_dir, windows.train, cfg)
        windows = Windows(
            np.concatenate([windows.train, extra]),
            windows.held_out,
            windows.regenerated + len(extra),
        )
    init = None if cfg.init is None else kind.load(Path(cfg.init), checkpoint)
    taps = cfg.tap_layers if init is None else getattr(init, "tap_layers", None)
    teacher = Teacher(checkpoint.config, checkpoint.state_dict, taps)
    torch.manual_seed(cfg.seed)
    model, vocab = kind.build(Inputs(cfg, checkpoint, windows, teacher), init)
    if vocab:
        progress(
            f"draft vocabulary {vocab['draft_vocab']}: covers {vocab['coverage_train']:.4f} of "
            f"the training tokens, {vocab['coverage_held_out']:.4f} of the held-out ones"
        )
    run = _Run(kind, cfg, model, windows, teacher, output_dir, progress)
    run.train()
    model.eval()
    kind.save(model, output_dir, checkpoint, tokenizer_path)
    report = {
        "kind": cfg.kind,
        "config": {**cfg.__dict__, "tap_layers": cfg.tap_layers and list(cfg.tap_layers)},
        "train_windows": len(windows.train),
        "regenerated_windows": windows.regenerated,
        "held_out_windows": len(windows.held_out),
        **vocab,
        "first_loss": run.losses[0] if run.losses else None,
        "final_loss": float(np.mean(run.losses[-20:])) if run.losses else None,
        "held_out_acceptance_before": run.curve[0]["acceptance"] if run.curve else None,
        "held_out_acceptance_after": run.after,
        "learning_curve": run.curve,
        "train_seconds": run.seconds,
    }
    atomic_write_text(output_dir / REPORT_FILE, json.dumps(report, indent=2) + "\n")
    run.state_path.unlink(missing_ok=True)
    before = report["held_out_acceptance_before"]
    progress(f"saved {output_dir}: held-out acceptance {before} -> {run.after:.3f}")
    return TrainResult(model, report)


class _Run:
    """One training run: optimizer, schedule, saved state, progress and learning curve.

    The curve holds (step, training tokens, held-out first-position acceptance) at step 0
    and every `eval_every` steps; the state saved every `save_every` steps holds it too, so
    a resumed run continues the same curve and reaches the same weights.
    """

    def __init__(
        self, kind: DrafterKind, cfg, model, windows: Windows, teacher, output_dir: Path, progress
    ):
        self.kind, self.cfg, self.model, self.windows = kind, cfg, model, windows
        self.teacher = teacher
        self.progress = progress
        model.train()
        self.optimizer = torch.optim.AdamW(
            [p for p in model.parameters() if p.requires_grad], lr=cfg.lr, weight_decay=0.0
        )
        steps = max(cfg.steps, 1)
        self.schedule = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: min(1.0, (s + 1) / 20) * max(0.1, 1 - s / steps)
        )
        output_dir.mkdir(parents=True, exist_ok=True)
        self.state_path = output_dir / STATE_FILE
        self.start, self.seconds = 0, 0.0
        self.losses: list[float] = []
        self.curve: list[dict[str, Any]] = []  # one acceptance measurement per entry
        if self.state_path.is_file():
            self._load()
            progress(f"resuming {cfg.kind} training at step {self.start}")
        self.after = float("nan")

    def _load(self) -> None:
        state = torch.load(self.state_path, weights_only=True)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.schedule.load_state_dict(state["schedule"])
        self.start, self.losses = int(state["step"]), list(state["losses"].tolist())
        self.curve = json.loads(state.get("curve", "[]"))
        self.seconds = float(state.get("seconds", 0.0))

    def _save(self, step: int) -> None:
        state = {
            "step": step,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "schedule": self.schedule.state_dict(),
            "losses": torch.tensor(self.losses),
            "curve": json.dumps(self.curve),
            "seconds": self.seconds,
        }
        partial = self.state_path.with_name(STATE_FILE + ".partial")
        torch.save(state, partial)
        partial.replace(self.state_path)

    def _measure(self, step: int) -> float:
        by_depth = _acceptance(
            self.kind, self.model, self.windows.held_out, self.teacher, self.cfg.batch
        )
        self.curve.append(
            {
                "step": step,
                "tokens": step * self.cfg.batch * self.cfg.seq_len,
                "acceptance": by_depth[0],
                "acceptance_by_depth": by_depth,
                "tau_chain5_estimate": chain_tau(by_depth, EVAL_DEPTH),
            }
        )
        return by_depth[0]

    def _step(self, step: int) -> None:
        cfg = self.cfg
        order = np.random.default_rng([cfg.seed, step]).choice(len(self.windows.train), cfg.batch)
        batch = torch.from_numpy(self.windows.train[order])
        labels = self.teacher(batch)  # fp32: bf16 trains the drafter, not its labels
        with torch.autocast("cpu", torch.bfloat16, enabled=cfg.bf16), warnings.catch_warnings():
            # RMSNorm's fp32 scale on bf16 input takes torch's unfused path, and says so.
            warnings.filterwarnings("ignore", "Mismatch dtype between input and weight")
            loss = self.kind.loss(self.model, batch, labels, cfg)
        self.optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.schedule.step()
        self.losses.append(loss.item())

    def train(self) -> None:
        """Runs the remaining steps, then measures held-out acceptance (`self.after`)."""
        cfg = self.cfg
        if self.start == 0:
            self._measure(0)
        began, start = time.perf_counter(), self.start
        for step in range(self.start, cfg.steps):
            self._step(step)
            done = step + 1
            if cfg.eval_every and done % cfg.eval_every == 0 and done < cfg.steps:
                self._measure(done)
            if done % 20 == 0 or done == cfg.steps:
                self._report(done, start, time.perf_counter() - began)
            if done % cfg.save_every == 0 and done < cfg.steps:
                self._save_at(done, began)
                began, start = time.perf_counter(), done
        self.seconds += time.perf_counter() - began
        self.after = self._measure(cfg.steps) if cfg.steps else float("nan")

    def _save_at(self, step: int, began: float) -> None:
        self.seconds += time.perf_counter() - began
        self._save(step)

    def _report(self, done: int, start: int, elapsed: float) -> None:
        cfg = self.cfg
        rate = (done - start) * cfg.batch * cfg.seq_len / max(elapsed, 1e-9)
        last = self.curve[-1] if self.curve else None
        held = (
            f", held-out acceptance {last['acceptance']:.3f} at step {last['step']}" if last else ""
        )
        self.progress(
            f"{cfg.kind} step {done}/{cfg.steps} loss {np.mean(self.losses[-20:]):.4f} "
            f"({rate:.0f} tokens/s{held})"
        )
