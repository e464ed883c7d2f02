"""Function-preserving widening (Net2Net, Chen et al. 2016) of pre-norm Llama weights.

Every hidden unit is repeated `factor` (K) times, so the wide model's residual stream is the
narrow one's with each value repeated:

- a weight that reads the hidden state has its columns repeated and divided by K
  (sum over the K copies of w/K * x = w * x);
- a weight that writes it has its rows repeated; embeddings and norm weights repeat;
- RMSNorm of a K-times repeated vector is the repeat of its RMSNorm (the mean square is
  unchanged), so every norm commutes with the widening.

Extra attention heads and MLP units do real work and add exactly nothing: their q/k/v and
gate/up rows are random, their o_proj / down_proj columns zero. The real query heads stay
in the groups of their real KV heads (GQA pairing). A tied lm_head must be untied (it reads
the hidden state: the embedding repeated, divided by K). Logits match the narrow model's to
float32 rounding (~1e-5), so greedy output is the same; the wide model costs what its shape
costs. Draft heads widen with the same rules (their inputs from the target are repeats,
their outputs into the target's space repeat), so they draft what they drafted before.

`widen_tensors` maps tensors by name (Llama, EAGLE-1, EAGLE-3, MTP and Medusa-1 names) and
refuses a name it has no rule for rather than guess. `narrow_tensors` is each rule's inverse
on the real part (copies of a read summed, one copy of a write kept, extra heads and units
dropped): `narrow_tensors(widen_tensors(t)) == t`. Applied to a wide model's *changed*
weights it gives the narrow model that computes what the wide one computes, as long as the
change keeps each row a row (a write's copies stay equal, extra units still add zero):
weight-only quantization per output row does (codes and scales are per row, and zero codes
zero), so a wide int4 model has a narrow twin that distils heads at the narrow model's cost.
"""

from __future__ import annotations

import json
import re
import shutil
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = [
    "NarrowShape",
    "Widening",
    "narrow_tensors",
    "twin_tensors",
    "widen_checkpoint",
    "widen_config",
    "widen_tensors",
]


@dataclass(frozen=True)
class NarrowShape:
    """The shape being widened: hidden size, attention heads, MLP units."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int

    @classmethod
    def of(cls, config: Mapping) -> NarrowShape:
        """Reads an HF Llama-style config (head_dim defaults to hidden / heads)."""
        heads = int(config["num_attention_heads"])
        return cls(
            hidden=int(config["hidden_size"]),
            heads=heads,
            kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or config["hidden_size"] // heads),
            intermediate=int(config["intermediate_size"]),
        )


@dataclass(frozen=True)
class Widening:
    """The wide shape: every hidden unit `factor` times, `heads` / `kv_heads`, `intermediate`."""

    factor: int
    heads: int
    kv_heads: int
    intermediate: int
    seed: int = 0

    def check(self, narrow: NarrowShape) -> None:
        """Raises ValueError where this cannot hold `narrow`'s heads, groups and units."""
        group, wide_group = narrow.heads // narrow.kv_heads, self.heads // max(self.kv_heads, 1)
        checks = (
            (self.factor >= 1, f"factor {self.factor} < 1"),
            (
                self.kv_heads >= 1 and self.heads % self.kv_heads == 0,
                f"heads {self.heads} not a multiple of kv_heads {self.kv_heads}",
            ),
            (
                self.kv_heads >= narrow.kv_heads,
                f"kv_heads {self.kv_heads} < the narrow model's {narrow.kv_heads}",
            ),
            (wide_group >= group, f"{wide_group} query heads per KV head < the narrow {group}"),
            (
                self.intermediate >= narrow.intermediate,
                f"intermediate {self.intermediate} < the narrow model's {narrow.intermediate}",
            ),
        )
        problems = [message for holds, message in checks if not holds]
        if problems:
            raise ValueError("cannot widen: " + "; ".join(problems))


class _Widener:
    """The per-tensor rules for one narrow shape and one widening."""

    def __init__(self, narrow: NarrowShape, widening: Widening):
        widening.check(narrow)
        self.n, self.w, self.k = narrow, widening, widening.factor
        group, wide_group = narrow.heads // narrow.kv_heads, widening.heads // widening.kv_heads
        # Query head h of KV group g keeps its place within group g.
        self.q_place = [(h // group) * wide_group + h % group for h in range(narrow.heads)]

    def vector(self, x: np.ndarray, name: str) -> np.ndarray:
        return np.repeat(x, self.k)

    def reads(self, x: np.ndarray, name: str = "") -> np.ndarray:
        """Columns (in parts of `hidden`: concatenated inputs) repeated, divided by K."""
        rows, cols = x.shape
        if cols % self.n.hidden:
            raise ValueError(f"{name}: {cols} input columns are not parts of {self.n.hidden}")
        parts = x.reshape(rows, cols // self.n.hidden, self.n.hidden)
        return np.repeat(parts, self.k, axis=2).reshape(rows, -1) / self.k

    def writes(self, x: np.ndarray, name: str) -> np.ndarray:
        return np.repeat(x, self.k, axis=0)

    def embedding(self, x: np.ndarray, name: str) -> np.ndarray:
        return np.repeat(x, self.k, axis=1)

    def linear(self, x: np.ndarray, name: str) -> np.ndarray:
        """Reads the hidden state and writes it (EAGLE fc, MTP eh_proj, Medusa blocks)."""
        return self.writes(self.reads(x, name), name)

    def _random(self, name: str, like: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
        rng = np.random.default_rng([self.w.seed, zlib.crc32(name.encode())])
        return rng.normal(0.0, float(like.std()) or 0.02, shape).astype(np.float32)

    def _head_rows(self, x: np.ndarray, name: str, heads: int, place: list[int]) -> np.ndarray:
        read = self.reads(x, name).reshape(len(place), self.n.head_dim, -1)
        out = self._random(name, x, (heads, self.n.head_dim, read.shape[-1]))
        out[place] = read
        return out.reshape(heads * self.n.head_dim, -1)

    def q_proj(self, x: np.ndarray, name: str) -> np.ndarray:
        return self._head_rows(x, name, self.w.heads, self.q_place)

    def kv_proj(self, x: np.ndarray, name: str) -> np.ndarray:
        return self._head_rows(x, name, self.w.kv_heads, list(range(self.n.kv_heads)))

    def o_proj(self, x: np.ndarray, name: str) -> np.ndarray:
        narrow = self.writes(x, name).reshape(-1, self.n.heads, self.n.head_dim)
        out = np.zeros((narrow.shape[0], self.w.heads, self.n.head_dim), np.float32)
        out[:, self.q_place] = narrow
        return out.reshape(narrow.shape[0], -1)

    def gate_up(self, x: np.ndarray, name: str) -> np.ndarray:
        read = self.reads(x, name)
        extra = self._random(name, x, (self.w.intermediate - read.shape[0], read.shape[1]))
        return np.concatenate([read, extra])

    def down(self, x: np.ndarray, name: str) -> np.ndarray:
        written = self.writes(x, name)
        extra = np.zeros((written.shape[0], self.w.intermediate - x.shape[1]), np.float32)
        return np.concatenate([written, extra], axis=1)

    def same(self, x: np.ndarray, name: str) -> np.ndarray:
        return x

    # The inverses, on the real part: a read's copies summed, a write's first copy kept.

    def vector_inverse(self, x: np.ndarray, name: str) -> np.ndarray:
        return x[:: self.k]

    def reads_inverse(self, x: np.ndarray, name: str = "") -> np.ndarray:
        rows = x.shape[0]
        return x.reshape(rows, -1, self.n.hidden, self.k).sum(-1).reshape(rows, -1)

    def writes_inverse(self, x: np.ndarray, name: str) -> np.ndarray:
        return x.reshape(-1, self.k, *x.shape[1:])[:, 0]

    def embedding_inverse(self, x: np.ndarray, name: str) -> np.ndarray:
        return x[:, :: self.k]

    def linear_inverse(self, x: np.ndarray, name: str) -> np.ndarray:
        return self.reads_inverse(self.writes_inverse(x, name), name)

    def _head_rows_inverse(self, x: np.ndarray, place: list[int]) -> np.ndarray:
        heads = x.reshape(-1, self.n.head_dim, x.shape[-1])[place]
        return self.reads_inverse(heads.reshape(len(place) * self.n.head_dim, -1))

    def q_proj_inverse(self, x: np.ndarray, name: str) -> np.ndarray:
        return self._head_rows_inverse(x, self.q_place)

    def kv_proj_inverse(self, x: np.ndarray, name: str) -> np.ndarray:
        return self._head_rows_inverse(x, list(range(self.n.kv_heads)))

    def o_proj_inverse(self, x: np.ndarray, name: str) -> np.ndarray:
        rows = self.writes_inverse(x, name).reshape(-1, self.w.heads, self.n.head_dim)
        return rows[:, self.q_place].reshape(rows.shape[0], -1)

    def gate_up_inverse(self, x: np.ndarray, name: str) -> np.ndarray:
        return self.reads_inverse(x[: self.n.intermediate], name)

    def down_inverse(self, x: np.ndarray, name: str) -> np.ndarray:
        return self.writes_inverse(x, name)[:, : self.n.intermediate]


_Rule = Callable[[_Widener, np.ndarray, str], np.ndarray]
# (pattern on the full tensor name, rule, its inverse); the first match wins.
_RULES: tuple[tuple[str, _Rule, _Rule], ...] = (
    (r"(^|\.)(d2t|t2d)$", _Widener.same, _Widener.same),  # EAGLE-3 vocabulary maps
    (r"self_attn\.q_proj\.weight$", _Widener.q_proj, _Widener.q_proj_inverse),
    (r"self_attn\.[kv]_proj\.weight$", _Widener.kv_proj, _Widener.kv_proj_inverse),
    (r"self_attn\.o_proj\.weight$", _Widener.o_proj, _Widener.o_proj_inverse),
    (r"mlp\.(gate|up)_proj\.weight$", _Widener.gate_up, _Widener.gate_up_inverse),
    (r"mlp\.down_proj\.weight$", _Widener.down, _Widener.down_inverse),
    (r"(norm|layernorm)\.weight$", _Widener.vector, _Widener.vector_inverse),
    (r"embed_tokens\.weight$", _Widener.embedding, _Widener.embedding_inverse),
    (
        r"(^|\.)(fc|eh_proj|\d+\.0\.linear)\.weight$",
        _Widener.linear,
        _Widener.linear_inverse,
    ),
    (r"(^|\.)(fc|\d+\.0\.linear)\.bias$", _Widener.vector, _Widener.vector_inverse),
    (
        r"(^|\.)(lm_head|shared_head\.head|\d+\.1)\.weight$",
        _Widener.reads,
        _Widener.reads_inverse,
    ),
)


def _rules_for(name: str) -> tuple[_Rule, _Rule]:
    for pattern, widen, narrow in _RULES:
        if re.search(pattern, name):
            return widen, narrow
    raise ValueError(f"no widening rule for tensor {name!r}")


# (widener, rule, inverse rule, name, float32 tensor) -> the tensor to keep
_Step = Callable[[_Widener, _Rule, _Rule, str, np.ndarray], np.ndarray]


def _each(
    tensors: Mapping[str, np.ndarray], narrow: NarrowShape, widening: Widening, step: _Step
) -> dict[str, np.ndarray]:
    """`step` applied to every tensor (float ones in float32) with its name's rules."""
    widener = _Widener(narrow, widening)
    out = {}
    for name, value in tensors.items():
        rule, inverse = _rules_for(name)
        x = value.astype(np.float32) if value.dtype.kind == "f" else value
        out[name] = np.ascontiguousarray(step(widener, rule, inverse, name, x))
    return out


def widen_tensors(
    tensors: Mapping[str, np.ndarray], narrow: NarrowShape, widening: Widening
) -> dict[str, np.ndarray]:
    """Every tensor widened by its name's rule (float tensors computed in float32).

    Raises:
        ValueError: a name no rule covers, a shape the rules cannot widen, or a widening
            too small for `narrow` (fewer heads, groups or units).
    """
    return _each(tensors, narrow, widening, lambda w, rule, _, name, x: rule(w, x, name))


def narrow_tensors(
    tensors: Mapping[str, np.ndarray], narrow: NarrowShape, widening: Widening
) -> dict[str, np.ndarray]:
    """Every wide tensor narrowed by its name's inverse rule (see the module docstring).

    Raises:
        ValueError: a name no rule covers.
    """
    return _each(tensors, narrow, widening, lambda w, _, inverse, name, x: inverse(w, x, name))


def twin_tensors(
    tensors: Mapping[str, np.ndarray],
    narrow: NarrowShape,
    widening: Widening,
    change: Callable[[str, np.ndarray], np.ndarray],
) -> dict[str, np.ndarray]:
    """The narrow tensors that compute what the widened ones compute after `change`.

    `change(name, wide)` returns the wide tensor as the wide model will hold it (quantized and
    dequantized, say). Each tensor is widened, changed and narrowed on its own, so only one
    wide tensor is in memory at a time. Exact where `change` keeps rows rows (module docstring).
    """

    def step(w: _Widener, rule: _Rule, inverse: _Rule, name: str, x: np.ndarray) -> np.ndarray:
        return inverse(w, change(name, rule(w, x, name)), name)

    return _each(tensors, narrow, widening, step)


def widen_config(config: Mapping, widening: Widening) -> dict:
    """An HF Llama-style config at the wide shape (head_dim kept, written out)."""
    narrow = NarrowShape.of(config)
    return {
        **config,
        "hidden_size": narrow.hidden * widening.factor,
        "num_attention_heads": widening.heads,
        "num_key_value_heads": widening.kv_heads,
        "head_dim": narrow.head_dim,
        "intermediate_size": widening.intermediate,
    }


def widen_checkpoint(source_dir: Path, output_dir: Path, widening: Widening) -> Path:
    """Writes `source_dir`'s Llama checkpoint widened (lm_head untied) to a new `output_dir`.

    Raises:
        FileExistsError: `output_dir` exists.
        ValueError: see `widen_tensors`.
    """
    from safetensors.numpy import load_file, save_file

    config = json.loads((source_dir / "config.json").read_text())
    tensors = load_file(source_dir / "model.safetensors")
    if "lm_head.weight" not in tensors:  # tied: the lm_head reads what the embedding writes
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
    wide = widen_tensors(tensors, NarrowShape.of(config), widening)
    output_dir.mkdir(parents=True, exist_ok=False)
    save_file(wide, output_dir / "model.safetensors", metadata={"format": "pt"})
    wide_config = {**widen_config(config, widening), "tie_word_embeddings": False}
    (output_dir / "config.json").write_text(json.dumps(wide_config, indent=2) + "\n")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (source_dir / name).is_file():
            shutil.copyfile(source_dir / name, output_dir / name)
    return output_dir
