"""Two-sample chi-square tests of generated-token histograms, per output position."""

from __future__ import annotations

import numpy as np
from scipy.stats import chi2_contingency


def histograms(tokens, vocab):
    rows = np.array(tokens)
    return [np.bincount(rows[:, k], minlength=vocab) for k in range(rows.shape[1])]


def p_values(plain, spec, vocab):
    """Chi-square p-value per output position: plain vs speculative token histograms."""
    values = []
    pairs = zip(histograms(plain.tokens, vocab), histograms(spec.tokens, vocab), strict=True)
    for a, b in pairs:
        table = np.stack([a, b])
        table = table[:, table.sum(0) > 0]
        values.append(chi2_contingency(table)[1] if table.shape[1] > 1 else 1.0)
    return values
