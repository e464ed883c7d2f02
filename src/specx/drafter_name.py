"""`DrafterName`: a drafter as users name it, `KIND` or `KIND:ARGUMENT`, parsed in one place.

The runtime (which drafter to build, which calibration entry applies), export (which head
to export) and calibration (which entry to write, keyed by the kind) read the same
grammar; a module below every layer keeps it one definition. (`manifest_types.DrafterSpec`
is another thing: the head an artifact was exported with.)
"""

from __future__ import annotations

from dataclasses import dataclass

from specx.errors import SpecxError

__all__ = [
    "FEATURE_HEADS",
    "HEADS",
    "KINDS",
    "KIND_TABLE",
    "LOOKUPS",
    "STEPWISE",
    "DrafterKind",
    "DrafterName",
]


@dataclass(frozen=True)
class DrafterKind:
    """What specx knows of a drafter kind: the one table every layer reads."""

    name: str
    model_free: bool = False  # drafts from the text alone, where it repeats (the LOOKUP of
    # `LOOKUP+KIND`: `specx.runtime.drafters.combined`, e.g. ngram+eagle3)
    head: bool = False  # exported with the target: its graphs live in the artifact
    stepwise: bool = False  # one forward a depth: dynamic trees, priced per draft step


# Every drafter specx builds (`specx.runtime.drafters.DRAFTERS` builds each of these).
KIND_TABLE: dict[str, DrafterKind] = {
    kind.name: kind
    for kind in (
        DrafterKind("ngram", model_free=True),
        DrafterKind("suffix", model_free=True),
        DrafterKind("draft-model", stepwise=True),
        DrafterKind("skip", stepwise=True),
        DrafterKind("eagle3", head=True, stepwise=True),
        DrafterKind("eagle", head=True, stepwise=True),
        DrafterKind("mtp", head=True, stepwise=True),
        DrafterKind("medusa", head=True),  # every depth from one forward
    )
}
KINDS = tuple(KIND_TABLE)
LOOKUPS = tuple(k.name for k in KIND_TABLE.values() if k.model_free)
HEADS = tuple(k.name for k in KIND_TABLE.values() if k.head)
STEPWISE = tuple(k.name for k in KIND_TABLE.values() if k.stepwise)
# Heads that draft a depth a forward from the target's features (EAGLE, MTP; not Medusa).
FEATURE_HEADS = tuple(k for k in HEADS if k in STEPWISE)


@dataclass(frozen=True)
class DrafterName:
    """`kind` (ngram, suffix, draft-model, skip, eagle3, eagle, mtp, medusa) and its argument.

    The argument is a path (a draft model's artifact, a head's checkpoint directory), the
    layers `skip` leaves out, or None; `str()` spells the spec back as it was given.
    """

    kind: str
    argument: str | None = None

    @classmethod
    def parse(cls, text: str | DrafterName) -> DrafterName:
        """`KIND` or `KIND:ARGUMENT`; the argument may itself contain ':' (a path).

        A `DrafterName` is returned as it is, so a boundary may take either.
        """
        if isinstance(text, DrafterName):
            return text
        if not isinstance(text, str):
            raise SpecxError(f"a drafter is named by a string such as 'ngram', got {text!r}")
        kind, _, argument = text.partition(":")
        return cls(kind, argument or None)

    @classmethod
    def known(cls, text: str | DrafterName) -> DrafterName:
        """`parse`, refusing a kind specx does not build (export and training know fewer)."""
        name = cls.parse(text)
        if name.combined is not None:
            lookup, model = name.combined
            if lookup not in LOOKUPS or model not in KINDS or model in LOOKUPS:
                raise SpecxError(
                    f"drafter {name.kind!r}: a combined drafter is LOOKUP+KIND, LOOKUP one of "
                    f"{', '.join(LOOKUPS)} and KIND a model's ({', '.join(KINDS[2:])})"
                )
        elif name.kind not in KINDS:
            raise SpecxError(f"unknown drafter {name.kind!r}; choose one of {', '.join(KINDS)}")
        return name

    @property
    def combined(self) -> tuple[str, str] | None:
        """(lookup, model) kinds of a `LOOKUP+KIND` name, else None."""
        lookup, plus, model = self.kind.partition("+")
        return (lookup, model) if plus else None

    def __str__(self) -> str:
        return self.kind if self.argument is None else f"{self.kind}:{self.argument}"
