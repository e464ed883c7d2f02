"""Where every backend's build is written, and how it joins the artifact atomically.

A build is assembled in a hidden staging directory inside the artifact, moved to a fresh
`builds/<name>.<id>/`, and only then referenced from a manifest written with
`os.replace`; an interrupted build leaves the previous manifest valid.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import uuid
from pathlib import Path

import onnx
import onnx_ir as ir

from specx.artifact import Manifest, apply_umask, manifest_body, write_manifest
from specx.builders.registry import BuildOutput, Progress
from specx.graphs.model_io import save_streamed
from specx.graphs.signature import graph_signature
from specx.manifest_types import BuildEntry, GraphEntry

__all__ = [
    "exported_entries",
    "fresh_output",
    "graph_entry",
    "load_graph",
    "publish_build",
    "save_graph",
]


def fresh_output(name: str, staging: Path) -> BuildOutput:
    """A new `builds/<name>.<id>` for a build staged in `staging` under the artifact."""
    return BuildOutput(staging, f"builds/{name}.{uuid.uuid4().hex[:8]}")


def exported_entries(manifest: Manifest) -> dict[str, GraphEntry]:
    """The exported graphs as a build that keeps them records them: files and signature."""
    return {
        name: GraphEntry(entry.file, entry.inputs, entry.outputs, entry.data_files)
        for name, entry in manifest.graphs.items()
    }


def publish_build(manifest: Manifest, name: str, output: BuildOutput, entry: BuildEntry) -> None:
    """Moves the staged files into place, then records `entry` as build `name`, the default.

    The build is referenced only once the new manifest is written; if writing fails, the
    moved directory is removed again. A previous build of the same name is deleted last.
    """
    root = manifest.root
    previous = manifest.builds[name].directory if name in manifest.builds else None
    directory = None
    if any(output.staging.iterdir()):
        (root / "builds").mkdir(exist_ok=True)
        apply_umask(output.staging)
        os.replace(output.staging, root / output.directory)
        directory = output.directory
    entry = dataclasses.replace(entry, directory=directory)
    retired = (previous,) if previous is not None and previous != directory else ()
    try:
        write_manifest(root, manifest_body(manifest.with_new_build(name, entry)), exclude=retired)
    except BaseException:
        if directory:
            shutil.rmtree(root / directory, ignore_errors=True)
        raise
    for old in retired:
        shutil.rmtree(root / old, ignore_errors=True)


def load_graph(manifest: Manifest, name: str) -> ir.Model:
    """The exported graph `name`, with its weights."""
    return ir.load(manifest.path(manifest.graph(name).file))


def save_graph(
    model: ir.Model, output: BuildOutput, name: str, progress: Progress = lambda m: None
) -> GraphEntry:
    """Saves `name.onnx` (+ `.data`) to the staging directory; returns its manifest entry.

    Weights are written one at a time (lazy ones, e.g. quantized, computed as they go).
    """
    save_streamed(model, output.staging / f"{name}.onnx", f"{name}.onnx.data", progress)
    return graph_entry(output, name)


def graph_entry(output: BuildOutput, name: str) -> GraphEntry:
    """The manifest entry of `name.onnx` (and its `.data`, if any) staged in `output`."""
    path = output.staging / f"{name}.onnx"
    data = [f"{name}.onnx.data"] if (output.staging / f"{name}.onnx.data").is_file() else []
    inputs, outputs = graph_signature(onnx.load(path, load_external_data=False))
    return GraphEntry(
        f"{output.directory}/{name}.onnx",
        inputs,
        outputs,
        tuple(f"{output.directory}/{file}" for file in data),
    )
