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
from collections.abc import Sequence
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


def copy_heavy_prompts(tokenizer, count: int | None, shortest: int = 600) -> list[list[int]]:
    """`count` (None: all) rewrite requests: a held-out stdlib function (`shortest`-1,600
    characters), a comment asking for it again, and its first third (32 such requests; 74
    from 300 characters).

    What a code assistant is asked when editing: the answer could copy most of the source,
    which lookup drafting (n-gram, suffix) takes from the prompt. 200-600 tokens each. The
    first function of each held-out file in the split's order, then each file's second, and
    so on: no prompt repeats (a batch of repeats would draft one row from another's output).
    """
    by_file = [_rewritable(path, shortest) for path in stdlib_split()[1]]
    requests = [f for rank in range(max(map(len, by_file))) for fs in by_file
                for f in fs[rank : rank + 1]]  # fmt: skip
    count = len(requests) if count is None else count
    if len(requests) < count:
        raise SystemExit(f"the held-out stdlib files hold {len(requests)} rewrite prompts, "
                         f"not {count}")  # fmt: skip
    return [tokenizer.encode(r) for r in requests[:count]]


def _rewritable(path: Path, shortest: int) -> list[str]:
    """A file's rewrite requests, one per function of `shortest`-1,600 characters."""
    import ast
    import textwrap

    source = path.read_text(errors="replace")
    try:
        functions = [n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.FunctionDef)]
    except SyntaxError:
        return []
    lines = source.splitlines()
    requests = []
    for node in functions:
        text = textwrap.dedent("\n".join(lines[node.lineno - 1 : node.end_lineno]))
        if shortest <= len(text) <= 1600:
            body = text.splitlines()
            start = "\n".join(body[: max(2, len(body) // 3)])
            requests.append(f"{text}\n\n\n# {node.name}, written again:\n{start}\n")
    return requests


def copy_share(prompt: Sequence[int], output: Sequence[int], n: int = 3) -> tuple[float, float]:
    """How much of `output` a lookup predicts: (from the prompt, from the output itself).

    Each output token counts where the latest earlier occurrence of the n tokens before it
    is followed by it; by where that occurrence is. What tells a copy-heavy load from a
    target that loops: on pyref-1b the rewrite requests' outputs are mostly its own loops.
    """
    history, found = list(prompt), [0, 0]
    for token in output:
        tail = history[-n:]
        for start in range(len(history) - n - 1, -1, -1):
            if history[start : start + n] == tail:
                if history[start + n] == token:
                    found[start + n >= len(prompt)] += 1
                break
        history.append(token)
    return found[0] / max(len(output), 1), found[1] / max(len(output), 1)


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
