"""specx's CPU kernels (`specx.runtime.kernels`, `specx build --backend cpu`): the GEMM's
sums, rows independent of everything else in a forward, the forward against the exported
graph, lossless speculation with chains, trees and heads, and the fallback where the kernels
do not run. Skipped where they were not compiled or this CPU runs neither of their paths."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from specx.runtime import kernels

LIB = kernels.library()
pytestmark = pytest.mark.skipif(LIB is None, reason=kernels.unavailable() or "")

from specx.artifact import load_manifest  # noqa: E402
from specx.builders import BuildOptions, build_artifact  # noqa: E402
from specx.errors import ArtifactError, BuildError  # noqa: E402
from specx.graphs.weight_only import quantize_rtn  # noqa: E402
from specx.masks import causal_mask  # noqa: E402
from specx.runtime.drafters import DrafterOptions, make_drafter  # noqa: E402
from specx.runtime.plain_decoding import generate_plain  # noqa: E402
from specx.runtime.speculative_decoding import generate_speculative  # noqa: E402
from specx.runtime.targets import open_decoder, select_build  # noqa: E402

PROMPTS = [[5, 9, 5, 9, 5, 9, 13, 5, 9, 5, 9], [7, 3, 11, 7, 3, 11, 7, 3], [4, 4, 6, 4, 4, 6]]
ZERO = {4: 8, 8: 128}


def _libraries() -> list[kernels.Library]:
    """Every compiled path this CPU runs (AVX-512 VNNI and AVX2 on a VNNI machine)."""
    import ctypes

    found = []
    for isa, needs in kernels._ISA_FLAGS.items():
        if set(needs) <= kernels.cpu_flags():
            for path in kernels._HERE.glob(f"_forward_{isa}.*so"):
                handle = ctypes.CDLL(str(path))
                found.append(kernels.Library(handle, isa))
    return found


def _weight(rng, n: int, k: int, bits: int, block: int = 32, symmetric: bool = True):
    """A random [n, k] weight rounded as the build rounds it: packed, and its codes, scales
    and zero points [n, k / block]."""
    weight = rng.standard_normal((k, n)).astype(np.float32) + (0 if symmetric else 0.7)
    quantized = quantize_rtn(weight, bits, block, symmetric)
    codes = np.maximum(quantized.codes.reshape(n, k), 1 if bits == 8 else 0)
    scales = quantized.scales.astype(np.float16).astype(np.float32)
    zeros = quantized.zero_points
    packed = kernels.pack_codes(codes, scales, bits, zeros)
    linear = kernels.Linear(packed.ctypes.data, None, bits, k, n, block, int(not symmetric))
    if zeros is None:
        zeros = np.full(scales.shape, ZERO[bits], dtype=np.uint8)
    return packed, linear, codes, scales, zeros


def _reference(x: np.ndarray, codes: np.ndarray, scales: np.ndarray, zeros: np.ndarray):
    """The kernels' product in float64: activations to int8 per weight block, integer dots."""
    rows, k = x.shape
    block = k // scales.shape[1]
    blocks = x.reshape(rows, -1, block)
    amax = np.abs(blocks).max(-1, keepdims=True)
    inverse = np.divide(np.float32(127), amax, out=np.zeros_like(amax), where=amax > 0)
    xq = np.rint(blocks * inverse)
    n = codes.shape[0]
    weights = codes.astype(np.float64).reshape(n, -1, block) - zeros[..., None]
    dots = np.einsum("mbi,nbi->mnb", xq, weights)
    return np.einsum("mnb,nb,mb->mn", dots, scales.reshape(n, -1), amax[..., 0] / 127)


GEMMS = [(4, 32, True), (8, 32, True), (4, 128, True), (8, 64, True), (4, 128, False)]


@pytest.mark.parametrize(("bits", "block", "symmetric"), GEMMS)
def test_the_gemm_is_the_block_quantized_product(bits, block, symmetric):
    """Each path (VNNI, AVX2) against float64, int4 with zero points too."""
    rng = np.random.default_rng(bits)
    packed, weight, codes, scales, zeros = _weight(rng, 72, 384, bits, block, symmetric)
    assert symmetric or len(np.unique(zeros)) > 3  # zero points that differ by column
    x = rng.standard_normal((5, 384)).astype(np.float32)
    x[1, :block] = 0.0  # an all-zero block
    for lib in _libraries():
        out = kernels.linear_forward(lib, weight, x, threads=2)
        expected = _reference(x, codes, scales, zeros)
        np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-4 * np.abs(expected).max())


@pytest.mark.parametrize(("bits", "block", "symmetric"), [*GEMMS[:3], GEMMS[-1]])
def test_a_row_of_the_gemm_is_bit_identical_whatever_rows_threads_and_path_run(
    bits, block, symmetric
):
    """1..20 rows (past one pass of 16), 1 or 2 threads, VNNI or AVX2, an odd count of tiles
    and more blocks than fit one cache chunk: the same bits a row."""
    rng = np.random.default_rng(10 + bits)
    packed, weight, _, _, _ = _weight(rng, 80, 4096, bits, block, symmetric)
    x = rng.standard_normal((20, 4096)).astype(np.float32)
    libraries = _libraries()
    first = kernels.linear_forward(libraries[0], weight, x[:1], threads=1)[0]
    for lib in libraries:
        for rows in (1, 2, 5, 16, 17, 20):
            for threads in (1, 2):
                out = kernels.linear_forward(lib, weight, x[:rows], threads=threads)
                np.testing.assert_array_equal(out[0], first, err_msg=f"{lib.isa} {rows} {threads}")
                alone = kernels.linear_forward(lib, weight, x[rows - 1 : rows], threads=threads)
                np.testing.assert_array_equal(out[rows - 1], alone[0])


def test_calls_from_many_threads_share_one_team_of_threads():
    """Every call runs on the library's one team thread: a thread that calls the kernels adds
    no OpenMP team of its own (libgomp keeps one per calling thread, and once teams' threads
    outnumber the CPUs its barriers sleep, ~6 ms a verify: docs/decisions.md#kernels-one-team).
    Counted as the process's threads while three long-lived callers are alive."""
    import os
    import threading

    rng = np.random.default_rng(3)
    _, weight, _, _, _ = _weight(rng, 32, 256, 8, 32, True)
    x = rng.standard_normal((2, 256)).astype(np.float32)
    lib = kernels.library()
    want = kernels.linear_forward(lib, weight, x, threads=2)  # the team, made here if not yet

    def threads_now() -> int:
        return len(os.listdir("/proc/self/task"))

    before, called, release, outs = threads_now(), threading.Barrier(4), threading.Event(), []

    def caller() -> None:
        outs.append(kernels.linear_forward(lib, weight, x, threads=2))
        called.wait()
        release.wait()

    callers = [threading.Thread(target=caller) for _ in range(3)]
    for thread in callers:
        thread.start()
    called.wait()
    grown = threads_now() - before
    release.set()
    for thread in callers:
        thread.join()
    assert grown == 3, f"{grown - 3} threads more than the callers"
    for out in outs:
        np.testing.assert_array_equal(out, want)


def _with_cpu_builds(source, directory):
    """A copy of the artifact `source` with cpu-int8 and cpu-int4 builds (int4 the default)."""
    artifact = shutil.copytree(source, directory)
    for precision in ("int8", "int4"):
        build_artifact(artifact, BuildOptions(backend="cpu", precision=precision))
    return artifact


def _assert_close(got: np.ndarray, want: np.ndarray, what: str = "") -> None:
    """Within an int8 build's rounding: 3% of the largest reference value."""
    assert np.abs(got - want).max() < 0.03 * np.abs(want).max(), what


@pytest.fixture(scope="module")
def built(artifacts, tmp_path_factory):
    """The llama artifact (EAGLE-3 taps) with cpu-int8 and cpu-int4 builds (int4 the default)."""
    return _with_cpu_builds(artifacts["llama"], tmp_path_factory.mktemp("cpu") / "llama")


def test_the_int8_build_computes_the_exported_graph_within_its_rounding(built):
    """Prefill of two rows: logits, taps and cache rows close to the float graph's."""
    manifest = load_manifest(built)
    exported = open_decoder(select_build(manifest, "exported"), threads=2)
    cpu = open_decoder(select_build(manifest, "cpu-int8"), threads=2)
    rng = np.random.default_rng(0)
    sequences = rng.integers(0, manifest.model.vocab_size, (2, 9)).tolist()
    outputs, caches = [], []
    for target in (exported, cpu):
        cache = target.allocate_cache(2, 32)
        output, _ = target.feed(cache, sequences, np.array([0, 3]))
        outputs.append(output)
        caches.append(cache)
    for name in ("logits", "taps"):
        _assert_close(getattr(outputs[1], name), getattr(outputs[0], name), name)
    for layer in (0, manifest.model.num_layers - 1):
        for kind in ("keys", "values"):
            want = getattr(caches[0], kind)[layer]
            got = getattr(caches[1], kind)[layer]
            _assert_close(got, want, kind)
            assert not got[0, :, 9:].any() and not got[1, :, :3].any()  # only the rows written


def _tree_forward(target, cache, tokens, prefix):
    """Nodes root, two children, a grandchild of the first (the token of `tokens[1]`)."""
    parents = [-1, 0, 0, 1]
    mask = np.zeros((1, 1, 4, prefix + 4), bool)
    mask[..., :prefix] = True
    depths = []
    for node, parent in enumerate(parents):
        seen = node
        while seen >= 0:
            mask[0, 0, node, prefix + seen] = True
            seen = parents[seen]
        depths.append(0 if parent < 0 else depths[parent] + 1)
    positions = prefix + np.array([depths])
    return target.forward(cache, np.array([tokens]), positions, mask, np.array([prefix]))


@pytest.mark.parametrize("build", ["cpu-int4", "cpu-int8"])
def test_a_token_s_logits_are_the_same_bits_alone_in_a_chunk_and_as_a_tree_node(built, build):
    """Row independence end to end: the plain step, a verify chunk's rows and a tree node
    deeper in the cache than its position all compute the same logits."""
    target = open_decoder(select_build(load_manifest(built), build), threads=2)
    rng = np.random.default_rng(1)
    prompt = rng.integers(0, 200, 10).tolist()
    a, b, c = (int(t) for t in rng.integers(0, 200, 3))
    caches = [target.allocate_cache(1, 32) for _ in range(3)]
    for cache in caches:
        target.feed(cache, [prompt], np.array([0]))
    chunk = target.forward(
        caches[0], np.array([[a, b, c]]), 10 + np.arange(3)[None],
        causal_mask(np.array([10]), 3, 13), np.array([10]),
    )  # fmt: skip
    alone = []
    for j, token in enumerate((a, b, c)):
        at = np.array([10 + j])
        step = target.decode_step(caches[1], np.array([token]), at)
        alone.append(step.logits[0, 0])
    # tree: a; b and a sibling c; c again under b: the path a, b, c sits at slots 10, 11, 13
    tree = _tree_forward(target, caches[2], [a, b, c, c], 10)
    for j in range(3):
        np.testing.assert_array_equal(alone[j], chunk.logits[0, j])
    np.testing.assert_array_equal(tree.logits[0, [0, 1, 3]], chunk.logits[0])
    np.testing.assert_array_equal(tree.taps[0, [0, 1, 3]], chunk.taps[0])


@pytest.mark.parametrize("build", ["cpu-int4", "cpu-int8"])
def test_greedy_speculation_on_a_cpu_build_equals_its_plain_decoding(built, build):
    target = open_decoder(select_build(load_manifest(built), build), threads=2)
    plain = generate_plain(target, PROMPTS, 24)
    # A chain of 3, and trees of n-gram matches (several continuations per round).
    for options in (DrafterOptions(3), DrafterOptions(4, ngram_matches=3)):
        speculative = generate_speculative(
            target, make_drafter("ngram", target, options), PROMPTS, 24
        )
        assert speculative.tokens == plain.tokens, (build, options)


@pytest.fixture(scope="module")
def eagle3_built(head_artifacts, tmp_path_factory):
    """The EAGLE-3 artifact with cpu-int8 and cpu-int4 builds: the head on the kernels too."""
    return _with_cpu_builds(head_artifacts["eagle3"], tmp_path_factory.mktemp("cpu") / "e3")


def test_an_eagle3_head_runs_on_the_kernels_as_its_exported_graph_within_rounding(eagle3_built):
    """The int8 head's forward (two rows of a catch-up over features) and its projection."""
    from specx.runtime.targets import graph_runtime, open_stateless

    manifest = select_build(load_manifest(eagle3_built), "cpu-int8")
    assert "draft_chain" not in manifest.build.graphs  # the chain loops over the kernels' head
    for graph in ("draft_head", "draft_projection"):
        assert graph_runtime(manifest, graph) == "cpu"
    exported = select_build(manifest, "exported")
    rng = np.random.default_rng(1)
    taps = rng.standard_normal((2, 7, manifest.model.taps.width)).astype(np.float32)
    projected = [open_stateless(m, "draft_projection", 2)(taps) for m in (exported, manifest)]
    _assert_close(projected[1], projected[0], "projection")
    tokens = rng.integers(0, manifest.model.vocab_size, (2, 7)).tolist()
    outputs = []
    for m in (exported, manifest):
        head = open_decoder(m, threads=2, graph="draft_head")
        cache = head.allocate_cache(2, 32)
        outputs.append(head.feed(cache, tokens, np.array([0, 4]), list(projected[0]))[0])
    for name in ("logits", "taps"):
        _assert_close(getattr(outputs[1], name), getattr(outputs[0], name), name)


def test_the_kernels_head_chain_drafts_what_the_per_depth_path_drafts(eagle3_built):
    """`StepChain` (one forward a depth) against the tree path's chain: the same tokens."""
    from specx.runtime.drafters.chain_graph import StepChain
    from specx.runtime.drafters.feature_head import FeatureHeadDrafter
    from specx.runtime.sampling import SamplingParams
    from specx.runtime.tree_shapes import StaticTree

    manifest = load_manifest(eagle3_built)
    target = open_decoder(manifest, threads=2)
    shape = StaticTree.chain(4)
    drafters = [FeatureHeadDrafter(manifest, shape, 2, one_call=c) for c in (True, False)]
    assert isinstance(drafters[0].chain, StepChain) and drafters[1].chain is None
    cache = target.allocate_cache(len(PROMPTS), 64)
    output, last = target.feed(cache, PROMPTS, np.zeros(len(PROMPTS), np.int64))
    histories = [list(p) + [int(output.logits[b, last[b]].argmax())] for b, p in enumerate(PROMPTS)]
    assert output.taps is not None
    taps = [output.taps[b, : len(p)] for b, p in enumerate(PROMPTS)]
    proposals = []
    for drafter in drafters:
        drafter.start(PROMPTS, 64, taps)
        trees = drafter.propose(histories, [True] * 3, SamplingParams(), np.random.default_rng(0))
        proposals.append([t.tokens.tolist() for t in trees])
    assert proposals[0] == proposals[1] and all(len(t) == 4 for t in proposals[0])


@pytest.mark.parametrize("tree", [None, "dynamic:11,3,3"])
def test_an_eagle3_head_on_the_kernels_drafts_losslessly(eagle3_built, tree):
    from specx.runtime.tree_shapes import parse_tree_spec

    manifest = load_manifest(eagle3_built)
    assert manifest.build.quantization.greedy_identity == "all"  # trees need no spine rule
    target = open_decoder(manifest, threads=2)
    plain = generate_plain(target, PROMPTS, 20)
    shape = None if tree is None else parse_tree_spec(tree)
    options = DrafterOptions(3) if shape is None else DrafterOptions(tree=shape)
    drafter = make_drafter("eagle3", target, options)
    speculative = generate_speculative(target, drafter, PROMPTS, 20)
    assert speculative.tokens == plain.tokens
    assert speculative.stats.speculative.acceptance.rounds > 0


def test_a_head_the_kernels_do_not_run_drafts_on_onnx_runtime_losslessly(head_artifacts, tmp_path):
    """An EAGLE-1 head: the build says why in its progress, the drafts run on ONNX Runtime."""
    from specx.runtime.targets import graph_runtime

    artifact = shutil.copytree(head_artifacts["eagle"], tmp_path / "eagle")
    lines: list[str] = []
    build_artifact(artifact, BuildOptions(backend="cpu", precision="int4"), lines.append)
    assert any("(the kernels run EAGLE-3 heads, not an eagle head)" in x for x in lines)
    manifest = load_manifest(artifact)
    drafts = [name for name in manifest.build.graphs if name != "target"]
    assert drafts and {graph_runtime(manifest, name) for name in drafts} == {"ort"}
    target = open_decoder(manifest, threads=2)
    plain = generate_plain(target, PROMPTS, 16)
    drafter = make_drafter("eagle", target, DrafterOptions(3))
    assert generate_speculative(target, drafter, PROMPTS, 16).tokens == plain.tokens


def test_a_symmetric_build_packs_without_zero_points_and_decodes_exactly(artifacts, tmp_path):
    """--symmetric --block-size 64: the index says so, the bytes hold no zero points (the
    int4 tile's 16 zero-point bytes per block gone), and speculation equals plain decoding."""
    from specx.graphs.weight_only import WeightOnlyConfig

    artifact = shutil.copytree(artifacts["llama"], tmp_path / "llama")
    told = WeightOnlyConfig(bits=4, block_size=64, symmetric=True)
    build_artifact(artifact, BuildOptions(backend="cpu", precision="int4", weight_only=told))
    manifest = load_manifest(artifact)
    details = manifest.builds["cpu-int4"].quantization.details
    assert (details["block"], details["symmetric"]) == (64, True)
    index = json.loads(manifest.path(manifest.builds["cpu-int4"].graphs["target"].file).read_text())
    layer = index["tensors"]["down.0"]
    assert (layer["block"], layer["zero_points"]) == (64, False)
    k, n = layer["k"], layer["n"]
    tiles, blocks = -(-n // kernels.TILE), k // 64
    assert layer["shape"] == [tiles * blocks * kernels.TILE * (64 // 2 + 2)]  # codes + fp16 scales
    target = open_decoder(select_build(manifest, "cpu-int4"), threads=2)
    plain = generate_plain(target, PROMPTS, 16)
    drafter = make_drafter("ngram", target, DrafterOptions(4, ngram_matches=3))
    assert generate_speculative(target, drafter, PROMPTS, 16).tokens == plain.tokens


@pytest.mark.parametrize(
    "told, refusal",
    [
        ({"bits": 4, "method": "gptq"}, "--block-size and --symmetric/--asymmetric only"),
        ({"bits": 4, "block_size": 16}, "--block-size 32, 64, 128, 256"),
        ({"bits": 8, "symmetric": False}, "drop --asymmetric"),
    ],
)
def test_settings_the_kernels_do_not_take_are_refused_before_any_work(
    artifacts, tmp_path, told, refusal
):
    from specx.graphs.weight_only import WeightOnlyConfig

    artifact = shutil.copytree(artifacts["llama"], tmp_path / "llama")
    options = BuildOptions("cpu", f"int{told['bits']}", weight_only=WeightOnlyConfig(**told))
    with pytest.raises(BuildError, match=refusal):
        build_artifact(artifact, options)
    assert not load_manifest(artifact).builds and not (artifact / "builds").exists()


def test_a_target_of_another_form_is_refused_before_any_work(artifacts, tmp_path):
    artifact = shutil.copytree(artifacts["gemma2"], tmp_path / "gemma2")
    with pytest.raises(BuildError, match="Llama-form targets only.*gemma2"):
        build_artifact(artifact, BuildOptions(backend="cpu", precision="int4"))
    with pytest.raises(BuildError, match="int4"):
        build_artifact(artifact, BuildOptions(backend="cpu", precision="fp16"))
    assert not load_manifest(artifact).builds and not (artifact / "builds").exists()


def test_without_the_kernels_a_cpu_build_is_refused_and_opening_one_says_why(
    built, monkeypatch, tmp_path
):
    monkeypatch.setattr(kernels, "library", lambda: None)
    reason = kernels.unavailable()
    assert reason is not None and "ONNX Runtime" in reason
    with pytest.raises(BuildError, match="kernels"):
        build_artifact(shutil.copytree(built, tmp_path / "again"), BuildOptions("cpu", "int4"))
    with pytest.raises(ArtifactError, match="--build"):
        open_decoder(load_manifest(built))
    plain = open_decoder(select_build(load_manifest(built), "exported"))  # the others still run
    assert plain.allocate_cache(1, 8).capacity == 8


def test_the_runtime_maps_the_weights_and_never_imports_the_build_side(built):
    """The cpu target opens with numpy, ctypes and the compiled library alone."""
    import subprocess
    import sys

    code = (
        "import sys, specx; e = specx.load(sys.argv[1]); "
        "e.generate([1, 2, 3], max_new_tokens=3, speculation='ngram'); "
        "bad = [m for m in ('torch', 'onnx', 'onnx_ir', 'specx.builders') if m in sys.modules]; "
        "assert not bad, bad"
    )
    done = subprocess.run([sys.executable, "-c", code, str(built)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


@pytest.fixture(scope="module", params=[(256, 4, 1), (320, 4, 2)], ids=["d64-group4", "d80-group2"])
def wide_heads(request, tmp_path_factory):
    """Targets whose heads (64 or 80 wide, 4 or 2 sharing a KV head) take the kernels' grouped
    attention passes, built at int4 (cpu-int4 the default)."""
    from specx.export.random_checkpoint import CheckpointPreset, write_random_checkpoint
    from specx.export.target_export import export_target

    hidden, heads, kv_heads = request.param
    root = tmp_path_factory.mktemp("wide-heads")
    preset = CheckpointPreset(hidden, 2 * hidden, 3, heads, kv_heads, 512)
    checkpoint = write_random_checkpoint(root / "ckpt", "llama", preset, seed=5, tokenizer=False)
    artifact = export_target(checkpoint, root / "art", max_context=256, taps="eagle3")
    build_artifact(artifact, BuildOptions(backend="cpu", precision="int4"))
    return artifact


def _chain_alone_tree(target, prefix: int):
    """Logits and taps of tokens a, b, c after `prefix` tokens: as a chunk, one by one, and as
    the path of a tree whose nodes sit at other slots than their positions."""
    rng = np.random.default_rng(2)
    prompt = rng.integers(0, 500, prefix).tolist()
    a, b, c = (int(t) for t in rng.integers(0, 500, 3))
    caches = [target.allocate_cache(1, prefix + 8) for _ in range(3)]
    for cache in caches:
        target.feed(cache, [prompt], np.array([0]))
    start = np.array([prefix])
    chunk = target.forward(
        caches[0], np.array([[a, b, c]]), prefix + np.arange(3)[None],
        causal_mask(start, 3, prefix + 3), start,
    )  # fmt: skip
    alone = [
        target.decode_step(caches[1], np.array([t]), start + j) for j, t in enumerate((a, b, c))
    ]
    tree = _tree_forward(target, caches[2], [a, b, c, c], prefix)
    return chunk, alone, tree


@pytest.mark.parametrize("prefix", [45, 70])  # past blocks of 16 slots and a chunk of 64
def test_grouped_attention_keeps_a_token_s_bits_alone_in_a_chunk_and_in_a_tree(wide_heads, prefix):
    target = open_decoder(load_manifest(wide_heads), threads=2)
    chunk, alone, tree = _chain_alone_tree(target, prefix)
    for j in range(3):
        np.testing.assert_array_equal(alone[j].logits[0, 0], chunk.logits[0, j])
    np.testing.assert_array_equal(tree.logits[0, [0, 1, 3]], chunk.logits[0])
    np.testing.assert_array_equal(tree.taps[0, [0, 1, 3]], chunk.taps[0])


def test_the_two_instruction_sets_compute_the_same_bits(wide_heads):
    """AVX-512's grouped attention (16 slots' dots folded by shuffles, heads sharing each key
    read) and AVX2's one-dot-at-a-time pass sum in the same order, as do their GEMMs."""
    libraries = {lib.isa: lib for lib in _libraries()}
    if set(libraries) != {"vnni", "avx2"}:
        pytest.skip("this CPU runs one of the kernels' instruction sets only")
    target = open_decoder(load_manifest(wide_heads), threads=2)
    outputs = {}
    for isa, lib in libraries.items():
        target._lib = lib
        outputs[isa] = _chain_alone_tree(target, 70)
    (chunk, alone, tree), (chunk2, alone2, tree2) = outputs["vnni"], outputs["avx2"]
    np.testing.assert_array_equal(chunk.logits, chunk2.logits)
    np.testing.assert_array_equal(tree.logits, tree2.logits)
    np.testing.assert_array_equal(alone[0].logits, alone2[0].logits)


def test_a_token_id_past_the_vocabulary_is_refused_not_read(built):
    from specx.errors import GenerationError

    target = open_decoder(load_manifest(built), threads=1)
    cache = target.allocate_cache(1, 8)
    with pytest.raises(GenerationError, match=r"token ids must lie in \[0, "):
        target.feed(cache, [[1, target.vocab_size]], np.array([0]))
