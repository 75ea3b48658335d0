"""Typed, validated run configuration, dotted overrides, and config files.

An experiment is one Python file defining `get_config() -> RunConfig` (and,
optionally, `get_cpu_config()`); its docstring holds the command that runs it.
Any field can be overridden from the command line with a dotted path:

    erpo train --config experiments/main_comparison.py rollout.temperature=1.2 loss.beta_query=0.1

`validate()` checks everything that can be checked before anything compiles
and raises a sentence naming the field.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import re
import types
import typing
from pathlib import Path
from typing import Any

from erpo_jax.rl.loss import LossConfig, deferred_validation
from erpo_jax.rl.weights import W_MAX, W_MIN
from erpo_jax.rollout.engine import ENGINES, samples_with_a_pool
from erpo_jax.runtime.errors import ConfigError  # noqa: F401  (re-exported: its home for callers)


@dataclasses.dataclass(frozen=True)
class ModelSection:
    """Where the policy comes from.

    init: 'sft' (the checkpoint `erpo sft` wrote to `path`, the embedded task's
      default), 'hf' (a local Hugging Face directory at `path`) or 'random'
      (a random model of `preset`, for smoke tests).
    lora_rank: low-rank adapters (model/lora.py): 0 = full fine-tuning; above
      0 the base is frozen (param_dtype may be bfloat16), float32 adapters on
      lora_targets are trained, and the reference is the base.
    lora_alpha: the adapters' scale is lora_alpha / lora_rank.
    lora_targets: the projections that get adapters (q_proj, k_proj, v_proj,
      o_proj, gate_proj, up_proj, down_proj); empty = all of them.
    """

    init: str = "sft"
    path: str = "runs/sft-arith"
    preset: str = "arith-small"
    param_dtype: str = "float32"
    compute_dtype: str = "float32"
    remat: bool = False
    scan_layers: bool | None = None
    logprob_chunk: int = 512
    # Run each group's query through the model once in the update and the
    # reference forward, not once per response (the G rows of a group repeat
    # it): the same numbers with the query's share of the work divided by
    # rollout.group_size. Off where a micro-batch's queries do not split
    # evenly over the mesh's data-parallel size (Programs.query_group).
    share_query: bool = True
    lora_rank: int = 0
    lora_alpha: float = 32.0
    lora_targets: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class DataSection:
    """The training queries and the evaluation sets.

    task: 'arithmetic' (the embedded task, no download) or 'jsonl' (a math
      training file `train_file` with `question_field`/`answer_field`,
      evaluated on `eval_benchmarks` read from `benchmarks_dir`).
    answer_format: what `answer_field` holds: 'plain' (the final answer),
      'gsm8k' (a worked solution ending '#### x') or 'boxed' (a worked
      solution whose last \boxed{} is the answer); see data/math_jsonl.py.
    solution_field: a field with worked solutions for `erpo sft` ('' = derive
      them from a gsm8k/boxed answer field).
    skip_bad_rows: drop bad rows of the training file (bad JSON or UTF-8, a
      missing field, a gold math-verify cannot parse) and report how many,
      instead of refusing the file.
    sft_slip: the arithmetic task's SFT demonstrations drop each carry or
      borrow with this probability (`arithmetic.slipped`; gold answers stay
      true): a reference that is often right but not reliably. 0 = exact.
    n_val: validation problems held out of training, to choose coefficients
      on without looking at the test sets (train.eval_split='validation'):
      per training family for the arithmetic task (drawn apart from its test
      sets), rows of the training file for a JSONL task. 0 = none.
    n_drift: rows of a JSONL training file held out of training (a draw
      apart from n_val's) to measure query drift on (train.drift_every).
      Without it drift is measured on the evaluation sets, else on the
      validation rows; `erpo train` with neither and drift_every > 0 is
      refused. A data field, so it is what every command (sft, train, eval)
      trains on; logging settings never change the training set.
    """

    task: str = "arithmetic"
    seed: int = 0
    n_train: int = 4000
    n_test: int = 100
    n_val: int = 0
    n_drift: int = 0
    train_file: str = ""
    question_field: str = "question"
    answer_field: str = "answer"
    answer_format: str = "plain"
    solution_field: str = ""
    skip_bad_rows: bool = False
    sft_slip: float = 0.0
    benchmarks_dir: str = "../shared/data/benchmarks"
    eval_benchmarks: tuple[str, ...] = ()
    template: str = "plain"
    instruction: str = "Please reason step by step, and put your final answer within \\boxed{}."
    max_prompt_len: int = 32


@dataclasses.dataclass(frozen=True)
class RewardSection:
    """The math-verify pool (data.task='jsonl').

    workers: verifier processes.
    timeout_s: wall-time limit per comparison (the worker is killed and the
      response scores 0, reason 'timeout').
    batch_budget_s: wall-time limit per scored batch, 0 = none: what is left
      when it runs out scores 0 with reason 'over_budget' (metric
      reward/over_budget).
    """

    workers: int = 2
    timeout_s: float = 5.0
    batch_budget_s: float = 0.0


@dataclasses.dataclass(frozen=True)
class RolloutSection:
    group_size: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 48
    min_new_tokens: int = 0
    # Prompts per sampler call (0: the whole batch at once). Bounds the KV cache
    # to max_prompts_per_call * group_size rows; evaluation uses it too.
    max_prompts_per_call: int = 0
    # The decode loop's KV cache grows in up to this many phases, so a decode
    # step's attention reads about the filled slots instead of the whole cache
    # (rollout.static.cache_phase_lengths); each phase compiles the decode
    # step once more. 1 = one loop over the whole cache.
    cache_phases: int = 4
    # The rollout engine (rollout.engine): 'static' (a call's rows decode
    # together until the longest ends), 'continuous' (a pool of decode slots,
    # each refilled by the next pending sample when its sample ends; the same
    # samples for the same key, to float rounding: a draw can flip where
    # rounding moves it across a token boundary), 'paged' (the continuous pool
    # over a KV cache in pages; rollout.page_size, kv_pages, paged_attention)
    # or 'auto': on the real path (data.task=jsonl), whose response lengths
    # vary, paged on a TPU mesh where its attention is the Pallas kernel and
    # continuous elsewhere; static on the embedded arithmetic task
    # (`rollout.engine.engine_name`). README "Choosing a rollout engine".
    engine: str = "auto"
    # The continuous engine's decode slots (0: the static engine's rows per
    # call, max_prompts_per_call (or the batch) x group_size, rounded up to the
    # data-parallel size), and the free slots at which it stops decoding to
    # refill them (0: slots / 16, at least 1).
    slots: int = 0
    refill: int = 0
    # The paged engine's KV entries per page (a power of two; a multiple of 8
    # on TPU).
    page_size: int = 16
    # The paged engine's pages over all data shards (0: every slot's longest
    # prompt and response, the continuous engine's memory; fewer: inserting
    # waits for pages to free).
    kv_pages: int = 0
    # Or the share of each chip's memory its pages take, e.g. 0.3 (0: off;
    # the chip's memory as the runtime reports it, or a TPU's HBM in `erpo
    # plan`; not on the CPU). Exclusive with kv_pages.
    kv_memory: float = 0.0
    # The paged engine's decode attention: 'auto' (jax's Pallas ragged paged
    # attention kernel on TPU where the head size is a multiple of 128, the
    # pure-JAX path elsewhere), 'kernel' or 'dense' (model.paged_attention).
    paged_attention: str = "auto"


@dataclasses.dataclass(frozen=True)
class AlgoSection:
    """The method, the advantage estimator and the per-query weights.

    method: 'erpo', 'grpo_policy_kl', 'no_kl' or 'custom' (the default): sets
      the loss coefficients and the weight scheme (`erpo_jax.train.methods`);
      the resolved method is printed in the run header and saved in config.json.
    advantage: 'grpo', 'dr_grpo', 'rloo', 'reinforce', 'reinforce_pp' or 'gae'
      (PPO with a learned critic).
    weight_scheme: 'uniform', 'likelihood' or 'typicality' (method page); ''
      means the method's scheme (erpo: likelihood, else uniform).
    weight_min, weight_max: the clip of the weights, the library's defaults
      (`weights.W_MIN`, `weights.W_MAX`).
    reinforce_pp_whiten: 'token' (REINFORCE++ as its paper, OpenRLHF and verl:
      returns-to-go whitened over all response tokens, unbiased variance) or
      'response' (a deviation: each response counted once, population std).
    filter_groups: DAPO's dynamic sampling (rl/dynamic_sampling.py): drop
      the groups whose rewards do not vary and sample further batches of
      prompts until train.batch_size groups vary.
    filter_max_batches: the most batches of prompts dynamic sampling draws in
      a step, the first included (verl's DAPO recipe: 10); 0 = no cap (at
      most one pass over the training set per step).
    filter_on_short: what a step that reaches the cap short of
      train.batch_size varied groups does: 'error' (DAPO: stop, saying so,
      after saving the finished steps) or 'pad' (fill the batch with flat
      groups that carry no signal; counted in the metric filter/short).
    overlong_buffer, overlong_penalty: DAPO's overlong shaping (rl/overlong.py):
      a penalty growing linearly to -overlong_penalty over the last
      overlong_buffer tokens before rollout.max_new_tokens; 0 = off.
    """

    method: str = "custom"
    advantage: str = "grpo"
    adv_eps: float = 1e-6
    gamma: float = 1.0
    lam: float = 0.95
    critic_lr: float = 1e-4
    value_clip: float = 0.2
    weight_scheme: str = ""
    weight_tau: float = 1.0
    weight_min: float = W_MIN
    weight_max: float = W_MAX
    reinforce_pp_whiten: str = "token"
    filter_groups: bool = False
    filter_max_batches: int = 10
    filter_on_short: str = "error"
    overlong_buffer: int = 0
    overlong_penalty: float = 1.0


@dataclasses.dataclass(frozen=True)
class OptimSection:
    lr: float = 1e-4
    warmup_steps: int = 0
    schedule: str = "constant"  # or 'cosine'
    weight_decay: float = 0.0
    b1: float = 0.9
    b2: float = 0.999
    max_grad_norm: float = 1.0
    epochs: int = 1  # passes over each rollout (PPO-style reuse)
    num_minibatches: int = 1  # optimizer steps per epoch
    micro_batches: int = 1  # gradient-accumulation micro-batches per mini-batch


@dataclasses.dataclass(frozen=True)
class TrainSection:
    steps: int = 40
    batch_size: int = 16  # queries per RL step (B); rows are B * group_size
    seed: int = 0
    out_dir: str = "runs/train"
    eval_every: int = 20
    eval_n: int = 1  # samples per problem for pass@k (k <= n); 1 = greedy only
    eval_temperature: float = 1.0
    eval_k: tuple[int, ...] = (1,)
    eval_max_problems: int = 100
    # 'test': evaluate on the test sets (the arithmetic families, data.eval_benchmarks);
    # 'validation': on the data.n_val validation problems instead, for coefficient searches.
    eval_split: str = "test"
    drift_every: int = 5
    drift_queries: int = 64
    policy_kl_metric: bool = False  # also log response Policy-KL every drift_every steps
    ckpt_every: int = 20
    keep_checkpoints: int = 2  # >= 1; the final policy is also exported to <out_dir>/model
    # Resuming from a checkpoint with a config that differs (outside a few
    # cosmetic fields) is refused unless this is true; see train/rundir.py.
    allow_config_change: bool = False
    tensorboard: bool = True  # TensorBoard events in <out_dir>/tb (local run directories only)
    max_nonfinite: int = 3
    progress: bool = True
    ref_cache_dir: str = ""  # default: <out_dir>/../.refcache (shared by sibling runs)
    ref_batch_size: int = 64
    # Compile the first step's update, rollout and reference forward in a
    # background thread while the reference pass runs (single-process runs).
    compile_ahead: bool = True
    # JAX's persistent compilation cache: 'auto' ($ERPO_JAX_COMPILE_CACHE, else
    # ~/.cache/erpo_jax/jax_cache/<machine>), 'off', or a directory (see erpo_jax.runtime.compile_cache).
    compile_cache: str = "auto"


@dataclasses.dataclass(frozen=True)
class MeshSection:
    shape: tuple[int, int, int] = (-1, 1, 1)  # data, fsdp, tensor


@dataclasses.dataclass(frozen=True)
class RunConfig:
    name: str = "run"
    model: ModelSection = ModelSection()
    data: DataSection = DataSection()
    rollout: RolloutSection = RolloutSection()
    reward: RewardSection = RewardSection()
    algo: AlgoSection = AlgoSection()
    loss: LossConfig = LossConfig()
    optim: OptimSection = OptimSection()
    train: TrainSection = TrainSection()
    mesh: MeshSection = MeshSection()

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _fail(field: str, msg: str):
    raise ConfigError(f"config field {field}: {msg}")


# The dtypes a model may be stored and computed in (model.config._DTYPES).
DTYPES = ("bfloat16", "float16", "float32")


# Float fields where inf means "no limit"; every other float must be finite.
_INF_ALLOWED = {"loss.eps_high", "loss.kl_clamp", "loss.dual_clip", "optim.max_grad_norm"}


def _check_numbers(obj, prefix: str = "") -> None:
    """NaN anywhere, or inf where it is not a "no limit", names its field."""
    for f in dataclasses.fields(obj):
        v, name = getattr(obj, f.name), f"{prefix}{f.name}"
        if dataclasses.is_dataclass(v):
            _check_numbers(v, name + ".")
        elif isinstance(v, float) and (math.isnan(v) or (math.isinf(v)
                                                          and name not in _INF_ALLOWED)):
            _fail(name, f"must be a finite number, got {v}.")


def _type_name(typ) -> str:
    if typing.get_origin(typ) is tuple:
        args = typing.get_args(typ)
        return f"a list of {_type_name(args[0]) if args else 'values'}"
    if typing.get_origin(typ) in (types.UnionType, typing.Union):
        return " or ".join(_type_name(a) for a in typing.get_args(typ))
    return {int: "an integer", float: "a number", bool: "true/false", str: "a string",
            type(None): "null"}.get(typ, getattr(typ, "__name__", str(typ)))


def _fits(value, typ) -> bool:
    """Whether `value` is of the config field type `typ` (an int is a float)."""
    origin = typing.get_origin(typ)
    if origin in (types.UnionType, typing.Union):
        return any(_fits(value, a) for a in typing.get_args(typ))
    if origin is tuple:
        args = typing.get_args(typ)
        if not isinstance(value, (tuple, list)):
            return False
        if len(args) == 2 and args[1] is Ellipsis:
            return all(_fits(v, args[0]) for v in value)
        return len(value) == len(args) and all(_fits(v, a) for v, a in zip(value, args))
    if typ is type(None):
        return value is None
    if typ is bool:
        return isinstance(value, bool)
    if typ is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if typ is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return not isinstance(typ, type) or isinstance(value, typ)


def _check_types(obj, prefix: str = "") -> None:
    """A field holding a value of another type (a string where a number goes,
    from a JSON or Python config file) names the field."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        v, name, typ = getattr(obj, f.name), f"{prefix}{f.name}", hints[f.name]
        if dataclasses.is_dataclass(typ):
            if not dataclasses.is_dataclass(v):
                _fail(name, f"is a section ({typ.__name__}), got {v!r}.")
            _check_types(v, name + ".")
        elif not _fits(v, typ):
            _fail(name, f"expects {_type_name(typ)}, got {v!r}.")


def _validate_ranges(cfg: RunConfig) -> None:
    """Numeric ranges the optimizer, sampler, evaluator and checkpointer rely on."""
    r, o, t = cfg.rollout, cfg.optim, cfg.train
    _check_types(cfg)
    _check_numbers(cfg)
    if r.top_k < 0:
        _fail("rollout.top_k", f"must be >= 0 (0 = no top-k), got {r.top_k}.")
    if r.engine != "auto" and r.engine not in ENGINES:
        _fail("rollout.engine", f"is {r.engine!r}; the engines are "
              f"{', '.join(repr(e) for e in ENGINES)} (or 'auto').")
    for name in ("slots", "refill", "kv_pages"):
        if getattr(r, name) < 0:
            _fail(f"rollout.{name}", f"must be >= 0 (0 = automatic), got {getattr(r, name)}.")
    # The page settings are checked whatever the engine: 'auto' resolves by
    # the mesh the run gets (`engine_name`), which validation does not know;
    # nor does it ask JAX for a platform (a multi-host run initialises JAX's
    # distributed runtime after its config is checked).
    from erpo_jax.model.paged_attention import IMPLS
    from erpo_jax.rollout.paged import check_page_size
    try:
        check_page_size(r.page_size)
    except ValueError as e:
        _fail("rollout.page_size", str(e).split("rollout.page_size ", 1)[1])
    if r.paged_attention not in IMPLS:
        _fail("rollout.paged_attention", f"is {r.paged_attention!r}; choose one of "
              f"{', '.join(map(repr, IMPLS))}.")
    if not 0 <= r.kv_memory < 1:
        _fail("rollout.kv_memory", f"is {r.kv_memory}; it is a share of a chip's memory in "
              "[0, 1) (0: off), e.g. 0.3.")
    if r.kv_memory and r.kv_pages:
        _fail("rollout.kv_memory", f"is {r.kv_memory} and rollout.kv_pages is {r.kv_pages}; "
              "both set the paged engine's pages: set one of them (the other to 0).")
    if r.cache_phases < 1:
        _fail("rollout.cache_phases", f"must be >= 1 (1 = the whole cache from the start), "
              f"got {r.cache_phases}.")
    if not t.eval_temperature > 0:
        _fail("train.eval_temperature", f"must be > 0, got {t.eval_temperature}.")
    for name, v in (("optim.b1", o.b1), ("optim.b2", o.b2)):
        if not 0 <= v < 1:
            _fail(name, f"must be in [0, 1), got {v}.")
    for name, v in (("optim.max_grad_norm", o.max_grad_norm), ("optim.warmup_steps",
                    o.warmup_steps), ("optim.weight_decay", o.weight_decay),
                    ("train.eval_every", t.eval_every), ("train.drift_every", t.drift_every)):
        if not v >= 0:
            _fail(name, f"must be >= 0, got {v}.")
    for name, v in (("train.keep_checkpoints", t.keep_checkpoints),
                    ("train.ckpt_every", t.ckpt_every), ("train.eval_n", t.eval_n)):
        if v < 1:
            _fail(name, f"must be >= 1, got {v}.")
    m, d = cfg.model, cfg.data
    for name, v in (("model.logprob_chunk", m.logprob_chunk), ("train.ref_batch_size",
                    t.ref_batch_size), ("train.eval_max_problems", t.eval_max_problems),
                    ("data.n_train", d.n_train), ("data.n_test", d.n_test)):
        if v < 1:
            _fail(name, f"must be >= 1, got {v}.")
    for name, v in (("train.seed", t.seed), ("data.seed", d.seed),
                    ("rollout.min_new_tokens", r.min_new_tokens)):
        if v < 0:
            _fail(name, f"must be >= 0, got {v}.")
    for name, v in (("model.param_dtype", m.param_dtype),
                    ("model.compute_dtype", m.compute_dtype)):
        if v not in DTYPES:
            _fail(name, f"is {v!r}; use one of {list(DTYPES)}.")
    if d.eval_benchmarks:
        from erpo_jax.data.benchmarks import BENCHMARKS
        unknown = [b for b in d.eval_benchmarks if b not in BENCHMARKS]
        if unknown:
            _fail("data.eval_benchmarks", f"{', '.join(map(repr, unknown))} "
                  f"{'is' if len(unknown) == 1 else 'are'} not a benchmark; choose from "
                  f"{sorted(BENCHMARKS)}.")
    if t.drift_every > 0 and t.drift_queries < 1:
        _fail("train.drift_queries", f"must be >= 1 when train.drift_every > 0, got "
              f"{t.drift_queries}.")
    if len(cfg.mesh.shape) != 3:
        _fail("mesh.shape", f"must have 3 entries (data, fsdp, tensor), got {cfg.mesh.shape}.")
    if any(s == 0 or s < -1 for s in cfg.mesh.shape):
        _fail("mesh.shape", f"entries must be positive or -1 (the rest), got {cfg.mesh.shape}.")
    from erpo_jax.runtime.rundir import is_remote
    if is_remote(t.out_dir) and t.tensorboard:
        _fail("train.tensorboard", f"TensorBoard events are written to local run directories "
              f"only; set train.tensorboard=false for train.out_dir={t.out_dir}.")
    if is_remote(cfg.model.path) and cfg.model.init in ("sft", "hf"):
        _fail("model.path", f"{cfg.model.path}: models are loaded from a local directory "
              "(memory-mapped safetensors); copy it to a local disk first.")


def check_lora(cfg: RunConfig, model_shape=None) -> None:
    """model.lora_*: a rank with no adapters, unknown targets, a rank above a
    targeted layer's smaller dimension (`model_shape`: the ModelConfig when
    known; else read from the preset or the local checkpoint's config.json),
    and LoRA with a learned critic."""
    from erpo_jax.model.config import LORA_TARGETS, PRESETS, from_hf_config
    m = cfg.model
    if m.lora_rank < 0 or (m.lora_rank == 0 and m.lora_targets):
        _fail("model.lora_rank", f"is {m.lora_rank} with model.lora_targets "
              f"{list(m.lora_targets)}; give a positive rank to train adapters on them, or "
              "leave model.lora_targets empty for full fine-tuning (rank 0).")
    bad = [t for t in m.lora_targets if t not in LORA_TARGETS]
    if bad:
        _fail("model.lora_targets", f"names {bad}, which are not projections; the valid "
              f"targets are {list(LORA_TARGETS)} (empty = all of them).")
    if not m.lora_rank:
        return
    if not m.lora_alpha > 0:
        _fail("model.lora_alpha", f"must be > 0 (the adapters' scale is lora_alpha / "
              f"lora_rank), got {m.lora_alpha}.")
    from erpo_jax.rl import estimators
    try:
        critic = estimators.get(cfg.algo.advantage).needs_critic
    except ValueError:
        critic = False   # an unknown estimator: its own check names algo.advantage
    if critic:
        _fail("model.lora_rank", f"is {m.lora_rank}, but algo.advantage="
              f"{cfg.algo.advantage!r} trains a learned critic (PPO), which has no adapters; "
              "use a critic-free advantage (e.g. grpo) with LoRA, or model.lora_rank=0.")
    if model_shape is None:
        if m.init == "random" and m.preset in PRESETS:
            model_shape = PRESETS[m.preset]
        elif m.init in ("sft", "hf"):
            import json
            from pathlib import Path
            f = Path(m.path) / "config.json"
            if f.is_file():
                try:
                    model_shape = from_hf_config(json.loads(f.read_text()))
                except (ValueError, KeyError):
                    model_shape = None   # the loader says what is wrong with it
    if model_shape is not None:
        import dataclasses
        try:
            dataclasses.replace(model_shape, lora_rank=m.lora_rank, lora_alpha=m.lora_alpha,
                                lora_targets=tuple(m.lora_targets))
        except ValueError as e:
            _fail("model.lora_rank", str(e).split("ModelConfig.lora_rank ", 1)[-1])


def validate(cfg: RunConfig, num_devices: int | None = None) -> RunConfig:
    """Raise ValueError naming the field for anything wrong; returns cfg with its
    method resolved (`methods.resolve_method`): use the returned config."""
    from erpo_jax.rl.estimators import ESTIMATORS
    from erpo_jax.train.methods import resolve_method
    check_loss(cfg)
    with deferred_validation():
        cfg = resolve_method(cfg)
    from erpo_jax.rl.shaping import WHITEN_MODES
    from erpo_jax.rl.weights import SCHEMES
    m, d, r, a, o, t = cfg.model, cfg.data, cfg.rollout, cfg.algo, cfg.optim, cfg.train
    _validate_ranges(cfg)
    check_lora(cfg)
    if m.init not in ("sft", "hf", "random"):
        _fail("model.init", f"is {m.init!r}; use 'sft', 'hf' or 'random'.")
    if m.init in ("sft", "hf") and not m.path:
        _fail("model.path", f"is empty but model.init={m.init!r} needs a checkpoint directory.")
    if m.init in ("sft", "hf"):
        from erpo_jax.train.policy import check_model_dir
        check_model_dir(m.path)   # a run directory where its <dir>/model is meant
    if d.task not in ("arithmetic", "jsonl"):
        _fail("data.task", f"is {d.task!r}; use 'arithmetic' or 'jsonl'.")
    if not 0 <= d.sft_slip <= 1:
        _fail("data.sft_slip", f"is a probability, got {d.sft_slip}.")
    if d.sft_slip and d.task != "arithmetic":
        _fail("data.sft_slip", f"slips the arithmetic task's worked solutions, but data.task="
              f"{d.task!r}; set it to 0.")
    if d.n_val < 0:
        _fail("data.n_val", f"must be >= 0, got {d.n_val}.")
    if d.n_drift < 0:
        _fail("data.n_drift", f"must be >= 0, got {d.n_drift}.")
    if d.n_drift and d.task != "jsonl":
        _fail("data.n_drift", f"is {d.n_drift} but holds rows out of a JSONL training file; "
              f"the {d.task} task measures drift on its held-out test families. Set it to 0.")
    if cfg.train.eval_split not in ("test", "validation"):
        _fail("train.eval_split", f"is {cfg.train.eval_split!r}; use 'test' or 'validation'.")
    if cfg.train.eval_split == "validation" and not d.n_val:
        _fail("train.eval_split", "is 'validation' but data.n_val=0 holds out no validation "
              "problems; set data.n_val (e.g. 100).")
    if d.task == "jsonl" and not d.train_file:
        _fail("data.train_file", "is empty but data.task='jsonl' needs a training JSONL file.")
    if d.answer_format not in ("plain", "gsm8k", "boxed"):
        _fail("data.answer_format", f"is {d.answer_format!r}; use 'plain', 'gsm8k' or 'boxed'.")
    if cfg.reward.workers < 1:
        _fail("reward.workers", f"must be >= 1, got {cfg.reward.workers}.")
    if not cfg.reward.timeout_s > 0:
        _fail("reward.timeout_s", f"must be > 0, got {cfg.reward.timeout_s}.")
    if not cfg.reward.batch_budget_s >= 0:
        _fail("reward.batch_budget_s", f"must be >= 0 (0 = no budget), got "
              f"{cfg.reward.batch_budget_s}.")
    if d.template not in ("plain", "chat"):
        _fail("data.template", f"is {d.template!r}; use 'plain' or 'chat'.")
    for name, value, low in [("rollout.group_size", r.group_size, 1),
                             ("rollout.max_new_tokens", r.max_new_tokens, 1),
                             ("train.steps", t.steps, 0), ("train.batch_size", t.batch_size, 1),
                             ("optim.epochs", o.epochs, 1),
                             ("optim.num_minibatches", o.num_minibatches, 1),
                             ("optim.micro_batches", o.micro_batches, 1),
                             ("data.max_prompt_len", d.max_prompt_len, 2),
                             ("train.max_nonfinite", t.max_nonfinite, 1)]:
        if value < low:
            _fail(name, f"must be >= {low}, got {value}.")
    if r.max_prompts_per_call < 0:
        _fail("rollout.max_prompts_per_call", f"must be >= 0 (0 = no limit), got "
              f"{r.max_prompts_per_call}.")
    if not r.temperature > 0:
        _fail("rollout.temperature", f"must be > 0, got {r.temperature}.")
    if not 0 < r.top_p <= 1:
        _fail("rollout.top_p", f"must be in (0, 1], got {r.top_p}.")
    if r.min_new_tokens > r.max_new_tokens:
        _fail("rollout.min_new_tokens", f"({r.min_new_tokens}) exceeds rollout.max_new_tokens "
              f"({r.max_new_tokens}).")
    if a.advantage not in ESTIMATORS:
        _fail("algo.advantage", f"is {a.advantage!r}; choose one of {sorted(ESTIMATORS)}.")
    est = ESTIMATORS[a.advantage]
    if r.group_size < est.min_group:
        _fail("rollout.group_size", f"is {r.group_size}, but algo.advantage={a.advantage!r} "
              f"needs a group of at least {est.min_group} responses per query.")
    if a.filter_groups and r.group_size < 2:
        _fail("algo.filter_groups", f"drops groups whose rewards do not vary, but "
              f"rollout.group_size={r.group_size} makes every group one response; set "
              "rollout.group_size >= 2 or algo.filter_groups=false.")
    if a.filter_max_batches < 0:
        _fail("algo.filter_max_batches", f"must be >= 0 (batches of prompts drawn per step, "
              f"the first included; 0 = no cap), got {a.filter_max_batches}.")
    from erpo_jax.rl.dynamic_sampling import ON_SHORT
    if a.filter_on_short not in ON_SHORT:
        _fail("algo.filter_on_short", f"is {a.filter_on_short!r}; choose 'error' (stop when "
              "dynamic sampling reaches algo.filter_max_batches short of train.batch_size "
              "varied groups) or 'pad' (fill with flat groups that carry no signal).")
    if not 0 <= a.overlong_buffer <= r.max_new_tokens:
        _fail("algo.overlong_buffer", f"must be in [0, rollout.max_new_tokens="
              f"{r.max_new_tokens}] (0 = off), got {a.overlong_buffer}.")
    if a.overlong_penalty < 0:
        _fail("algo.overlong_penalty", f"must be >= 0, got {a.overlong_penalty}.")
    if a.reinforce_pp_whiten not in WHITEN_MODES:
        _fail("algo.reinforce_pp_whiten", f"is {a.reinforce_pp_whiten!r}; choose one of "
              f"{WHITEN_MODES}.")
    if a.weight_scheme not in SCHEMES:
        _fail("algo.weight_scheme", f"is {a.weight_scheme!r}; choose one of {SCHEMES}.")
    if not (0 <= a.weight_min <= 1 <= a.weight_max):
        _fail("algo.weight_min", f"and algo.weight_max must satisfy 0 <= min <= 1 <= max, got "
              f"[{a.weight_min}, {a.weight_max}].")
    if not a.weight_tau > 0:
        _fail("algo.weight_tau", f"must be > 0, got {a.weight_tau}.")
    if o.schedule not in ("constant", "cosine"):
        _fail("optim.schedule", f"is {o.schedule!r}; use 'constant' or 'cosine'.")
    if not o.lr > 0:
        _fail("optim.lr", f"must be > 0, got {o.lr}.")
    rows = t.batch_size * r.group_size
    if t.batch_size % o.num_minibatches:
        _fail("optim.num_minibatches", f"({o.num_minibatches}) must divide train.batch_size "
              f"({t.batch_size}) so every mini-batch holds whole groups.")
    mb_queries = t.batch_size // o.num_minibatches
    if mb_queries % o.micro_batches:
        _fail("optim.micro_batches", f"({o.micro_batches}) must divide the {mb_queries} queries "
              "of a mini-batch so every micro-batch holds whole groups.")
    if any(k < 1 or k > t.eval_n for k in t.eval_k):
        _fail("train.eval_k", f"{t.eval_k}: every k must be in [1, train.eval_n={t.eval_n}].")
    if num_devices is not None:
        shape = list(cfg.mesh.shape)
        known = math.prod(s for s in shape if s != -1)
        if known > num_devices or (-1 in shape and num_devices % known):
            _fail("mesh.shape", f"{tuple(shape)} does not fit the {num_devices} available devices.")
        data_par = (num_devices // known if -1 in shape[:2] else 1) * math.prod(
            s for s in shape[:2] if s != -1)
        micro_rows = rows // o.num_minibatches // o.micro_batches
        if micro_rows % data_par:
            _fail("optim.micro_batches", f"a micro-batch has {micro_rows} rows, which is not "
                  f"divisible by the data-parallel size {data_par}; change train.batch_size, "
                  "rollout.group_size or the mesh.")
        if samples_with_a_pool(cfg) and r.slots % data_par:
            name = r.engine if r.engine != "auto" else "continuous or paged"
            _fail("rollout.slots", f"is {r.slots}, not a multiple of the data-parallel size "
                  f"{data_par}: the {name} engine's slots lie over the data axes; "
                  f"set it to {-(-r.slots // data_par) * data_par}.")
        if r.kv_pages % data_par:
            _fail("rollout.kv_pages", f"is {r.kv_pages}, not a multiple of the data-parallel "
                  f"size {data_par}: each data shard holds its own pages; set it to "
                  f"{-(-r.kv_pages // data_par) * data_par}.")
    return cfg


# ----------------------------------------------------------------------------- overrides


def _convert(text: str, typ, field: str):
    origin = typing.get_origin(typ)
    if typ is bool:
        if text.lower() in ("1", "true", "yes", "on"):
            return True
        if text.lower() in ("0", "false", "no", "off"):
            return False
        _fail(field, f"expects true/false, got {text!r}.")
    if origin in (types.UnionType, typing.Union):
        args = [x for x in typing.get_args(typ) if x is not type(None)]
        if text.lower() in ("none", "null"):
            return None
        return _convert(text, args[0], field)
    if origin is tuple:
        items = [s for s in text.strip("()[] ").split(",") if s.strip()]
        args = typing.get_args(typ)
        item_t = args[0] if args else str
        return tuple(_convert(s.strip(), item_t, field) for s in items)
    try:
        return typ(text)
    except (TypeError, ValueError):
        _fail(field, f"expects {getattr(typ, '__name__', typ)}, got {text!r}.")


def apply_overrides(cfg, overrides: list[str]):
    """Return cfg with `a.b.c=value` overrides applied (typed by the dataclass).
    The loss section is checked once all are applied and the method is
    resolved (`check_loss`), so their order never changes the verdict."""
    with deferred_validation():
        for item in overrides:
            if "=" not in item:
                raise ConfigError(f"override {item!r} has no '=': write section.field=value "
                                  "(e.g. train.steps=10).")
            path, text = item.split("=", 1)
            cfg = _replace_path(cfg, path.strip().split("."), text.strip(), path.strip())
    if overrides and isinstance(cfg, RunConfig):
        check_loss(cfg)
    return cfg


def check_loss(cfg: RunConfig) -> None:
    """The loss section's own checks (LossConfig.validate) on the method-resolved
    config, as a ConfigError naming the field (`config field loss.<name>: ...`)."""
    from erpo_jax.train.methods import resolve_method
    with deferred_validation():
        lc = resolve_method(cfg).loss
    try:
        lc.validate()
    except ValueError as e:
        msg = str(e)
        m = re.match(r"LossConfig\.(\w+)", msg)
        if m and m.group(1) in {f.name for f in dataclasses.fields(LossConfig)}:
            rest = msg[len("LossConfig."):]
            rest = rest[len(m.group(1)):].lstrip() if rest[len(m.group(1))] == " " else rest
            _fail(f"loss.{m.group(1)}", rest.replace("LossConfig.", "loss."))
        _fail("loss", msg)


def _replace_path(obj, parts: list[str], text: str, full: str):
    hints = typing.get_type_hints(type(obj))
    name = parts[0]
    if full in REMOVED_FIELDS:
        _fail(full, f"was removed ({REMOVED_FIELDS[full]}); drop it from the command line.")
    if name not in hints:
        fields = ", ".join(f.name for f in dataclasses.fields(obj))
        _fail(full, f"{type(obj).__name__} has no field {name!r} (fields: {fields}).")
    if len(parts) == 1:
        value = _convert(text, hints[name], full)
    else:
        value = _replace_path(getattr(obj, name), parts[1:], text, full)
    try:
        return dataclasses.replace(obj, **{name: value})
    except ValueError as e:
        _fail(full, str(e))


# Fields that once existed and were removed: a config.json written before still
# loads (they are dropped, with what they did), an override of one is refused.
REMOVED_FIELDS = {
    "train.log_every": "nothing read it: every step's metrics are logged",
    "train.samples_per_eval": "nothing read it: train.eval_n sets the samples per problem",
}


# Top-level keys of a run's config.json that record what a start found, not
# fields to set: from_dict skips them (so config.json loads as a config again).
RECORDED_KEYS = {
    "data_rows": "the rows the run trains on, holds out and dropped (Task.data_rows)",
}


def from_dict(cls, data: dict, prefix: str = ""):
    """Build a (nested) config dataclass from a dict, e.g. a saved config.json;
    a value of the wrong type, or an unknown field, names its dotted field."""
    if not isinstance(data, dict):
        _fail(prefix.rstrip(".") or "(the whole config)",
              f"is a section ({cls.__name__}), expected an object of fields, got {data!r}.")
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for k, v in data.items():
        name = f"{prefix}{k}"
        if name in REMOVED_FIELDS or (not prefix and name in RECORDED_KEYS):
            continue
        if k not in hints:
            _fail(name if prefix else f"{cls.__name__}.{k}", "is not a known field.")
        t = hints[k]
        if dataclasses.is_dataclass(t):
            v = from_dict(t, v, name + ".")
        elif not _fits(v, t):
            _fail(name, f"expects {_type_name(t)}, got {v!r}.")
        elif isinstance(v, list):
            v = tuple(v)
        kwargs[k] = v
    try:
        with deferred_validation():   # the loss is checked whole, method resolved
            out = cls(**kwargs)
        if cls is RunConfig:
            check_loss(out)
        return out
    except (TypeError, ValueError) as e:   # a section's own check (e.g. LossConfig)
        if isinstance(e, ConfigError):
            raise
        _fail(prefix.rstrip(".") or cls.__name__, str(e))


def load_experiment(path: str | Path) -> types.ModuleType:
    """Import an experiment file by path (experiments/ is not a package)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist (or is not a file); give --config "
                          "an experiment .py file or a config.json.")
    spec = importlib.util.spec_from_file_location(f"erpo_experiment_{path.stem}", path)
    mod = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(mod)
    except SyntaxError as e:
        raise ConfigError(f"config file {path} has a syntax error at line {e.lineno}: "
                          f"{e.msg}.") from None
    except Exception as e:  # noqa: BLE001 - the user's file: one sentence naming it
        raise ConfigError(f"config file {path} failed to import ({type(e).__name__}: "
                          f"{e}).") from None
    return mod


def load_config(path: str | None, overrides: list[str] = (), cpu: bool = False) -> RunConfig:
    """Load an experiment file (.py with get_config / get_cpu_config, or .json).
    `cpu` needs the file's get_cpu_config (a .json config has none)."""
    if path is None:
        if cpu:
            raise ConfigError("--cpu picks the config file's get_cpu_config(), but no --config "
                              "was given; drop --cpu or pass --config FILE.")
        cfg = RunConfig()
    elif str(path).endswith(".json"):
        if cpu:
            raise ConfigError(f"--cpu picks a config file's get_cpu_config(), but {path} is a "
                              "JSON config; drop --cpu.")
        if not Path(path).is_file():
            raise ConfigError(f"config file {path} does not exist (or is not a file).")
        try:
            data = json.loads(Path(path).read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"config file {path} is not valid JSON ({e}).") from None
        try:
            cfg = from_dict(RunConfig, data)
        except ConfigError as e:
            raise ConfigError(f"{str(e).rstrip('.')} (in {path}).") from None
    else:
        mod = load_experiment(path)
        name = "get_cpu_config" if cpu else "get_config"
        getter = getattr(mod, name, None)
        if getter is None:
            hint = " (drop --cpu to use its get_config())" if cpu and hasattr(
                mod, "get_config") else ""
            raise ConfigError(f"config file {path} defines no {name}(){hint}.")
        cfg = getter()
        if not isinstance(cfg, RunConfig):
            raise ConfigError(f"config file {path}: {name}() returned a "
                              f"{type(cfg).__name__}, not a RunConfig.")
        try:
            _check_types(cfg)
        except ConfigError as e:
            raise ConfigError(f"{str(e).rstrip('.')} (in {path} {name}()).") from None
    return apply_overrides(cfg, list(overrides))


def config_dict(cfg: RunConfig) -> dict:
    """The config as the JSON that config.json holds (tuples as lists)."""
    return json.loads(json.dumps(cfg.to_dict(), default=list))


def normalized(data: dict) -> dict:
    """A saved config.json with fields added since it was written at their
    defaults (and without its RECORDED_KEYS)."""
    data = {k: v for k, v in data.items() if k not in RECORDED_KEYS}
    try:
        return config_dict(from_dict(RunConfig, data))
    except (TypeError, ValueError):
        return data


def save_config(cfg: RunConfig, path) -> None:
    from erpo_jax.runtime.rundir import write_json
    write_json(path, config_dict(cfg), indent=2, sort_keys=True)


def load_any(path: str | None, overrides=(), cpu=False) -> Any:
    return load_config(path, overrides, cpu)

