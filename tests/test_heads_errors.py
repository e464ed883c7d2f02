"""Corrupted or mismatched head checkpoints fail with errors naming the key and shapes."""

from __future__ import annotations

import json
import pickle
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from head_checkpoints import mtp_tensors, write_eagle, write_medusa
from specx.errors import CheckpointError, ExportError
from specx.export.checkpoint import load_checkpoint
from specx.export.heads import load_head


@pytest.fixture(scope="module")
def target(head_target):
    return load_checkpoint(head_target)


def edit(directory, tmp_path, change, file="model.safetensors"):
    copy = shutil.copytree(directory, tmp_path / directory.name)
    tensors = load_file(copy / file)
    change(tensors)
    save_file(tensors, copy / file)
    return copy


def test_missing_key(head_dirs, target, tmp_path):
    path = edit(head_dirs["eagle3"], tmp_path, lambda t: t.pop("midlayer.self_attn.k_proj.weight"))
    with pytest.raises(
        CheckpointError,
        match=r"missing tensor 'midlayer\.self_attn\.k_proj\.weight' for the eagle3 head",
    ):
        load_head(f"eagle3:{path}", target)


def test_misshaped_key_names_expected_and_actual(head_dirs, target, tmp_path):
    def change(t):
        t["fc.weight"] = torch.zeros(32, 64)

    path = edit(head_dirs["eagle3"], tmp_path, change)
    with pytest.raises(
        CheckpointError,
        match=r"'fc\.weight' of the eagle3 head has shape \(32, 64\), expected \(32, 96\)",
    ):
        load_head(f"eagle3:{path}", target)


def test_d2t_out_of_range(head_dirs, target, tmp_path):
    def change(t):
        t["d2t"][5] = 1000

    path = edit(head_dirs["eagle3"], tmp_path, change)
    with pytest.raises(
        CheckpointError, match=r"d2t maps draft id 5 to target id \d+, outside \[0, 32\)"
    ):
        load_head(f"eagle3:{path}", target)


def test_d2t_inconsistent_with_t2d(head_dirs, target, tmp_path):
    def change(t):
        t["t2d"] = ~t["t2d"]

    path = edit(head_dirs["eagle3"], tmp_path, change)
    with pytest.raises(CheckpointError, match="t2d is inconsistent with d2t"):
        load_head(f"eagle3:{path}", target)


def test_vocab_and_hidden_mismatch(head_dirs, target, tmp_path):
    for field, value, message in (
        ("vocab_size", 999, "vocab_size 999 differs"),
        ("target_hidden_size", 48, "target_hidden_size 48"),
    ):
        copy = shutil.copytree(head_dirs["eagle3"], tmp_path / field)
        config = json.loads((copy / "config.json").read_text())
        config[field] = value
        (copy / "config.json").write_text(json.dumps(config))
        with pytest.raises(CheckpointError, match=message):
            load_head(f"eagle3:{copy}", target)


def test_unknown_tap_layers(head_dirs, target, tmp_path):
    copy = shutil.copytree(head_dirs["eagle3-modelopt"], tmp_path / "taps")
    config = json.loads((copy / "config.json").read_text())
    config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [0, 1, 2]
    (copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        CheckpointError,
        match=r"eagle_aux_hidden_state_layer_ids \[0, 1, 2\] are not EAGLE-3's taps",
    ):
        load_head(f"eagle3:{copy}", target)


class _RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_malicious_pickles_are_refused(head_target, target, tmp_path):
    config = json.loads((head_target / "config.json").read_text())
    marker = tmp_path / "pwned"
    eagle = write_eagle(tmp_path / "eagle", config, as_bin=True)
    medusa = write_medusa(tmp_path / "medusa", config, as_pt=True)
    for path, file in ((eagle, "pytorch_model.bin"), (medusa, "medusa_lm_head.pt")):
        tensors = torch.load(path / file, weights_only=True)
        with open(path / file, "wb") as f:
            pickle.dump({**tensors, "x": _RunsCode(str(marker))}, f)
    with pytest.raises(CheckpointError, match=r"refused to load .*pytorch_model\.bin"):
        load_head(f"eagle:{eagle}", target)
    with pytest.raises(CheckpointError, match=r"refused to load .*medusa_lm_head\.pt"):
        load_head(f"medusa:{medusa}", target)
    assert not marker.exists()


def test_clean_bin_and_pt_heads_load(head_target, target, tmp_path):
    config = json.loads((head_target / "config.json").read_text())
    load_head(f"eagle:{write_eagle(tmp_path / 'e', config, as_bin=True)}", target)
    load_head(f"medusa:{write_medusa(tmp_path / 'm', config, as_pt=True)}", target)


def test_medusa_config_and_keys(head_dirs, target, tmp_path):
    path = edit(
        head_dirs["medusa"],
        tmp_path,
        lambda t: t.pop("2.0.linear.bias"),
        file="medusa_lm_head.safetensors",
    )
    with pytest.raises(
        CheckpointError, match=r"missing tensor '2\.0\.linear\.bias' for the medusa head"
    ):
        load_head(f"medusa:{path}", target)
    (path / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match="medusa_num_heads"):
        load_head(f"medusa:{path}", target)


def test_mtp_moe_and_missing(head_target, target, tmp_path):
    config = json.loads((head_target / "config.json").read_text())
    moe = tmp_path / "moe"
    moe.mkdir()
    tensors = mtp_tensors("mimo", config)
    tensors["model.mtp_layers.0.mlp.experts.0.up_proj.weight"] = torch.zeros(4, 4)
    save_file(tensors, moe / "model.safetensors")
    with pytest.raises(CheckpointError, match="MoE; only dense MLPs are supported"):
        load_head(f"mtp:{moe}", target)
    empty = tmp_path / "empty"
    empty.mkdir()
    save_file({"x": torch.zeros(1)}, empty / "model.safetensors")
    with pytest.raises(CheckpointError, match="no MTP weights found"):
        load_head(f"mtp:{empty}", target)


def test_unknown_head_and_missing_dir(target):
    with pytest.raises(ExportError, match="unknown drafter 'hydra'"):
        load_head("hydra:/x", target)
    with pytest.raises(ExportError, match="needs a checkpoint directory"):
        load_head("eagle3", target)


def test_d2t_must_be_injective(head_dirs, target, tmp_path):
    def change(t):
        t["d2t"][1] = t["d2t"][0] - 1  # draft ids 0 and 1 -> the same target id

    path = edit(head_dirs["eagle3-modelopt"], tmp_path, change)
    with pytest.raises(CheckpointError, match="maps two draft ids to the same target id"):
        load_head(f"eagle3:{path}", target)
