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


def test_tap_layers_outside_the_target(head_dirs, target, tmp_path):
    copy = shutil.copytree(head_dirs["eagle3-modelopt"], tmp_path / "taps")
    config = json.loads((copy / "config.json").read_text())
    n = target.config.num_layers
    config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [0, 1, n]  # layer outputs
    (copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        CheckpointError,
        match=rf"eagle_aux_hidden_state_layer_ids: EAGLE-3 taps \[1, 2, {n + 1}\] must be three "
        rf"layers in \[1, {n}\]",
    ):
        load_head(f"eagle3:{copy}", target)


def test_a_heads_own_taps_are_read_in_each_layouts_numbering(head_dirs, target, tmp_path):
    n = target.config.num_layers
    copy = shutil.copytree(head_dirs["eagle3-modelopt"], tmp_path / "taps")
    config = json.loads((copy / "config.json").read_text())
    config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [0, 1, n - 1]  # outputs
    (copy / "config.json").write_text(json.dumps(config))
    assert load_head(f"eagle3:{copy}", target).tap_layers == (1, 2, n)  # states entering
    assert load_head(f"eagle3:{head_dirs['eagle3']}", target).tap_layers is None


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


def _medusa_dir(directory, tensors, config):
    directory.mkdir()
    save_file(tensors, directory / "medusa_lm_head.safetensors")
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def test_medusa_version_2_equals_version_1_with_the_targets_lm_head(head_target, target, tmp_path):
    from click.testing import CliRunner

    from specx.cli import main

    config = json.loads((head_target / "config.json").read_text())
    tensors = load_file(write_medusa(tmp_path / "v1", config) / "medusa_lm_head.safetensors")
    blocks = {k: v for k, v in tensors.items() if ".linear." in k}  # ResBlocks only
    lm_head = load_file(head_target / "model.safetensors")["lm_head.weight"]
    counts = {"medusa_num_heads": 3, "medusa_num_layers": 1}
    v2 = _medusa_dir(tmp_path / "v2", blocks, {**counts, "version": "2"})
    twin = {**blocks, **{f"{h}.1.weight": lm_head.clone() for h in range(3)}}
    v1 = _medusa_dir(tmp_path / "v1-twin", twin, counts)
    features = torch.randn(2, 5, config["hidden_size"])
    with torch.no_grad():
        assert torch.equal(load_head(f"medusa:{v2}", target)(features),
                           load_head(f"medusa:{v1}", target)(features))  # fmt: skip
    # Exported and drafting: speculative decoding with the version-2 heads equals plain.
    out = tmp_path / "artifact"
    args = ["export", str(head_target), "-o", str(out), "--drafter", f"medusa:{v2}",
            "--max-context", "64"]  # fmt: skip
    assert CliRunner().invoke(main, args).exit_code == 0
    args = ["generate", str(out), "--prompt-ids", "1,2,3,4", "--max-new-tokens", "12",
            "--ignore-eos", "--drafter", "medusa", "--tree", "chain:3", "--compare",
            "--json"]  # fmt: skip
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["stats"]["compare"]["identical_tokens"]


def test_medusa_versions_are_named_when_they_do_not_fit(head_target, target, tmp_path):
    config = json.loads((head_target / "config.json").read_text())
    tensors = load_file(write_medusa(tmp_path / "v1", config) / "medusa_lm_head.safetensors")
    blocks = {k: v for k, v in tensors.items() if ".linear." in k}
    counts = {"medusa_num_heads": 3, "medusa_num_layers": 1}
    unmarked = _medusa_dir(tmp_path / "unmarked", blocks, counts)
    with pytest.raises(CheckpointError, match='version-2 layout; add "version": "2"'):
        load_head(f"medusa:{unmarked}", target)
    future = _medusa_dir(tmp_path / "future", blocks, {**counts, "version": "3"})
    with pytest.raises(CheckpointError, match="Medusa version '3' is unknown"):
        load_head(f"medusa:{future}", target)


def _speculators_eagle3(official, directory, target_config, **extra):
    """The official-layout head at `official` rewritten in vllm-project/speculators' layout."""
    config = json.loads((official / "config.json").read_text())
    tensors = {
        k.replace("midlayer.", "layers.0."): v
        for k, v in load_file(official / "model.safetensors").items()
    }
    n = target_config["num_hidden_layers"]
    layer = {k: v for k, v in config.items() if k not in ("draft_vocab_size", "architectures")}
    speculators = {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": "0.3.0",
        "draft_vocab_size": config["draft_vocab_size"],
        "target_hidden_size": None,
        "norm_before_residual": False,
        "eagle_aux_hidden_state_layer_ids": [2, n // 2, n - 3],
        "transformer_layer_config": {"model_type": "llama", **layer, "num_hidden_layers": 1},
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
            "verifier": {"name_or_path": "target", "architectures": ["LlamaForCausalLM"]},
        },
        **extra,
    }
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(speculators))
    save_file(tensors, directory / "model.safetensors")
    return directory


def test_a_speculators_eagle3_head_equals_the_same_head_in_the_official_layout(
    head_dirs, head_target, target, tmp_path
):
    config = json.loads((head_target / "config.json").read_text())
    converted = _speculators_eagle3(head_dirs["eagle3"], tmp_path / "speculators", config)
    official = load_head(f"eagle3:{head_dirs['eagle3']}", target)
    speculators = load_head(f"eagle3:{converted}", target)
    assert official.config == speculators.config
    ours, theirs = official.state_dict(), speculators.state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"speculators_model_type": "dflash"}, "speculators_model_type 'dflash' is not an EAGLE-3"),
        ({"norm_before_residual": True}, "norm_before_residual: true changes the EAGLE-3 layer"),
        ({"fc_norm": True}, "fc_norm: true"),
        ({"eagle_aux_hidden_state_layer_ids": [0, 1, 2]}, r"taps \[0, 1, 2\] must be three"),
    ],
)
def test_speculators_variants_specx_does_not_load_are_named(
    head_dirs, head_target, target, tmp_path, extra, message
):
    config = json.loads((head_target / "config.json").read_text())
    converted = _speculators_eagle3(head_dirs["eagle3"], tmp_path / "s", config, **extra)
    with pytest.raises(CheckpointError, match=message):
        load_head(f"eagle3:{converted}", target)
