"""Statistics of the paper's tables: bootstrap CIs, the interquartile mean, paired comparisons,
and the trace of a gradient covariance with a bootstrap CI of a ratio of two of them (the probe
and the variance map; `trace_ratio_ci` works on Gram matrices, so gradients of any size do).

Every resampling function takes a `numpy.random.Generator`, so that a table is reproduced
exactly from its seed. The IQM, its stratified bootstrap and the probability of improvement are
rliable's (Agarwal et al., "Deep RL at the Edge of the Statistical Precipice", 2021): the IQM is
the mean of the middle 50% of the pooled scores, and a bootstrap sample resamples the scores
within each stratum (there: the runs of each task; here: the episodes of each seed and
evaluation split), so that every stratum keeps its size.

scipy.stats computes them, not rliable itself. rliable's metrics are these same scipy calls
(`aggregate_iqm` is `trim_mean(x, 0.25)`, `probability_of_improvement` a Mann-Whitney U over
`n * m`), and its interval estimates cannot make a reproducible table: `get_interval_estimates`
takes no Generator and draws its resamples from numpy's global state (`np.random.choice`),
whatever `random_state` it is given. Besides, with what pip resolves for rliable 1.2.0 today
(arch 7.2.0, pandas 3.1.1), `import rliable.library` fails (`TypeError: deprecate_kwarg()
missing 1 required positional argument: 'new_arg_name'`), and rliable brings arch, statsmodels,
pandas and seaborn (166 MiB installed). `scipy.stats.bootstrap` resamples each sample on its
own, which is the stratified bootstrap, from the Generator it is given.

The covariance-trace bootstrap stays here: it resamples from a Gram matrix, not from the
samples, which no library's bootstrap does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import scipy.stats

NUM_RESAMPLES = 10_000


def iqm(scores) -> float:
    """The interquartile mean: the mean after cutting `floor(n / 4)` scores from each end."""
    x = np.asarray(scores, np.float64).ravel()
    if x.size == 0:
        raise ValueError("the IQM of no scores is undefined.")
    return float(scipy.stats.trim_mean(x, 0.25))


def _iqm_rows(x: np.ndarray) -> np.ndarray:
    """The IQM of each row of `x` [B, n]."""
    return scipy.stats.trim_mean(x, 0.25, axis=1)


def percentile_ci(samples: np.ndarray, level: float = 0.95) -> tuple[float, float]:
    """The central `level` interval of bootstrap statistics (the percentile method)."""
    alpha = 100.0 * (1.0 - level) / 2.0
    lo, hi = np.percentile(samples, [alpha, 100.0 - alpha])
    return float(lo), float(hi)


def wilson_ci(wins: int, n: int, level: float = 0.95) -> tuple[float, float]:
    """Wilson score interval of a success rate from `wins` of `n` episodes.

    Unlike a bootstrap, it is not degenerate at 0 or n wins (0 of 55 games: [0, 0.065]),
    which is where the start policy's evaluations sit.
    """
    if n <= 0 or not 0 <= wins <= n:
        raise ValueError(f"a success CI needs 0 <= wins <= n and n > 0, got {wins} of {n}.")
    ci = scipy.stats.binomtest(wins, n).proportion_ci(level, method="wilson")
    return float(ci.low), float(ci.high)


def bootstrap_mean_ci(
    values,
    rng: np.random.Generator,
    num_resamples: int = NUM_RESAMPLES,
    level: float = 0.95,
) -> tuple[float, float]:
    """Percentile bootstrap CI of the mean of `values` (resampled with replacement)."""
    x = np.asarray(values, np.float64).ravel()
    if x.size == 0:
        raise ValueError("a bootstrap CI needs at least one value.")
    return stratified_bootstrap_ci([x], rng, _rows_mean, num_resamples, level)


def _rows_mean(x: np.ndarray) -> np.ndarray:
    return x.mean(axis=1)


def stratified_bootstrap_ci(
    strata: Sequence,
    rng: np.random.Generator,
    statistic: Callable[[np.ndarray], np.ndarray] = _iqm_rows,
    num_resamples: int = NUM_RESAMPLES,
    level: float = 0.95,
) -> tuple[float, float]:
    """Percentile CI of `statistic` over the pooled scores, resampling within each stratum.

    Args:
      strata: one array of scores per stratum (e.g. the episodes of one seed and split).
      rng: the generator of the resamples.
      statistic: maps resampled pooled scores [B, n] to B statistics (default: the IQM).
      num_resamples: B.
      level: the CI's coverage.
    """
    parts = [np.asarray(s, np.float64).ravel() for s in strata]
    parts = [p for p in parts if p.size]
    if not parts:
        raise ValueError("a stratified bootstrap needs at least one non-empty stratum.")
    # scipy refuses a sample of one; it resamples to itself, so it joins every resample as it
    # is (drawing it would not advance `rng` either: integers(0, 1) draws nothing).
    drawn = [i for i, p in enumerate(parts) if p.size > 1]
    if not drawn:
        value = float(statistic(np.concatenate(parts)[None])[0])
        return value, value

    def pooled(*samples, axis):
        del axis  # Always the last: each resample is [B, n_i].
        rows = dict(zip(drawn, samples, strict=True))
        b = samples[0].shape[0]
        fixed = lambda p: np.broadcast_to(p, (b, 1))
        return statistic(
            np.concatenate([rows[i] if i in rows else fixed(p) for i, p in enumerate(parts)], 1)
        )

    res = scipy.stats.bootstrap(
        [parts[i] for i in drawn],
        pooled,
        n_resamples=num_resamples,
        vectorized=True,
        axis=-1,
        confidence_level=level,
        method="percentile",
        rng=rng,
    )
    return float(res.confidence_interval.low), float(res.confidence_interval.high)


def probability_of_improvement(diffs) -> float:
    """P(X > Y) over paired differences `X - Y`: the share of pairs with X ahead, ties 1/2.

    rliable's P(X > Y) is the Mann-Whitney U of the runs of X against those of Y over the
    number of pairs; over paired runs it is the U of the differences against a single 0.
    """
    d = np.asarray(diffs, np.float64).ravel()
    if d.size == 0:
        raise ValueError("no pairs to compare.")
    return float(scipy.stats.mannwhitneyu(d, [0.0], alternative="greater").statistic / d.size)


def gram(rows) -> np.ndarray:
    """`rows @ rows.T` in float64: the inner products of M vectors [M, D] (e.g. gradients)."""
    x = np.asarray(rows, np.float64)
    if x.ndim != 2:
        raise ValueError(f"gram needs a 2-d array [M, D], got shape {x.shape}.")
    return x @ x.T


def trace_covariance(g: np.ndarray) -> float:
    """`E||g - E g||^2`, the trace of the covariance of M samples g [M, D] (unbiased, M - 1)."""
    return trace_covariance_from_gram(gram(g))


def trace_covariance_from_gram(k: np.ndarray) -> float:
    """`trace_covariance` from the Gram matrix `k = g @ g.T` [M, M] of the samples."""
    k = np.asarray(k, np.float64)
    m = k.shape[0]
    if k.shape != (m, m) or m < 2:
        raise ValueError(f"need a square Gram matrix of >= 2 samples, got shape {k.shape}.")
    return float((np.trace(k) / m - k.sum() / m**2) * m / (m - 1))


def bootstrap_trace_covariance(
    k: np.ndarray, rng: np.random.Generator, num_resamples: int = 2000, chunk: int = 256
) -> np.ndarray:
    """Bootstrap replicates of `trace_covariance` (samples resampled with replacement).

    Works on the Gram matrix `k` [M, M] only, so samples of any dimension (a model's gradient)
    cost M^2 memory: a resample with counts c (summing to M) has
    `trace = M / (M - 1) * (c . diag(k) / M - c^T k c / M^2)`.

    Returns:
      float64 [num_resamples].
    """
    k = np.asarray(k, np.float64)
    m = k.shape[0]
    if k.shape != (m, m) or m < 2:
        raise ValueError(f"need a square Gram matrix of >= 2 samples, got shape {k.shape}.")
    diag, out = np.diag(k), []
    for start in range(0, num_resamples, chunk):
        b = min(chunk, num_resamples - start)
        idx = rng.integers(0, m, size=(b, m))
        counts = np.zeros((b, m))
        np.add.at(counts, (np.repeat(np.arange(b), m), idx.ravel()), 1.0)
        quad = np.einsum("bm,mn,bn->b", counts, k, counts)
        out.append((counts @ diag / m - quad / m**2) * m / (m - 1))
    return np.concatenate(out)


def trace_ratio_ci(
    k_num: np.ndarray,
    k_den: np.ndarray,
    rng: np.random.Generator,
    num_resamples: int = 2000,
    level: float = 0.95,
) -> tuple[float, tuple[float, float]]:
    """`trace_covariance(num) / trace_covariance(den)` and its percentile bootstrap CI.

    The two sets of samples are independent (two estimators, each run on its own batches), so
    each is resampled on its own.

    Args:
      k_num, k_den: Gram matrices of the two estimators' samples (`gram`), any sizes >= 2.
    """
    ratio = trace_covariance_from_gram(k_num) / trace_covariance_from_gram(k_den)
    with np.errstate(divide="ignore", invalid="ignore"):
        reps = bootstrap_trace_covariance(k_num, rng, num_resamples) / bootstrap_trace_covariance(
            k_den, rng, num_resamples
        )
    return float(ratio), percentile_ci(reps[np.isfinite(reps)], level)
