"""The errors specx raises on bad input; each message names the file, key or value at fault."""

__all__ = [
    "ArtifactError",
    "BuildError",
    "CalibrationError",
    "CheckpointError",
    "ExportError",
    "GenerationError",
    "SpecxError",
]


class SpecxError(Exception):
    """Base class of every error specx raises for bad input or a failed step."""


class CheckpointError(SpecxError):
    """A source checkpoint is unsupported, incomplete, mis-shaped or unsafe to load."""


class ExportError(SpecxError):
    """Exporting a model to ONNX failed or was asked for something unsupported."""


class ArtifactError(SpecxError):
    """An artifact is missing files, tampered with, or from an incompatible specx."""


class GenerationError(SpecxError):
    """A generation request cannot be served (e.g. the prompt exceeds the KV capacity)."""


class CapacityError(GenerationError):
    """A request needs more KV slots than the artifact holds.

    The numbers are kept for each caller's own words: the message speaks the CLI's flags,
    the server rephrases it in its request fields.
    """

    def __init__(self, longest: int, new_tokens: int, needed: int, capacity: int):
        super().__init__(
            f"the longest prompt has {longest} tokens; with {new_tokens} new tokens it "
            f"needs {needed} KV slots but the artifact's capacity is {capacity}: shorten the "
            "prompt, lower --max-new-tokens, or re-export with a larger --max-context (past "
            "the checkpoint's max_position_embeddings only with --beyond-trained-positions)"
        )
        self.longest, self.new_tokens, self.needed, self.capacity = (
            longest, new_tokens, needed, capacity,
        )  # fmt: skip


class BuildError(SpecxError):
    """`specx build` cannot build the requested backend (missing TensorRT, lint failures)."""


class CalibrationError(SpecxError):
    """`specx calibrate` cannot run on this input (no prompts, no drafter, prompts too long)."""
