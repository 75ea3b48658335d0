"""The loss's terms, one module each, registered in this order (see base.py).

A new term: a module here that calls `register(Term(...))`, imported below,
plus its coefficient's field in `LossConfig`."""

from erpo_jax.rl.terms.base import (AGG_MODES, NORMALISERS, TERMS, LossInputs,  # noqa: F401
                                    Term, aggregate, register)
from erpo_jax.rl.terms import pg, policy_kl, query_kl, entropy  # noqa: F401,E402
