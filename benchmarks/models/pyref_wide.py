"""pyref-1b: pyref-7m's predictions at a 1.09B-parameter model's cost, and its heads widened.

Widening (`specx.training.widening`, Net2Net): every hidden unit of pyref-7m repeated 6 times
(hidden 320 -> 1920), its 4 query / 2 KV heads placed among 24 / 6 (head_dim 80, the GQA
pairing kept), MLP 864 -> 7680 units; the extra heads and units do real work and add
exactly zero. Block expansion (`specx.training.block_expansion`, LLaMA Pro) then grows the
5 real layers R0..R4 to 20: R0, R1, R2, R3, R4 at layers 0, 1, 9, 17, 19, the rest copies
silenced by zeroed norm weights with every matrix redrawn (`distinct_copies`: no two layers
share a weight, as in a real model; OpenVINO stores equal constants once, and with copied
weights its int4 export was 159 MB, not ~600). Untied lm_head. fp32 weights, 4.3 GB.

The committed pyref-7m drafters (`benchmarks/heads/pyref-7m`) are widened the same way into
`OUT/heads/<kind>`, each head's layer at the target's width (24 / 6 heads, 7680 MLP units: a
real-size head's cost); the draft model (hidden 160) by the same factor (960, 12 / 3 heads,
3840 units). EAGLE-3's taps are renumbered: pyref-7m's outputs of layers 1, 2, 4 (R1, R2,
R4) are pyref-1b's outputs of layers 1, 9, 19, which specx names by the layer they enter
(`eagle_aux_hidden_state_layer_ids` 1, 9, 19 = specx taps 2, 10, 20) and OpenVINO GenAI by
the layer they leave (`hidden_layers_list` 1, 9, 19). MTP's layer is renamed
`model.layers.20.` (DeepSeek names it by target depth).

Checks (`--check`): pyref-1b's logits within 1e-4 of pyref-7m's and greedy identical on 18
held-out prompts (12 HumanEval stubs + 6 held-out stdlib files) x 96 tokens (transformers,
fp32), written to OUT/checks.json. That every widened head drafts what it drafted is checked
where it is used (benchmarks/edge.py compares acceptance with pyref-7m's).

`--twin` writes OUT/pyref-7m-int4-twin, the pyref-7m-sized model computing what pyref-1b's
int4 build computes (`write_int4_twin`), and how often its argmax (and pyref-7m's) is what the
int4 build decodes, to OUT/twin_checks.json.

    python -m benchmarks.models.pyref_wide OUT [--factor 6 --heads 24 --kv-heads 6
        --intermediate 7680 --layers 20] [--check] [--twin]
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from benchmarks.inputs import PYREF_7M as SOURCE
from benchmarks.inputs import prompts_for
from benchmarks.models import pyref_heads
from benchmarks.runners import build_options

# The draft model (hidden 160, 2 / 1 heads of 80, 400 units) widened by the same factor, with
# the target's 4 queries per KV head and MLP ratio: hidden 960, 12 / 3 heads, 3840 units.
DRAFT_HEADS, DRAFT_KV_HEADS, DRAFT_INTERMEDIATE = 12, 3, 3840


def log(message: str) -> None:
    print(time.strftime("%H:%M:%S"), message, file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Shape:
    """pyref-1b's shape: the widening and the depth."""

    factor: int = 6
    heads: int = 24
    kv_heads: int = 6
    intermediate: int = 7680
    layers: int = 20

    @property
    def real_positions(self) -> tuple[int, ...]:
        """Where R0..R4 sit: 0, 1, L/2 - 1, L - 3, L - 1 (20 layers: 0, 1, 9, 17, 19)."""
        n = self.layers
        return (0, 1, n // 2 - 1, n - 3, n - 1)

    def widening(self):
        from specx.training.widening import Widening

        return Widening(self.factor, self.heads, self.kv_heads, self.intermediate)

    def entering(self, layer: int) -> int:
        """The wide layer whose input is the stream entering pyref-7m's `layer` (0..5)."""
        return 0 if layer == 0 else self.real_positions[layer - 1] + 1


def write_target(out: Path, shape: Shape) -> Path:
    """OUT/pyref-1b (replaced when it is a partial one of ours)."""
    from specx.training.block_expansion import ExpansionLayout, expand_checkpoint
    from specx.training.widening import widen_checkpoint

    target = out / "pyref-1b"
    if (target / "model.safetensors").is_file():
        return target
    narrow_wide = out / ".pyref-wide-5-layers"
    for partial in (narrow_wide, target):
        shutil.rmtree(partial, ignore_errors=True)
    log(f"widening pyref-7m x{shape.factor} into {narrow_wide}")
    widen_checkpoint(SOURCE, narrow_wide, shape.widening())
    log(f"expanding to {shape.layers} layers into {target}")
    layout = ExpansionLayout.placing(shape.layers, shape.real_positions)
    expand_checkpoint(narrow_wide, target, layout, distinct_copies=True)
    shutil.rmtree(narrow_wide)
    return target


def write_heads(
    out: Path, shape: Shape, source: Path = pyref_heads.HEADS, dest_dir: str = "heads"
) -> dict[str, Path]:
    """OUT/dest_dir/<kind>: every committed drafter under `source` widened (the docstring)."""
    from safetensors.numpy import load_file, save_file

    from specx.training.widening import NarrowShape, Widening, widen_checkpoint, widen_tensors

    narrow = NarrowShape.of(json.loads((SOURCE / "config.json").read_text()))
    written = {}
    for kind in [k for k in pyref_heads.KINDS if (source / k / "config.json").is_file()]:
        head, dest = source / kind, out / dest_dir / kind
        written[kind] = dest
        stamp = json.dumps(pyref_heads.weights_sha256(head))  # a retrained head is widened anew
        if (dest / "source.json").is_file() and (dest / "source.json").read_text() == stamp:
            continue
        shutil.rmtree(dest, ignore_errors=True)
        if kind == "draft-model":
            draft = Widening(shape.factor, DRAFT_HEADS, DRAFT_KV_HEADS, DRAFT_INTERMEDIATE)
            widen_checkpoint(head, dest, draft)
            (dest / "source.json").write_text(stamp)
            continue
        dest.mkdir(parents=True)
        for path in head.glob("*.safetensors"):
            tensors = widen_tensors(load_file(path), narrow, shape.widening())
            if kind == "mtp":
                tensors = {_renumber_mtp(k, shape.layers): v for k, v in tensors.items()}
            save_file(tensors, dest / path.name, metadata={"format": "pt"})
        config = json.loads((head / "config.json").read_text())
        (dest / "config.json").write_text(json.dumps(_head_config(kind, config, shape), indent=2))
        (dest / "source.json").write_text(stamp)
        log(f"widened {kind} into {dest}")
    return written


def _renumber_mtp(name: str, layers: int) -> str:
    parts = name.split(".")
    return ".".join([*parts[:2], str(layers), *parts[3:]])


def _head_config(kind: str, config: dict, shape: Shape) -> dict:
    from specx.training.widening import widen_config

    if kind not in ("eagle", "eagle3"):
        return config  # MTP and Medusa take their sizes from the target and the weights
    wide = widen_config(config, shape.widening())
    if kind == "eagle3":
        wide["target_hidden_size"] = wide["hidden_size"]
        taps = wide["eagle_config"]["eagle_aux_hidden_state_layer_ids"]  # layer outputs
        wide["eagle_config"] = {
            "eagle_aux_hidden_state_layer_ids": [shape.entering(t + 1) - 1 for t in taps]
        }
    return wide


def write_int4_twin(out: Path, shape: Shape) -> Path:
    """OUT/pyref-7m-int4-twin: the narrow model computing what pyref-1b's int4 build computes.

    `specx build --precision int4` rounds every MatMul weight to nearest per output row
    (`specx.graphs.weight_only`), which keeps each widened row a row, so the quantized wide
    weights narrow to an exact twin (`specx.training.widening.twin_tensors`; the silenced
    layer copies add zero before and after rounding). Two things the twin does not carry: the
    int8 activations of MatMulNBits' accuracy level 4, and the lm_head's 4-bit logits outside
    the top 16 (the build rescores those 16 from an 8-bit copy; the twin holds the 8-bit one
    everywhere). `--twin` measures how close that is. Heads distilled against the twin are
    distilled against the int4 target at pyref-7m's cost.
    """
    from safetensors.numpy import load_file, save_file

    from specx.builders.ort import STREAMED_WEIGHTS
    from specx.graphs.weight_only import WeightOnlyConfig, quantize_rtn
    from specx.training.widening import NarrowShape, twin_tensors

    twin = out / "pyref-7m-int4-twin"
    if (twin / "model.safetensors").is_file():
        return twin
    target = out / "pyref-1b"
    block = 128 if parameters(target) >= STREAMED_WEIGHTS else 32  # as specx.builders.ort
    config = WeightOnlyConfig(bits=4, block_size=block)

    def stored(name: str, wide: np.ndarray) -> np.ndarray:
        if wide.ndim != 2 or "embed_tokens" in name:
            return wide  # norms and the embedding (a Gather) stay float
        bits = config.bits if name != "lm_head.weight" else 8  # the rescored top 16
        weight = quantize_rtn(np.ascontiguousarray(wide.T), bits, block, config.is_symmetric)
        return np.ascontiguousarray(weight.dequantize()[: wide.shape[1]].T)

    narrow_config = json.loads((SOURCE / "config.json").read_text())
    tensors = load_file(SOURCE / "model.safetensors")
    tensors.setdefault("lm_head.weight", tensors["model.embed_tokens.weight"])
    log(f"writing pyref-1b's int4 twin (blocks of {block}) into {twin}")
    partial = out / ".pyref-7m-int4-twin.partial"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    narrow = NarrowShape.of(narrow_config)
    save_file(
        twin_tensors(tensors, narrow, shape.widening(), stored), partial / "model.safetensors"
    )
    twin_config = {**narrow_config, "tie_word_embeddings": False}
    (partial / "config.json").write_text(json.dumps(twin_config, indent=2) + "\n")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (SOURCE / name).is_file():
            shutil.copyfile(SOURCE / name, partial / name)
    partial.replace(twin)
    return twin


def check_target(target: Path, new_tokens: int) -> dict:
    """pyref-1b vs pyref-7m: largest logit difference on each prompt, greedy identity."""
    import torch
    from transformers import AutoModelForCausalLM

    from specx.runtime.tokenizer import TextTokenizer

    prompts = prompts_for(TextTokenizer(SOURCE / "tokenizer.json"), 12)
    models = [AutoModelForCausalLM.from_pretrained(p).eval() for p in (SOURCE, target)]
    worst, identical = 0.0, 0
    for i, prompt in enumerate(prompts):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            small, wide = (m(ids).logits for m in models)
            worst = max(worst, float((small - wide).abs().max()))
            outs = [
                m.generate(ids, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
                for m in models
            ]
        identical += outs[0].tolist() == outs[1].tolist()
        log(f"check {i + 1}/{len(prompts)}: max |logit diff| so far {worst:.2e}")
    return {
        "prompts": len(prompts),
        "new_tokens": new_tokens,
        "max_abs_logit_difference": worst,
        "greedy_identical": identical,
    }


def int4_build(out: Path, target: Path) -> Path:
    """OUT/specx-int4: pyref-1b exported and built at int4 as edge.py builds it."""
    from specx.builders import build_artifact
    from specx.export.target_export import export_target

    artifact = out / "specx-int4"
    if not (artifact / ".complete").is_file():
        shutil.rmtree(artifact, ignore_errors=True)
        log(f"specx export + int4 build of pyref-1b into {artifact}")
        export_target(target, artifact, max_context=1024)
        build_artifact(artifact, build_options("ort-int4"))
        (artifact / ".complete").write_text("")
    return artifact


def check_twin(twin: Path, artifact: Path, new_tokens: int, threads: int = 2) -> dict:
    """How often the twin (and pyref-7m) predicts what pyref-1b at int4 decodes greedily.

    Each held-out prompt is decoded greedily by specx from the int4 build; the twin and
    pyref-7m read the same tokens (teacher forcing) and their argmax at every decoded
    position is compared with the int4 token there.
    """
    import torch
    from transformers import AutoModelForCausalLM

    from specx.artifact import load_manifest
    from specx.runtime.plain_decoding import generate_plain
    from specx.runtime.targets import open_decoder
    from specx.runtime.tokenizer import TextTokenizer

    decoder = open_decoder(load_manifest(artifact).with_build("ort-int4"), threads=threads)
    prompts = prompts_for(TextTokenizer(SOURCE / "tokenizer.json"), 12)
    models = {
        name: AutoModelForCausalLM.from_pretrained(path).eval()
        for name, path in (("twin", twin), ("pyref-7m", SOURCE))
    }
    agree = dict.fromkeys(models, 0)
    positions = 0
    for i, prompt in enumerate(prompts):
        decoded = generate_plain(decoder, [list(prompt)], new_tokens).tokens[0]
        ids = torch.tensor([list(prompt) + list(decoded)])
        for name, model in models.items():
            with torch.no_grad():
                predicted = model(ids).logits[0, len(prompt) - 1 : -1].argmax(-1)
            agree[name] += int((predicted == torch.tensor(decoded)).sum())
        positions += len(decoded)
        log(f"twin check {i + 1}/{len(prompts)}: {agree} of {positions}")
    return {
        "prompts": len(prompts),
        "new_tokens": new_tokens,
        "positions": positions,
        "top1_agreement_with_int4": {name: n / positions for name, n in agree.items()},
    }


def parameters(target: Path) -> int:
    from safetensors import safe_open

    with safe_open(target / "model.safetensors", "np") as f:
        return sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    for field, default in vars(Shape()).items():
        parser.add_argument(f"--{field.replace('_', '-')}", type=int, default=default)
    parser.add_argument("--check", action="store_true", help="logits and greedy vs pyref-7m")
    parser.add_argument("--check-tokens", type=int, default=96)
    parser.add_argument(
        "--twin", action="store_true", help="write pyref-1b's int4 twin and check it"
    )
    args = parser.parse_args()
    if not (SOURCE / "model.safetensors").is_file():
        log("skipped: shared/models/pyref-7m is absent")
        return
    shape = Shape(args.factor, args.heads, args.kv_heads, args.intermediate, args.layers)
    target = write_target(args.out, shape)
    log(f"{target}: {parameters(target) / 1e9:.3f}B parameters")
    write_heads(args.out, shape)
    if args.check:
        report = check_target(target, args.check_tokens)
        (args.out / "checks.json").write_text(json.dumps(report, indent=2) + "\n")
        log(json.dumps(report))
    if args.twin:
        twin = write_int4_twin(args.out, shape)
        report = check_twin(twin, int4_build(args.out, target), args.check_tokens)
        (args.out / "twin_checks.json").write_text(json.dumps(report, indent=2) + "\n")
        log(json.dumps(report))


if __name__ == "__main__":
    main()
