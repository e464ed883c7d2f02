"""Drafters behind one protocol, and the registry that builds them from a CLI spec."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from specx.drafter_name import HEADS, DrafterName
from specx.errors import SpecxError
from specx.runtime.drafters.base import Drafter
from specx.runtime.drafters.combined import CombinedDrafter
from specx.runtime.drafters.draft_model import DraftModelDrafter, check_same_vocabulary
from specx.runtime.drafters.feature_head import FeatureHeadDrafter
from specx.runtime.drafters.layer_skip import LayerSkipDrafter, default_skipped, parse_layers
from specx.runtime.drafters.medusa import MedusaDrafter
from specx.runtime.drafters.ngram import NGramDrafter
from specx.runtime.drafters.suffix import SuffixDrafter, SuffixOptions
from specx.runtime.targets import open_decoder
from specx.runtime.targets.base import DecoderBackend
from specx.runtime.tree_shapes import StaticTree, TreeShape, describe

__all__ = ["DRAFTERS", "Drafter", "DrafterOptions", "describe_drafts", "make_drafter"]


@dataclass(frozen=True)
class DrafterOptions:
    """Knobs shared by the drafters; each uses the ones that apply to it."""

    num_draft_tokens: int | None = None  # None: 4, or suffix drafting's 16-node budget
    tree: TreeShape | None = None  # None = a chain of num_draft_tokens
    ngram_min: int = 1
    ngram_max: int = 3
    ngram_matches: int = 1
    threads: int | None = None


def _ngram(target: DecoderBackend, argument: str | None, options: DrafterOptions) -> Drafter:
    if argument:
        raise SpecxError(f"the ngram drafter takes no argument, got 'ngram:{argument}'")
    if options.tree is not None:
        raise SpecxError("--tree does not apply to ngram: its tree comes from --ngram-matches")
    try:
        return NGramDrafter(
            _chain_length(options), options.ngram_min, options.ngram_max, options.ngram_matches
        )
    except ValueError as e:
        raise SpecxError(str(e)) from e


def _draft_model(target: DecoderBackend, argument: str | None, options: DrafterOptions) -> Drafter:
    from specx.artifact import load_manifest

    if not argument:
        raise SpecxError("draft-model needs an artifact: --drafter draft-model:PATH")
    draft = open_decoder(load_manifest(Path(argument)), threads=options.threads)
    check_same_vocabulary(target, draft)
    return DraftModelDrafter(draft, options.tree or StaticTree.chain(_chain_length(options)))


def _skip(target: DecoderBackend, argument: str | None, options: DrafterOptions) -> Drafter:
    """`skip:LAYERS`, or `skip`: the layers calibration chose, else `default_skipped`."""
    layers = target.num_layers
    if argument:
        skipped = parse_layers(argument, layers)
    elif "skip" in target.manifest.calibration_keys:
        skipped = frozenset(target.manifest.calibration("skip").skipped_layers)
    else:
        skipped = default_skipped(layers)
    shape = options.tree or StaticTree.chain(_chain_length(options))
    return LayerSkipDrafter(target, skipped, shape)


def _head(kind: str):
    def build(target: DecoderBackend, argument: str | None, options: DrafterOptions) -> Drafter:
        if argument:
            raise SpecxError(f"{kind} drafts with the artifact's own head; it takes no argument")
        head = target.manifest.drafter
        exported = None if head is None else head.kind
        if exported != kind:
            raise SpecxError(
                f"{target.manifest.root} was exported with drafter {exported!r}, not {kind!r}: "
                f"export with --drafter {kind}:DIR"
            )
        if kind == "medusa":
            return MedusaDrafter(target.manifest, options.tree, options.threads)
        shape = options.tree or StaticTree.chain(_chain_length(options))
        return FeatureHeadDrafter(target.manifest, shape, options.threads)

    return build


def _suffix(target: DecoderBackend, argument: str | None, options: DrafterOptions) -> Drafter:
    if argument:
        raise SpecxError(f"the suffix drafter takes no argument, got 'suffix:{argument}'")
    if options.tree is not None:
        raise SpecxError("--tree does not apply to suffix: it grows its own trees")
    budget = options.num_draft_tokens or SuffixOptions.max_nodes
    return SuffixDrafter(SuffixOptions(max_nodes=budget))


def _chain_length(options: DrafterOptions) -> int:
    return options.num_draft_tokens or 4


DRAFTERS: dict[str, Callable[[DecoderBackend, str | None, DrafterOptions], Drafter]] = {
    "ngram": _ngram,
    "suffix": _suffix,
    "draft-model": _draft_model,
    "skip": _skip,
    **{kind: _head(kind) for kind in HEADS},
}


def make_drafter(
    spec: str | DrafterName, target: DecoderBackend, options: DrafterOptions
) -> Drafter:
    """Builds a drafter from `NAME` or `NAME:ARGUMENT` (e.g. `draft-model:artifacts/small`)."""
    parsed = DrafterName.known(spec)
    if parsed.combined is not None:
        lookup, model = parsed.combined
        built = DRAFTERS[model](target, parsed.argument, options)
        # The lookup drafts chains as long as the model's; an n-gram takes a round only on a
        # match of 2 tokens or more, where it beat the model (docs/decisions.md#ngram-plus).
        looked = replace(
            options,
            tree=None,
            num_draft_tokens=built.max_nodes,
            ngram_min=max(options.ngram_min, 2),
            ngram_max=max(options.ngram_max, 2),
        )
        return CombinedDrafter(DRAFTERS[lookup](target, None, looked), built)
    return DRAFTERS[parsed.kind](target, parsed.argument, options)


def describe_drafts(drafter: Drafter) -> str:
    """What `drafter` proposes each round, for the stats.

    Its tree as `--tree` spells it, or a model-free drafter's own trees by their node budget.
    """
    shape = getattr(drafter, "shape", None)
    if shape is not None:
        return describe(shape)
    if isinstance(drafter, NGramDrafter) and drafter.max_matches == 1:
        return f"chain:{drafter.max_nodes}"
    return f"{drafter.name}'s own trees, up to {drafter.max_nodes} nodes"
