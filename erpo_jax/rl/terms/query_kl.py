"""Query-KL (ERPO): beta_query * QKL on the query positions at temperature 1,
counted once per query (`rl/query_kl.py`); with beta_query 0 it is still
measured, without gradient, as the drift monitors."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from erpo_jax.rl.query_kl import query_kl as qkl
from erpo_jax.rl.terms.base import Term, register


def _args(inputs, gradient: bool):
    lp = inputs.logp_t1 if gradient else jax.lax.stop_gradient(inputs.logp_t1)
    b = inputs.batch
    return lp, b.ref_query_logp.astype(jnp.float32), inputs.qm, b.group_id


def _monitors(inputs) -> dict:
    mon = _args(inputs, False)
    return {"query_kl_k1": qkl(*mon, "k1"), "query_kl_k3": qkl(*mon, "k3")}


def query_kl(inputs):
    c = inputs.cfg
    value = qkl(*_args(inputs, True), c.query_kl_estimator, c.kl_clamp)
    return value, {"query_kl": jax.lax.stop_gradient(value), **_monitors(inputs)}


def monitor(inputs):
    c = inputs.cfg
    return {"query_kl": qkl(*_args(inputs, False), c.query_kl_estimator, c.kl_clamp),
            **_monitors(inputs)}


register(Term("query_kl", query_kl, coef="beta_query", normaliser="query", monitor=monitor))
