"""The public API: specx.load -> Engine (generate, stream, chat, stop strings, typed results)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

import specx
from conftest import CHAT_TEMPLATE
from specx.cli import main
from specx.drafter_name import KINDS, DrafterName
from specx.errors import GenerationError
from specx.runtime.detokenize import TextStream
from specx.runtime.drafters import DRAFTERS
from specx.runtime.engine import Speculation

README = Path(__file__).resolve().parents[1] / "README.md"


@pytest.fixture(scope="module")
def engine(artifacts):
    return specx.load(artifacts["llama"], threads=2)


def test_the_readme_embedding_example_runs(artifacts, capsys):
    block = re.search(r"<!-- embedding-example -->\n```python\n(.*?)```", README.read_text(), re.S)
    assert block, "README lost its embedding example"
    code = block.group(1)
    assert len(code.strip().splitlines()) <= 10
    exec(code.replace('"artifacts/pyref"', repr(str(artifacts["llama"]))), {})
    assert capsys.readouterr().out.strip()


@pytest.mark.parametrize("drafter", [None, "ngram", "suffix", "draft-model"])
def test_generate_equals_the_cli_and_plain_decoding(engine, artifacts, draft_artifacts, drafter):
    prompt = [5, 9, 5, 9, 5, 9, 13]
    if drafter == "draft-model":
        drafter = f"draft-model:{draft_artifacts['llama']}"
    plain = engine.generate(prompt, max_new_tokens=24, ignore_eos=True)
    done = engine.generate(prompt, max_new_tokens=24, ignore_eos=True, speculation=drafter)
    assert done.tokens == plain.tokens and len(done.tokens) == 24
    assert done.finish_reason == "length" and done.prompt_tokens == prompt
    assert done.stats.mode == ("plain" if drafter is None else "speculative")
    assert done.stats.new_tokens == 24 and done.stats.ms_per_token > 0
    args = ["generate", str(artifacts["llama"]), "--prompt-ids", "5,9,5,9,5,9,13"]
    args += ["--max-new-tokens", "24", "--ignore-eos", "--json"]
    args += [] if drafter is None else ["--drafter", drafter]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["tokens"] == [done.tokens]


def test_stream_chunks_add_up_to_the_completion(engine):
    for speculation in (None, "ngram"):
        whole = engine.generate("def f(x):", max_new_tokens=20, speculation=speculation)
        chunks = list(engine.stream("def f(x):", max_new_tokens=20, speculation=speculation))
        assert chunks[-1].completion is not None and chunks[-1].completion.tokens == whole.tokens
        assert [t for c in chunks for t in c.tokens] == whole.tokens
        assert "".join(c.text for c in chunks) == whole.text
        assert all(c.completion is None for c in chunks[:-1])


def test_closing_a_stream_ends_its_decoding(engine):
    stream = engine.stream([5, 9, 5], max_new_tokens=100, ignore_eos=True)
    first = next(stream)
    assert first.tokens
    stream.close()  # the decoding stops at its next round and releases the engine
    again = engine.generate([5, 9, 5], max_new_tokens=3, ignore_eos=True)
    assert len(again.tokens) == 3


def test_stop_strings_cut_the_text_and_the_tokens(engine):
    whole = engine.generate("import os", max_new_tokens=40, ignore_eos=True)
    assert len(whole.text) > 6
    stop = whole.text[3:6]  # occurs in the output: generation must end there
    done = engine.generate("import os", max_new_tokens=40, ignore_eos=True, stop=[stop, "@@@"])
    assert done.finish_reason == "stop" and done.text == whole.text[: whole.text.index(stop)]
    assert done.tokens == whole.tokens[: len(done.tokens)] and len(done.tokens) < 40
    assert stop in engine.tokenizer.decode(done.tokens)  # the last token completes the stop
    assert stop not in engine.tokenizer.decode(done.tokens[:-1])
    streamed = list(engine.stream("import os", max_new_tokens=40, ignore_eos=True, stop=stop))
    assert "".join(c.text for c in streamed) == done.text
    spec = engine.generate(
        "import os", max_new_tokens=40, ignore_eos=True, stop=[stop], speculation="ngram"
    )
    assert spec.text == done.text and spec.tokens == done.tokens


def test_text_stream_holds_back_partial_characters_and_stop_prefixes():
    pieces = {1: b"ab", 2: b"\xe2\x82", 3: b"\xac", 4: b"cd", 5: b"EN", 6: b"Dxy"}
    decode = lambda ids: b"".join(pieces[i] for i in ids).decode("utf-8", "replace")  # noqa: E731
    stream = TextStream(decode, stop=["END"])
    assert stream.push([1]) == "ab"
    assert stream.push([2]) == ""  # an incomplete euro sign is never shown
    assert stream.push([3, 4]) == "\u20accd"
    assert stream.push([5]) == ""  # "EN" may start the stop string: held
    assert stream.push([6]) == "" and stream.stopped and stream.text == "ab\u20accd"
    assert stream.finish() == "" and stream.tokens == [1, 2, 3, 4, 5, 6]
    free = TextStream(decode)
    assert free.push([1, 2]) == "ab" and free.push([3]) == "\u20ac" and free.finish() == ""
    cut = TextStream(decode)  # a sequence that ends inside a character: shown at the end
    assert cut.push([1, 2]) == "ab" and cut.finish() == "\ufffd"


def test_chat_renders_the_checkpoints_template_like_transformers(chat_artifact, checkpoints):
    from transformers import PreTrainedTokenizerFast

    engine = specx.load(chat_artifact, threads=2)
    messages = [
        {"role": "system", "content": "You write Python."},
        {"role": "user", "content": "Sort a list, ü"},
    ]
    reference = PreTrainedTokenizerFast(
        tokenizer_file=str(checkpoints["llama"] / "tokenizer.json"), bos_token="<|endoftext|>"
    )
    reference.chat_template = CHAT_TEMPLATE
    expected = reference.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if not isinstance(expected, list):  # newer transformers return a BatchEncoding
        expected = expected["input_ids"]
    assert engine.chat_prompt(messages) == list(expected)
    answer = engine.chat(messages, max_new_tokens=8, ignore_eos=True)
    assert answer.prompt_tokens == list(expected) and len(answer.tokens) == 8


def test_bad_requests_are_refused_by_name_before_decoding(engine, artifacts):
    with pytest.raises(GenerationError, match="no chat template"):
        engine.chat([{"role": "user", "content": "hi"}])
    with pytest.raises(GenerationError, match="temperature must be"):
        engine.generate("x", temperature=-1)
    with pytest.raises(GenerationError, match="top_p must be"):
        engine.generate("x", temperature=1, top_p=0)
    with pytest.raises(GenerationError, match="max_new_tokens must be"):
        engine.generate("x", max_new_tokens=0)
    with pytest.raises(GenerationError, match="prompt is empty"):
        engine.generate([])
    # The hint names every flag a larger capacity may take, past the trained positions too.
    with pytest.raises(GenerationError, match="capacity.*--beyond-trained-positions"):
        engine.generate([1] * 200)
    with pytest.raises(GenerationError, match="non-negative integers"):
        engine.generate([1, -2])
    with pytest.raises(specx.errors.SpecxError, match="unknown drafter"):
        engine.generate("x", speculation="telepathy")


def test_speculation_parses_its_drafter_once_and_refuses_an_unknown_kind_at_construction():
    spec = Speculation("draft-model:artifacts/small:v2")
    assert spec.drafter == DrafterName("draft-model", "artifacts/small:v2")
    assert spec.drafter_name is spec.drafter
    assert str(spec.drafter) == "draft-model:artifacts/small:v2"
    assert Speculation(DrafterName("ngram")).drafter == Speculation("ngram").drafter
    with pytest.raises(specx.errors.SpecxError, match="unknown drafter 'telepathy'; choose one of"):
        Speculation("telepathy")
    with pytest.raises(specx.errors.SpecxError, match="named by a string"):
        Speculation(3)  # type: ignore[arg-type]


def test_every_drafter_kind_is_built_by_the_runtime():
    assert set(DRAFTERS) == set(KINDS)
