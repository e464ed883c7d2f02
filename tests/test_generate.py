"""`specx generate`: greedy equals transformers, sampling is seeded, bad requests are refused."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from conftest import FAMILIES, MAX_CONTEXT
from specx.artifact import load_manifest
from specx.cli import main
from specx.errors import GenerationError
from specx.runtime.plain_decoding import generate_plain
from specx.runtime.sampling import SamplingParams
from specx.runtime.targets.base import DecoderBackend
from specx.runtime.targets.ort import OrtTarget

NEW_TOKENS = 64


def hf_greedy(model, prompt, eos):
    out = model.generate(
        torch.tensor([prompt]),
        max_new_tokens=NEW_TOKENS,
        do_sample=False,
        eos_token_id=eos,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_equals_transformers(family, artifacts, hf_models, rng):
    target = OrtTarget(load_manifest(artifacts[family]), threads=2)
    vocab = target.vocab_size
    # Token 0 is eos; avoid it so that most runs produce all 64 tokens.
    prompts = [rng.integers(1, vocab, n).tolist() for n in (3, 17, 9)]
    batched = generate_plain(target, prompts, NEW_TOKENS, eos_token_ids=(0,))
    for prompt, tokens in zip(prompts, batched.tokens, strict=True):
        expected = hf_greedy(hf_models[family], prompt, eos=0)
        assert tokens == expected
        assert (
            generate_plain(target, [prompt], NEW_TOKENS, eos_token_ids=(0,)).tokens[0] == expected
        )
    ignoring = generate_plain(target, prompts[:1], NEW_TOKENS)
    assert len(ignoring.tokens[0]) == NEW_TOKENS


def test_sampling_is_reproducible_with_a_seed(artifacts):
    target = OrtTarget(load_manifest(artifacts["llama"]), threads=2)
    prompts = [[5, 6, 7], [8, 9]]

    def run(seed):
        params = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, seed=seed)
        return generate_plain(target, prompts, 24, params).tokens

    assert run(7) == run(7)
    assert run(7) != run(8)
    assert run(7) != generate_plain(target, prompts, 24).tokens


def test_prompt_longer_than_capacity_is_refused(artifacts):
    target = OrtTarget(load_manifest(artifacts["llama"]), threads=2)
    with pytest.raises(
        GenerationError, match=rf"needs {MAX_CONTEXT + 10} KV slots .* capacity is {MAX_CONTEXT}"
    ):
        generate_plain(target, [[1] * MAX_CONTEXT], 11)
    with pytest.raises(GenerationError, match="outside"):
        generate_plain(target, [[1, 100000]], 4)
    with pytest.raises(GenerationError, match="prompt 1 is empty"):
        generate_plain(target, [[1], []], 4)


def test_forward_rejects_cache_overflow(artifacts):
    target = OrtTarget(load_manifest(artifacts["llama"]), threads=2)
    cache = target.allocate_cache(1, 8)
    with pytest.raises(GenerationError, match="overflows the KV cache"):
        target.forward(
            cache,
            np.ones((1, 4), np.int64),
            np.zeros((1, 4), np.int64),
            np.ones((1, 1, 4, 10), bool),
            np.array([6]),
        )


def test_decode_step_equals_forward_and_follows_its_cache(artifacts, rng):
    """The bound-buffer step == the generic one (via forward), rows at different lengths."""
    target = OrtTarget(load_manifest(artifacts["llama"]), threads=2)
    prompts = [rng.integers(1, 100, 5).tolist(), rng.integers(1, 100, 9).tolist()]
    caches = []
    for _ in range(3):
        cache = target.allocate_cache(2, 24)
        target.feed(cache, prompts, np.zeros(2, np.int64))
        cache.lengths[:] = [5, 9]
        caches.append(cache)
    fast, other, generic = caches
    tokens = np.array([3, 4])
    for _ in range(6):
        ours = target.decode_step(fast, tokens)
        logits, taps = ours.logits.copy(), ours.taps.copy()
        target.decode_step(other, tokens[::-1])  # another cache in between: rebinding
        reference = DecoderBackend.decode_step(target, generic, tokens)
        np.testing.assert_allclose(logits, reference.logits, atol=1e-6)
        np.testing.assert_allclose(taps, reference.taps, atol=1e-6)
        buffers = zip(fast.keys + fast.values, generic.keys + generic.values, strict=True)
        for mine, theirs in buffers:
            np.testing.assert_array_equal(mine, theirs)
        tokens = logits[:, 0].argmax(-1)
        for cache in caches:
            cache.lengths += 1
    fast.lengths[:] = [3, 24]
    with pytest.raises(GenerationError, match="overflows the KV cache"):
        target.decode_step(fast, tokens)


def cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def test_cli_json_with_text_prompt(artifacts, hf_models):
    from specx.runtime.tokenizer import TextTokenizer

    artifact = artifacts["qwen2"]
    result = cli(
        "generate",
        artifact,
        "--prompt",
        "def main():",
        "--max-new-tokens",
        12,
        "--ignore-eos",
        "--threads",
        2,
        "--json",
    )
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    tokenizer = TextTokenizer(artifact / "tokenizer.json")
    prompt = tokenizer.encode("def main():")
    expected = (
        hf_models["qwen2"]
        .generate(
            torch.tensor([prompt]),
            max_new_tokens=12,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )[0, len(prompt) :]
        .tolist()
    )
    assert out["tokens"] == [expected]
    assert out["text"] == [tokenizer.decode(expected)]
    assert out["stats"]["new_tokens"] == 12 and out["stats"]["tokens_per_s"] > 0


def test_cli_batch_from_jsonl(artifacts, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        '{"prompt": "import os"}\n\n{"prompt_ids": [4, 5, 6]}\n{"turns": ["x = 1"]}\n'
    )
    result = cli(
        "generate",
        artifacts["llama"],
        "--prompts-file",
        prompts,
        "--max-new-tokens",
        5,
        "--ignore-eos",
        "--json",
        "--temperature",
        0.8,
        "--seed",
        3,
    )
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert len(out["tokens"]) == 3 and all(len(t) == 5 for t in out["tokens"])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--prompt-ids", "1,2,x"], "comma-separated non-negative integers"),
        (["--prompt-ids", ",".join(["1"] * MAX_CONTEXT)], "KV slots"),
        (["--prompt-ids", "1", "--temperature", "-1"], "'--temperature': -1.0 is not in"),
        (["--prompt-ids", "1", "--prompt", "a"], "exactly one of"),
    ],
)
def test_cli_bad_input_is_one_clear_line(artifacts, args, message):
    result = CliRunner().invoke(main, ["generate", str(artifacts["llama"]), *args])
    assert result.exit_code == 2
    assert message in result.output and "Traceback" not in result.output


def test_cli_refuses_tampered_artifact(artifacts, tmp_path):
    import shutil

    copy = shutil.copytree(artifacts["llama"], tmp_path / "a")
    with open(copy / "target.onnx.data", "ab") as f:
        f.write(b"\0")
    result = CliRunner().invoke(main, ["generate", str(copy), "--prompt-ids", "1"])
    assert result.exit_code == 2 and "does not match" in result.output


def test_feed_near_the_end_of_the_cache_does_not_pad_past_it(artifacts):
    """A short row at the cache's end and a long row elsewhere: padding would overflow."""
    target = OrtTarget(load_manifest(artifacts["llama"]), threads=2)
    cache = target.allocate_cache(2, 16)
    output, last = target.feed(cache, [[7], [1, 2, 3, 4]], np.array([15, 0]))
    assert last.tolist() == [0, 3]
    alone = target.allocate_cache(1, 16)
    reference, _ = target.feed(alone, [[1, 2, 3, 4]], np.array([0]))
    np.testing.assert_allclose(output.logits[1, :4], reference.logits[0], atol=1e-5)
    np.testing.assert_allclose(cache.keys[0][1, :, :4], alone.keys[0][0, :, :4], atol=1e-6)
    assert np.abs(cache.keys[0][0, :, 15]).sum() > 0  # row 0's token was written in place


def test_phi3_longrope_within_its_original_context_equals_transformers(tmp_path):
    """longrope exports its short factors: exact up to original_max_position_embeddings."""
    import transformers

    from specx.errors import ExportError
    from specx.export.target_export import export_target

    half = 8  # head_dim 16
    rng = np.random.default_rng(0)
    config = transformers.Phi3Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=256, max_position_embeddings=1024,
        original_max_position_embeddings=64, bos_token_id=0, eos_token_id=0, pad_token_id=0,
        sliding_window=None,
        rope_scaling={"type": "longrope", "short_factor": (1 + rng.random(half)).tolist(),
                      "long_factor": (4 + rng.random(half)).tolist()},
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.Phi3ForCausalLM(config).eval()
    model.save_pretrained(tmp_path / "phi3")
    with pytest.raises(ExportError, match="longrope is a fixed table only up to .* 64"):
        export_target(tmp_path / "phi3", tmp_path / "too-long", max_context=128)
    artifact = export_target(tmp_path / "phi3", tmp_path / "artifact", max_context=64)
    target = OrtTarget(load_manifest(artifact), threads=2)
    prompt = rng.integers(1, 256, 60).tolist()
    cache = target.allocate_cache(1, 64)
    output, _ = target.feed(cache, [prompt], np.zeros(1, dtype=np.int64))
    with torch.no_grad():
        expected = model(torch.tensor([prompt])).logits[0].numpy()
    np.testing.assert_allclose(output.logits[0, :60], expected, atol=1e-4, rtol=1e-4)
    out = model.generate(torch.tensor([prompt[:20]]), max_new_tokens=40, do_sample=False,
                         eos_token_id=None, pad_token_id=0)  # fmt: skip
    assert generate_plain(target, [prompt[:20]], 40).tokens[0] == out[0, 20:].tolist()
