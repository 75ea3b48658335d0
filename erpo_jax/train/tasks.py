"""What a run trains and evaluates on: problems, prompts as token ids, the tokenizer, the reward.

Two tasks: the embedded arithmetic task (no download, a character tokenizer,
an exact integer checker, six held-out families as the evaluation sets), and
math JSONL data (a local training file, a tokenizer from the model directory,
math-verify in a process pool, the six benchmark files as evaluation sets).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from erpo_jax.data.problem import Problem
from erpo_jax.train.config import RunConfig

CHAR_TOKENIZER_FILE = "erpo_tokenizer.json"


class Tokenizer:
    """The tokenizer surface the trainer uses, over a char or an HF tokenizer."""

    def __init__(self, inner: Any, kind: str, generation_eos: tuple[int, ...] = (),
                 generation_pad: int | None = None):
        """generation_eos / generation_pad: the ids of the checkpoint's
        generation_config.json (HF only). A response stops at the tokenizer's
        EOS and at every one of them, as transformers' `generate` does (for
        Qwen chat models: <|im_end|> and <|endoftext|>)."""
        self.inner, self.kind = inner, kind
        if kind == "char":
            self.eos_ids = (inner.eos_id,)
            self.pad_id, self.bos_id = inner.pad_id, inner.bos_id
            self.vocab_size = inner.vocab_size
            self.identity = "char:" + inner.alphabet
        else:
            eos = inner.eos_token_id
            eos = list(eos) if isinstance(eos, (list, tuple)) else [eos]
            # The tokenizer's own EOS first (what a plain-template target ends with).
            self.eos_ids = tuple(dict.fromkeys(int(e) for e in [*eos, *generation_eos]
                                               if e is not None))
            if not self.eos_ids:
                raise ValueError("the tokenizer has no eos_token and generation_config.json no "
                                 "eos_token_id: rollouts would never stop; set eos_token in "
                                 "tokenizer_config.json.")
            pad = inner.pad_token_id if inner.pad_token_id is not None else generation_pad
            self.pad_id = int(pad if pad is not None else self.eos_ids[0])
            self.bos_id = inner.bos_token_id
            self.vocab_size = len(inner)
            blob = json.dumps(inner.get_vocab(), sort_keys=True).encode()
            self.identity = "hf:" + hashlib.sha256(blob).hexdigest()

    def encode_prompt(self, text: str) -> list[int]:
        if self.kind == "char":
            return self.inner.encode(text, add_bos=True)
        return list(self.inner(text, add_special_tokens=False)["input_ids"])

    def encode_target(self, text: str, end_id: int | None = None) -> list[int]:
        """Ids of a solution, `end_id` (default: the first EOS) appended (for SFT)."""
        if self.kind == "char":
            return self.inner.encode(text, add_eos=True)
        end = self.eos_ids[0] if end_id is None else end_id
        return list(self.inner(text, add_special_tokens=False)["input_ids"]) + [end]

    def turn_end_id(self) -> int | None:
        """The token the chat template closes an assistant turn with (Qwen:
        <|im_end|>) when it is one of the EOS ids, else None."""
        if self.kind == "char" or getattr(self.inner, "chat_template", None) is None:
            return None
        marker = "\u2063erpo\u2063"
        text = self.inner.apply_chat_template(
            [{"role": "user", "content": "q"}, {"role": "assistant", "content": marker}],
            tokenize=False)
        if not isinstance(text, str) or marker not in text:
            return None
        after = self.inner(text.rsplit(marker, 1)[1], add_special_tokens=False)["input_ids"]
        return int(after[0]) if after and int(after[0]) in self.eos_ids else None

    def decode_responses(self, ids: np.ndarray, mask: np.ndarray) -> list[str]:
        """Strings of response ids int[R, N], stopped at the first EOS."""
        from erpo_jax.rollout.decode import decode_responses
        ids = np.where(np.asarray(mask, bool), ids, self.pad_id)
        # Ids past the tokenizer (the model's vocabulary is padded, e.g. to a
        # multiple of 64) decode to nothing, as HF tokenizers do.
        ids = np.where(ids < self.vocab_size, ids, self.pad_id)
        if self.kind == "char":
            return self.inner.batch_decode(ids, stop_at_eos=True)
        return decode_responses(ids, self.eos_ids, tokenizer=self.inner, mask=mask,
                                skip_special_tokens=True)

    def save(self, directory: Path) -> None:
        if self.kind == "char":
            (directory / CHAR_TOKENIZER_FILE).write_text(json.dumps(
                {"type": "char", "alphabet": self.inner.alphabet}))
        else:
            self.inner.save_pretrained(str(directory))
            # generate() and our loader read the stop ids from here.
            gen = directory / "generation_config.json"
            spec = json.loads(gen.read_text()) if gen.is_file() else {}
            spec.update(eos_token_id=list(self.eos_ids), pad_token_id=self.pad_id)
            if self.bos_id is not None:
                spec["bos_token_id"] = int(self.bos_id)
            gen.write_text(json.dumps(spec, indent=2, sort_keys=True))


def load_tokenizer(directory: str | Path | None) -> Tokenizer:
    """The tokenizer saved in a model directory: our char tokenizer if it has
    erpo_tokenizer.json, else transformers' AutoTokenizer (local files only)."""
    from erpo_jax.data.char_tokenizer import CharTokenizer
    if directory is None:
        return Tokenizer(CharTokenizer(), "char")
    directory = Path(directory)
    f = directory / CHAR_TOKENIZER_FILE
    if f.is_file():
        spec = json.loads(f.read_text())
        return Tokenizer(CharTokenizer(spec["alphabet"]), "char")
    from erpo_jax.model.hf import generation_eos_ids
    from erpo_jax.model.hf import load_tokenizer as load_hf_tokenizer
    return Tokenizer(load_hf_tokenizer(directory), "hf", *generation_eos_ids(directory))


@dataclasses.dataclass
class Task:
    """Training problems with their prompt ids, evaluation sets and the reward."""

    name: str
    train: list[Problem]
    train_prompts: list[list[int]]
    eval_sets: dict[str, list[Problem]]
    tokenizer: Tokenizer
    template_id: str
    reward_fn: Callable[[Sequence[str], Sequence[str]], tuple[np.ndarray, list[str]]]
    close: Callable[[], None] = lambda: None

    def prompts(self, problems: Sequence[Problem]) -> list[list[int]]:
        return [self.tokenizer.encode_prompt(self.format(p)) for p in problems]

    format: Callable[[Problem], str] = lambda p: p.question
    # The held-out queries query drift is measured on (train.drift_every).
    drift_set: list[Problem] = dataclasses.field(default_factory=list)
    # The id a training target ends with (chat template: its turn end); None: the first EOS.
    target_end: int | None = None
    # What loading dropped: {'bad_rows': n, 'unparseable': n, 'first_ids': [...]}.
    load_report: dict = dataclasses.field(default_factory=dict)

    def target(self, solution: str) -> list[int]:
        """Token ids of a worked solution as an SFT target, terminator included."""
        return self.tokenizer.encode_target(solution, self.target_end)

    def data_rows(self) -> dict:
        """What the run trains and evaluates on, counted: the `data_rows` entry
        of its config.json (`config.RECORDED_KEYS`). Every row held out of
        training or dropped at load time is there, with the field that did it."""
        r = self.load_report
        return {"train": len(self.train),
                "held_out": dict(r.get("held_out", {})),
                "dropped": {k: r[k] for k in ("bad_rows", "unparseable", "timed_out")
                            if r.get(k)},
                "eval": {name: len(ps) for name, ps in self.eval_sets.items()}}


def _check_prompt_lengths(prompts: list[list[int]], problems: list[Problem], limit: int,
                          where: str) -> None:
    for p, ids in zip(problems, prompts):
        if len(ids) > limit:
            raise ValueError(f"{where}: problem {p.id} has a {len(ids)}-token prompt, longer than "
                             f"data.max_prompt_len={limit}; raise the limit or drop the problem.")


def load_task(cfg: RunConfig, tokenizer: Tokenizer, drift: bool = True) -> Task:
    """The task of `cfg.data`: its rows depend on `cfg.data` alone. drift: the
    caller measures query drift (`erpo train`), so a JSONL task with no
    held-out queries to measure it on (data.n_drift, evaluation sets,
    validation rows) is refused; `erpo sft` and `erpo eval` pass False."""
    d = cfg.data
    if d.task == "arithmetic":
        from erpo_jax.data import arithmetic
        from erpo_jax.rewards.arithmetic_reward import arithmetic_rewards
        splits = arithmetic.split(d.seed, d.n_train, d.n_test, n_val=d.n_val)
        train = splits.train
        if d.sft_slip:   # its own stream: the problems stay those of sft_slip=0
            rng = np.random.default_rng([d.seed, 2])
            train = [arithmetic.slipped(p, rng, d.sft_slip) for p in train]
        evals = ({f"val_{f}": ps for f, ps in splits.val.items()}
                 if cfg.train.eval_split == "validation" else dict(splits.test))
        task = Task("arithmetic", train, [], evals, tokenizer,
                    "arithmetic-v1", lambda texts, golds: arithmetic_rewards(
                        list(zip(texts, golds))))
        task.drift_set = _interleave(task.eval_sets)
    else:
        task = _load_jsonl_task(cfg, tokenizer, drift)
    task.train_prompts = task.prompts(task.train)
    _check_prompt_lengths(task.train_prompts, task.train, d.max_prompt_len, "training set")
    return task


def _interleave(sets: dict[str, list[Problem]]) -> list[Problem]:
    """One problem of each set in turn (every set is represented in a prefix)."""
    return [p for group in zip(*sets.values()) for p in group]


def _load_jsonl_task(cfg: RunConfig, tokenizer: Tokenizer, measure_drift: bool) -> Task:
    """A math JSONL file under data.answer_format, golds checked by math-verify
    at load time, rewards from the math-verify pool (config section `reward`)."""
    from erpo_jax.data.benchmarks import load_benchmark
    from erpo_jax.data.math_jsonl import drop_unparseable, load_training_file
    from erpo_jax.data.templates import format_prompt
    from erpo_jax.rewards.math_verify_pool import MathVerifyPool
    d, t, rw = cfg.data, cfg.train, cfg.reward
    lines: list[int] = []
    loaded = load_training_file(d.train_file, d.question_field, d.answer_field, d.answer_format,
                                solution_field=d.solution_field, skip_bad_rows=d.skip_bad_rows,
                                lines=lines)
    evals = {name: load_benchmark(name, d.benchmarks_dir).problems for name in d.eval_benchmarks}
    pool = MathVerifyPool(num_workers=rw.workers, timeout_s=rw.timeout_s)
    try:
        numeric = d.answer_format == "gsm8k"   # GSM8K's answers are numbers
        train, report = drop_unparseable(
            loaded.problems, pool.gold_reasons([p.answer for p in loaded.problems], numeric),
            f"data.train_file {d.train_file}", d.skip_bad_rows, lines=lines, path=d.train_file,
            numeric=numeric)
        report["bad_rows"] = loaded.skipped
        if report["bad_rows"] or report["unparseable"] or report.get("timed_out"):
            slow = (f" and {report['timed_out']} whose check ran out of time (reward.timeout_s)"
                    if report.get("timed_out") else "")
            print(f"{d.train_file}: dropped {report['bad_rows']} bad rows and "
                  f"{report['unparseable']} golds math-verify cannot parse{slow} (first ids: "
                  f"{report['first_ids']}); {len(train)} problems left (data.skip_bad_rows).",
                  flush=True)
        if d.n_val:
            if len(train) - d.n_val < t.batch_size:
                raise ValueError(
                    f"config field data.n_val: holding {d.n_val} validation rows out of "
                    f"{len(train)} leaves fewer than train.batch_size={t.batch_size} to train "
                    "on; lower data.n_val.")
            train, val = _hold_out(train, d.n_val, d.seed, stream=8)
            if t.eval_split == "validation":
                evals = {"validation": val}
        else:
            val = []
        held_out = {"validation (data.n_val)": d.n_val}
        if d.n_drift:   # its own held-out split: what trains depends on data fields only
            if d.n_drift >= len(train):
                raise ValueError(
                    f"config field data.n_drift: holds {d.n_drift} rows out of training to "
                    f"measure query drift on, but {d.train_file} has {len(train)} training "
                    "rows (after data.n_val); lower data.n_drift.")
            if len(train) - d.n_drift < t.batch_size:
                raise ValueError(
                    f"config field data.n_drift: holding {d.n_drift} rows out of training to "
                    f"measure query drift on leaves {len(train) - d.n_drift} of {len(train)}, "
                    f"fewer than train.batch_size={t.batch_size}; lower data.n_drift.")
            train, drift = _hold_out(train, d.n_drift, d.seed, stream=7)
            held_out["drift (data.n_drift)"] = d.n_drift
        else:
            drift = _interleave(evals) or val
        if measure_drift and t.drift_every > 0 and not drift:
            raise ValueError(
                f"config field data.n_drift: train.drift_every={t.drift_every} measures query "
                "drift on held-out queries, and this JSONL task has none (no "
                "data.eval_benchmarks, no data.n_val); set data.n_drift=64 to hold 64 rows out "
                "of training for it, add data.eval_benchmarks, or set train.drift_every=0.")
        if measure_drift and t.drift_every > 0 and t.drift_queries > len(drift):
            print(f"[erpo] WARNING: train.drift_queries={t.drift_queries} but the held-out "
                  f"drift set has {len(drift)} queries: drift is measured on {len(drift)} "
                  "(raise data.n_drift for more).", flush=True)
        held = [f"{n} for {what}" for what, n in held_out.items() if n]
        if held:   # every row kept out of training is counted, in the run's header
            report["held_out"] = {k: n for k, n in held_out.items() if n}
            print(f"[erpo] {d.train_file}: {len(train)} training rows; held out of training: "
                  f"{', '.join(held)}.", flush=True)
        if not train:
            raise ValueError(f"config field data.train_file: {d.train_file} has no usable "
                             "problems.")
    except BaseException:
        pool.close()
        raise
    inner = tokenizer.inner if tokenizer.kind == "hf" else None

    def fmt(p: Problem) -> str:
        return format_prompt(p.question, d.template, tokenizer=inner, instruction=d.instruction)

    def reward_fn(texts, golds):
        return pool.verify_batch(list(zip(texts, golds)), budget_s=rw.batch_budget_s)

    return Task("jsonl", train, [], evals, tokenizer, f"{d.template}:{d.instruction}",
                reward_fn, close=pool.close, format=fmt, drift_set=drift,
                target_end=tokenizer.turn_end_id() if d.template == "chat" else None,
                load_report=report)


def _hold_out(train: list[Problem], n: int, seed: int, stream: int) -> tuple[list, list]:
    """(training rows, n held-out rows), drawn by `seed` and `stream`."""
    order = np.random.default_rng([seed, stream]).permutation(len(train))
    held = set(order[:n].tolist())
    return ([p for i, p in enumerate(train) if i not in held],
            [train[i] for i in sorted(held)])
