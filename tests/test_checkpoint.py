"""Checkpoint loading: supported families, shards, .bin, and clear errors on bad input."""

from __future__ import annotations

import json
import os
import pickle
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from specx.errors import CheckpointError, ExportError
from specx.export.checkpoint import load_checkpoint
from specx.export.target_export import export_target


def copy_checkpoint(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_family_specific_config(checkpoints):
    qwen2 = load_checkpoint(checkpoints["qwen2"]).config
    qwen3 = load_checkpoint(checkpoints["qwen3"]).config
    llama = load_checkpoint(checkpoints["llama"]).config
    assert qwen2.qkv_bias and not qwen2.o_bias and qwen2.tie_word_embeddings
    assert qwen3.qk_norm and not llama.qk_norm
    assert llama.eos_token_ids == (0,)


def test_unsupported_architecture_names_the_file(checkpoints, tmp_path):
    path = copy_checkpoint(checkpoints["llama"], tmp_path / "gpt2")
    config = json.loads((path / "config.json").read_text())
    config["model_type"] = "gpt2"
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"config.json: model_type 'gpt2'.*not supported"):
        load_checkpoint(path)


def test_sequence_dependent_rope_is_refused(checkpoints, tmp_path):
    path = copy_checkpoint(checkpoints["llama"], tmp_path / "dyn")
    config = json.loads((path / "config.json").read_text())
    config["rope_scaling"] = {"rope_type": "dynamic", "factor": 2.0}
    config.pop("rope_parameters", None)
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="rope type 'dynamic'"):
        load_checkpoint(path)


def test_partial_rotary_is_read_and_odd_rotary_widths_are_refused(checkpoints, tmp_path):
    """Phi-4-mini's partial rotary: 3/4 of each 16-wide head turns (6 frequencies)."""
    assert len(load_checkpoint(checkpoints["phi3"]).config.inv_freq) == 6
    path = copy_checkpoint(checkpoints["phi3"], tmp_path / "odd")
    config = json.loads((path / "config.json").read_text())
    config["partial_rotary_factor"] = 0.1875  # 3 of 16 dims: rotate_half needs pairs
    config["rope_parameters"]["partial_rotary_factor"] = 0.1875
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="partial_rotary_factor 0.1875 gives 3 rotary dims"):
        load_checkpoint(path)


def test_missing_tensor_is_named(checkpoints, tmp_path):
    path = copy_checkpoint(checkpoints["llama"], tmp_path / "missing")
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(
        CheckpointError, match=r"missing tensors model\.layers\.1\.mlp\.up_proj\.weight"
    ):
        load_checkpoint(path)


def test_misshaped_tensor_names_file_key_and_shapes(checkpoints, tmp_path):
    path = copy_checkpoint(checkpoints["qwen3"], tmp_path / "shape")
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.0.self_attn.k_norm.weight"] = torch.ones(7)
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(
        CheckpointError,
        match=r"model\.safetensors: tensor model\.layers\.0\.self_attn"
        r"\.k_norm\.weight has shape \(7,\), expected \(16,\)",
    ):
        load_checkpoint(path)


def test_sharded_checkpoint_loads_like_single_file(tmp_path):
    from transformers import AutoModelForCausalLM

    from specx.export.random_checkpoint import write_random_checkpoint

    single = write_random_checkpoint(tmp_path / "single", "llama", "tiny", tokenizer=False)
    model = AutoModelForCausalLM.from_pretrained(single)
    model.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    a, b = load_checkpoint(single), load_checkpoint(tmp_path / "sharded")
    assert len(b.files) > 1
    assert a.state_dict.keys() == b.state_dict.keys()
    assert all(torch.equal(a.state_dict[k], b.state_dict[k]) for k in a.state_dict)


def test_torch_bin_loads_through_weights_only(checkpoints, tmp_path):
    path = copy_checkpoint(checkpoints["llama"], tmp_path / "bin")
    tensors = load_file(path / "model.safetensors")
    os.remove(path / "model.safetensors")
    torch.save(tensors, path / "pytorch_model.bin")
    loaded = load_checkpoint(path)
    assert torch.equal(loaded.state_dict["model.norm.weight"], tensors["model.norm.weight"])


class _RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_pickle_that_runs_code_is_refused(checkpoints, tmp_path):
    path = copy_checkpoint(checkpoints["llama"], tmp_path / "evil")
    tensors = load_file(path / "model.safetensors")
    os.remove(path / "model.safetensors")
    marker = tmp_path / "pwned"
    with open(path / "pytorch_model.bin", "wb") as f:
        pickle.dump({**tensors, "payload": _RunsCode(str(marker))}, f)
    with pytest.raises(
        CheckpointError, match=r"refused to load .*pytorch_model\.bin.*could run code"
    ):
        load_checkpoint(path)
    assert not marker.exists()


def test_no_weights_is_a_clear_error(checkpoints, tmp_path):
    path = copy_checkpoint(checkpoints["llama"], tmp_path / "empty")
    os.remove(path / "model.safetensors")
    with pytest.raises(CheckpointError, match="no weights found"):
        load_checkpoint(path)


def test_sliding_window_beyond_window_is_refused(tmp_path):
    from specx.export.random_checkpoint import write_random_checkpoint

    # Qwen2's windows (use_sliding_window, from max_window_layers on) are not implemented;
    # Mistral's and Gemma 3's are (tests/test_sliding_window.py).
    path = write_random_checkpoint(tmp_path / "m", "qwen2", "tiny", tokenizer=False)
    config = json.loads((path / "config.json").read_text())
    config.update(sliding_window=64, use_sliding_window=True)
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ExportError, match=r"sliding-window .*qwen2.*--max-context <= 64"):
        export_target(path, tmp_path / "out", max_context=128)
    assert not (tmp_path / "out").exists()


def test_gemma3_fields_are_read_and_its_unsupported_variants_named(checkpoints, tmp_path):
    config = load_checkpoint(checkpoints["gemma3_text"]).config
    assert config.activation == "gelu_tanh" and config.sandwich_norms and config.qk_norm
    assert config.embedding_scale == config.hidden_size**0.5 and config.norm_offset == 1.0
    assert config.attention_scale == 24**-0.5  # query_pre_attn_scalar, not head_dim
    assert config.local_layers == (True, False, True, False)
    assert config.local_inv_freq != config.inv_freq  # base 10000 vs 1e6
    # The norms are read as 1 + w (what the RMSNorm scales by), in float32.
    stored = load_file(checkpoints["gemma3_text"] / "model.safetensors")
    key = "model.layers.0.pre_feedforward_layernorm.weight"
    loaded = load_checkpoint(checkpoints["gemma3_text"]).state_dict[key]
    torch.testing.assert_close(loaded, 1 + stored[key].float(), rtol=0, atol=0)
    for field, value, message in [
        ("model_type", "gemma3", "vision tower"),
        ("attn_logit_softcapping", 50.0, "attn_logit_softcapping 50.0 is not supported for gemma3"),
        (
            "final_logit_softcapping",
            30.0,
            "final_logit_softcapping 30.0 is not supported for gemma3",
        ),
        ("layer_types", ["sliding_attention"], "number of `layer_types`"),  # transformers'
        ("layer_types", ["full_attention", "sliding_attention"] * 2, None),
        ("hidden_activation", "relu", "hidden_activation 'relu' is not supported"),
    ]:
        path = copy_checkpoint(checkpoints["gemma3_text"], tmp_path / f"{field}-{value}")
        raw = json.loads((path / "config.json").read_text())
        raw[field] = value
        (path / "config.json").write_text(json.dumps(raw))
        if message is None:  # a valid variant: global and local layers the other way round
            assert load_checkpoint(path).config.local_layers == (False, True) * 2
            continue
        with pytest.raises(CheckpointError, match=message):
            load_checkpoint(path)


def test_gemma2_caps_are_read_and_bad_ones_named(checkpoints, tmp_path):
    config = load_checkpoint(checkpoints["gemma2"]).config
    assert (config.attn_softcap, config.logit_softcap) == (0.02, 1.0)
    assert config.sandwich_norms and config.norm_offset == 1.0 and not config.qk_norm
    assert config.local_layers == (True, False, True, False) and config.local_inv_freq == ()
    assert config.llama_layers().attn_softcap == config.llama_layers().logit_softcap == 0.0
    for field, value, message in [
        ("attn_logit_softcapping", None, None),  # no cap: the field may be null
        ("attn_logit_softcapping", -1.0, "attn_logit_softcapping must be a positive number"),
        ("final_logit_softcapping", 0.0, "final_logit_softcapping must be a positive number"),
        ("final_logit_softcapping", "30", "valid gemma2 config.*final_logit_softcapping"),
    ]:
        path = copy_checkpoint(checkpoints["gemma2"], tmp_path / f"{field}-{value}")
        raw = json.loads((path / "config.json").read_text())
        raw[field] = value
        (path / "config.json").write_text(json.dumps(raw))
        if message is None:
            assert load_checkpoint(path).config.attn_softcap == 0.0
            continue
        with pytest.raises(CheckpointError, match=message):
            load_checkpoint(path)
