"""The shared sampling transform, checked on hand-computed distributions."""

from __future__ import annotations

import numpy as np
import pytest

from specx.runtime.sampling import SamplingParams, sample, sampling_probs


def softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


LOGITS = np.log(np.array([0.05, 0.4, 0.1, 0.3, 0.15]))


def test_greedy_is_one_hot_at_argmax():
    probs = sampling_probs(np.array([[1.0, 3.0, 3.0, 0.0]]), SamplingParams())
    assert probs.tolist() == [[0.0, 1.0, 0.0, 0.0]]


def test_temperature_scales_logits():
    probs = sampling_probs(LOGITS, SamplingParams(temperature=0.5))
    np.testing.assert_allclose(probs, softmax(LOGITS / 0.5))


def test_top_k_keeps_k_largest():
    probs = sampling_probs(LOGITS, SamplingParams(temperature=1.0, top_k=2))
    np.testing.assert_allclose(probs, [0, 0.4 / 0.7, 0, 0.3 / 0.7, 0])


def test_top_p_keeps_smallest_prefix_reaching_p():
    # Sorted: 0.4, 0.3, 0.15, 0.1, 0.05. Mass before 0.15 is 0.7 < 0.75, so it is kept.
    probs = sampling_probs(LOGITS, SamplingParams(temperature=1.0, top_p=0.75))
    np.testing.assert_allclose(probs, [0, 0.4 / 0.85, 0, 0.3 / 0.85, 0.15 / 0.85])
    probs = sampling_probs(LOGITS, SamplingParams(temperature=1.0, top_p=0.7))
    np.testing.assert_allclose(probs, [0, 0.4 / 0.7, 0, 0.3 / 0.7, 0])
    probs = sampling_probs(LOGITS, SamplingParams(temperature=1.0, top_p=0.01))
    np.testing.assert_allclose(probs, [0, 1, 0, 0, 0])


def test_top_k_then_top_p_match_transformers_processors():
    torch = pytest.importorskip("torch")
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    rng = np.random.default_rng(0)
    logits = rng.standard_normal((4, 50)) * 3
    params = SamplingParams(temperature=0.7, top_k=20, top_p=0.8)
    scores = torch.tensor(logits, dtype=torch.float64)
    for warper in (TemperatureLogitsWarper(0.7), TopKLogitsWarper(20), TopPLogitsWarper(0.8)):
        scores = warper(None, scores)
    expected = torch.softmax(scores, -1).numpy()
    np.testing.assert_allclose(sampling_probs(logits, params), expected, atol=1e-12)


def test_sample_follows_probs():
    probs = np.array([0.1, 0.6, 0.0, 0.3])
    draws = sample(np.broadcast_to(probs, (40000, 4)), np.random.default_rng(0))
    freq = np.bincount(draws, minlength=4) / len(draws)
    assert freq[2] == 0
    np.testing.assert_allclose(freq, probs, atol=0.01)


@pytest.mark.parametrize(
    "kwargs", [{"temperature": -0.1}, {"top_k": -1}, {"top_p": 0.0}, {"top_p": 1.5}]
)
def test_bad_params_are_refused(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)
