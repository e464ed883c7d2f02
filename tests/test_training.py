"""`specx train`: losses fall, trained drafters beat untrained ones on held-out text, the
public-format output loads back identically, training is deterministic and resumable."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from specx.cli import main
from specx.errors import SpecxError
from specx.export.checkpoint import load_checkpoint
from specx.export.heads import load_head
from specx.training.loop import TrainConfig, train_drafter

CORPUS = [str(Path(sysconfig.get_paths()["stdlib"]) / "json")]


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    """A peaked random target with a tokenizer: distributions far from uniform."""
    from specx.export.random_checkpoint import CheckpointPreset, write_random_checkpoint

    path = write_random_checkpoint(
        tmp_path_factory.mktemp("teacher") / "t",
        "llama",
        CheckpointPreset(48, 96, 4, 4, 2, 256),
        seed=7,
    )
    weights = load_file(path / "model.safetensors")
    weights["lm_head.weight"] *= 25.0
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return path


def config(kind, **kw):
    return TrainConfig(
        kind,
        **{
            "steps": 60,
            "batch": 4,
            "seq_len": 64,
            "lr": 3e-3,
            "draft_vocab": 160 if kind == "eagle3" else None,
            **kw,
        },
    )


@pytest.mark.parametrize("kind", ["eagle3", "eagle", "medusa", "mtp", "draft-model"])
def test_loss_falls_and_acceptance_rises(kind, teacher_dir, tmp_path):
    report = train_drafter(teacher_dir, CORPUS, tmp_path / kind, config(kind)).report
    assert report["final_loss"] < report["first_loss"]
    assert report["held_out_acceptance_after"] > report["held_out_acceptance_before"] + 0.01
    first, last = report["learning_curve"][0], report["learning_curve"][-1]
    assert last["acceptance_by_depth"][0] == report["held_out_acceptance_after"]
    if kind != "draft-model":  # deeper drafts, from the drafter's own outputs, improve too
        assert len(last["acceptance_by_depth"]) >= 4
        assert last["acceptance_by_depth"][1] > first["acceptance_by_depth"][1]
    assert last["tau_chain5_estimate"] > first["tau_chain5_estimate"]
    assert json.loads((tmp_path / kind / "train_report.json").read_text()) == report
    assert not (tmp_path / kind / "train_state.pt").exists()


@pytest.mark.parametrize("kind", ["eagle3", "eagle", "medusa", "mtp"])
def test_saved_head_loads_back_identically(kind, teacher_dir, tmp_path):
    result = train_drafter(teacher_dir, CORPUS, tmp_path / kind, config(kind, steps=5))
    spec = "mtp:" if kind == "mtp" else f"{kind}:"
    loaded = load_head(spec + str(tmp_path / kind), load_checkpoint(teacher_dir))
    for name, tensor in result.model.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], tensor, atol=0, rtol=0)
    if kind == "eagle3":
        raw = load_file(tmp_path / kind / "model.safetensors")
        assert {"d2t", "t2d", "fc.weight", "midlayer.hidden_norm.weight"} <= set(raw)
        assert int(raw["t2d"].sum()) == 160


def test_resume_reproduces_an_uninterrupted_run(teacher_dir, tmp_path):
    def interrupt(message):
        if message.startswith("medusa step 40/"):
            raise KeyboardInterrupt

    cfg = config("medusa", steps=60, save_every=20, eval_every=10)
    with pytest.raises(KeyboardInterrupt):
        train_drafter(teacher_dir, CORPUS, tmp_path / "b", cfg, progress=interrupt)
    assert (tmp_path / "b" / "train_state.pt").is_file()
    messages = []
    resumed = train_drafter(teacher_dir, CORPUS, tmp_path / "b", cfg, progress=messages.append)
    assert "resuming medusa training at step 20" in messages
    fresh = train_drafter(teacher_dir, CORPUS, tmp_path / "c", cfg)
    for name, tensor in fresh.model.state_dict().items():
        torch.testing.assert_close(resumed.model.state_dict()[name], tensor)
    # The learning curve survives the interruption: the same steps, the same measures.
    curve = [(c["step"], round(c["acceptance"], 6)) for c in resumed.report["learning_curve"]]
    assert curve == [(c["step"], round(c["acceptance"], 6)) for c in fresh.report["learning_curve"]]
    assert [step for step, _ in curve] == [0, 10, 20, 30, 40, 50, 60]


@pytest.mark.parametrize("taps", [None, (1, 3, 4)])
def test_trained_eagle3_drafts_losslessly(teacher_dir, tmp_path, taps):
    from specx.artifact import load_manifest
    from specx.export.target_export import export_target
    from specx.runtime.drafters import DrafterOptions, make_drafter
    from specx.runtime.plain_decoding import generate_plain
    from specx.runtime.speculative_decoding import generate_speculative
    from specx.runtime.targets.ort import OrtTarget
    from specx.runtime.tree_shapes import parse_tree_spec

    train_drafter(
        teacher_dir, CORPUS, tmp_path / "head", config("eagle3", steps=80, tap_layers=taps)
    )
    artifact = export_target(
        teacher_dir, tmp_path / "art", max_context=128, drafter=f"eagle3:{tmp_path / 'head'}"
    )
    manifest = load_manifest(artifact)
    # The head's own taps (4 = the last layer's output) reach the exported target.
    assert manifest.model.taps.layers == tuple(taps or (2, 2, 1))
    target = OrtTarget(manifest, threads=2)
    from specx.runtime.tokenizer import TextTokenizer

    tokenizer = TextTokenizer(teacher_dir / "tokenizer.json")
    source = (Path(CORPUS[0]) / "decoder.py").read_text()
    prompts = [tokenizer.encode(source[i : i + 300])[:40] for i in (0, 2000, 5000)]
    plain = generate_plain(target, prompts, 40)
    drafter = make_drafter("eagle3", target, DrafterOptions(tree=parse_tree_spec("dynamic:11,3,3")))
    spec = generate_speculative(target, drafter, prompts, 40)
    assert spec.tokens == plain.tokens
    assert spec.stats.speculative.acceptance.acceptance_length > 1.2


def test_cli_train_and_bad_input(teacher_dir, tmp_path):
    result = CliRunner().invoke(
        main,
        [
            "train",
            "medusa",
            str(teacher_dir),
            "--corpus",
            CORPUS[0],
            "-o",
            str(tmp_path / "m"),
            "--steps",
            "3",
            "--batch",
            "2",
            "--seq-len",
            "32",
        ],
    )
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["kind"] == "medusa"
    with pytest.raises(SpecxError, match="does not exist"):
        train_drafter(teacher_dir, [str(tmp_path / "nope")], tmp_path / "x", config("eagle"))
    with pytest.raises(SpecxError, match="unknown drafter"):
        train_drafter(teacher_dir, CORPUS, tmp_path / "x", config("hydra"))
    refused = CliRunner().invoke(
        main,
        ["train", "eagle", str(teacher_dir), "--corpus", CORPUS[0], "-o", str(tmp_path / "e"),
         "--normalise-taps"],
    )  # fmt: skip
    assert refused.exit_code != 0
    assert "--normalise-taps/--raw-taps applies only to eagle3 training" in refused.output
    assert not (tmp_path / "e").exists()


def test_on_policy_windows_are_added(teacher_dir, tmp_path):
    report = train_drafter(
        teacher_dir,
        CORPUS,
        tmp_path / "op",
        config("medusa", steps=3, on_policy_windows=4, on_policy_prompt=8),
    ).report
    plain = train_drafter(teacher_dir, CORPUS, tmp_path / "plain", config("medusa", steps=3)).report
    assert report["train_windows"] == plain["train_windows"] + 4


@pytest.mark.parametrize("kind", ["eagle3", "eagle", "medusa", "mtp", "draft-model"])
def test_bf16_autocast_trains_every_kind(kind, teacher_dir, tmp_path):
    report = train_drafter(teacher_dir, CORPUS, tmp_path / kind, config(kind, bf16=True)).report
    assert report["final_loss"] < report["first_loss"]
    assert report["held_out_acceptance_after"] > report["held_out_acceptance_before"]


def test_normalised_taps_fold_into_the_saved_fc(teacher_dir, tmp_path):
    """A head trained on unit-RMS taps saves the scale inside `fc`: the loaded head projects
    the raw taps exactly as the trained one did, and training differed from raw taps."""
    from specx.training.teacher import Teacher

    trained = {}
    for normalise in (True, False):
        cfg = config("eagle3", steps=5, normalise_taps=normalise, tap_layers=(1, 2, 4))
        trained[normalise] = train_drafter(teacher_dir, CORPUS, tmp_path / f"{normalise}", cfg)
    result = trained[True]
    assert result.model.tap_scale is None  # folded when saved
    assert not torch.allclose(result.model.fc.weight, trained[False].model.fc.weight)
    checkpoint = load_checkpoint(teacher_dir)
    loaded = load_head(f"eagle3:{tmp_path / 'True'}", checkpoint)
    taps = Teacher(checkpoint.config, checkpoint.state_dict, (1, 2, 4))(
        torch.arange(20)[None] * 7 % 256
    ).eagle3
    with torch.no_grad():
        torch.testing.assert_close(loaded.project(taps), result.model.project(taps))


@pytest.mark.parametrize("kind", ["eagle3", "medusa", "draft-model"])  # heads load alike
def test_init_continues_from_a_saved_drafter(kind, teacher_dir, tmp_path):
    """`init` starts from a saved drafter: the new run's step-0 held-out acceptance is the
    saved run's final one (EAGLE-3's folded tap scale unfolded again), and it trains on."""
    extra = {"tap_layers": (1, 2, 4)} if kind == "eagle3" else {}
    first = train_drafter(teacher_dir, CORPUS, tmp_path / "a", config(kind, steps=4, **extra))
    cfg = config(kind, steps=4, init=str(tmp_path / "a"), draft_vocab=None, seed=1)
    second = train_drafter(teacher_dir, CORPUS, tmp_path / "b", cfg).report
    start = second["learning_curve"][0]["acceptance_by_depth"]
    after = first.report["learning_curve"][-1]["acceptance_by_depth"]
    assert start == pytest.approx(after, abs=1e-5)
    assert second["learning_curve"][-1]["acceptance"] != pytest.approx(start[0], abs=1e-6)
    if kind == "eagle3":  # the same taps and vocabulary, read from the saved head
        assert second["draft_vocab"] == 160
        loaded = load_head(f"eagle3:{tmp_path / 'b'}", load_checkpoint(teacher_dir))
        assert tuple(loaded.tap_layers) == (1, 2, 4)


def test_init_refuses_what_would_change_its_shape(teacher_dir, tmp_path):
    train_drafter(teacher_dir, CORPUS, tmp_path / "a", config("medusa", steps=1))
    with pytest.raises(SpecxError, match="--draft-vocab: the --init drafter keeps"):
        train_drafter(
            teacher_dir, CORPUS, tmp_path / "x", config("eagle3", init=str(tmp_path / "a"))
        )
    with pytest.raises(SpecxError, match="no such directory"):
        train_drafter(
            teacher_dir, CORPUS, tmp_path / "x", config("eagle", init=str(tmp_path / "nope"))
        )
    args = ["--corpus", CORPUS[0], "-o", str(tmp_path / "m"), "--init", str(tmp_path / "a")]
    wrong = CliRunner().invoke(main, ["train", "eagle", str(teacher_dir), *args])
    assert wrong.exit_code != 0 and "Traceback" not in wrong.output
    assert "no head weights (looked for model.safetensors" in wrong.output
    shaped = CliRunner().invoke(
        main, ["train", "medusa", str(teacher_dir), *args, "--medusa-heads", "3"]
    )
    assert "--medusa-heads: the --init drafter keeps" in shaped.output
    with pytest.raises(SpecxError, match="not a draft model transformers can load"):
        train_drafter(
            teacher_dir, CORPUS, tmp_path / "x", config("draft-model", init=str(tmp_path / "a"))
        )
    assert not (tmp_path / "m").exists()


def test_the_cli_takes_kinds_from_the_registry(teacher_dir, tmp_path, monkeypatch):
    """`specx train` lists, refuses and checks options of kinds by the registry alone, and
    refuses an unknown kind before the library is called or anything is written."""
    from specx.training import loop
    from specx.training.kinds import KINDS

    def never(*args, **kwargs):
        raise AssertionError("the CLI called the library")

    monkeypatch.setattr(loop, "train_drafter", never)
    args = [str(teacher_dir), "--corpus", CORPUS[0], "-o", str(tmp_path / "x")]
    unknown = CliRunner().invoke(main, ["train", "hydra", *args])
    assert unknown.exit_code == 2, unknown.output
    assert f"unknown drafter 'hydra'; choose one of {', '.join(KINDS)}" in unknown.output
    refused = CliRunner().invoke(main, ["train", "medusa", *args, "--ttt-steps", "2"])
    assert refused.exit_code == 2
    assert "--ttt-steps applies only to eagle3 and mtp training, not medusa" in refused.output
    assert not (tmp_path / "x").exists()
    described = CliRunner().invoke(main, ["train", "--help"]).output
    line = " ".join(described.split()).partition("KIND: ")[2].partition(".")[0]
    assert set(line.replace(",", " ").split()) - {"or"} == set(KINDS)


def test_training_compares_no_kind_with_a_kind_name():
    """What differs by kind is its object in the registry (`specx.training.kinds`): no
    `kind == "eagle3"` (or `!=`, `in`) is left in training or its command."""
    import ast

    import specx
    from specx.training.kinds import KINDS

    def names_a_kind(node) -> bool:
        constants = node.elts if isinstance(node, ast.Tuple | ast.List | ast.Set) else [node]
        return any(isinstance(c, ast.Constant) and c.value in KINDS for c in constants)

    def is_kind(node) -> bool:
        return (isinstance(node, ast.Name) and node.id == "kind") or (
            isinstance(node, ast.Attribute) and node.attr == "kind"
        )

    root = Path(specx.__file__).parent
    found = []
    for path in [*sorted((root / "training").rglob("*.py")), root / "cli" / "train.py"]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare):
                sides = [node.left, *node.comparators]
                if any(map(is_kind, sides)) and any(map(names_a_kind, sides)):
                    found.append(f"{path.relative_to(root)}:{node.lineno}")
    assert not found, found
