"""Dataset-static per-query weights, from the cached reference query log-probs.

    s(x) = mean_t logp_ref[t] over the query's target tokens
    z(x) = (s(x) - mean_D s) / std_D s          (population std over the set)
    raw  = 1 | exp(z / tau) | exp(-|z| / tau)    uniform | likelihood | typicality
    w    = clip(c * raw, w_min, w_max),  c > 0 chosen so that mean_D w == 1

Clipping and renormalising interact: renormalising after a clip can push
weights back out of range, and clipping after a renormalisation breaks the
mean. We therefore solve for the one scale `c` at which the *clipped* weights
have mean 1. mean(clip(c * raw)) is continuous and non-decreasing in c,
equal to w_min at c -> 0 and to w_max at c -> inf, so a root exists whenever
w_min <= 1 <= w_max, and bisection finds it. The result respects the bounds
exactly (clip is applied last), has mean 1 to float precision, and keeps
the order of the raw weights. With no bound active it is raw / mean(raw).

Computed once before training on the host (numpy, float64 internally) and
stored with the dataset; it never changes during training.
"""

from __future__ import annotations

import numpy as np

SCHEMES = ("uniform", "likelihood", "typicality")
# Default clip of the weights, shared with the run config (`algo.weight_min/max`):
# no query counts more than 4x or less than 1/4 of the average. Pass
# w_min=0, w_max=inf for the unclipped formula.
W_MIN, W_MAX = 0.25, 4.0


def query_scores(ref_query_logp, query_mask) -> np.ndarray:
    """float64[Q] s(x): mean reference log-prob over each query's target tokens.

    ref_query_logp: float[Q, L] (any alignment; only masked entries are read);
    query_mask: bool[Q, L]. A query with no target token (length 1) gets the
    mean score of the set, i.e. z = 0.
    """
    lp = np.asarray(ref_query_logp, np.float64)
    m = np.asarray(query_mask).astype(bool)
    if lp.shape != m.shape:
        raise ValueError(f"ref_query_logp {lp.shape} and query_mask {m.shape} must match.")
    cnt = m.sum(axis=-1)
    s = np.where(m, lp, 0.0).sum(axis=-1) / np.maximum(cnt, 1)
    if not np.all(np.isfinite(s[cnt > 0])):
        raise ValueError("ref_query_logp has non-finite values on query tokens.")
    if np.any(cnt > 0):
        s = np.where(cnt > 0, s, s[cnt > 0].mean())
    return s


def standardize(s) -> np.ndarray:
    """z = (s - mean) / std over the set (std with ddof=0); all-equal s gives z = 0."""
    s = np.asarray(s, np.float64)
    std = s.std()
    if not np.isfinite(std) or std == 0:
        return np.zeros_like(s)
    return (s - s.mean()) / std


def raw_weights(z, scheme: str = "likelihood", tau: float = 1.0) -> np.ndarray:
    """Unnormalised weights for standardised scores z (float64)."""
    z = np.asarray(z, np.float64)
    if scheme not in SCHEMES:
        raise ValueError(f"Unknown query weight scheme {scheme!r}; choose one of {SCHEMES}.")
    if not tau > 0:
        raise ValueError(f"Query weight temperature tau must be positive, got {tau}.")
    if scheme == "uniform":
        return np.ones_like(z)
    log_w = z / tau if scheme == "likelihood" else -np.abs(z) / tau
    # Only ratios matter (the weights are renormalised), so shift to avoid overflow.
    return np.exp(log_w - log_w.max()) if log_w.size else log_w


def clip_to_unit_mean(raw, w_min: float = 0.0, w_max: float = np.inf,
                      iters: int = 200) -> np.ndarray:
    """clip(c * raw, w_min, w_max) with the scale c > 0 that makes the mean exactly 1.

    raw: positive float[Q]. Needs 0 <= w_min <= 1 <= w_max.
    """
    raw = np.asarray(raw, np.float64)
    if raw.size == 0:
        return raw
    if not (0.0 <= w_min <= 1.0 <= w_max):
        raise ValueError(f"Query weight bounds must satisfy 0 <= w_min <= 1 <= w_max so that "
                         f"mean 1 is reachable; got w_min={w_min}, w_max={w_max}.")
    if not np.all(np.isfinite(raw)) or np.any(raw < 0) or not raw.max() > 0:
        raise ValueError("Raw query weights must be finite, non-negative and not all zero.")
    w = raw / raw.mean()
    if w.min() >= w_min and w.max() <= w_max:
        return w
    mean_at = lambda c: np.clip(c * w, w_min, w_max).mean()
    if mean_at(1e300) < 1.0:
        raise ValueError(f"Query weights cannot reach mean 1 under w_max={w_max}: too many "
                         "weights underflow to 0; use a larger tau or a positive w_min.")
    lo, hi = 1.0, 1.0
    while mean_at(lo) > 1.0:
        lo /= 2.0
    while mean_at(hi) < 1.0:
        hi *= 2.0
    for _ in range(iters):
        mid = 0.5 * (lo + hi)
        if mean_at(mid) < 1.0:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-15 * hi:
            break
    out = np.clip(hi * w, w_min, w_max)
    # Spread the last rounding error over the unclipped weights (bounds untouched).
    free = (out > w_min) & (out < w_max)
    if free.any():
        out[free] += (len(out) - out.sum()) / free.sum()
        out = np.clip(out, w_min, w_max)
    return out


def query_weights(scores, scheme: str = "likelihood", tau: float = 1.0,
                  w_min: float = W_MIN, w_max: float = W_MAX) -> np.ndarray:
    """float32[Q] per-query weights over a training set, mean 1, within [w_min, w_max].

    scores: float[Q] s(x) for every query of the training set (`query_scores`).
    scheme: 'uniform' (all ones), 'likelihood' (exp(z / tau), the default) or
      'typicality' (exp(-|z| / tau)).
    """
    z = standardize(scores)
    return clip_to_unit_mean(raw_weights(z, scheme, tau), w_min, w_max).astype(np.float32)
