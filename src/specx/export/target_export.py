"""`export_target`: HF checkpoint directory -> specx artifact with the target ONNX graph."""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import onnx_ir as ir
import torch

from specx.artifact import (
    atomic_output_dir,
    check_output_dir,
    exported_body,
    sha256_file,
    write_manifest,
)
from specx.chat import CHAT_TEMPLATE_FILE, ChatTemplate, read_checkpoint_template
from specx.errors import ExportError
from specx.export.checkpoint import Checkpoint, load_checkpoint
from specx.export.config import TargetConfig, load_target_config
from specx.export.decoder import TargetDecoder
from specx.export.gguf import GgufFile
from specx.export.onnx_graph import export_streamed, save_graph_streamed
from specx.export.weight_writer import WeightWriter, planned_weights
from specx.graphs.signature import graph_entry
from specx.manifest_types import ModelSpec, TapSpec
from specx.progress import Progress, heartbeat

__all__ = ["DEFAULT_MAX_CONTEXT", "export_gguf", "export_target", "io_names"]

log = logging.getLogger(__name__)

DEFAULT_MAX_CONTEXT = 2048
# Verify forwards take at most this many tokens (root + draft nodes); TensorRT profiles use it.
DEFAULT_MAX_TREE_TOKENS = 64


def io_names(num_layers: int, taps: str) -> tuple[list[str], list[str]]:
    """Input and output names of the target graph, in the decoder's argument order."""
    inputs = ["input_ids", "position_ids", "attention_mask", "write_pos"]
    outputs = ["logits"] + ([] if taps == "none" else ["hidden_taps"])
    for i in range(num_layers):
        inputs += [f"past_key_{i}", f"past_value_{i}"]
        outputs += [f"present_key_{i}", f"present_value_{i}"]
    return inputs, outputs


def _example_inputs(decoder: TargetDecoder) -> tuple[Any, ...]:
    # Distinct sizes per dynamic dim, so the tracer never equates two of them.
    c = decoder.config
    batch, n, capacity, kv_len = 2, 3, 11, 7
    # One tensor per cache: the tracer would alias inputs that are the same object.
    cache = [
        torch.zeros(batch, c.num_kv_heads, capacity, c.head_dim) for _ in range(2 * c.num_layers)
    ]
    return (
        torch.zeros(batch, n, dtype=torch.int64),
        torch.arange(n).repeat(batch, 1) + 4,
        torch.ones(batch, 1, n, kv_len, dtype=torch.bool),
        torch.tensor([4, 4]),
        cache,
    )


def _dynamic_shapes(num_layers: int) -> tuple[Any, ...]:
    dim = torch.export.Dim
    batch, n, capacity, kv_len = dim("batch"), dim("tokens"), dim("capacity"), dim("kv_len")
    cache = [{0: batch, 2: capacity}] * (2 * num_layers)
    return ({0: batch, 1: n}, {0: batch, 1: n}, {0: batch, 2: n, 3: kv_len}, {0: batch}, cache)


def _placeholder_decoder(
    config: TargetConfig, taps: str, layers: tuple[int, ...] | None = None
) -> TargetDecoder:
    """The decoder with uninitialised parameters: address space, no resident memory.

    The export traces this; the weights come from the checkpoint when the graph is saved.
    """
    with torch.device("meta"):
        decoder = TargetDecoder(config, taps, layers)
    decoder = decoder.to_empty(device="cpu")
    decoder.compute_rope_tables()
    return decoder.eval()


def _export_graph(
    checkpoint: Checkpoint, taps: str, layers: tuple[int, ...] | None
) -> tuple[ir.Model, TargetDecoder]:
    decoder = _placeholder_decoder(checkpoint.config, taps, layers)
    inputs, outputs = io_names(decoder.config.num_layers, decoder.taps)
    model = export_streamed(
        decoder,
        _example_inputs(decoder),
        _dynamic_shapes(decoder.config.num_layers),
        inputs,
        outputs,
        f"the {decoder.config.family} target",
        checkpoint.state_dict,
    )
    return model, decoder


def _writing_progress(progress: Progress) -> Callable[[int, int], None]:
    def report(done: int, total: int) -> None:
        if done == 1 or done % 20 == 0 or done == total:
            progress(f"  weights written while tracing: {done}/{total}")

    return report


def _check_request(
    checkpoint_dir: Path,
    output_dir: Path,
    max_context: int,
    max_tree_tokens: int,
    taps: str | None,
    drafter: str | None,
    overwrite: bool,
) -> tuple[Path, ...]:
    """The checks that need no weights, run before anything is loaded or traced.

    Returns:
        The source directories (checkpoint, head), which the export may never replace.
    """
    from specx.export.heads import HEAD_TAPS, head_source

    if max_context < 2:
        raise ExportError(f"--max-context must be at least 2, got {max_context}")
    if not 1 <= max_tree_tokens <= max_context:
        raise ExportError(
            f"--max-tree-tokens must be in [1, --max-context={max_context}], got {max_tree_tokens}"
        )
    sources = [checkpoint_dir]
    if drafter is not None:
        kind, directory = head_source(drafter)
        if taps not in (None, HEAD_TAPS[kind]):
            raise ExportError(f"the {kind} head reads --taps {HEAD_TAPS[kind]}, not {taps}")
        if directory:
            sources.append(directory)
    check_output_dir(output_dir, overwrite, tuple(sources))
    return tuple(sources)


def _check_capacity(
    checkpoint: Checkpoint, max_context: int, max_tree_tokens: int, beyond_trained_positions: bool
) -> None:
    config = checkpoint.config
    window = config.sliding_window
    if window is not None and not config.windowed_layers and max_context > window:
        raise ExportError(
            f"{checkpoint.directory}: the target uses sliding-window attention "
            f"(window {window}), which specx does not implement for {config.family}; "
            f"export with --max-context <= {window}"
        )
    # windowed_layers is () without a window; see decoder._window
    if window is not None and config.windowed_layers and max_tree_tokens > window:
        raise ExportError(
            f"--max-tree-tokens {max_tree_tokens} exceeds the target's sliding window {window}: "
            "a verified tree must fit in the window"
        )
    if config.rope_max_context is not None and max_context > config.rope_max_context:
        raise ExportError(
            f"{checkpoint.directory}: rope_scaling longrope is a fixed table only up to "
            f"original_max_position_embeddings {config.rope_max_context} (transformers "
            "switches to the long factors mid-sequence past it); export with --max-context "
            f"<= {config.rope_max_context}"
        )
    if max_context > config.max_position_embeddings and not beyond_trained_positions:
        raise ExportError(
            f"--max-context {max_context} exceeds the {config.max_position_embeddings} positions "
            f"{checkpoint.directory.name} was trained for (max_position_embeddings): export with "
            "--max-context <= that, or allow it by name with --beyond-trained-positions"
        )


def _warn_on_shared_taps(decoder: TargetDecoder) -> None:
    layers = decoder.tap_layers
    if len(set(layers)) < len(layers):
        log.warning(
            "--taps eagle3 on a %d-layer target reads layers %s: EAGLE-3's layers 2, N//2, N-3 "
            "coincide below 7 layers, so its head sees fewer distinct states than it was "
            "designed for",
            decoder.config.num_layers,
            list(layers),
        )


def export_target(
    checkpoint_dir: str | Path,
    output_dir: str | Path,
    *,
    max_context: int | None = None,
    beyond_trained_positions: bool = False,
    taps: str | None = None,
    max_tree_tokens: int | None = None,
    drafter: str | None = None,
    overwrite: bool = False,
    chat_template: ChatTemplate | None = None,
    progress: Progress = lambda message: None,
    gguf: GgufFile | None = None,
) -> Path:
    """Exports an HF target checkpoint (and optionally a draft head) to an artifact directory.

    `gguf`: the checkpoint was written from this GGUF file (`export_gguf`), which the
    manifest's source then names, with its grid.

    `drafter` is `eagle3:DIR`, `eagle:DIR`, `medusa:DIR`, `mtp` or `mtp:DIR`; the target
    then exports the taps that head reads (`taps` None picks them). An existing
    `output_dir` is replaced only with `overwrite`, and only if it is a specx artifact
    (`specx.artifact.check_output_dir`); that and the option ranges are checked before
    anything is loaded. `max_context` (the KV capacity) defaults to 2048 or the positions the
    checkpoint was trained for, if fewer; more than those is refused unless
    `beyond_trained_positions`. `chat_template` replaces the checkpoint's own (or its lack).

    Returns:
        The artifact directory. It appears only when the export completed.
    """
    from specx.export.heads import HEAD_TAPS, load_head

    started = time.perf_counter()
    checkpoint_dir, output_dir = Path(checkpoint_dir), Path(output_dir)
    if max_context is None:
        trained = load_target_config(checkpoint_dir)[0].max_position_embeddings
        max_context = min(DEFAULT_MAX_CONTEXT, trained)
    if max_tree_tokens is None:
        max_tree_tokens = min(DEFAULT_MAX_TREE_TOKENS, max_context)
    sources = _check_request(
        checkpoint_dir, output_dir, max_context, max_tree_tokens, taps, drafter, overwrite
    ) + ((gguf.path,) if gguf else ())
    steps = 5 if drafter is None else 6  # a head is traced and written as a step of its own
    progress(f"[1/{steps}] loading {checkpoint_dir}")
    checkpoint = load_checkpoint(checkpoint_dir)
    _check_capacity(checkpoint, max_context, max_tree_tokens, beyond_trained_positions)
    # Hashed while the graph is traced (hashlib releases the GIL), off the export's path: its
    # time on a 1.5B export in docs/decisions.md#checkpoint-hashed-while-tracing.
    hashing = ThreadPoolExecutor(1)
    hashed = [gguf.path] if gguf else checkpoint.files
    digests = hashing.submit(lambda: {p.name: sha256_file(p) for p in hashed})
    hashing.shutdown(wait=False)
    head, layers = None, None
    if drafter is not None:
        head = load_head(drafter, checkpoint)
        taps, layers = HEAD_TAPS[head.kind], getattr(head, "tap_layers", None)
    taps = taps or "none"
    shapes = TargetDecoder.parameter_shapes(checkpoint.config)
    n_params = TargetDecoder.parameter_count(checkpoint.config)
    progress(
        f"[2/{steps}] tracing {checkpoint.config.family} target "
        f"({n_params / 1e6:.1f}M parameters, {checkpoint.config.num_layers} layers)"
    )
    plans = planned_weights(checkpoint.state_dict, list(shapes))
    with (
        atomic_output_dir(output_dir, overwrite, sources) as staging,
        # Writes the weights while the graph is traced.
        WeightWriter(staging, "target.onnx.data", checkpoint.state_dict, plans) as writer,
    ):
        with heartbeat(progress, "tracing"):
            model, decoder = _export_graph(checkpoint, taps, layers)
        _warn_on_shared_taps(decoder)
        progress(f"[3/{steps}] writing target.onnx")
        writer.wait_for_plans(_writing_progress(progress))
        graph, graph_file, data_file, digest = save_graph_streamed(
            model, staging, "target", progress, writer, writer.reuse
        )
        del model  # the placeholder parameters' address space goes with it
        graphs = {"target": graph_entry(graph, graph_file, data_file)}
        head_spec = None
        if head is not None:
            from specx.export.head_export import export_head

            assert drafter is not None  # the head was loaded from it

            progress(f"[4/{steps}] tracing and writing the {head.kind} head")
            head_spec, head_graphs = export_head(head, drafter, staging)
            graphs.update(head_graphs)
        tokenizer = checkpoint_dir / "tokenizer.json"
        if tokenizer.is_file():
            shutil.copyfile(tokenizer, staging / "tokenizer.json")
        chat = chat_template or read_checkpoint_template(checkpoint_dir)
        if chat is not None:  # for `Engine.chat` and the server's /v1/chat/completions
            (staging / CHAT_TEMPLATE_FILE).write_text(chat.to_json(), encoding="utf-8")
        progress(f"[{steps - 1}/{steps}] hashing {len(hashed)} source weight files")
        body = exported_body(
            _source(checkpoint, digests.result(), gguf),
            _model_spec(checkpoint.config, decoder, max_context, max_tree_tokens),
            graphs,
            head_spec,
            "tokenizer.json" if tokenizer.is_file() else None,
            None if chat is None else CHAT_TEMPLATE_FILE,
        )
        progress(f"[{steps}/{steps}] writing manifest.json")
        write_manifest(staging, body, known={data_file: digest})
    progress(f"exported {output_dir} in {time.perf_counter() - started:.1f}s")
    return output_dir


def _source(
    checkpoint: Checkpoint, weights: dict[str, str], gguf: GgufFile | None
) -> dict[str, Any]:
    """The manifest's record of the checkpoint exported (`weights`: file name -> sha256)."""
    source = {
        "path": str(checkpoint.directory.absolute()),
        "family": checkpoint.config.family,
        "architectures": checkpoint.raw_config.get("architectures"),
        "config": checkpoint.raw_config,
        "config_sha256": sha256_file(checkpoint.directory / "config.json"),
        "weights": weights,
    }
    if gguf is not None:  # the scratch checkpoint is gone once the export ends
        del source["config_sha256"]
        source |= {"path": str(gguf.path.absolute()), "grid": gguf.grid.to_json()}
    return source


def export_gguf(source: Path, output_dir: str | Path, **options: Any) -> Path:
    """Exports a GGUF file (`source`, or a directory's only one) via an HF checkpoint.

    As `export_target` would export the checkpoint it converts to (`specx.export.gguf`);
    `options` are `export_target`'s. The file is checked, and the output directory, before
    it is read.
    """
    from specx.export.gguf import find_gguf, inspect_gguf, write_checkpoint

    path = find_gguf(source)
    if path is None:
        raise ExportError(f"{source}: neither a .gguf file nor a directory holding one")
    gguf = inspect_gguf(path)
    output_dir = Path(output_dir)
    check_output_dir(output_dir, options.get("overwrite", False), (path,))
    parent = output_dir.absolute().parent
    parent.mkdir(parents=True, exist_ok=True)
    progress = options.get("progress", lambda message: None)
    with write_checkpoint(gguf, parent, progress) as checkpoint:
        return export_target(checkpoint, output_dir, gguf=gguf, **options)


def _model_spec(
    config: TargetConfig, decoder: TargetDecoder, max_context: int, max_tree_tokens: int
) -> ModelSpec:
    return ModelSpec(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        num_layers=config.num_layers,
        num_heads=config.num_heads,
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        kv_capacity=max_context,
        max_tree_tokens=max_tree_tokens,
        eos_token_ids=tuple(config.eos_token_ids),
        taps=TapSpec(decoder.taps, decoder.tap_width, tuple(decoder.tap_layers)),
        family=config.family,
        kv_dtype="float32",
        bos_token_id=config.bos_token_id,
    )
