"""The values training's stages hand each other.

What to train (`TrainConfig`), on which windows (`Windows`), and what a kind builds its
drafter from (`Inputs`). Their own home, below the loop (`specx.training.loop`) and the
kinds it drives (`specx.training.kinds` and each kind's module), so a kind names these types
without importing the loop that imports it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specx.export.checkpoint import Checkpoint
from specx.training.teacher import Teacher

__all__ = ["Inputs", "TrainConfig", "Windows"]


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
    on_policy_windows: int = 0  # extra windows continued by the target (greedy and T=0.7)
    on_policy_prompt: int = 16  # corpus tokens that start each on-policy window
    tap_layers: tuple[int, ...] | None = None  # EAGLE-3 taps of the teacher (None: 2, N//2, N-3)
    save_every: int = 100
    eval_every: int = 0  # held-out acceptance every this many steps (0: before and after)
    bf16: bool = False  # bf16 autocast (fast where the CPU has AVX-512 BF16 or AMX)
    mask_unreachable: bool = True  # EAGLE-3: skip positions whose target argmax is off-vocab
    normalise_taps: bool = True  # EAGLE-3: taps scaled to unit RMS per channel (folded into fc)
    init: str | None = None  # a drafter of this kind (public format) to train on from; None: new


@dataclass(frozen=True)
class Windows:
    """Token windows [n, seq_len] to train on and to measure held-out acceptance on."""

    train: np.ndarray
    held_out: np.ndarray
    regenerated: int  # how many of `train` the target itself continued


@dataclass(frozen=True)
class Inputs:
    """What a kind builds its drafter from (`DrafterKind.build`)."""

    cfg: TrainConfig
    checkpoint: Checkpoint
    windows: Windows
    teacher: Teacher
