"""The resolved recipe of a run: what its config switches on, decided once.

`recipe(cfg)` reads the registered pieces (the advantage estimator,
`rl/estimators.py`; the loss terms, `rl/terms/`; the PG surrogate,
`rl/policy_losses/`) and the config, and says what every part of the
trainer needs to know: the Trainer (reference forward, critic, dynamic
sampling, overlong shaping), the programs (the batch's shapes, the state's
adaptive coefficient), validation (the group size an estimator needs) and
`erpo inspect-grads` (the same shaping and terms as the run). Nothing else
keeps a list of estimator or term names.
"""

from __future__ import annotations

import dataclasses

from erpo_jax.rl import estimators
from erpo_jax.rl.estimators import Estimator
from erpo_jax.rl.terms import TERMS


@dataclasses.dataclass(frozen=True)
class Recipe:
    """estimator: the registered entry of algo.advantage; token_level: its
    level under this config; terms: the names of the terms that are on, in
    registry order; pg_loss: the PG surrogate; needs_ref_logp: the reference
    runs over each step's responses (Policy-KL in the loss or the reward);
    shapes_rewards: Policy-KL is in the reward; adaptive_kl: beta_policy is
    the controller's (TrainState.kl_coef); needs_key: the loss draws;
    filter_groups: DAPO's dynamic sampling; overlong_buffer: DAPO's overlong
    shaping's L (0: off)."""

    estimator: Estimator
    token_level: bool
    terms: tuple[str, ...]
    pg_loss: str
    needs_ref_logp: bool
    shapes_rewards: bool
    adaptive_kl: bool
    needs_key: bool
    filter_groups: bool
    overlong_buffer: int

    @property
    def needs_critic(self) -> bool:
        return self.estimator.needs_critic


def recipe(cfg) -> Recipe:
    """The Recipe of a RunConfig (ValueError naming the field for an unknown
    estimator)."""
    a, lc = cfg.algo, cfg.loss
    try:
        est = estimators.get(a.advantage)
    except ValueError as e:
        raise ValueError(f"config field algo.advantage: {e}") from None
    return Recipe(
        estimator=est, token_level=est.token_level(a),
        terms=tuple(name for name, t in TERMS.items() if t.is_on(lc)),
        pg_loss=lc.pg_loss, needs_ref_logp=lc.needs_ref_logp,
        shapes_rewards=lc.beta_policy > 0 and lc.policy_kl_mode == "reward",
        adaptive_kl=lc.adaptive_kl, needs_key=lc.needs_key,
        filter_groups=a.filter_groups, overlong_buffer=a.overlong_buffer)
