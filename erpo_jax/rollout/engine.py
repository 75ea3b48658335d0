"""The rollout-engine seam: what the Trainer, the evaluator, `erpo
inspect-grads`, the bench and `erpo plan` call to sample, whichever engine
runs it (`rollout.engine`).

An engine is built from the model config, a `SamplingConfig` and the mesh
(nothing that reads weights), and offers:

  batch_shape(num_prompts, longest)      the padded (B', P) a call runs at;
  lower(params, num_prompts, longest)    its programs at those shapes
                                         (params: arrays or ShapeDtypeStructs);
  compile(params, num_prompts, longest)  compile them ahead of the first call;
  sample(params, prompts, key, max_prompts) -> Rollout of numpy arrays, every
                                         host, len(prompts) * G rows; chunk c
                                         of max_prompts prompts is keyed
                                         fold_in(key, c) by both engines;
  run(params, prompts, key) -> (Rollout of device arrays, real rows);
  last_stats                             the last sample's decode steps and
                                         token-slot utilisation;
  num_traces                             traces of its programs so far.

Two engines: `static` (`sampler.Sampler`: a call's rows prefill together and
decode until the longest ends) and `continuous` (`continuous.ContinuousEngine`:
a pool of slots, each refilled by the next pending sample). For the same key
they return the same samples, to float rounding: a draw can flip where
rounding moves it across a token boundary.
"""

from __future__ import annotations

from erpo_jax.model.config import ModelConfig
from erpo_jax.model.sharding import Sharding
from erpo_jax.rollout.continuous import ContinuousEngine
from erpo_jax.rollout.sampler import Sampler, SamplingConfig

ENGINES = {"static": Sampler, "continuous": ContinuousEngine}


def make_engine(name: str, cfg: ModelConfig, sampling: SamplingConfig,
                sharding: Sharding | None = None, *, slots: int = 0, refill: int = 0,
                rows_per_call: int = 0):
    """The engine `name` for these shapes. slots / refill: the continuous
    engine's (0: automatic; slots then defaults to rows_per_call, the static
    engine's rows per call, rounded up to the data-parallel size)."""
    if name not in ENGINES:
        raise ValueError(f"rollout.engine is {name!r}; the engines are "
                         f"{', '.join(repr(e) for e in ENGINES)}.")
    if name == "static":
        return Sampler(cfg, sampling, sharding)
    if not slots:
        dp = sharding.data_size if sharding is not None else 1
        slots = -(-max(rows_per_call, 1) // dp) * dp
    return ContinuousEngine(cfg, sampling, sharding, slots=slots, refill=refill)
