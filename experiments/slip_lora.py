"""LoRA on the slip testbed: does ERPO's lead over GRPO + Policy-KL hold when
only a rank-r update is trained, and what does rank cost? (issue 50, item 5)

    erpo sweep experiments/slip_lora.py --cpu --seeds 0 --jobs 2 --only TUNING    # the learning rate
    erpo sweep experiments/slip_lora.py --cpu --seeds 0,1,2 --jobs 2 --only MAIN  # the comparison

The testbed's T = 1.5 comparison (slip_temperature.py: the slipped
reference, the tuned coefficients, 100 steps, greedy and 8-sample evaluation
on the test families every 50 steps) with `model.lora_rank` R on every
projection (alpha 32). Its full fine-tuning runs, `erpo-T1.5` and
`grpo+policy_kl-T1.5` (lr 3e-4), are the rows LoRA is read against.

The learning rate is chosen per method on the validation split (never the
test families), at rank 8, seed 0, 100 steps, final greedy pass@1: 3e-4 (the
full fine-tuning rate), 1e-3 and 3e-3 (LoRA's rule of thumb is about 10x
the full rate). `CHOSEN_LR` holds the winners; the main rows run at ranks
1, 8 and 32.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from erpo_jax.tools.sweep import load_experiment
from erpo_jax.train.config import RunConfig

testbed = load_experiment(Path(__file__).with_name("slip_testbed.py"))

EXPERIMENT = "slip_lora"
TEMPERATURE, STEPS = 1.5, 100
METHODS = ("erpo", "grpo+policy_kl")
RANKS = (1, 8, 32)
ALPHA = 32.0
TUNE_RANK, TUNE_LRS = 8, (3e-4, 1e-3, 3e-3)
# Chosen on the validation split by the tuning runs (RESULTS.md, slip_lora_tuning).
CHOSEN_LR = {"erpo": 1e-3, "grpo+policy_kl": 3e-4}
COMPARISONS = [(f"erpo-lora{r}", f"grpo+policy_kl-lora{r}") for r in RANKS]
COLLAPSE_DROP = 0.15
ENTROPY_FLOOR = testbed.ENTROPY_FLOOR
sft_config = testbed.sft_config


def lora_config(method: str, rank: int, lr: float, name: str, **kw) -> RunConfig:
    cfg = testbed.method_config(method, temperature=TEMPERATURE, steps=STEPS, lr=lr,
                                name=name, experiment=EXPERIMENT, **kw)
    return dataclasses.replace(cfg, model=dataclasses.replace(
        cfg.model, lora_rank=rank, lora_alpha=ALPHA))


def tuning_name(method: str, lr: float) -> str:
    return f"tune-{method}-lr{lr:g}"


def variants() -> dict[str, RunConfig]:
    out = {tuning_name(m, lr): lora_config(m, TUNE_RANK, lr, tuning_name(m, lr),
                                           eval_split="validation", eval_every=STEPS,
                                           sampled_eval=False)
           for m in METHODS for lr in TUNE_LRS}
    for m in METHODS:
        if CHOSEN_LR[m] is not None:
            out.update({f"{m}-lora{r}": lora_config(m, r, CHOSEN_LR[m], f"{m}-lora{r}")
                        for r in RANKS})
    return out


get_config, get_cpu_config, sweep = testbed.cpu_experiment(
    EXPERIMENT, variants, tuning_name("erpo", TUNE_LRS[1]))
