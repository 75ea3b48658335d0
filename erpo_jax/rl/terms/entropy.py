"""The entropy bonus: -entropy_coef * agg(entropy) over the response positions."""

from __future__ import annotations

import jax

from erpo_jax.rl.terms.base import Term, register


def entropy(inputs):
    return inputs.agg(inputs.entropy), monitor(inputs)


def monitor(inputs):
    return {"entropy": jax.lax.stop_gradient(inputs.tok_mean(inputs.entropy))}


register(Term("entropy", entropy, coef="entropy_coef", sign=-1.0, normaliser="response",
              monitor=monitor))
