"""Coefficients for the stabilizer comparison, chosen on the slip testbed's validation split (issue 35, item 5).

    erpo sweep experiments/slip_stabilizer_tuning.py --cpu --seeds 0,1 --jobs 2

The comparison (slip_stabilizers.py) runs with MINIBATCHES optimizer steps per
rollout (`optim.num_minibatches`; the testbed's main runs take one). With
one, every update is on-policy: the PPO ratio is 1 up to rounding (the grid's
runs log ratios within 1 ± 3e-5 and a clip fraction of exactly 0), so
clip-higher changes nothing and KL-Cov's |log r| penalty is 0; those two
techniques are defined on the ratio, so the comparison gives them one. ERPO
and GRPO + Policy-KL are tuned again in that setting, like every technique.

Each method or technique at three values of the field it is known by, a
factor of about 3 apart around its paper's value (DAPO: eps_high, with its
dynamic sampling and overlong shaping fixed; ERPO + DAPO: beta_q), at T =
1.5 and the testbed's lr and 100 steps, evaluated once at the end on the 100
held-out validation problems of each training family, never on the test
families. `chosen` picks each one's value with the highest final validation
greedy pass@1, averaged over seeds, as slip_tuning.py chose beta_q and
beta_policy; slip_stabilizers.py runs at those values.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from erpo_jax.tools.presets import STABILIZERS, stabilizer_overrides
from erpo_jax.tools.sweep import load_experiment
from erpo_jax.train.config import RunConfig, apply_overrides

testbed = load_experiment(Path(__file__).with_name("slip_testbed.py"))
slip_tuning = load_experiment(Path(__file__).with_name("slip_tuning.py"))

EXPERIMENT = "slip_stabilizer_tuning"
MINIBATCHES = 4
TEMPERATURE, STEPS = 1.5, 100
# method or technique -> (the field tuned, its three values)
GRID = {
    "erpo": ("loss.beta_query", (0.3, 1.0, 3.0)),
    "grpo+policy_kl": ("loss.beta_policy", (0.01, 0.04, 0.16)),
    "adaptive_kl": ("loss.kl_target", (0.001, 0.01, 0.1)),
    "clip_higher": ("loss.eps_high", (0.24, 0.28, 0.35)),
    "entropy_bonus": ("loss.entropy_coef", (1e-4, 1e-3, 1e-2)),
    "clip_cov": ("loss.clip_cov_ratio", (2e-4, 2e-3, 2e-2)),
    "kl_cov": ("loss.kl_cov_ratio", (2e-4, 2e-3, 2e-2)),
    "dapo": ("loss.eps_high", (0.24, 0.28, 0.35)),
    "erpo+dapo": ("loss.beta_query", (0.3, 1.0, 3.0)),
}
COLLAPSE_DROP = 0.15
ENTROPY_FLOOR = testbed.ENTROPY_FLOOR
sft_config = testbed.sft_config


def technique_config(name: str, value=None, *, temperature: float = TEMPERATURE,
                     steps: int = STEPS, experiment: str = EXPERIMENT, run_name: str = "",
                     **kw) -> RunConfig:
    """`name` (a method of the testbed or a technique of presets.STABILIZERS)
    with its tuned field at `value`, MINIBATCHES optimizer steps per rollout;
    kw goes to the testbed's method_config (eval_split, eval_every, ...)."""
    if name in STABILIZERS:
        base, overrides = stabilizer_overrides(name, testbed.method_config(
            "no_kl").rollout.max_new_tokens)
    else:
        base, overrides = name, ()
    field, _ = GRID.get(name, (None, ()))
    overrides = list(overrides) + [f"optim.num_minibatches={MINIBATCHES}"]
    if value is not None and field is not None:
        overrides.append(f"{field}={value}")
    cfg = testbed.method_config(base, temperature=temperature, steps=steps,
                                name=run_name or name, experiment=experiment, **kw)
    return apply_overrides(cfg, overrides)


def variant_name(name: str, value) -> str:
    return f"{name}-v{value:g}"


def variant(name: str, value) -> RunConfig:
    return technique_config(name, value, eval_split="validation", eval_every=STEPS,
                            sampled_eval=False, run_name=variant_name(name, value))


def chosen(runs: Sequence[dict]) -> dict[str, float]:
    """{method or technique: value} with the best mean final validation greedy
    pass@1 over seeds (slip_tuning.py's rule); `runs` as
    `erpo_jax.tools.report.load_run` gives them."""
    return slip_tuning.chosen(runs, sep="-v")


def get_config() -> RunConfig:
    return get_cpu_config()


def get_cpu_config() -> RunConfig:
    return variant("erpo", testbed.BETA_QUERY)


def sweep(cpu: bool = False) -> dict[str, RunConfig]:
    if not cpu:
        raise ValueError("slip_stabilizer_tuning.py tunes the CPU testbed; run it with --cpu.")
    return {variant_name(n, v): variant(n, v) for n, (_, values) in GRID.items()
            for v in values}
