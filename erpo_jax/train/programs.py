"""The Trainer's jitted programs, built from the config and abstract shapes.

Nothing here reads weights or data: the programs depend only on the config,
the model's shapes, the tokenizer's special ids and the mesh. `Trainer` calls
them on real arrays; `erpo plan` lowers the very same ones on
ShapeDtypeStructs (with their NamedShardings) for a TPU topology it does not
have, and the compile-ahead thread lowers them for the first step's shapes.

The programs of one RL run:
  rollout            the rollout engine's (`Engine.step_programs`: the static
                     engine's one call of max_prompts_per_call prompts, the
                     continuous engine's inserts and decode loops)
  reference forward  the Policy-KL reference's response log-probs (when it has one)
  update             the RL update: micro-batches, optimizer, donated state
  eval greedy / eval sampled   the evaluation engines' (their largest programs)
  reference pass     the one-time reference query pass (ref_batch_size rows)
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from erpo_jax.runtime import xla_options
from erpo_jax.model import model as model_lib
from erpo_jax.model.config import ModelConfig
from erpo_jax.model.sharding import Sharding
from erpo_jax.rl import critic as critic_lib
from erpo_jax.rl import reference as ref_lib
from erpo_jax.rl.batch import RLBatch
from erpo_jax.rl.recipe import recipe
from erpo_jax.rl.shaping import shaped_advantages
from erpo_jax.rollout.engine import engine_for
from erpo_jax.rollout.types import DecodeLoop, Engine
from erpo_jax.model import lora
from erpo_jax.train import train_step as step_lib
from erpo_jax.train.config import RunConfig


@dataclasses.dataclass(frozen=True)
class Program:
    """One program at the shapes it is planned for: `lower()` gives jax's Lowered."""

    name: str
    shapes: str            # a line saying which shapes (for the report)
    lower: object          # () -> jax.stages.Lowered
    rows: int = 0          # rows of the batch it processes
    tokens: int = 0        # tokens it processes (for FLOP accounting)
    # A rollout engine's program: its name within the engine ('insert Q',
    # 'decode n' of the continuous engine; '' when a call is one program),
    # the engine's use it belongs to ('rollout', 'eval greedy', ...), the
    # engine, and the decode loops whose steps `erpo plan` costs by themselves.
    part: str = ""
    group: str = ""
    engine: Any = None
    loops: tuple[DecodeLoop, ...] = ()

    def __post_init__(self):
        if not self.group:
            object.__setattr__(self, "group", self.name)


def _abstract(x, sharding=None):
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)


class Programs:
    """Every jitted program of an RL run of `cfg` (see the module docstring)."""

    def __init__(self, cfg: RunConfig, model_cfg: ModelConfig, sharding: Sharding | None,
                 eos_ids: Sequence[int], pad_id: int):
        self.cfg, self.model_cfg, self.sharding = cfg, model_cfg, sharding
        self.recipe = rec = recipe(cfg)
        o, a, lc, r, t = cfg.optim, cfg.algo, cfg.loss, cfg.rollout, cfg.train
        self.G, self.B = r.group_size, t.batch_size
        total = t.steps * o.epochs * o.num_minibatches
        self.tx, self.schedule = step_lib.make_optimizer(o, total)
        self.has_critic = rec.needs_critic
        self.critic_tx = (step_lib.make_optimizer(o, total, lr=a.critic_lr)[0]
                          if self.has_critic else None)
        self.state_shardings = (None if sharding is None else
                                step_lib.shardings_of(self.abstract_state()))
        chunk = cfg.model.logprob_chunk
        self.query_group, self.query_group_note = self._query_group()
        self.update = step_lib.build_update(
            model_cfg, lc, a, self.tx, self.critic_tx, micro_batches=o.micro_batches,
            group_size=self.G, temperature=r.temperature, chunk_size=chunk, sharding=sharding,
            state_shardings=self.state_shardings, schedule=self.schedule,
            response_width=r.max_new_tokens, share_query=self.query_group > 1, seed=t.seed)
        self.sampler, self.eval_greedy, self.eval_sampled = (
            engine_for(cfg, model_cfg, purpose, eos_ids, pad_id, sharding)
            for purpose in ("rollout", "eval greedy", "eval sampled"))
        # The reference is the base model: with LoRA, the policy's own base
        # weights under the base config (`reference_params`), never a copy.
        self.ref_cfg = ref_cfg = lora.base_config(model_cfg)
        logp_fn = lambda mc: step_lib.make_logprob_fn(mc, r.temperature, chunk, sharding,
                                                      row_chunks=o.micro_batches,
                                                      group_size=self.query_group)
        self.ref_logp_fn, self.policy_logp_fn = logp_fn(ref_cfg), logp_fn(model_cfg)
        self.t1_logp_fn = step_lib.make_logprob_fn(model_cfg, 1.0, chunk, sharding)
        self.ref_pass_fn = ref_lib.make_pass_fn(ref_cfg, chunk, sharding)
        self.shapes_rewards = rec.shapes_rewards
        self.advantages_fn = self._make_advantages_fn()
        self.values_fn = None
        if self.has_critic:
            self.values_fn = jax.jit(lambda c, tok, m: critic_lib.values(c, model_cfg, tok, m),
                                     compiler_options=xla_options.for_steps())

    def _query_group(self) -> tuple[int, str | None]:
        """(G, None) when the update and the reference forward run each group's
        query once (model.share_query), else (1, why not: None when it was
        not asked for). The query stream of a micro-batch (and of a reference
        row chunk) has one row per query, so those queries must split evenly
        over the data-parallel devices."""
        cfg, G = self.cfg, self.G
        if not cfg.model.share_query or G < 2:
            return 1, None
        o = cfg.optim
        queries = self.B // o.num_minibatches // o.micro_batches
        data = 1 if self.sharding is None else self.sharding.data_size
        if queries % data:
            return 1, (f"model.share_query is off for this run: a micro-batch holds {queries} "
                       f"queries, not a multiple of the data-parallel size {data}")
        return G, None

    # ------------------------------------------------------------------ state

    def abstract_params(self):
        """The policy's parameters as ShapeDtypeStructs in their shardings."""
        shapes = model_lib.abstract_params(self.model_cfg)
        if self.sharding is None:
            return shapes
        return jax.tree_util.tree_map(
            _abstract, shapes, model_lib.param_shardings(self.model_cfg, self.sharding))

    def abstract_state(self) -> step_lib.TrainState:
        """The TrainState as ShapeDtypeStructs with the shardings `init_state` commits."""
        params = self.abstract_params()
        critic = None
        if self.has_critic:
            critic = jax.eval_shape(lambda p: critic_lib.init_critic(
                self.model_cfg, jax.random.key(0), p), params)
            if self.sharding is not None:
                rep = self.sharding.replicated()
                critic = {"trunk": jax.tree_util.tree_map(lambda a, p: _abstract(a, p.sharding),
                                                          critic["trunk"], params),
                          "value_head": jax.tree_util.tree_map(lambda a: _abstract(a, rep),
                                                               critic["value_head"])}
        return jax.eval_shape(lambda p, c: self._state_from(p, c), params, critic) \
            if self.sharding is None else self._abstract_state_sharded(params, critic)

    def _state_from(self, params, critic):
        z = jnp.zeros((), jnp.int32)
        return step_lib.TrainState(
            step=z, params=params,
            opt_state=self.tx.init(step_lib.trainable(params, self.model_cfg)), critic=critic,
            critic_opt=None if critic is None else self.critic_tx.init(critic),
            nonfinite=z, skipped=z,
            kl_coef=None if self._kl_coef0() is None else jnp.zeros((), jnp.float32))

    def _abstract_state_sharded(self, params, critic):
        shapes = jax.eval_shape(self._state_from, params, critic)
        rep = self.sharding.replicated()

        def opt_like(opt, tx, p):  # moments follow their parameter; counters replicated
            return optax.tree_map_params(tx, lambda s, q: _abstract(s, q.sharding), opt, p,
                                         transform_non_params=lambda s: _abstract(s, rep))

        return shapes.replace(
            step=_abstract(shapes.step, rep), params=params,
            opt_state=opt_like(shapes.opt_state, self.tx,
                               step_lib.trainable(params, self.model_cfg)),
            critic=critic,
            critic_opt=None if critic is None else opt_like(shapes.critic_opt, self.critic_tx,
                                                            critic),
            nonfinite=_abstract(shapes.nonfinite, rep), skipped=_abstract(shapes.skipped, rep),
            kl_coef=None if shapes.kl_coef is None else _abstract(shapes.kl_coef, rep))

    def init_state(self, params, critic=None) -> step_lib.TrainState:
        """A fresh state for loaded parameters, committed to `state_shardings`."""
        return step_lib.init_state(params, self.tx, critic, self.critic_tx, self.sharding,
                                   shardings=self.state_shardings, kl_coef=self._kl_coef0(),
                                   model_cfg=self.model_cfg)

    def reference_params(self, params):
        """The reference's parameters in the policy's `params`: with LoRA its
        base (the same buffers; the reference is the base with the adapters
        off), else `params` itself (the Trainer keeps a copy of the start)."""
        return lora.base(params) if self.model_cfg.lora_rank else params

    def init_state_kl_coef(self):
        """A fresh adaptive coefficient (loss.beta_policy), placed as
        `init_state` places it (None: not adaptive)."""
        b = self._kl_coef0()
        if b is None:
            return None
        where = (self.state_shardings.kl_coef if self.state_shardings is not None else None)
        return jax.device_put(np.float32(b), where)

    def _kl_coef0(self) -> float | None:
        """The adaptive Policy-KL coefficient's start (None: not adaptive)."""
        return self.cfg.loss.beta_policy if self.recipe.adaptive_kl else None

    # ------------------------------------------------------------------ shapes

    def _rows(self, rows: int, *shape, dtype=jnp.float32):
        logical = ("batch", None)[:1 + len(shape)]
        sh = None if self.sharding is None else self.sharding.named(logical)
        return jax.ShapeDtypeStruct((rows, *shape), dtype, sharding=sh)

    def update_arguments(self, state, T: int):
        """Abstract (state, mini-batch, critic batch) of one update call on
        rollouts of width T (prompt bucket + max_new_tokens)."""
        o = self.cfg.optim
        rows = self.B // o.num_minibatches * self.G
        arg = lambda dtype, *shape: self._rows(rows, *shape, dtype=dtype)
        f32, tok = lambda: arg(jnp.float32, T - 1), lambda: arg(jnp.bool_, T - 1)
        per_token = self.recipe.token_level
        batch = RLBatch(
            tokens=arg(jnp.int32, T), attn_mask=arg(jnp.bool_, T), query_mask=tok(),
            response_mask=tok(), old_logp=f32(),
            advantages=f32() if per_token else arg(jnp.float32),
            ref_query_logp=f32(), query_weight=arg(jnp.float32), group_id=arg(jnp.int32),
            ref_logp=f32() if self.recipe.needs_ref_logp else None)
        critic = step_lib.CriticBatch(f32(), f32()) if self.has_critic else None
        state = jax.tree_util.tree_map(lambda a: _abstract(a, getattr(a, "sharding", None)),
                                       state)
        return state, batch, critic

    def lower_reference_forward(self, params, T: int):
        rows = self.B * self.G
        return self.ref_logp_fn.lower(self.reference_params(params),
                                      self._rows(rows, T, dtype=jnp.int32),
                                      self._rows(rows, T, dtype=jnp.bool_),
                                      last=self.cfg.rollout.max_new_tokens)

    def lower_advantages(self, T: int):
        R = self.B * self.G
        logp = jax.ShapeDtypeStruct((R, T - 1), jnp.float32)
        token = (logp, logp) if self.shapes_rewards else (None, None)
        return self.advantages_fn.lower(jax.ShapeDtypeStruct((R,), jnp.float32),
                                        jax.ShapeDtypeStruct((R, T - 1), jnp.bool_), *token,
                                        self._beta_arg())

    def _beta_arg(self):
        """The shaping's coefficient argument: the state's kl_coef (float32[])
        when it is adaptive and in the reward, else None."""
        rec = self.recipe
        return (jax.ShapeDtypeStruct((), jnp.float32)
                if rec.adaptive_kl and rec.shapes_rewards else None)

    def planned(self) -> list[Program]:
        """Every per-step program at its largest shapes: prompts at
        data.max_prompt_len, rollouts of rollout.max_prompts_per_call prompts
        (train.batch_size when 0), the reference pass at train.ref_batch_size."""
        cfg, r, G, B = self.cfg, self.cfg.rollout, self.G, self.B
        state = self.abstract_state()
        params = state.params
        P_max, N = cfg.data.max_prompt_len, r.max_new_tokens
        per_call = r.max_prompts_per_call or B
        Bp, P = self.sampler.batch_shape(per_call, P_max)
        T = P + N
        out = self._engine_programs("rollout", self.sampler, params)
        if self.recipe.needs_ref_logp:
            out.append(Program("reference forward", f"{B * G} rows x {T} tokens",
                               lambda: self.lower_reference_forward(params, T), B * G, B * G * T))
        rows = B // cfg.optim.num_minibatches * G
        out.append(Program(
            "update", f"{rows} rows x {T} tokens in {cfg.optim.micro_batches} micro-batches",
            lambda: self.update.lower(*self.update_arguments(state, T)), rows, rows * T))
        for name, s in (("eval greedy", self.eval_greedy), ("eval sampled", self.eval_sampled)):
            if s is not None:
                out += self._engine_programs(name, s, params, brief=True)
        rb, width = cfg.train.ref_batch_size, ref_lib.bucket(P_max + 1)
        out.append(Program("reference pass", f"{rb} queries x {width} tokens",
                           lambda: self.ref_pass_fn.lower(
                               self.reference_params(params),
                               self._rows(rb, width, dtype=jnp.int32),
                               self._rows(rb, width, dtype=jnp.bool_)), rb, rb * width))
        return out

    def _engine_programs(self, name: str, engine: Engine, params,
                         brief: bool = False) -> list[Program]:
        """The programs a rollout engine runs for a step's train.batch_size
        prompts of data.max_prompt_len tokens, in calls of
        rollout.max_prompts_per_call (`Engine.step_programs`; brief: the
        largest of each kind), named '<name> <part>' (or `name` when a call
        is one program)."""
        parts = engine.step_programs(params, self.B, self.cfg.data.max_prompt_len,
                                     self.cfg.rollout.max_prompts_per_call, brief)
        return [Program(f"{name} {p.part}" if p.part else name, p.shapes, p.lower, p.rows,
                        p.tokens, part=p.part, group=name, engine=engine, loops=p.loops)
                for p in parts]

    # ------------------------------------------------------------------ small programs

    def _make_advantages_fn(self):
        """Jitted `shaping.shaped_advantages` (rewards float32[R], response_mask,
        old_logp, ref_logp) -> (shaped rewards, advantages or None for GAE): the
        Policy-KL reward shaping (policy_kl_mode 'reward'; old_logp and ref_logp
        are None otherwise) and the estimator, as one program that compiles
        ahead rather than as a dozen eager ops that would each compile in the
        first step. beta: the adaptive coefficient (TrainState.kl_coef) when
        the penalty in the reward is adaptive, else None."""
        lc, a, G = self.cfg.loss, self.cfg.algo, self.G

        def advantages_fn(rewards, response_mask, old_logp, ref_logp, beta=None):
            return shaped_advantages(rewards, response_mask, old_logp, ref_logp, loss_cfg=lc,
                                     algo=a, group_size=G, beta=beta)

        return jax.jit(advantages_fn, compiler_options=xla_options.for_steps())
