"""Real scale: ERPO vs GRPO + Policy-KL vs no KL, Qwen2.5-Math-1.5B (v4-8) and Qwen2.5-7B (v5e-16).

Not run on the CPU machine; a test checks that every config parses, validates
for its device count and that its parameters shard on its mesh (abstractly).

One run (what `tpu_setup/launch.sh --config experiments/real_scale.py` starts;
get_config() is Qwen2.5-Math-1.5B with ERPO on a v4-8):

    erpo train --config experiments/real_scale.py \
        model.path=checkpoints/Qwen2.5-Math-1.5B train.out_dir=runs/real_scale/1.5b-erpo/seed0

The whole comparison, one variant (and seed) per TPU job:

    erpo sweep experiments/real_scale.py --only 1.5b-erpo,1.5b-grpo+policy_kl,1.5b-no_kl --seeds 0
    erpo sweep experiments/real_scale.py --only 7b-erpo --seeds 0        # on a v5litepod-16
    erpo sweep experiments/real_scale.py --only 7b-v5p-erpo --seeds 0    # on a v5p-8

Before creating a slice, check that every program fits it (free, on a CPU box):

    erpo plan --config experiments/real_scale.py --topology v4-8
    erpo plan --config experiments/real_scale_7b.py --topology v5e-16
    erpo plan --config experiments/real_scale_7b_v5p.py --topology v5p-8

(on a multi-host slice the trainer's run directory must be shared, see
tpu_setup/README.md; the sweep's skip/resume check reads it with pathlib).

Inputs, relative to the checkout on the workers (`tpu_setup/sync.sh`):
  checkpoints/Qwen2.5-Math-1.5B, checkpoints/Qwen2.5-7B   local HF directories
  data/math_train/train.jsonl   the RL training set, fields `problem`, `answer`
                                (e.g. MATH levels 3-5, as Dr. GRPO and SimpleRL-Zoo use)
  data/benchmarks/<name>/test.jsonl   the six benchmarks (`sync.sh --data
                                ../shared/data/benchmarks`)

CPU variant (`--cpu`): the same recipe shrunk to one host and a short run; it
still needs the HF checkpoint and the data, so it is for a single-GPU/CPU box
with the files, not for the test suite.

Where the numbers come from (as reported by each source; facts, not quotes):
- DeepSeekMath (Shao et al., 2024), which introduced GRPO: policy learning
  rate 1e-6, KL coefficient 0.04 (k3 estimator, in the loss), 64 samples per
  question, maximum length 1024, batch size 1024, one policy update per
  exploration stage.
- Dr. GRPO ("Understanding R1-Zero-Like Training", Liu et al., 2025), the
  Qwen2.5-Math-1.5B script of its code (sail-sg/understand-r1-zero,
  examples/qwen2.5-math-1.5b.sh): learning rate 1e-6 constant, beta 0 (no
  KL), 128 prompts per rollout x 8 samples, one update per rollout (train
  batch 128), prompt length 1024, generation length 3000, temperature 1.0,
  top-p 1.0, greedy evaluation with generation length 3000, MATH 12k
  training prompts.
- SimpleRL-Zoo (Zeng et al., 2025): GRPO on 8K MATH problems for ten base
  models including Qwen2.5-Math-7B and Qwen2.5-1.5B/7B; its training script's
  defaults (hkust-nlp/simpleRL-reason, train_grpo_math_tune_ray.sh): prompt
  length 1024, response length 3072, 8 rollouts per prompt, temperature 1.0,
  KL loss coefficient 1e-3 with the low-variance (k3) estimator, clip ratio
  0.2, learning rate 5e-7; it evaluates on exactly our six benchmarks (GSM8K,
  MATH500, Minerva Math, OlympiadBench, AIME24, AMC23).
- DAPO (Yu et al., 2025), Qwen2.5-32B: learning rate 1e-6 with 20 warm-up
  steps, 512 prompts x 16 responses, token-level loss aggregation, clip
  range [0.8, 1.28], no KL term.
Our choice, from these: lr 1e-6 constant (DeepSeekMath, Dr. GRPO, DAPO),
128 prompts x 8 samples (Dr. GRPO), 1024 prompt + 3072 response tokens
(SimpleRL-Zoo; 4096 is also Qwen2.5-Math's context length), temperature 1.0
and top-p 1.0 (all), one on-policy update per rollout (DeepSeekMath, Dr.
GRPO), clip 0.2, token-mean aggregation (DAPO). The regularisers (beta_policy
0.04 k3 for the baseline: DeepSeekMath's value; ERPO's beta_query and weight
scheme) come from `erpo_jax.tools.presets.arith_rl_config`, the same as the CPU
experiments: they are not tuned at this scale. The step count (200, about two
passes over 12k prompts) is ours.

Memory: `erpo plan` compiles every program of these configs with XLA's TPU
compiler (on a CPU host) and reports the per-chip peak against HBM; its
tables are in experiments/BENCHMARKS.md (section 5). The rollout samples 16
prompts (128 rows) per call (`rollout.max_prompts_per_call`): the KV cache of
a whole 1024-row rollout would be about 120 GB (1.5B) / 240 GB (7B).
"""

from __future__ import annotations

import dataclasses

from erpo_jax.tools.presets import METHODS, arith_rl_config
from erpo_jax.rl.loss import LossConfig
from erpo_jax.train.config import (AlgoSection, DataSection, MeshSection, ModelSection,
                                   OptimSection, RolloutSection, RunConfig, TrainSection)

BENCHMARKS = ("gsm8k", "math500", "aime24", "amc23", "minerva_math", "olympiadbench")

# model key -> (preset with its shapes, checkpoint dir, TPU, mesh (data, fsdp, tensor),
#               gradient-accumulation micro-batches per 128-prompt batch)
MODELS = {
    "1.5b": ("qwen2.5-math-1.5b", "checkpoints/Qwen2.5-Math-1.5B", "v4-8", (1, 4, 1), 32),
    "7b": ("qwen2.5-7b", "checkpoints/Qwen2.5-7B", "v5litepod-16", (1, 16, 1), 64),
    "7b-v5p": ("qwen2.5-7b", "checkpoints/Qwen2.5-7B", "v5p-8", (1, 4, 1), 32),
}

# model key -> rollout.slots where `erpo plan` compiled the pool engines at
# more than one pool (experiments/BENCHMARKS.md, "Session 23"; the drawn
# prompts' 512-token bucket): 256 slots against the default 128 (the rows of
# one call of 16 prompts), 10.7 against 13.3 s of paged rollout per RL step
# for 1.5B on a v4-8, 15.6 against 20.8 s for 7B on a v5p-8 (the continuous
# engine: 29.5 against 31.1 s and 35.5 against 39.6 s); both fit with room to
# spare. Elsewhere the default.
SLOTS = {"1.5b": 256, "7b-v5p": 256}


def regulariser(method: str) -> tuple[LossConfig, AlgoSection]:
    """(loss section, algo section: method name and weight scheme) of a method,
    shared with the CPU experiments."""
    cfg = arith_rl_config(method, sft_model="unused", out_dir="unused")
    return cfg.loss, cfg.algo


def method_config(method: str, model: str = "1.5b", steps: int = 200) -> RunConfig:
    """The real-scale run of `method` on `model` ('1.5b' or '7b')."""
    preset, path, _, mesh, micro = MODELS[model]
    loss, algo = regulariser(method)
    return RunConfig(
        name=f"{model}-{method}",
        model=ModelSection(init="hf", path=path, preset=preset, param_dtype="float32",
                           compute_dtype="bfloat16", remat=True, logprob_chunk=512),
        data=DataSection(task="jsonl", train_file="data/math_train/train.jsonl",
                         question_field="problem", answer_field="answer",
                         benchmarks_dir="data/benchmarks", eval_benchmarks=BENCHMARKS,
                         template="chat", max_prompt_len=1024),
        rollout=RolloutSection(group_size=8, temperature=1.0, top_p=1.0, max_new_tokens=3072,
                               max_prompts_per_call=16, slots=SLOTS.get(model, 0)),
        algo=AlgoSection(method=algo.method, advantage="grpo", weight_scheme=algo.weight_scheme),
        loss=dataclasses.replace(loss, eps_low=0.2, eps_high=0.2, agg_mode="token_mean"),
        optim=OptimSection(lr=1e-6, warmup_steps=0, schedule="constant", max_grad_norm=1.0,
                           epochs=1, num_minibatches=1, micro_batches=micro),
        train=TrainSection(steps=steps, batch_size=128,
                           out_dir=f"runs/real_scale/{model}-{method}/seed0",
                           eval_every=25, eval_n=1, eval_max_problems=100_000, drift_every=5,
                           drift_queries=64, ckpt_every=25, keep_checkpoints=2,
                           ref_batch_size=64),
        mesh=MeshSection(shape=mesh),
    )


def cpu_config(method: str, model: str = "1.5b") -> RunConfig:
    """The same recipe on one host: 8 prompts x 4 samples, 512 new tokens, 20 steps."""
    cfg = method_config(method, model, steps=20)
    return dataclasses.replace(
        cfg,
        model=dataclasses.replace(cfg.model, compute_dtype="float32"),
        rollout=dataclasses.replace(cfg.rollout, group_size=4, max_new_tokens=512, slots=0),
        optim=dataclasses.replace(cfg.optim, micro_batches=1),
        train=dataclasses.replace(cfg.train, batch_size=8, eval_every=10, eval_max_problems=20,
                                  ckpt_every=10),
        mesh=MeshSection(shape=(-1, 1, 1)))


def get_config() -> RunConfig:
    return method_config("erpo", "1.5b")


def get_cpu_config() -> RunConfig:
    return cpu_config("erpo", "1.5b")


def sweep(cpu: bool = False) -> dict[str, RunConfig]:
    make = cpu_config if cpu else method_config
    return {f"{model}-{m}": make(m, model) for model in MODELS for m in METHODS}


def accelerator(cfg: RunConfig) -> str:
    """The TPU type a real-scale config is laid out for: by its name's model key
    (e.g. '7b-v5p-erpo'), else the first model of its preset."""
    keys = [k for k in MODELS if cfg.name.startswith(k + "-")]
    if keys:
        return MODELS[max(keys, key=len)][2]
    return next(acc for preset, _, acc, _, _ in MODELS.values() if preset == cfg.model.preset)


def get_config_7b() -> RunConfig:
    """Qwen2.5-7B with ERPO on a v5litepod-16 (`experiments/real_scale_7b.py`)."""
    return method_config("erpo", "7b")


def get_config_7b_v5p() -> RunConfig:
    """Qwen2.5-7B with ERPO on a v5p-8 (`experiments/real_scale_7b_v5p.py`)."""
    return method_config("erpo", "7b-v5p")


COMPARISONS = [(f"{m}-erpo", f"{m}-{b}") for m in MODELS for b in ("grpo+policy_kl", "no_kl")]
