"""An independent draft model's training: a small Llama distilled on real tokens.

Unlike a head it reads no target features: it is a causal LM of its own (the target's
vocabulary, half its width), saved as a transformers checkpoint with the target's
tokenizer, what `specx export` turns into a `draft-model:` artifact.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from specx.errors import SpecxError
from specx.export.checkpoint import Checkpoint
from specx.export.config import TargetConfig
from specx.training.objectives import draft_model_loss
from specx.training.teacher import TeacherOutput

if TYPE_CHECKING:
    from specx.training.config import Inputs, TrainConfig

__all__ = ["DraftModelKind"]


class DraftModelKind:
    """A `DrafterKind` for draft models (see the module docstring)."""

    name = "draft-model"
    options = frozenset({"draft_model_layers"})

    def check(self, target: TargetConfig) -> None:  # noqa: D102 - every target will do
        return None

    def load(self, directory: Path, checkpoint: Checkpoint) -> torch.nn.Module:
        """A transformers causal LM over the target's vocabulary."""
        from transformers import AutoModelForCausalLM

        try:
            model = AutoModelForCausalLM.from_pretrained(directory, torch_dtype=torch.float32)
        except (OSError, ValueError) as e:
            raise SpecxError(
                f"--init {directory}: not a draft model transformers can load ({e})"
            ) from e
        if model.config.vocab_size != checkpoint.config.vocab_size:
            raise SpecxError(
                f"--init {directory}: vocabulary {model.config.vocab_size} differs from the "
                f"target's {checkpoint.config.vocab_size}"
            )
        return model

    def build(
        self, given: Inputs, init: torch.nn.Module | None
    ) -> tuple[torch.nn.Module, dict[str, Any]]:
        """`init`, or a new model of `cfg.draft_model_layers` layers; nothing for the report."""
        if init is not None:
            return init, {}
        cfg = given.cfg
        return _new_draft_model(given.checkpoint.config, cfg.seed, cfg.draft_model_layers), {}

    def loss(  # noqa: D102
        self, model: Any, windows: torch.Tensor, teacher: TeacherOutput, cfg: TrainConfig
    ) -> torch.Tensor:
        return draft_model_loss(model, windows, teacher)

    def depths(
        self, model: Any, windows: torch.Tensor, teacher: TeacherOutput, depth: int
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """One (q, p) for all depths: a draft model reads real tokens at every depth."""
        yield torch.softmax(model(windows).logits[:, 1:-1], -1), teacher.probs[:, 1:-1]

    def save(self, model: Any, directory: Path, checkpoint: Checkpoint, tokenizer: Path) -> None:
        """A transformers checkpoint with the target's tokenizer.json beside it."""
        model.save_pretrained(directory)
        (directory / "tokenizer.json").write_bytes(tokenizer.read_bytes())


def _new_draft_model(config: TargetConfig, seed: int, layers: int) -> torch.nn.Module:
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
