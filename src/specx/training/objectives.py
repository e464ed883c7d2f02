"""Distillation objectives, one per head: soft cross-entropy to the target (forward KL).

Conventions, for windows x_0..x_{T-1} and teacher `probs[t]` = p(x_{t+1} | x_<=t):
- a feature head at position t reads (token x_{t+1}, feature of x_t) and predicts
  x_{t+2}, so its label is probs[t + 1];
- EAGLE-3 / MTP "training-time test": step j >= 1 of the chain rooted at position r sits at
  position r + j, reads token x_{r+j+1} and the head's own output of step j - 1 (never the
  target's feature), attends to the real prefix [0, r] and its own chain, and is labelled
  probs[r + j + 1]; step j is weighted 0.8^j. This is the inference-time tree, unrolled.
- Medusa head k at position t predicts x_{t+k+2}: label probs[t + k + 1].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specx.training.teacher import TeacherOutput

__all__ = [
    "draft_model_loss",
    "eagle_loss",
    "medusa_loss",
    "soft_cross_entropy",
    "unrolled",
    "unrolled_loss",
]

STEP_DECAY = 0.8


def soft_cross_entropy(logits: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """Mean over positions of -sum_x p(x) log q(x): forward KL to the teacher up to a constant."""
    return -(probs * F.log_softmax(logits, -1)).sum(-1).mean()


def _chain_mask(n: int, step: int) -> torch.Tensor:
    """[n, (step + 1) * n]: chain root r sees real slots [0, r] and its own step-i slots."""
    real = torch.ones(n, n, dtype=torch.bool).tril()
    own = torch.eye(n, dtype=torch.bool)
    return torch.cat([real] + [own] * step, dim=1)


def _empty_cache(head, batch: int, slots: int) -> list[torch.Tensor]:
    """The head's K/V cache, in the dtype its projections produce (bf16 under autocast)."""
    c = head.config
    bf16 = torch.is_autocast_enabled("cpu")
    dtype = torch.get_autocast_dtype("cpu") if bf16 else torch.float32
    return [torch.zeros(batch, c.num_kv_heads, slots, c.head_dim, dtype=dtype) for _ in range(2)]


def unrolled(head, windows: torch.Tensor, features: torch.Tensor, steps: int):
    """The training-time-test unroll of an autoregressive head (EAGLE-3, EAGLE-1, MTP).

    Yields (step, logits [B, valid, V']) for each step whose labels lie in the window: the
    chains rooted at positions 0..valid-1, step `step` labelled `probs[:, step + 1 :][:,
    :valid]` (the module docstring's conventions).
    """
    batch, n = windows.shape
    cache = _empty_cache(head, batch, steps * n)
    hidden = features
    for step in range(steps):
        valid = n - step - 2  # chains whose label x_{r+step+2} lies in the window
        if valid <= 0:
            return
        tokens = torch.cat([windows[:, step + 1 :], windows.new_zeros(batch, step + 1)], 1)
        positions = (torch.arange(n) + step).expand(batch, n)
        mask = _chain_mask(n, step)[None, None].expand(batch, 1, n, (step + 1) * n)
        write_pos = torch.full((batch,), step * n, dtype=torch.int64)
        logits, hidden, *cache = head(tokens, hidden, positions, mask, write_pos, cache)
        yield step, logits[:, :valid]


def unrolled_loss(
    head,
    windows: torch.Tensor,
    teacher: TeacherOutput,
    features: torch.Tensor,
    steps: int,
    draft_probs=lambda probs: probs,
) -> torch.Tensor:
    """Training-time-test loss of an autoregressive head (EAGLE-3, MTP) over `steps` steps.

    `draft_probs` maps teacher probabilities onto the head's output vocabulary.
    """
    loss = windows.new_zeros((), dtype=torch.float32)
    for step, logits in unrolled(head, windows, features, steps):
        labels = draft_probs(teacher.probs[:, step + 1 : step + 1 + logits.shape[1]])
        loss = loss + STEP_DECAY**step * soft_cross_entropy(logits, labels)
    return loss


def eagle_loss(
    head, windows: torch.Tensor, teacher: TeacherOutput, token_weight: float = 0.1
) -> torch.Tensor:
    """EAGLE-1: smooth-L1 regression of the next feature + soft CE of the next token."""
    batch, n = windows.shape
    cache = _empty_cache(head, batch, n)
    tokens = torch.cat([windows[:, 1:], windows.new_zeros(batch, 1)], 1)
    mask = torch.ones(n, n, dtype=torch.bool).tril()[None, None].expand(batch, 1, n, n)
    logits, hidden, *_ = head(
        tokens,
        teacher.last,
        torch.arange(n).expand(batch, n),
        mask,
        torch.zeros(batch, dtype=torch.int64),
        cache,
    )
    regression = F.smooth_l1_loss(hidden[:, : n - 2], teacher.last[:, 1 : n - 1])
    return regression + token_weight * soft_cross_entropy(
        logits[:, : n - 2], teacher.probs[:, 1 : n - 1]
    )


def medusa_loss(heads, teacher: TeacherOutput) -> torch.Tensor:
    """Medusa-1 on the frozen target: head k at t is labelled probs[t + k + 1]."""
    logits = heads(teacher.last)  # [B, T, K, V]
    n, count = logits.shape[1], logits.shape[2]
    loss = logits.new_zeros(())
    for k in range(count):
        if n - k - 1 > 0:
            loss = loss + STEP_DECAY**k * soft_cross_entropy(
                logits[:, : n - k - 1, k], teacher.probs[:, k + 1 :]
            )
    return loss


def draft_model_loss(model, windows: torch.Tensor, teacher: TeacherOutput) -> torch.Tensor:
    """An independent draft model: soft CE to the target at every position."""
    return soft_cross_entropy(model(windows).logits, teacher.probs)
