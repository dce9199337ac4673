"""Covariance-trace statistics of `bpo_jax.study.stats` (the probe's and the variance map's)."""

from __future__ import annotations

import numpy as np
import pytest

from bpo_jax.study import stats


def test_trace_covariance_by_hand():
    g = np.array([[1.0, 0.0], [3.0, 2.0], [2.0, 4.0]])
    # Per component sample variances: var(1, 3, 2) = 1, var(0, 2, 4) = 4.
    assert stats.trace_covariance(g) == pytest.approx(5.0)
    assert stats.trace_covariance_from_gram(stats.gram(g)) == pytest.approx(5.0)
    with pytest.raises(ValueError, match=">= 2 samples"):
        stats.trace_covariance(g[:1])


def test_bootstrap_replicates_match_explicit_resampling():
    rng = np.random.default_rng(0)
    g = rng.normal(size=(30, 7))
    reps = stats.bootstrap_trace_covariance(stats.gram(g), np.random.default_rng(5), 40, chunk=16)
    again = np.random.default_rng(5)
    explicit = []
    for start in range(0, 40, 16):
        idx = again.integers(0, 30, size=(min(16, 40 - start), 30))
        explicit += [stats.trace_covariance(g[i]) for i in idx]
    np.testing.assert_allclose(reps, explicit, rtol=1e-10)


def test_trace_ratio_ci_covers_the_true_ratio():
    rng = np.random.default_rng(1)
    hits = 0
    for _ in range(40):
        a = rng.normal(scale=np.sqrt(2.0), size=(64, 5))  # true trace 10
        b = rng.normal(size=(64, 5))  # true trace 5
        ratio, (lo, hi) = stats.trace_ratio_ci(stats.gram(a), stats.gram(b), rng, num_resamples=400)
        assert lo < ratio < hi
        hits += lo <= 2.0 <= hi
    assert hits >= 32  # about 95% coverage; 32 of 40 leaves room for the bootstrap's error
