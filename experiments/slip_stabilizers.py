"""ERPO against the stability techniques it was never compared with (issue 35, item 5).

    erpo sweep experiments/slip_stabilizer_tuning.py --cpu --seeds 0,1 --jobs 2   # first
    erpo sweep experiments/slip_stabilizers.py --cpu --seeds 0,1,2,3,4 --jobs 2

On the slip testbed with MINIBATCHES optimizer steps per rollout (why:
slip_stabilizer_tuning.py), in two settings: hot rollouts (T = 1.5, 100
steps) and a long horizon (T = 1, 200 steps), 5 seeds each. Against ERPO:
the adaptive KL controller, clip-higher, the entropy bonus, Clip-Cov,
KL-Cov, DAPO (clip-higher + dynamic sampling + overlong shaping) and ERPO +
DAPO, with GRPO + Policy-KL and no KL as in the testbed's comparisons. Each
at the value slip_stabilizer_tuning.py chose on the validation split, read
from its committed summaries (experiments/results/slip_stabilizer_tuning/);
without them this file refuses to plan. Evaluation on the test families
every 20 steps, greedy and 8 samples (pass@1, pass@8); the collapse test
reads the evaluations. The verdict rule is RESULTS.md's "The verdict rule",
fixed before these runs. Dynamic sampling's extra rollouts are logged per
step (`rollout/prompts_sampled`), so accuracy is read at equal steps and at
equal sampled responses. Runs go to runs/slip_stabilizers/<name>-<setting>/seed<k>.
"""

from __future__ import annotations

from pathlib import Path

from erpo_jax.tools.presets import STABILIZERS
from erpo_jax.tools.sweep import load_experiment
from erpo_jax.train.config import RunConfig

tuning = load_experiment(Path(__file__).with_name("slip_stabilizer_tuning.py"))
testbed = tuning.testbed

EXPERIMENT = "slip_stabilizers"
MINIBATCHES = tuning.MINIBATCHES
SETTINGS = {"T1.5": (1.5, 100), "long200": (1.0, 200)}   # name -> (temperature, steps)
METHODS = ("erpo", "grpo+policy_kl", "no_kl", *STABILIZERS)
TUNING_RUNS = Path(__file__).with_name("results") / "slip_stabilizer_tuning" / "runs"
COMPARISONS = [(f"erpo-{s}", f"{m}-{s}") for s in SETTINGS for m in METHODS if m != "erpo"]
COLLAPSE_DROP = 0.15
ENTROPY_FLOOR = testbed.ENTROPY_FLOOR
sft_config = testbed.sft_config


def tuned_values(runs_dir: Path = TUNING_RUNS) -> dict[str, float]:
    """The values slip_stabilizer_tuning.py chose, from its committed summaries."""
    from erpo_jax.tools.report import load_run
    files = sorted(Path(runs_dir).glob("*/seed*.json"))
    if not files:
        raise ValueError(f"no tuning summaries in {runs_dir}: run and commit "
                         "experiments/slip_stabilizer_tuning.py first (its docstring).")
    runs = [load_run(f) for f in files]
    values = tuning.chosen(runs)
    have = {}
    for r in runs:
        have.setdefault(tuning.variant_value(r["name"]), set()).add(r["config"]["train"]["seed"])
    seeds = set().union(*have.values())
    missing = sorted({name for name, (_, vs) in tuning.GRID.items() for v in vs
                      if have.get((name, v)) != seeds})
    if missing:
        raise ValueError(f"the tuning summaries in {runs_dir} lack runs of {missing} (every "
                         f"value at seeds {sorted(seeds)}): finish "
                         "experiments/slip_stabilizer_tuning.py first.")
    return values


def variant(name: str, setting: str, value=None) -> RunConfig:
    temperature, steps = SETTINGS[setting]
    return tuning.technique_config(name, value, temperature=temperature, steps=steps,
                                   experiment=EXPERIMENT, run_name=f"{name}-{setting}",
                                   eval_every=20, sampled_eval=True)


def _variants() -> dict[str, RunConfig]:
    values = tuned_values(TUNING_RUNS)
    return {f"{m}-{s}": variant(m, s, values.get(m)) for s in SETTINGS for m in METHODS}


get_config, get_cpu_config, sweep = testbed.cpu_experiment(EXPERIMENT, _variants, "erpo-T1.5")
