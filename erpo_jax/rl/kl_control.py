"""The adaptive Policy-KL coefficient (`loss.kl_target > 0`).

The proportional controller of Ziegler et al. (2019), "Fine-Tuning Language
Models from Human Preferences", that TRL and verl ship as the adaptive KL
controller, with its step bounded: after an update on n samples whose
measured Policy-KL is `kl`,

    error = clip(kl / target - 1, -0.2, 0.2)
    beta <- beta * (1 + error * min(n / horizon, 1))

so beta grows while the policy is further from the reference than the
target and shrinks while it is closer. It starts at `loss.beta_policy`.

The bound. The unbounded rule (TRL's and verl's) multiplies by
1 + error * n / horizon, which is negative once n > 5 * horizon and the
policy is under target: beta changes sign and the Policy-KL term then
rewards drifting from the reference. Capping n / horizon at 1 keeps every
multiplier in [0.8, 1.2], so beta stays positive whatever the horizon;
for n <= horizon (the rule's intended use) the two are the same.

How far it can move. One update changes beta by at most the factor
1.2 (`max_factor`); an RL step makes epochs * num_minibatches updates of
B * G / num_minibatches samples each. `reach(cfg)` gives the largest
factor per step, per 100 steps and over the run, which the run header
prints; a run where the controller cannot move beta by 1.5x over the whole
run gets a warning at start (its horizon is too long for its samples per
step, and it is a fixed beta in all but name).

The coefficient is part of the TrainState (`kl_coef`), updated inside the
jitted update after each optimizer step, so it is in every checkpoint and a
resumed run continues with the same value bit for bit. In 'loss' mode it
scales the Policy-KL term; in 'reward' mode it is the penalty the rewards are
shaped with (the trainer passes the state's value to the shaping). `kl` is
the update's Policy-KL (the configured estimator, before the coefficient),
averaged over its micro-batches by their share of the response tokens.
"""

from __future__ import annotations

import math

import jax.numpy as jnp

ERROR_CLIP = 0.2
# Below this factor over the whole run the controller is reported as unable to move.
MIN_RUN_FACTOR = 1.5


def adapt(beta, kl, n, target: float, horizon: float):
    """float32[]: the coefficient after an update on `n` samples that measured `kl`."""
    error = jnp.clip(jnp.asarray(kl, jnp.float32) / target - 1.0, -ERROR_CLIP, ERROR_CLIP)
    return jnp.asarray(beta, jnp.float32) * (1.0 + error * min(n / horizon, 1.0))


def max_factor(n: float, horizon: float) -> float:
    """The largest factor one update on `n` samples can change beta by (up or down)."""
    return 1.0 + ERROR_CLIP * min(n / horizon, 1.0)


def reach(cfg) -> dict:
    """How far the controller of RunConfig `cfg` can move beta: {'samples':
    per update, 'updates': per RL step, 'step', 'per_100', 'run': the largest
    factor in one step, in 100 steps and over train.steps}."""
    o, t = cfg.optim, cfg.train
    n = t.batch_size * cfg.rollout.group_size // o.num_minibatches
    updates = o.epochs * o.num_minibatches
    log_f = math.log(max_factor(n, cfg.loss.kl_horizon)) * updates
    grow = lambda steps: math.exp(min(log_f * steps, 700.0))
    return {"samples": n, "updates": updates, "step": grow(1), "per_100": grow(100),
            "run": grow(t.steps)}


def describe_reach(cfg) -> str:
    """One header line on the controller's reach; a warning when it cannot move."""
    r = reach(cfg)
    lc = cfg.loss
    line = (f"adaptive KL: target {lc.kl_target:g}, horizon {lc.kl_horizon:g} samples; "
            f"{r['updates']} update(s) of {r['samples']} samples per step move beta_policy by "
            f"at most x{r['step']:.4g} per step, x{r['per_100']:.4g} per 100 steps, "
            f"x{r['run']:.4g} over the run's {cfg.train.steps} steps")
    if r["run"] < MIN_RUN_FACTOR:
        line += (f". WARNING: it cannot move beta by x{MIN_RUN_FACTOR:g} over the run, so "
                 "beta_policy is fixed in all but name; lower loss.kl_horizon (<= the "
                 "samples per update lets it move 20% per update)")
    return line
