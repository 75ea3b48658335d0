"""The advantage estimators as registered entries, with their properties.

`algo.advantage` names one entry. An entry says what the trainer must know
about it, so nothing else keeps a list of names:

  level         'outcome' (one advantage per response, from one reward per
                response) or 'token' (per-token rewards in, float32[N, T-1]
                advantages out); `level_of(algo)` when a config field decides
  needs_critic  a learned value function is trained beside the policy (GAE)
  min_group     the smallest rollout.group_size it is defined for

and its function `advantages(shaped, response_mask, algo, group_size)`:
shaped is float32[R] (outcome) or float32[R, T-1] (token level), query-major
groups of `group_size`; it returns float32[R] or float32[R, T-1]. A critic
estimator has no such function: the trainer calls `advantages.gae` with the
critic's values. `formula` is the entry's pure function in `rl/advantages.py`
(`grpo`, ..., `gae`), which `compute_advantages(name, rewards)` calls.

This is the one list of estimators and the one look-up by name (`get`,
`compute_advantages`); `rl/advantages.py` holds only the formulas and does
not import this module. A new estimator: its formula in `rl/advantages.py`
(or its own module) and a `register_estimator(Estimator(...))` call, here or
in a module imported at the end of this file.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from erpo_jax.rl import advantages as adv
from erpo_jax.rl.registry import Registry

LEVELS = ("outcome", "token")


@dataclasses.dataclass(frozen=True)
class Estimator:
    name: str
    advantages: Callable[..., Any] | None
    level: str = "outcome"
    needs_critic: bool = False
    min_group: int = 1
    level_of: Callable[[Any], str] | None = None
    doc: str = ""
    formula: Callable[..., Any] | None = None

    def __post_init__(self):
        if self.level not in LEVELS:
            raise ValueError(f"Estimator {self.name!r}: level must be one of {LEVELS}.")
        if self.advantages is None and not self.needs_critic:
            raise ValueError(f"Estimator {self.name!r} has no advantages function.")

    def token_level(self, algo=None) -> bool:
        """Whether, under `algo` (an AlgoSection), it takes per-token rewards and
        gives per-token advantages."""
        level = self.level_of(algo) if self.level_of is not None and algo is not None \
            else self.level
        return level == "token"


ESTIMATORS: Registry[Estimator] = Registry("advantage estimator")
register_estimator = ESTIMATORS.register


def get(name: str) -> Estimator:
    """The registered estimator `name`; ValueError listing them otherwise."""
    return ESTIMATORS.get_entry(name)


def compute_advantages(name: str, rewards, group_size: int | None = None, **kwargs):
    """Outcome advantages float32[B, G] of the registered estimator `name`, from
    rewards [B, G] (or [B*G] with group_size), by its formula in
    `rl/advantages.py`; kwargs go to the formula (e.g. eps for grpo,
    group_baseline for reinforce_pp). ValueError for an unknown name, and for
    a critic estimator ('gae': call `advantages.gae` with the critic's values).
    """
    est = get(name)
    if est.needs_critic or est.formula is None:
        raise ValueError(f"{name!r} is per-token and needs critic values; call "
                         "advantages.gae(...) with token rewards, values and the response mask.")
    return est.formula(rewards, group_size, **kwargs)


def _grouped(fn, with_eps: bool):
    def advantages(shaped, response_mask, algo, group_size):
        kw = {"eps": algo.adv_eps} if with_eps else {}
        return fn(shaped.reshape(-1, group_size), **kw).reshape(-1)
    return advantages


def _reinforce_pp(shaped, response_mask, algo, group_size):
    if shaped.ndim == 2:   # the token-level estimator (reinforce_pp_whiten='token')
        return adv.reinforce_pp_tokens(shaped, response_mask, gamma=algo.gamma, eps=algo.adv_eps)
    return _grouped(adv.reinforce_pp, True)(shaped, response_mask, algo, group_size)


register_estimator(Estimator("grpo", _grouped(adv.grpo, True), min_group=2,
                             doc="(r - group mean) / (group std + eps)", formula=adv.grpo))
register_estimator(Estimator("dr_grpo", _grouped(adv.dr_grpo, False),
                             doc="r - group mean (Dr. GRPO)", formula=adv.dr_grpo))
register_estimator(Estimator("rloo", _grouped(adv.rloo, False), min_group=2,
                             doc="r - mean of the other responses of the group",
                             formula=adv.rloo))
register_estimator(Estimator("reinforce", _grouped(adv.reinforce, False), min_group=2,
                             doc="r - group mean (REINFORCE with a group baseline)",
                             formula=adv.reinforce))
register_estimator(Estimator(
    "reinforce_pp", _reinforce_pp, level="token",
    level_of=lambda a: "token" if a.reinforce_pp_whiten == "token" else "outcome",
    doc="REINFORCE++: returns whitened over the batch's response tokens "
        "(algo.reinforce_pp_whiten='response': over its responses)",
    formula=adv.reinforce_pp))
register_estimator(Estimator("gae", None, level="token", needs_critic=True,
                             doc="PPO's GAE with a learned critic (algo.gamma, algo.lam)",
                             formula=adv.gae))
