"""What the benchmarks read: where shared/ and results/ are, and the prompts they decode.

`SHARED` is the `shared/` folder beside the checkout (pyref-7m and the eval prompt sets);
a benchmark that needs it skips cleanly without it. Prompts are pyref-7m's token ids:
`prompts_for` is the suite's mix (HumanEval stubs, then stdlib files pyref-7m's split
holds out), `load_prompts` the first prompts of one eval set, `copy_heavy_prompts` requests
to write a held-out function again.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
RESULTS = ROOT / "benchmarks" / "results"
PYREF_7M = SHARED / "models" / "pyref-7m"


def log(message: str) -> None:
    """A progress line on stderr (stdout carries a script's results)."""
    print(message, file=sys.stderr, flush=True)


def stdlib_split() -> tuple[list[Path], list[Path]]:
    """The running Python's stdlib files: (training split, held out), by pyref-7m's rule."""
    from specx.training.corpus import stdlib_files

    return stdlib_files()


def prompts_for(tokenizer, count: int) -> list[list[int]]:
    """`count` HumanEval stubs, then `count // 2` held-out stdlib files (their last 320 ids)."""
    lines = (SHARED / "data" / "eval" / "humaneval.jsonl").read_text().splitlines()
    texts = [
        json.loads(line)["turns"][0].replace("Complete the code I provided.\n", "")
        for line in lines[:count]
    ]
    _, held = stdlib_split()
    texts += [p.read_text(errors="replace")[:1200] for p in held[: count // 2]]
    return [tokenizer.encode(t)[-320:] for t in texts]


def copy_heavy_prompts(tokenizer, count: int) -> list[list[int]]:
    """`count` rewrite requests: a held-out stdlib function (600-1,600 characters; one a
    file, in the split's order), a comment asking for it again, and its first third.

    What a code assistant is asked when editing: the answer copies most of the source,
    which lookup drafting (n-gram, suffix) can take from the prompt. 200-600 tokens each.
    """
    import ast
    import textwrap

    _, held = stdlib_split()
    prompts: list[list[int]] = []
    for path in held:
        source = path.read_text(errors="replace")
        try:
            functions = [n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.FunctionDef)]
        except SyntaxError:
            continue
        lines = source.splitlines()
        for node in functions:
            text = textwrap.dedent("\n".join(lines[node.lineno - 1 : node.end_lineno]))
            if 600 <= len(text) <= 1600:
                body = text.splitlines()
                start = "\n".join(body[: max(2, len(body) // 3)])
                request = f"{text}\n\n\n# {node.name}, written again:\n{start}\n"
                prompts.append(tokenizer.encode(request))
                break
        if len(prompts) == count:
            break
    return prompts


def prompt_sets(count: int) -> list[str]:
    """Which set each of `prompts_for(tokenizer, count)`'s prompts comes from, in its order."""
    _, held = stdlib_split()
    return ["humaneval"] * count + ["stdlib"] * len(held[: count // 2])


def load_prompts(file: str, count: int, max_tokens: int = 200) -> list[list[int]]:
    """The first `count` prompts of an eval set (`shared/data/eval/FILE`), as pyref-7m's ids."""
    from specx.runtime.tokenizer import TextTokenizer

    tokenizer = TextTokenizer(PYREF_7M / "tokenizer.json")
    lines = (SHARED / "data" / "eval" / file).read_text(encoding="utf-8").splitlines()
    return [tokenizer.encode(json.loads(line)["turns"][0])[:max_tokens] for line in lines[:count]]
