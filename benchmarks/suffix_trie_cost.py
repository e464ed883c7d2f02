"""What the suffix drafter's trie costs at a large shared size: feeding tokens, and a full gc.

Builds a `SuffixTrie` (depth 32) from 60,000 code-like tokens (Zipf over 8,000 ids, seed 0),
then times a full `gc.collect()` and feeding 2,000 more tokens in stretches of 64 (the
tokens a row emits between proposals), fastest of 5. Run it from each checkout to compare
trie layouts:

    cd CHECKOUT && PYTHONPATH=src python /path/to/benchmarks/suffix_trie_cost.py
"""

from __future__ import annotations

import gc
import time
from pathlib import Path

import numpy as np


def main() -> None:
    import specx
    from specx.runtime.drafters.suffix import SuffixTrie

    rng = np.random.default_rng(0)
    base = (rng.zipf(1.3, 60_000) % 8000).tolist()
    trie = SuffixTrie(32)
    started = time.perf_counter()
    trie.extend(base)
    build = (time.perf_counter() - started) / len(base)
    started = time.perf_counter()
    gc.collect()
    full_gc = time.perf_counter() - started
    more = (rng.zipf(1.3, 10_000) % 8000).tolist()
    best = float("inf")
    for r in range(5):
        started = time.perf_counter()
        for i in range(0, 2000, 64):
            trie.new_document()
            trie.extend(more[r * 2000 + i : r * 2000 + i + 64])
        best = min(best, (time.perf_counter() - started) / 2000)
    print(f"{Path(specx.__file__).parents[2]}: {len(trie)} nodes; building "
          f"{1e6 * build:.1f} us/token; a full gc {1e3 * full_gc:.1f} ms; "
          f"feeding {1e6 * best:.1f} us/token")  # fmt: skip


if __name__ == "__main__":
    main()
