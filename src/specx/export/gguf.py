"""GGUF files (llama.cpp's format) as export sources: `specx export model.gguf`.

Most CPU users hold their models as GGUF files quantized by llama.cpp. Such a file is read
by transformers' GGUF loader (with the `gguf` package: every tensor de-quantized to fp32, the
converter's rotary permutation of q and k undone, the tokenizer rebuilt from the file's
vocabulary), saved as an HF checkpoint in a scratch directory beside the output and exported
from there as any checkpoint is; the scratch directory goes when the export ends.

De-quantizing loses nothing: a Q4_0 block's values are (q - 8) x d with d in fp16, exact in
fp32, and so are Q8_0's q x d. So the weights llama.cpp runs can be taken back from the
exported graph: the manifest's source records the file's grid (`SourceGrid`: the one type
of every layer MatMul, and the output projection's), and `specx build --backend cpu` at the
matching width keeps those codes and scales (`specx.builders.grid`) instead of rounding again,
so its outputs can be compared with llama.cpp's token for token.

Architectures: the Llama and Qwen families (GGUF's `llama`, which Mistral's files use too,
`qwen2`, `qwen3`). Tensor types: the float ones and every type the `gguf` package
de-quantizes; a file with another is refused before anything is loaded, naming it.
"""

from __future__ import annotations

import collections
import re
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from specx.errors import ExportError
from specx.manifest_types import SourceGrid
from specx.progress import heartbeat

__all__ = ["ARCHITECTURES", "GgufFile", "find_gguf", "inspect_gguf", "write_checkpoint"]

ARCHITECTURES = ("llama", "qwen2", "qwen3")
FLOATS = ("F32", "F16", "BF16")
# The layer MatMuls' tensors in llama.cpp's names (blk.N.<role>.weight).
LINEAR_ROLES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
_LAYER_TENSOR = re.compile(r"blk\.\d+\.(\w+)\.weight")


@dataclass(frozen=True)
class GgufFile:
    """What a GGUF file holds, read from its header: enough to refuse it before loading."""

    path: Path
    architecture: str
    types: Mapping[str, int]  # tensor type name -> how many tensors have it
    grid: SourceGrid


def find_gguf(source: Path) -> Path | None:
    """The GGUF file `source` names: itself, or a directory's only *.gguf (None: neither).

    Raises:
        ExportError: a directory with several GGUF files (which one is ambiguous).
    """
    if source.is_file():
        return source if source.suffix == ".gguf" else None
    if (source / "config.json").is_file():
        return None  # an HF checkpoint, whatever else lies beside it
    found = sorted(source.glob("*.gguf"))
    if len(found) > 1:
        names = ", ".join(p.name for p in found)
        raise ExportError(f"{source} holds several GGUF files ({names}): name one")
    return found[0] if found else None


def inspect_gguf(path: Path) -> GgufFile:
    """The file's architecture and tensor types, checked.

    Raises:
        ExportError: not a GGUF file, an architecture or tensor type specx does not read, or
            the `gguf` package missing.
    """
    gguf = _gguf()
    try:
        reader = gguf.GGUFReader(path)
    except (ValueError, OSError) as e:
        raise ExportError(f"{path}: not a readable GGUF file ({e})") from None
    field = reader.fields.get("general.architecture")
    architecture = field.contents() if field is not None else None
    if architecture not in ARCHITECTURES:
        raise ExportError(
            f"{path}: GGUF architecture {architecture!r} is not supported; supported: "
            f"{', '.join(ARCHITECTURES)} (Llama, Mistral and Qwen families)"
        )
    readable = set(FLOATS) | {t.name for t in gguf.quants._type_traits}
    types = collections.Counter(t.tensor_type.name for t in reader.tensors)
    unreadable = sorted(set(types) - readable)
    if unreadable:
        raise ExportError(
            f"{path}: tensor type(s) {', '.join(unreadable)} cannot be read; readable: "
            f"{', '.join(sorted(readable))}"
        )
    return GgufFile(path, architecture, dict(types), _grid(path, reader.tensors))


def _grid(path: Path, tensors) -> SourceGrid:
    linears = {t.tensor_type.name for t in tensors if _role(t.name) in LINEAR_ROLES}
    output = [t.tensor_type.name for t in tensors if t.name == "output.weight"]
    return SourceGrid(
        format="gguf",
        file=path.name,
        linears=linears.pop() if len(linears) == 1 else None,
        output=output[0] if output else None,  # None: tied to the embeddings
    )


def _role(name: str) -> str | None:
    match = _LAYER_TENSOR.fullmatch(name)
    return match.group(1) if match else None


def write_checkpoint(
    gguf: GgufFile, parent: Path, progress: Callable[[str], None]
) -> tempfile.TemporaryDirectory:
    """The file as an fp32 HF checkpoint in a new scratch directory under `parent`.

    The caller removes it (`cleanup()`, or use it as a context manager).
    """
    import torch
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as transformers_logging

    scratch = tempfile.TemporaryDirectory(prefix=".specx-gguf-", dir=parent)
    folder, name = str(gguf.path.parent), gguf.path.name
    transformers_logging.disable_progress_bar()  # the heartbeat says it is still working
    try:
        with heartbeat(progress, "de-quantizing"):
            progress(f"reading {gguf.path} ({_summary(gguf.types)})")
            model = AutoModelForCausalLM.from_pretrained(
                folder, gguf_file=name, dtype=torch.float32
            )
            progress(f"writing it as an fp32 checkpoint in {scratch.name}")
            # Not save_pretrained, which refuses a model loaded from GGUF: the weights are
            # plain fp32 now, and the config loses the note that they were quantized.
            del model.config.quantization_config
            model.config.architectures = [type(model).__name__]
            model.config.save_pretrained(scratch.name)
            save_model(model, f"{scratch.name}/model.safetensors")
            del model
            AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(scratch.name)
    except BaseException:
        scratch.cleanup()
        raise
    return scratch


def _summary(types: Mapping[str, int]) -> str:
    return ", ".join(f"{n} {t}" for t, n in sorted(types.items(), key=lambda kv: -kv[1]))


def _gguf():
    try:
        import gguf
    except ImportError:
        raise ExportError(
            "reading GGUF files needs the gguf package: pip install 'specx[export]'"
        ) from None
    return gguf
