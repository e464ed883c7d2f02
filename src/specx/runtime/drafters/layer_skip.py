"""`skip`: the target drafts for itself with some of its layers skipped (self-speculation).

Draft & Verify and LayerSkip (the seed's section 7.2): the target minus a set of layers is
a cheaper model of the same vocabulary that often predicts what the whole target would, with
no extra weights and no training. Its draft cost c is about the kept layers' share of a
step (the embedding and lm_head are paid in full).

Here it is a draft model (`DraftModelDrafter`: chains, static and dynamic trees, sampled
chains for the sampled rule) whose model is a view of the target: on a cpu build
(`CpuTarget.skipping`) the view lists the kept layers' weights, which are the target's own
mapped pages, so the weights are in memory once. Its KV cache holds the kept layers and is
its own: it prefills the prompt once per request (`prepare`, about the kept share of the
target's prefill) rather than reading the target's cache, whose rows the whole target wrote.
ONNX Runtime and OpenVINO builds would need a second graph, whose initializers those
runtimes load (and ONNX Runtime prepacks) into memory of their own: a second copy of the
weights, which is what this drafter exists to avoid, so they refuse it and say so.

Exact like every drafter: what it drafts only decides what the target verifies.
"""

from __future__ import annotations

from specx.errors import SpecxError
from specx.runtime.drafters.draft_model import DraftModelDrafter
from specx.runtime.targets.base import DecoderBackend
from specx.runtime.tree_shapes import TreeShape

__all__ = ["LayerSkipDrafter", "default_skipped", "parse_layers"]


def parse_layers(text: str, num_layers: int) -> frozenset[int]:
    """`skip:LAYERS`'s argument: layer indices and ranges, "4,6,8-11" (0-based, inclusive).

    Raises:
        SpecxError: a malformed item, an index outside the target, or a set that skips no
            layer or every layer.
    """
    layers: set[int] = set()
    for item in text.split(","):
        first, dash, last = item.strip().partition("-")
        try:
            span = range(int(first), int(last if dash else first) + 1)
        except ValueError:
            raise SpecxError(
                f"skip:{text}: {item!r} is not a layer index or range (e.g. skip:4,6,8-11)"
            ) from None
        if not span or span.start < 0 or span.stop > num_layers:
            raise SpecxError(
                f"skip:{text}: {item!r} is outside the target's layers 0-{num_layers - 1}"
            )
        layers.update(span)
    if len(layers) >= num_layers:
        raise SpecxError(f"skip:{text} skips all {num_layers} layers: keep at least one")
    return frozenset(layers)


def default_skipped(num_layers: int) -> frozenset[int]:
    """Every other layer between the first and the last two, before calibration measures.

    The first layer and the last two are kept: the first turns embeddings into the residual
    stream the rest read, the last ones into logits; both are where skipping costs the most
    (LayerSkip, Draft & Verify).
    """
    return frozenset(range(1, num_layers - 2, 2))


class LayerSkipDrafter(DraftModelDrafter):
    """The target with `skipped` layers left out drafts a chain or tree for itself."""

    name = "skip"

    def __init__(self, target: DecoderBackend, skipped: frozenset[int], shape: TreeShape):
        skipping = getattr(target, "skipping", None)
        if skipping is None:
            raise SpecxError(
                f"{target.manifest.root}: --drafter skip runs on a cpu build (specx build "
                "--backend cpu), whose kernels skip layers over the target's own weights; an "
                "ONNX Runtime or OpenVINO build would hold a second copy of them"
            )
        if not skipped:
            raise SpecxError("skip: no layer skipped, so it would draft at the target's cost")
        super().__init__(skipping(skipped), shape)
        self.skipped = skipped
