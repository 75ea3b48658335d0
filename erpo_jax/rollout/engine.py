"""The rollout-engine seam: which engine samples (`rollout.engine`), and the
one place a run's config becomes an engine (`engine_for`), for the Trainer,
the evaluator, `erpo inspect-grads`, the bench and `erpo plan`.

What every engine offers is `types.Engine`: built from the model config, a
`SamplingConfig`, the mesh and the run's `rollout` section (nothing that
reads weights), it pads a call to `batch_shape`, lowers and compiles its
programs, and `sample`s a Rollout of numpy arrays on every host
(len(prompts) * G rows; chunk c of max_prompts prompts keyed fold_in(key, c)
by every engine), with `last_stats` (decode steps, token-slot utilisation)
and `num_traces`. For `train.programs` and `erpo plan` it names the programs
an RL step runs (`step_programs`) and estimates its rollout time on a
distribution of response lengths (`plan_estimate`), so neither asks which
engine it has.

The engines, one module each: `static` (`static.StaticEngine`: a call's rows
prefill together and decode until the longest ends), `continuous`
(`continuous.ContinuousEngine`: a pool of slots, each refilled by the next
pending sample) and `paged` (`paged.PagedEngine`: the continuous pool over a
KV cache in pages, a prompt's pages shared by its samples, the decode
attention reading only what each slot holds). For the same key they return the same samples, to float
rounding: a draw can flip where rounding moves it across a token boundary.
A new engine is a module with a class that offers `types.Engine`, and an
entry in `ENGINES`.

The shared layer under them: `types` (SamplingConfig, Rollout, keys,
statistics, the interface), `choice` (token choice), `head` (the decode
head), `prompts` (validation and padding).
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

from erpo_jax.model.config import ModelConfig
from erpo_jax.model.sharding import Sharding
from erpo_jax.rollout.continuous import ContinuousEngine
from erpo_jax.rollout.paged import PagedEngine
from erpo_jax.rollout.static import StaticEngine
from erpo_jax.rollout.types import Engine, SamplingConfig

ENGINES: dict[str, type] = {"static": StaticEngine, "continuous": ContinuousEngine,
                             "paged": PagedEngine}

# What an engine samples for (`engine_for`), as `erpo plan` names their programs.
PURPOSES = ("rollout", "eval greedy", "eval sampled")


def engine_name(cfg, sharding: Sharding | None = None, model_cfg: ModelConfig | None = None
                ) -> str:
    """The rollout engine a run of `cfg` (a RunConfig) uses: rollout.engine,
    where 'auto' is, on the real path (data.task=jsonl: chat-templated
    prompts, responses of every length), 'paged' where its attention is the
    Pallas TPU kernel (a TPU mesh, the head size a multiple of 128:
    `paged_attention.resolve_impl`), which reads only the pages a slot holds
    (`erpo plan`: about 0.4x the continuous engine's decode step on the 1.5B
    v4-8 and 7B v5p-8 configs, experiments/BENCHMARKS.md, session 18), and
    'continuous' elsewhere (the CPU and GPU, where the paged engine's pure-JAX
    attention gathers whole page tables: 2.9x the continuous engine's wall on
    the CPU bench); and 'static' on the embedded arithmetic task, whose
    answers have nearly equal lengths. sharding: the mesh it runs on (None:
    JAX's default backend); model_cfg: the model (None: a head size the
    kernel serves)."""
    e = cfg.rollout.engine
    if e != "auto":
        return e
    if not samples_with_a_pool(cfg):
        return "static"
    from erpo_jax.model.paged_attention import resolve_impl
    head = None if model_cfg is None else model_cfg.head_dim
    kernel = resolve_impl(cfg.rollout.paged_attention, sharding, head) == "kernel"
    return "paged" if kernel else "continuous"


def samples_with_a_pool(cfg) -> bool:
    """Whether a run of `cfg` samples with one of the pool engines (continuous
    or paged, whose slots lie over the data axes), decided without the mesh:
    'auto' picks one of them on the real path and the static engine on the
    arithmetic task (`engine_name`)."""
    e = cfg.rollout.engine
    return cfg.data.task == "jsonl" if e == "auto" else e in ("continuous", "paged")


def _engine_class(name: str) -> type:
    if name not in ENGINES:
        raise ValueError(f"rollout.engine is {name!r}; the engines are "
                         f"{', '.join(repr(e) for e in ENGINES)}.")
    return ENGINES[name]


class _Settings(NamedTuple):
    """The `rollout` fields `make_engine` gives an engine's `from_config`."""

    slots: int
    refill: int
    page_size: int = 16
    kv_pages: int = 0
    paged_attention: str = "auto"
    kv_memory: float = 0.0


def make_engine(name: str, cfg: ModelConfig, sampling: SamplingConfig,
                sharding: Sharding | None = None, *, slots: int = 0, refill: int = 0,
                rows_per_call: int = 0) -> Engine:
    """The engine `name` for these shapes, outside a run config (tests,
    benches). slots / refill: the continuous engine's (0: automatic; slots
    then defaults to rows_per_call, the static engine's rows per call,
    rounded up to the data-parallel size)."""
    return _engine_class(name).from_config(cfg, sampling, sharding, _Settings(slots, refill),
                                           rows_per_call)


def engine_for(cfg, model_cfg: ModelConfig, purpose: str, eos_ids: Sequence[int], pad_id: int,
               sharding: Sharding | None = None) -> Engine | None:
    """The engine a run of `cfg` (a RunConfig) samples with for `purpose`, of
    the run's `rollout.engine` (`engine_name` on this mesh and model):

      'rollout'       the RL step's groups: rollout.group_size samples per
                      prompt at rollout.temperature / top_p / top_k, at least
                      rollout.min_new_tokens (also `erpo inspect-grads`, which
                      must draw the same groups);
      'eval greedy'   one greedy sample per evaluation problem;
      'eval sampled'  train.eval_n samples at train.eval_temperature for
                      pass@k (None when train.eval_n == 1).

    Each samples at most rollout.max_new_tokens tokens after prompts of at
    most data.max_prompt_len; the engine reads its own settings from the
    `rollout` section (`types.Engine.from_config`)."""
    t, r = cfg.train, cfg.rollout
    common = dict(max_new_tokens=r.max_new_tokens, eos_ids=tuple(eos_ids), pad_id=pad_id,
                  max_prompt_len=cfg.data.max_prompt_len, cache_phases=r.cache_phases)
    if purpose == "rollout":
        sampling = SamplingConfig(num_samples=r.group_size, temperature=r.temperature,
                                  top_p=r.top_p, top_k=r.top_k, min_new_tokens=r.min_new_tokens,
                                  **common)
    elif purpose == "eval greedy":
        sampling = SamplingConfig(num_samples=1, greedy=True, **common)
    elif purpose == "eval sampled":
        if t.eval_n <= 1:
            return None
        sampling = SamplingConfig(num_samples=t.eval_n, temperature=t.eval_temperature, **common)
    else:
        raise ValueError(f"engine_for: purpose {purpose!r} is not one of {PURPOSES}.")
    rows = (r.max_prompts_per_call or t.batch_size) * sampling.num_samples
    name = engine_name(cfg, sharding, model_cfg)
    return _engine_class(name).from_config(model_cfg, sampling, sharding, r, rows)
