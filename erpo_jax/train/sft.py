"""Supervised fine-tuning on (prompt, solution) pairs: the warm start before RL.

Loss: token-mean cross-entropy on the solution tokens only (the prompt, chat
template included, is context). A solution ends with the chat template's turn
end (Qwen: <|im_end|>) under data.template='chat', else with the EOS. Same
mesh, optimizer, checkpoints and metrics as RL. The result is written as a Hugging Face directory (`<out_dir>/model`, plus the tokenizer),
which RL loads with `model.init='sft'` as both policy and reference.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from erpo_jax.runtime import xla_options
from erpo_jax.data.iterator import QueryBatchIterator
from erpo_jax.model.logprobs import token_logprobs
from erpo_jax.train import checkpoint as ckpt_lib
from erpo_jax.train import startup
from erpo_jax.train import train_step as step_lib
from erpo_jax.runtime import rundir
from erpo_jax.runtime.run_lock import RunLock
from erpo_jax.runtime.progress import progress_bar
from erpo_jax.train.config import RunConfig, config_dict, normalized
from erpo_jax.train.evaluate import Evaluator, keep_evals, write_eval
from erpo_jax.train.metrics import MetricsWriter
from erpo_jax.train.policy import MODEL_SUBDIR, export_policy


def sft_examples(task, tokenizer) -> tuple[list[list[int]], list[int]]:
    """(token ids of prompt + solution + EOS, prompt length) per training problem."""
    seqs, plens = [], []
    for p, prompt in zip(task.train, task.train_prompts):
        if p.solution is None:
            raise ValueError(f"SFT needs a worked solution, but problem {p.id} has none; "
                             "use data.answer_format=gsm8k or boxed (worked-solution answers) "
                             "or name a field of solutions in data.solution_field.")
        seqs.append(prompt + task.target(p.solution))
        plens.append(len(prompt))
    return seqs, plens


def pack(seqs, plens, idx, width: int, pad_id: int):
    """tokens int32[B, width] (right-padded), attn bool[B, width], loss mask bool[B, width-1]."""
    B = len(idx)
    tokens = np.full((B, width), pad_id, np.int32)
    attn = np.zeros((B, width), bool)
    target = np.zeros((B, width - 1), bool)
    for r, i in enumerate(idx):
        s = seqs[i]
        if len(s) > width:
            raise ValueError(f"SFT example {i} has {len(s)} tokens, more than the packing "
                             f"width {width}.")
        tokens[r, :len(s)], attn[r, :len(s)] = s, True
        target[r, plens[i] - 1:len(s) - 1] = True  # predict solution tokens (and EOS)
    return tokens, attn, target


def run_sft(cfg: RunConfig) -> dict:
    """Train, evaluate, export. Resumes from `<out_dir>/checkpoints` if present."""
    if cfg.model.lora_rank:
        from erpo_jax.train.config import ConfigError
        raise ConfigError(f"config field model.lora_rank: is {cfg.model.lora_rank}, but "
                          "`erpo sft` trains the whole model; LoRA is for `erpo train` (RL). "
                          "Set model.lora_rank=0 for SFT.")
    run: dict = {}

    def claim(cfg: RunConfig, sharding) -> None:
        """Between the config checks and the model load: the batch against the
        mesh, the run directory's lock, the config against the run it resumes."""
        t = cfg.train
        if t.batch_size % sharding.data_size:
            raise ValueError(f"config field train.batch_size: {t.batch_size} SFT sequences per "
                             f"step are not divisible by the data-parallel size "
                             f"{sharding.data_size}.")
        run["dir"] = run_dir = rundir.path(t.out_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        run["primary"] = primary = jax.process_index() == 0
        if primary:   # one run per directory
            run["lock"] = RunLock(run_dir, "erpo sft")
        run["ckpt"] = ckpt = ckpt_lib.Checkpointer(run_dir / "checkpoints", t.keep_checkpoints,
                                                   t.ckpt_every)
        run["latest"] = latest = ckpt.latest_step()
        if primary:
            # Checked now, written once the start has succeeded (_run_sft).
            run["config_record"] = rundir.check_config(
                run_dir, config_dict(cfg), normalized, start_step=latest or 0,
                resuming=latest is not None, allow_change=t.allow_config_change)

    started = None
    try:
        # SFT measures no drift; the rows it trains on are data.*'s alone.
        started = startup.start(cfg, policy="the starting model", claim=claim)
        return _run_sft(started, run["dir"], run["primary"], run["ckpt"], run["latest"],
                        run.get("config_record"))
    finally:
        if started is not None and started.task is not None:
            started.task.close()
        if "ckpt" in run:
            run["ckpt"].close()
        if "lock" in run:
            run["lock"].close()


def _run_sft(started: startup.Started, run_dir, primary: bool, ckpt, latest: int | None,
             config_record) -> dict:
    cfg, sharding, task = started.cfg, started.sharding, started.task
    model_cfg, params, tok = started.model_cfg, started.params, started.tokenizer
    t, o = cfg.train, cfg.optim
    seqs, plens = sft_examples(task, tok)
    width = max(8, 1 << (max(len(s) for s in seqs) - 1).bit_length())
    tx, schedule = step_lib.make_optimizer(o, t.steps)
    state = step_lib.init_state(params, tx, sharding=sharding)
    shardings = step_lib.shardings_of(state)

    def loss_fn(p, tokens, attn, target):
        lp = token_logprobs(p, model_cfg, tokens, attn, chunk_size=cfg.model.logprob_chunk,
                            sharding=sharding).logp
        n = jnp.maximum(jnp.sum(target), 1)
        return -jnp.sum(jnp.where(target, lp, 0.0)) / n

    @jax.jit
    def update(state, tokens, attn, target):
        loss, g = jax.value_and_grad(loss_fn)(state.params, tokens, attn, target)
        gnorm = jax.tree_util.tree_reduce(lambda a, x: a + jnp.sum(x * x), g, 0.0) ** 0.5
        ok = jnp.isfinite(loss) & jnp.isfinite(gnorm)
        upd, opt = tx.update(g, state.opt_state, state.params)
        new = state.replace(
            step=state.step + ok.astype(jnp.int32),
            params=step_lib._select(ok, jax.tree_util.tree_map(jnp.add, state.params, upd),
                                    state.params),
            opt_state=step_lib._select(ok, opt, state.opt_state),
            nonfinite=jnp.where(ok, 0, state.nonfinite + 1),
            skipped=state.skipped + (~ok).astype(jnp.int32))
        new = jax.lax.with_sharding_constraint(new, shardings)
        return new, {"loss": loss, "grad_norm": gnorm}

    update = jax.jit(update.__wrapped__, donate_argnums=(0,),
                     compiler_options=xla_options.for_steps())
    iterator = QueryBatchIterator(len(seqs), t.batch_size, t.seed)
    start = 0
    if latest is not None:
        state, meta = ckpt.restore(state)
        start = int(meta["step"])
        iterator.set_state(meta["data"])
    if primary:
        rundir.write_config(config_record, {"data_rows": task.data_rows()})
    writer = MetricsWriter(run_dir, primary, t.tensorboard)
    writer.truncate_after(start)
    put = lambda x: jax.device_put(x, sharding.named(("batch", None)))
    bar = None
    if t.progress and primary:
        bar = progress_bar(t.steps, start, desc=f"{cfg.name} (sft)")
    for step in range(start, t.steps):
        t0 = time.perf_counter()
        iterator.step = step
        tokens, attn, target = pack(seqs, plens, next(iterator), width, tok.pad_id)
        state, m = update(state, put(tokens), put(attn), put(target))
        row = {"sft_loss": float(m["loss"]), "grad_norm": float(m["grad_norm"]),
               "lr": float(schedule(step)), "time/step": time.perf_counter() - t0}
        writer.write(step + 1, row)
        if bar is not None:
            bar.set_postfix(loss=f"{row['sft_loss']:.4f}")
            bar.update(1)
        if int(state.nonfinite) >= t.max_nonfinite:
            raise FloatingPointError(f"{int(state.nonfinite)} consecutive non-finite SFT "
                                     "updates; lower optim.lr.")
        if (step + 1) % t.ckpt_every == 0 or step + 1 == t.steps:
            iterator.step = step + 1
            ckpt.save(step + 1, state, {"step": step + 1, "data": iterator.get_state()},
                      force=True)
    if bar is not None:
        bar.close()
    writer.close()
    result = Evaluator(model_cfg, task, cfg, sharding).evaluate(
        state.params, jax.random.key(t.seed), t.steps)
    if primary:
        keep_evals(run_dir, lambda s: s < t.steps)   # a rerun evaluates again
        write_eval(run_dir, result)
        export_policy(state.params, model_cfg, tok, cfg, run_dir / MODEL_SUBDIR)
    return {"eval": result, "model_dir": str(run_dir / MODEL_SUBDIR)}
