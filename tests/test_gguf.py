"""GGUF files as export sources, and the cpu build that keeps a Q4_0 / Q8_0 file's codes.

The files are written here as llama.cpp's converter writes them (its tensor names, q and k
rows permuted for its rotary layout, the tokenizer as a vocabulary and merges) from a tiny
random checkpoint, quantized by the `gguf` package's own Q4_0 / Q8_0 code.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
pytest.importorskip("accelerate")

from specx.artifact import load_manifest  # noqa: E402
from specx.builders import BuildOptions, build_artifact  # noqa: E402
from specx.builders.grid import GRIDS, kept_codes  # noqa: E402
from specx.errors import BuildError, ExportError  # noqa: E402
from specx.runtime import kernels  # noqa: E402

QUANT = gguf.GGMLQuantizationType
ROLES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
         "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
         "mlp.down_proj": "ffn_down"}  # fmt: skip


def _permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's reordering of q / k rows (its rotary layout)."""
    return (
        weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def write_gguf(checkpoint: Path, path: Path, linears=QUANT.Q4_0, output=QUANT.Q8_0,
               architecture: str = "llama") -> Path:  # fmt: skip
    """`checkpoint` (a tiny llama) as a GGUF file, its layer MatMuls at `linears`."""
    from safetensors.numpy import load_file

    config = json.loads((checkpoint / "config.json").read_text())
    weights = load_file(checkpoint / "model.safetensors")
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    writer = gguf.GGUFWriter(path, architecture)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(config.get("rope_theta", 10000.0))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_dimension_count(config["hidden_size"] // heads)
    tokenizer = json.loads((checkpoint / "tokenizer.json").read_text())
    vocab = sorted(tokenizer["model"]["vocab"].items(), key=lambda kv: kv[1])
    tokens = [t for t, _ in vocab] + [f"[PAD{i}]" for i in range(config["vocab_size"] - len(vocab))]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if i == 0 else 1 for i in range(len(tokens))])
    merges = tokenizer["model"]["merges"]
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(0)

    def add(name: str, array: np.ndarray, kind) -> None:
        array = np.ascontiguousarray(array, dtype=np.float32)
        if kind == QUANT.F32:
            writer.add_tensor(name, array)
            return
        writer.add_tensor(name, gguf.quants.quantize(array, kind), raw_dtype=kind)

    add("token_embd.weight", weights["model.embed_tokens.weight"], linears)
    add("output_norm.weight", weights["model.norm.weight"], QUANT.F32)
    add("output.weight", weights["lm_head.weight"], output)
    for i in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{i}"
        add(f"blk.{i}.attn_norm.weight", weights[f"{prefix}.input_layernorm.weight"], QUANT.F32)
        add(f"blk.{i}.ffn_norm.weight", weights[f"{prefix}.post_attention_layernorm.weight"],
            QUANT.F32)  # fmt: skip
        for hf, role in ROLES.items():
            weight = weights[f"{prefix}.{hf}.weight"]
            if role in ("attn_q", "attn_k"):
                weight = _permute(weight, heads if role == "attn_q" else kv_heads)
            add(f"blk.{i}.{role}.weight", weight, linears)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _raw_q4_0(reader, name: str) -> tuple[np.ndarray, np.ndarray]:
    """A Q4_0 tensor's codes [n, k] and scales [n, k / 32], decoded from its bytes."""
    tensor = next(t for t in reader.tensors if t.name == name)
    blocks = np.asarray(tensor.data).reshape(tensor.data.shape[0], -1, 18)
    scales = blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
    packed = blocks[..., 2:]
    codes = np.concatenate([packed & 0x0F, packed >> 4], axis=-1)  # low nibbles: 0-15
    return codes.reshape(codes.shape[0], -1), scales


@pytest.fixture(scope="module")
def gguf_artifact(checkpoints, tmp_path_factory):
    from specx.export.target_export import export_gguf

    root = tmp_path_factory.mktemp("gguf")
    path = write_gguf(checkpoints["llama"], root / "tiny-q4_0.gguf")
    artifact = export_gguf(path, root / "artifact", max_context=64)
    build_artifact(artifact, BuildOptions(backend="cpu", precision="int4"))
    return path, artifact


def test_a_q4_0_file_exports_and_its_cpu_build_runs_the_file_s_own_codes(gguf_artifact):
    path, artifact = gguf_artifact
    manifest = load_manifest(artifact)
    assert manifest.source_grid is not None and manifest.source_grid.linears == "Q4_0"
    assert manifest.source_grid.output == "Q8_0" and manifest.data["source"]["path"] == str(path)
    details = manifest.builds["cpu-int4"].quantization.details
    assert details["kept_grid"] == {"file": path.name, "linears": "Q4_0", "output": "Q8_0"}
    build = artifact / manifest.builds["cpu-int4"].graphs["target"].file
    index = json.loads(build.read_text())["tensors"]
    data = np.fromfile(build.with_suffix(".bin"), dtype=np.uint8)
    codes, scales = _raw_q4_0(gguf.GGUFReader(path), "blk.1.attn_output.weight")
    assert (scales < 0).any()  # llama.cpp's d takes the sign of the largest value
    want = kernels.pack_codes(codes.astype(np.uint8), scales, 4)
    entry = index["o.1"]
    assert entry["block"] == 32 and not entry["zero_points"]
    np.testing.assert_array_equal(data[entry["offset"] : entry["offset"] + want.size], want)


def test_the_kept_build_is_the_float_graph_within_rounding_and_decodes_losslessly(gguf_artifact):
    """The int4 build runs the file's weights as the exported float graph holds them
    de-quantized (logits within its activations' int8 rounding), and greedy speculation on
    it equals its plain decoding."""
    import specx
    from specx.runtime.targets import open_decoder, select_build

    _, artifact = gguf_artifact
    manifest = load_manifest(artifact)
    sequence = [[5, 9, 5, 9, 5, 9, 13, 7, 2]]
    logits = []
    for build in ("exported", "cpu-int4"):
        target = open_decoder(select_build(manifest, build), threads=2)
        output, _ = target.feed(target.allocate_cache(1, 16), sequence, np.array([0]))
        logits.append(output.logits)
    assert np.abs(logits[1] - logits[0]).max() < 0.03 * np.abs(logits[0]).max()
    engine = specx.load(artifact, build="cpu-int4", threads=2)
    plain = engine.generate(sequence[0], max_new_tokens=24, ignore_eos=True)
    fast = engine.generate(sequence[0], max_new_tokens=24, ignore_eos=True, speculation="ngram")
    assert fast.tokens == plain.tokens


@pytest.mark.parametrize("kind", ["Q4_0", "Q8_0"])
def test_kept_codes_give_back_the_gguf_package_s_codes_and_refuse_what_is_off_grid(kind, rng):
    weight = rng.normal(size=(48, 96)).astype(np.float32)
    weight[0, :32] = 0.0  # an all-zero block
    raw = gguf.quants.quantize(weight, QUANT[kind])
    values = gguf.quants.dequantize(raw, QUANT[kind]).reshape(weight.shape)
    codes, scales = kept_codes(values, GRIDS[kind], "w")
    grid = GRIDS[kind]
    np.testing.assert_array_equal((codes.astype(np.float32) - grid.zero).reshape(48, 3, 32)
                                  * scales[..., None], values.reshape(48, 3, 32))  # fmt: skip
    assert codes.min() >= grid.codes[0] and codes.max() <= grid.codes[1]
    nudged = values.copy()
    nudged[7, 40] = np.nextafter(nudged[7, 40], np.float32(np.inf))
    with pytest.raises(BuildError, match="not on the source's .* grid"):
        kept_codes(nudged, grid, "w")
    with pytest.raises(BuildError, match="not on the source's"):
        kept_codes(weight, grid, "w")  # float weights, never quantized


def test_files_specx_cannot_read_are_refused_by_name_before_loading(checkpoints, tmp_path):
    from specx.export.target_export import export_gguf

    other = write_gguf(checkpoints["llama"], tmp_path / "gpt2.gguf", architecture="gpt2")
    with pytest.raises(ExportError, match="architecture 'gpt2' is not supported"):
        export_gguf(other, tmp_path / "out")
    (tmp_path / "two").mkdir()
    for name in ("x.gguf", "y.gguf"):
        (tmp_path / "two" / name).write_bytes(b"")
    with pytest.raises(ExportError, match="several GGUF files"):
        export_gguf(tmp_path / "two", tmp_path / "out")
    (tmp_path / "bad.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(ExportError, match="not a readable GGUF file"):
        export_gguf(tmp_path / "bad.gguf", tmp_path / "out")
    assert not (tmp_path / "out").exists()
