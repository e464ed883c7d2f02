"""Export of a draft head next to its target: ONNX graphs plus the manifest's `drafter` entry."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from specx.artifact import sha256_file
from specx.drafter_name import DrafterName
from specx.export.heads.eagle import EagleHead
from specx.export.heads.eagle3 import Eagle3Head
from specx.export.heads.medusa import MedusaHeads
from specx.export.heads.mtp import MTPHead
from specx.export.onnx_graph import export_module, save_graph
from specx.graphs.draft_chain import HEAD_INPUTS, HEAD_OUTPUTS, save_draft_chain
from specx.graphs.signature import graph_entry
from specx.manifest_types import DecoderSpec, DrafterSpec, GraphEntry

__all__ = ["export_head"]

# The heads `specx.export.heads.load_head` returns; all but Medusa draft autoregressively.
AutoregressiveHead = Eagle3Head | EagleHead | MTPHead
DraftHead = AutoregressiveHead | MedusaHeads


class _Projection(nn.Module):
    def __init__(self, head: Eagle3Head):
        super().__init__()
        self.head = head

    def forward(self, taps: torch.Tensor) -> torch.Tensor:
        return self.head.project(taps)


def _autoregressive(head: nn.Module) -> nn.Module:
    class Flat(nn.Module):
        # torch.onnx wants flat tensors; the heads take the cache as a list.
        def __init__(self):
            super().__init__()
            self.head = head

        def forward(self, input_ids, features, position_ids, attention_mask, write_pos, key, value):
            return self.head(
                input_ids, features, position_ids, attention_mask, write_pos, [key, value]
            )

    return Flat()


def _ar_example(head: AutoregressiveHead) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    c = head.config
    batch, n, capacity, kv_len = 2, 3, 11, 7
    cache = [torch.zeros(batch, c.num_kv_heads, capacity, c.head_dim) for _ in range(2)]
    inputs = (
        torch.zeros(batch, n, dtype=torch.int64),
        torch.zeros(batch, n, c.hidden_size),
        torch.arange(n).repeat(batch, 1) + 4,
        torch.ones(batch, 1, n, kv_len, dtype=torch.bool),
        torch.tensor([4, 4]),
        *cache,
    )
    dim = torch.export.Dim
    b, t, cap, kv = dim("batch"), dim("tokens"), dim("capacity"), dim("kv_len")
    shapes = (
        {0: b, 1: t},
        {0: b, 1: t},
        {0: b, 1: t},
        {0: b, 2: t, 3: kv},
        {0: b},
        {0: b, 2: cap},
        {0: b, 2: cap},
    )
    return inputs, shapes


def _source(spec: str) -> dict[str, Any]:
    directory = DrafterName.parse(spec).argument
    if not directory:
        return {"spec": spec, "weights": "in the target checkpoint"}
    files = sorted(
        p for p in Path(directory).iterdir() if p.suffix in (".safetensors", ".bin", ".pt")
    )
    return {
        "spec": spec,
        "path": str(Path(directory).absolute()),
        "weights": {p.name: sha256_file(p) for p in files},
    }


def export_head(
    head: DraftHead, spec: str, staging: Path
) -> tuple[DrafterSpec, dict[str, GraphEntry]]:
    """Writes the head's graphs into `staging`.

    Returns:
        The manifest's `drafter` entry and the graph entries to add to `graphs`.
    """
    dim = torch.export.Dim
    drafter = DrafterSpec(head.kind, "draft_head", head.taps, source=_source(spec))
    if isinstance(head, MedusaHeads):
        width = head.hidden_size
        b, t = dim("batch"), dim("tokens")
        model = export_module(
            head,
            (torch.zeros(2, 3, width),),
            ({0: b, 1: t},),
            ["features"],
            ["logits"],
            "the medusa heads",
        )
        graph = graph_entry(model, *save_graph(model, staging, "draft_head"))
        return replace(drafter, medusa_heads=len(head.heads)), {"draft_head": graph}
    inputs, shapes = _ar_example(head)
    model = export_module(
        _autoregressive(head), inputs, shapes, HEAD_INPUTS, HEAD_OUTPUTS, f"the {head.kind} head"
    )
    entry = graph_entry(model, *save_graph(model, staging, "draft_head"))
    c = head.config
    vocab = int(entry.outputs[0].shape[-1])  # a draft vocabulary may be smaller than the target's
    entry = replace(entry, decoder=DecoderSpec(1, c.num_kv_heads, c.head_dim, c.hidden_size, vocab))
    graphs = {"draft_head": entry}
    if isinstance(head, Eagle3Head):  # the one head with a feature projection
        width = head.fc.in_features
        b, t = dim("batch"), dim("tokens")
        projection = export_module(
            _Projection(head),
            (torch.zeros(2, 3, width),),
            ({0: b, 1: t},),
            ["hidden_taps"],
            ["features"],
            f"the {head.kind} feature projection",
        )
        graphs["draft_projection"] = graph_entry(
            projection, *save_graph(projection, staging, "draft_projection")
        )
        drafter = replace(drafter, projection="draft_projection")
    d2t = getattr(head, "d2t", None)
    if d2t is not None:
        np.save(staging / "draft_d2t.npy", d2t.numpy())
        drafter = replace(drafter, d2t="draft_d2t.npy")
    graphs["draft_chain"] = save_draft_chain(staging, entry, drafter_d2t(head))
    return drafter, graphs


def drafter_d2t(head: nn.Module) -> np.ndarray | None:
    """EAGLE-3's draft id -> target id table (i + d2t[i]); None for target-vocabulary heads."""
    d2t = getattr(head, "d2t", None)
    return None if d2t is None else np.arange(len(d2t)) + d2t.numpy()
