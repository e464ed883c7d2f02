"""The export's weight writer process: the bytes it writes, and how it fails and stops."""

from __future__ import annotations

import hashlib
import os
import shutil

import numpy as np
import onnx_ir as ir
import pytest

from specx.errors import CheckpointError, ExportError
from specx.export import target_export
from specx.export.checkpoint import load_checkpoint
from specx.export.random_checkpoint import write_random_checkpoint
from specx.export.streamed_weights import StreamedTensor
from specx.export.target_export import export_target
from specx.export.weight_writer import WeightWriter, planned_weights


@pytest.fixture(scope="module")
def bf16_checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("bf16")
    return write_random_checkpoint(root / "llama", "llama", dtype="bfloat16", tokenizer=False)


def _array(path, reference: ir.ExternalTensor) -> np.ndarray:
    with open(path, "rb") as f:
        f.seek(reference.offset)
        raw = f.read(reference.length)
    return np.frombuffer(raw, dtype=np.float32).reshape(reference.shape.numpy())


def test_written_bytes_are_the_tensors_values(bf16_checkpoint, tmp_path):
    """Planned, appended-by-description and appended-by-bytes tensors, read back."""
    tensors = load_checkpoint(bf16_checkpoint).state_dict
    key = "model.layers.0.mlp.down_proj.weight"
    plans = planned_weights(tensors, [key])
    expected_t = tensors[key].numpy().T
    norm = "model.layers.0.input_layernorm.weight"
    with WeightWriter(tmp_path, "w.data", tensors, plans) as writer:
        assert writer.wait_for_plans() == 1
        planned = StreamedTensor(tensors, [key], True, expected_t.shape, "a")
        not_planned = StreamedTensor(tensors, [key], False, expected_t.T.shape, "b")
        in_memory = ir.tensor(np.arange(300, dtype=np.float32).reshape(3, 100), name="c")
        assert writer.reuse(not_planned) is None and writer.reuse(in_memory) is None
        references = [
            writer.reuse(planned),
            writer.append(not_planned),
            writer.append(in_memory),
            writer.append(StreamedTensor(tensors, [norm], False, tensors[norm].shape, "d")),
        ]
        digest = writer.close()
    path = tmp_path / "w.data"
    assert digest == hashlib.sha256(path.read_bytes()).hexdigest()
    assert [r.name for r in references] == ["a", "b", "c", "d"]
    np.testing.assert_array_equal(_array(path, references[0]), expected_t)
    np.testing.assert_array_equal(_array(path, references[1]), expected_t.T)
    np.testing.assert_array_equal(_array(path, references[2]), in_memory.numpy())
    np.testing.assert_array_equal(_array(path, references[3]), tensors[norm].numpy())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w.data"]


def test_the_childs_error_is_raised_in_the_caller(bf16_checkpoint, tmp_path):
    """The child opens the checkpoint again: a file truncated since is its CheckpointError."""
    checkpoint = shutil.copytree(bf16_checkpoint, tmp_path / "checkpoint")
    tensors = load_checkpoint(checkpoint).state_dict
    weights = checkpoint / "model.safetensors"
    os.truncate(weights, weights.stat().st_size - 100)
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(CheckpointError, match="model.safetensors"):
        with WeightWriter(out, "w.data", tensors, planned_weights(tensors, list(tensors))) as w:
            w.wait_for_plans()
    assert list(out.iterdir()) == []


def test_a_killed_writer_is_an_export_error(bf16_checkpoint, tmp_path):
    tensors = load_checkpoint(bf16_checkpoint).state_dict
    with pytest.raises(ExportError, match="exited with status -9"):
        with WeightWriter(tmp_path, "w.data", tensors, []) as writer:
            writer._process.kill()
            writer.close()
    assert list(tmp_path.iterdir()) == []


def test_an_interrupted_export_stops_its_writer(checkpoints, tmp_path, monkeypatch):
    writers = []

    class Recorded(WeightWriter):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            writers.append(self)

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(target_export, "WeightWriter", Recorded)
    monkeypatch.setattr(target_export, "_export_graph", interrupt)
    with pytest.raises(KeyboardInterrupt):
        export_target(checkpoints["llama"], tmp_path / "out", max_context=32)
    assert len(writers) == 1 and writers[0]._process.returncode is not None
    assert list(tmp_path.iterdir()) == []
