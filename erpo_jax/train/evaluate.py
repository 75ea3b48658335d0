"""Evaluation: greedy pass@1 and sampled pass@k on every evaluation set.

pass@k uses the unbiased estimator 1 - C(n-c, k) / C(n, k) over n samples
per problem with c correct, averaged over problems.
"""

from __future__ import annotations

from math import comb
from typing import Any

import jax
import numpy as np

from erpo_jax.model.config import ModelConfig
from erpo_jax.model.sharding import Sharding
from erpo_jax.rollout.engine import engine_for
from erpo_jax.rollout.types import rollout_key
from erpo_jax.runtime import rundir
from erpo_jax.train.config import RunConfig
from erpo_jax.train.tasks import Task


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for one problem with c of n samples correct."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}.")
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


class Evaluator:
    """Runs the evaluation sets of a task with the run's 'eval greedy' and
    'eval sampled' engines (`rollout.engine.engine_for`; passed in as
    `samplers`, e.g. the Trainer's `Programs`', or built here)."""

    def __init__(self, model_cfg: ModelConfig, task: Task, cfg: RunConfig,
                 sharding: Sharding | None = None, max_problems: int | None = None,
                 samplers: tuple | None = None):
        t, tok = cfg.train, task.tokenizer
        self.task, self.cfg = task, cfg
        self.max_problems = max_problems or t.eval_max_problems
        self.greedy, self.sampled = samplers or tuple(
            engine_for(cfg, model_cfg, purpose, tok.eos_ids, tok.pad_id, sharding)
            for purpose in ("eval greedy", "eval sampled"))
        self.sets = {name: probs[:self.max_problems] for name, probs in task.eval_sets.items()}
        self.prompts = {name: task.prompts(probs) for name, probs in self.sets.items()}

    def evaluate(self, params, seed_key: jax.Array, step: int) -> dict[str, Any]:
        """{'sets': {name: {greedy_acc, pass@k..., n}}, 'average': {...}, 'samples': [...]}"""
        from erpo_jax.train.host import sample
        tok = self.task.tokenizer
        chunk = self.cfg.rollout.max_prompts_per_call
        results, samples = {}, []
        for i, (name, probs) in enumerate(self.sets.items()):
            golds = [p.answer for p in probs]
            out = sample(self.greedy, params, self.prompts[name], seed_key, chunk)
            texts = tok.decode_responses(out.response_tokens, out.response_mask)
            rewards, _ = self.task.reward_fn(texts, golds)
            res = {"greedy_acc": float(np.mean(rewards)), "n_problems": len(probs)}
            samples += [{"set": name, "id": p.id, "prompt": p.question, "response": s,
                         "gold": p.answer, "reward": float(rw)}
                        for p, s, rw in list(zip(probs, texts, rewards))[:2]]
            if self.sampled is not None:
                n = self.cfg.train.eval_n
                key = rollout_key(jax.random.fold_in(seed_key, i), step)
                out = sample(self.sampled, params, self.prompts[name], key, chunk)
                texts = tok.decode_responses(out.response_tokens, out.response_mask)
                rw, _ = self.task.reward_fn(texts, [g for g in golds for _ in range(n)])
                correct = rw.reshape(len(probs), n).sum(axis=1).astype(int)
                for k in self.cfg.train.eval_k:
                    res[f"pass@{k}"] = float(np.mean([pass_at_k(n, int(c), k) for c in correct]))
                res["sampled_acc"] = float(rw.mean())
            results[name] = res
        keys = sorted({k for r in results.values() for k in r if k != "n_problems"})
        average = {k: float(np.mean([r[k] for r in results.values() if k in r])) for k in keys}
        return {"step": step, "sets": results, "average": average, "samples": samples}


def write_eval(run_dir, result: dict) -> None:
    """Append to evals.jsonl and keep each as eval_<step>.json (local or gs://)."""
    run_dir = rundir.path(run_dir)
    rundir.write_json(run_dir / f"eval_{result['step']:06d}.json", result, indent=2)
    rundir.append_line(run_dir / "evals.jsonl",
                       {k: v for k, v in result.items() if k != "samples"})


def keep_evals(run_dir, keep) -> None:
    """Drop evals.jsonl rows (and eval_<step>.json files) of steps `keep` rejects:
    a resumed run rewrites the evaluations it redoes."""
    run_dir = rundir.path(run_dir)
    rundir.keep_steps(run_dir / "evals.jsonl", keep)
    for f in run_dir.glob("eval_*.json"):
        step = f.stem[len("eval_"):]
        if step.isdigit() and not keep(int(step)):
            f.unlink()
