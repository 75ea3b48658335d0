"""The adaptive Policy-KL coefficient (`loss.kl_target > 0`).

The proportional controller of Ziegler et al. (2019), "Fine-Tuning Language
Models from Human Preferences", that TRL and verl ship as the adaptive KL
controller: after an update on n samples whose measured Policy-KL is `kl`,

    error = clip(kl / target - 1, -0.2, 0.2)
    beta <- beta * (1 + error * n / horizon)

so beta grows while the policy is further from the reference than the
target and shrinks while it is closer. It starts at `loss.beta_policy`.

The coefficient is part of the TrainState (`kl_coef`), updated inside the
jitted update after each optimizer step, so it is in every checkpoint and a
resumed run continues with the same value bit for bit. In 'loss' mode it
scales the Policy-KL term; in 'reward' mode it is the penalty the rewards are
shaped with (the trainer passes the state's value to the shaping). `kl` is
the update's Policy-KL (the configured estimator, before the coefficient),
averaged over its micro-batches by their share of the response tokens.
"""

from __future__ import annotations

import jax.numpy as jnp

ERROR_CLIP = 0.2


def adapt(beta, kl, n, target: float, horizon: float):
    """float32[]: the coefficient after an update on `n` samples that measured `kl`."""
    error = jnp.clip(jnp.asarray(kl, jnp.float32) / target - 1.0, -ERROR_CLIP, ERROR_CLIP)
    return jnp.asarray(beta, jnp.float32) * (1.0 + error * (n / horizon))
