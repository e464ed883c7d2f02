"""EAGLE-3's training: a draft vocabulary, taps of three target layers, unrolled chains.

What only EAGLE-3 has: its head reads three tap layers of the teacher (`--tap-layers`),
predicts over a draft vocabulary of the most frequent training tokens (`--draft-vocab`;
d2t/t2d in its public format) and trains on taps scaled to unit RMS per channel
(`--normalise-taps`), a scale folded into its `fc` when it is saved.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from specx.errors import SpecxError
from specx.export.checkpoint import Checkpoint
from specx.export.config import TargetConfig
from specx.export.heads.eagle3 import Eagle3Head
from specx.training.heads import AutoregressiveKind, Public, Tensors, llama_config, one_layer
from specx.training.objectives import unrolled_loss
from specx.training.teacher import Teacher, TeacherOutput

if TYPE_CHECKING:
    from specx.training.config import Inputs, TrainConfig

__all__ = ["Eagle3Kind", "coverage", "draft_vocab"]


class Eagle3Kind(AutoregressiveKind):
    """EAGLE-3 (see the module docstring)."""

    name = "eagle3"
    options = frozenset(
        {"draft_vocab", "tap_layers", "normalise_taps", "ttt_steps", "mask_unreachable"}
    )
    frozen = ("embed_tokens.weight",)

    def check(self, target: TargetConfig) -> None:
        """Refuses a target with fewer than the 3 layers its taps read."""
        if target.num_layers < 3:
            raise SpecxError(
                f"EAGLE-3 needs a target with at least 3 layers; it has {target.num_layers}"
            )

    def build(
        self, given: Inputs, init: torch.nn.Module | None
    ) -> tuple[torch.nn.Module, dict[str, Any]]:
        """`init` or a new head, its taps scaled; the draft vocabulary's coverage."""
        cfg, windows, vocab = given.cfg, given.windows, given.checkpoint.config.vocab_size
        if init is None:
            ids = draft_vocab(windows.train, cfg.draft_vocab or vocab, vocab)
            model: Any = self.freeze(self.new(cfg, given.checkpoint, ids))
        else:
            model = init
            ids = (torch.arange(len(model.d2t)) + model.d2t).numpy()
        if cfg.normalise_taps:  # an --init head's fc reads raw taps: unfold the scale
            model.tap_scale = _tap_scale(given.teacher, windows.train)
            if init is not None:
                model.fc.weight.data.div_(model.tap_scale)
        report = {
            "draft_vocab": len(ids),
            "coverage_train": coverage(windows.train, ids, vocab),
            "coverage_held_out": coverage(windows.held_out, ids, vocab),
        }
        return model, report

    def new(
        self, cfg: TrainConfig, checkpoint: Checkpoint, draft_ids: np.ndarray | None = None
    ) -> torch.nn.Module:
        """A new head over `draft_ids` (None: the full vocabulary), reading `cfg.tap_layers`."""
        config, target = checkpoint.config, checkpoint.state_dict
        ids = np.arange(config.vocab_size) if draft_ids is None else np.sort(draft_ids)
        head = Eagle3Head(one_layer(config), config.hidden_size, config.vocab_size, len(ids))
        head.tap_layers = cfg.tap_layers
        # Its output meets the target's lm_head, so its final norm starts as the target's
        # (pyref-7m's scale is ~2: from ones, Adam at lr 2e-3 needs ~500 steps to get there).
        head.norm.weight.data.copy_(target["model.norm.weight"])
        head.embed_tokens.weight.data.copy_(target["model.embed_tokens.weight"])
        head.lm_head.weight.data.copy_(target["lm_head.weight"][torch.from_numpy(ids)])
        head.d2t.copy_(torch.from_numpy(ids) - torch.arange(len(ids)))
        return head

    def loss(
        self, model: Any, windows: torch.Tensor, teacher: TeacherOutput, cfg: TrainConfig
    ) -> torch.Tensor:
        """Unrolled chains against the target's distribution on the draft vocabulary."""
        keep = torch.arange(len(model.d2t)) + model.d2t
        reachable = torch.zeros(teacher.probs.shape[-1], dtype=torch.bool)
        reachable[keep] = True

        def on_draft_vocab(probs):
            # The target's distribution renormalised over the draft vocabulary; with
            # `mask_unreachable`, positions whose target argmax the head cannot propose
            # weigh nothing (EAGLE-3's `position_mask`).
            restricted = probs[..., keep]
            labels = restricted / restricted.sum(-1, keepdim=True).clamp_min(1e-12)
            if cfg.mask_unreachable:
                labels = labels * reachable[probs.argmax(-1)][..., None]
            return labels

        features = self.features(model, teacher)
        return unrolled_loss(model, windows, teacher, features, cfg.ttt_steps, on_draft_vocab)

    def features(self, model: Any, teacher: TeacherOutput) -> torch.Tensor:
        """The three taps, projected by the head's `fc`."""
        return model.project(teacher.eagle3)

    def on_target_vocab(self, model: Any, q: torch.Tensor, vocab: int) -> torch.Tensor:
        """The draft vocabulary's distribution placed on the target's (zero elsewhere)."""
        full = q.new_zeros(*q.shape[:-1], vocab)
        full[..., torch.arange(len(model.d2t)) + model.d2t] = q
        return full

    def save(
        self, model: torch.nn.Module, directory: Path, checkpoint: Checkpoint, tokenizer: Path
    ) -> None:
        """Writes the head, its tap scale folded into `fc` first: the saved head reads raw taps."""
        assert isinstance(model, Eagle3Head)
        model.fold_tap_scale()
        super().save(model, directory, checkpoint, tokenizer)

    def public(self, model: Any, state: Tensors, target_raw: dict[str, Any]) -> Public:
        """The official layout: no embeddings (the target's), t2d beside d2t, tap ids."""
        tensors = {k: v for k, v in state.items() if not k.startswith("embed_tokens")}
        t2d = torch.zeros(model.embed_tokens.num_embeddings, dtype=torch.bool)
        t2d[torch.arange(len(model.d2t)) + model.d2t] = True
        tensors["t2d"] = t2d
        config = llama_config(
            model.config,
            target_raw,
            architectures=["LlamaForCausalLMEagle3"],
            draft_vocab_size=len(model.d2t),
            target_hidden_size=model.fc.in_features // 3,
        )
        if model.tap_layers is not None:  # ModelOpt / SGLang numbering: layer outputs
            layers = [t - 1 for t in model.tap_layers]
            config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": layers}
        return config, {"model.safetensors": tensors}


def draft_vocab(windows: np.ndarray, size: int, vocab: int) -> np.ndarray:
    """The `size` most frequent target tokens of the training windows (ties: lower id)."""
    counts = np.bincount(windows.reshape(-1), minlength=vocab)
    return np.sort(np.argsort(-counts, kind="stable")[:size])


def coverage(windows: np.ndarray, ids: np.ndarray, vocab: int) -> float:
    """The share of `windows`' tokens whose id is in `ids` (a draft vocabulary)."""
    inside = np.zeros(vocab, dtype=bool)
    inside[ids] = True
    return float(inside[windows].mean())


def _tap_scale(teacher: Teacher, windows: np.ndarray, count: int = 16) -> torch.Tensor:
    """1 / the RMS of each tap channel over the first `count` training windows.

    The raw residual streams EAGLE-3 reads are large (pyref-7m: RMS 6-11 a channel, up to
    34) and uneven, so `fc`'s output swamps the draft layer's own updates at first and Adam
    moves the weights of loud channels as far as quiet ones. Training on unit-RMS taps is
    a preconditioner only: the scale is folded into `fc` when the head is saved.
    """
    taps = teacher(torch.from_numpy(windows[:count].astype(np.int64))).eagle3
    assert taps is not None
    return 1.0 / taps.pow(2).mean((0, 1)).sqrt().clamp_min(1e-6)
