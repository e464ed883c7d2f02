"""The draft heads training distils, one `DrafterKind` each (EAGLE-3's in `eagle3.py`).

A new head starts from the target: the embeddings and output projections it shares with
it are copied and frozen (`frozen`), as EAGLE, Medusa and DeepSeek's MTP do; everything
else starts from torch's default init. A trained head is written in its public format,
what `specx export --drafter KIND:DIR` reads (and `--init` trains on from).
"""

from __future__ import annotations

import dataclasses
import json
from abc import ABC, abstractmethod
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import save_file

from specx.export.checkpoint import Checkpoint
from specx.export.config import TargetConfig
from specx.export.heads.eagle import EagleHead
from specx.export.heads.medusa import MedusaHeads
from specx.export.heads.mtp import MTPHead
from specx.training.objectives import eagle_loss, medusa_loss, unrolled, unrolled_loss
from specx.training.teacher import TeacherOutput

if TYPE_CHECKING:
    from specx.training.config import Inputs, TrainConfig

__all__ = ["EagleKind", "HeadKind", "MTPKind", "MedusaKind", "llama_config", "one_layer"]

Tensors = dict[str, torch.Tensor]
Public = tuple[dict[str, Any], dict[str, Tensors]]  # config.json, {file name: tensors}


class HeadKind(ABC):
    """What the heads share: built on the target's tensors, loaded as `specx export` does."""

    name: str
    options: frozenset[str] = frozenset()
    frozen: tuple[str, ...] = ()  # the tensors shared with the target: copied, never trained

    def check(self, target: TargetConfig) -> None:  # noqa: D102 - every target will do
        return None

    def load(self, directory: Path, checkpoint: Checkpoint) -> torch.nn.Module:
        """The published head in `directory`, fp32, frozen as a new one."""
        from specx.export.heads import load_head

        return self.freeze(load_head(f"{self.name}:{directory}", checkpoint).float())

    def build(
        self, given: Inputs, init: torch.nn.Module | None
    ) -> tuple[torch.nn.Module, dict[str, Any]]:
        """`init`, or a new head; nothing for the report."""
        return (self.freeze(self.new(given.cfg, given.checkpoint)) if init is None else init), {}

    @abstractmethod
    def new(self, cfg: TrainConfig, checkpoint: Checkpoint) -> torch.nn.Module:
        """A freshly initialised head for the target (before `freeze`)."""

    @abstractmethod
    def loss(
        self, model: Any, windows: torch.Tensor, teacher: TeacherOutput, cfg: TrainConfig
    ) -> torch.Tensor:
        """The distillation loss of a batch (`specx.training.objectives`)."""

    @abstractmethod
    def depths(
        self, model: Any, windows: torch.Tensor, teacher: TeacherOutput, depth: int
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """(q, p) per draft depth (`specx.training.kinds.DrafterKind.depths`)."""

    def freeze(self, head: torch.nn.Module) -> torch.nn.Module:
        """`head` with the tensors it shares with the target (`frozen`) out of training."""
        for name, param in head.named_parameters():
            param.requires_grad_(name not in self.frozen)
        return head

    def save(
        self, model: torch.nn.Module, directory: Path, checkpoint: Checkpoint, tokenizer: Path
    ) -> None:
        """Writes the head's public format: its config.json and safetensors files."""
        directory.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
        config, files = self.public(model, state, checkpoint.raw_config)
        for name, tensors in files.items():
            save_file(tensors, directory / name, metadata={"format": "pt"})
        (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")

    @abstractmethod
    def public(self, model: Any, state: Tensors, target_raw: dict[str, Any]) -> Public:
        """The public format of `model`, whose tensors are `state`.

        `target_raw` is the target's config.json (RoPE settings, layer count).
        """


class AutoregressiveKind(HeadKind):
    """EAGLE-1, EAGLE-3 and MTP: chains drafted from the head's own outputs (`unrolled`)."""

    def features(self, model: Any, teacher: TeacherOutput) -> torch.Tensor:
        """What the head reads in place of the target's feature at the chain's root."""
        return teacher.last

    def on_target_vocab(self, model: Any, q: torch.Tensor, vocab: int) -> torch.Tensor:
        """The head's distribution placed on the target's vocabulary."""
        return q

    def depths(
        self, model: Any, windows: torch.Tensor, teacher: TeacherOutput, depth: int
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Depth d's q is built from the head's own earlier outputs, as at inference."""
        vocab = teacher.probs.shape[-1]
        for step, logits in unrolled(model, windows, self.features(model, teacher), depth):
            q = self.on_target_vocab(model, torch.softmax(logits, -1), vocab)
            yield q, teacher.probs[:, step + 1 : step + 1 + logits.shape[1]]


class EagleKind(AutoregressiveKind):
    """EAGLE-1/2: regresses the next feature and predicts the next token."""

    name = "eagle"
    frozen = ("embed_tokens.weight", "lm_head.weight")

    def new(self, cfg: TrainConfig, checkpoint: Checkpoint) -> torch.nn.Module:  # noqa: D102
        head = EagleHead(one_layer(checkpoint.config), fc_bias=True)
        head.embed_tokens.weight.data.copy_(checkpoint.state_dict["model.embed_tokens.weight"])
        head.lm_head.weight.data.copy_(checkpoint.state_dict["lm_head.weight"])
        return head

    def loss(  # noqa: D102
        self, model: Any, windows: torch.Tensor, teacher: TeacherOutput, cfg: TrainConfig
    ) -> torch.Tensor:
        return eagle_loss(model, windows, teacher)

    def public(self, model: Any, state: Tensors, target_raw: dict[str, Any]) -> Public:  # noqa: D102
        tensors = {k: v for k, v in state.items() if not k.startswith(("embed_tokens", "lm_head"))}
        config = llama_config(model.config, target_raw, bias=True)
        return config, {"model.safetensors": tensors}


class MTPKind(AutoregressiveKind):
    """DeepSeek-V3's multi-token prediction layer, trained by its own unrolled chains."""

    name = "mtp"
    options = frozenset({"ttt_steps"})
    frozen = ("embed_tokens.weight", "head.weight")

    def new(self, cfg: TrainConfig, checkpoint: Checkpoint) -> torch.nn.Module:  # noqa: D102
        target = checkpoint.state_dict
        head = MTPHead(one_layer(checkpoint.config), hidden_first=False)
        head.embed_tokens.weight.data.copy_(target["model.embed_tokens.weight"])
        head.head.weight.data.copy_(target["lm_head.weight"])
        head.norm.weight.data.copy_(target["model.norm.weight"])  # as EAGLE-3's (eagle3.py)
        return head

    def loss(  # noqa: D102
        self, model: Any, windows: torch.Tensor, teacher: TeacherOutput, cfg: TrainConfig
    ) -> torch.Tensor:
        return unrolled_loss(model, windows, teacher, teacher.last, cfg.ttt_steps)

    def public(self, model: Any, state: Tensors, target_raw: dict[str, Any]) -> Public:
        """DeepSeek-V3's layout: the layer after the target's last, model.layers.{N}.*."""
        p = f"model.layers.{target_raw['num_hidden_layers']}."
        names = {
            "enorm.weight": "enorm.weight",
            "hnorm.weight": "hnorm.weight",
            "proj.weight": "eh_proj.weight",
            "norm.weight": "shared_head.norm.weight",
            "head.weight": "shared_head.head.weight",
            "embed_tokens.weight": "embed_tokens.weight",
        }
        tensors = {p + theirs: state[ours] for ours, theirs in names.items()}
        tensors.update(
            {p + k.removeprefix("layer."): v for k, v in state.items() if k.startswith("layer.")}
        )
        return {"num_nextn_predict_layers": 1}, {"model.safetensors": tensors}


class MedusaKind(HeadKind):
    """Medusa-1: heads on the frozen target's last feature, head k guessing k + 2 ahead."""

    name = "medusa"
    options = frozenset({"medusa_heads"})

    def new(self, cfg: TrainConfig, checkpoint: Checkpoint) -> torch.nn.Module:  # noqa: D102
        config, lm_head = checkpoint.config, checkpoint.state_dict["lm_head.weight"]
        head = MedusaHeads(config.hidden_size, config.vocab_size, cfg.medusa_heads, 1)
        # torch types ModuleList items as plain Modules; each head is an nn.Sequential.
        for block in head.heads:  # Medusa starts each head as the target's lm_head
            torch.nn.init.zeros_(block[0].linear.weight)  # type: ignore[index]
            block[-1].weight.data.copy_(lm_head)  # type: ignore[index]
        return head

    def loss(  # noqa: D102
        self, model: Any, windows: torch.Tensor, teacher: TeacherOutput, cfg: TrainConfig
    ) -> torch.Tensor:
        return medusa_loss(model, teacher)

    def depths(
        self, model: Any, windows: torch.Tensor, teacher: TeacherOutput, depth: int
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Depth d is head d - 1's guess, from the target's feature alone."""
        logits = model(teacher.last)  # [B, T, K, V]
        for k in range(min(depth, logits.shape[2])):
            valid = windows.shape[1] - k - 2
            yield torch.softmax(logits[:, :valid, k], -1), teacher.probs[:, k + 1 : k + 1 + valid]

    def public(self, model: Any, state: Tensors, target_raw: dict[str, Any]) -> Public:  # noqa: D102
        tensors = {k.removeprefix("heads."): v for k, v in state.items()}
        depth = len(model.heads[0]) - 1  # an nn.Sequential, typed Module
        config = {"medusa_num_heads": len(model.heads), "medusa_num_layers": depth}
        return config, {"medusa_lm_head.safetensors": tensors}


def one_layer(config: TargetConfig) -> TargetConfig:
    """The target's layer shape, once: the draft layer of EAGLE and MTP heads."""
    return dataclasses.replace(config.llama_layers(), num_layers=1)


_ROPE_KEYS = ("rope_theta", "rope_scaling", "rope_parameters")


def llama_config(config: TargetConfig, target_raw: dict[str, Any], **extra: Any) -> dict:
    """The config.json of a one-layer Llama draft head, RoPE as the target's."""
    rope = {k: target_raw[k] for k in _ROPE_KEYS if target_raw.get(k) is not None}
    return {
        "model_type": "llama",
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": 1,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "vocab_size": config.vocab_size,
        "rms_norm_eps": config.rms_norm_eps,
        "max_position_embeddings": config.max_position_embeddings,
        **rope,
        **extra,
    }
