"""The PG term's per-token surrogates (`loss.pg_loss`), one module each; see base.py."""

from erpo_jax.rl.policy_losses.base import (POLICY_LOSSES, PolicyLoss,  # noqa: F401
                                            get_policy_loss, register_policy_loss)
from erpo_jax.rl.policy_losses import ppo_clip, clip_cov, kl_cov  # noqa: F401,E402
