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

    def __init__(self, inner: Any, kind: str):
        self.inner, self.kind = inner, kind
        if kind == "char":
            self.eos_ids = (inner.eos_id,)
            self.pad_id, self.bos_id = inner.pad_id, inner.bos_id
            self.vocab_size = inner.vocab_size
            self.identity = "char:" + inner.alphabet
        else:
            eos = inner.eos_token_id
            eos = eos if isinstance(eos, (list, tuple)) else [eos]
            self.eos_ids = tuple(int(e) for e in eos if e is not None)
            self.pad_id = int(inner.pad_token_id if inner.pad_token_id is not None
                              else self.eos_ids[0])
            self.bos_id = inner.bos_token_id
            self.vocab_size = len(inner)
            blob = json.dumps(inner.get_vocab(), sort_keys=True).encode()
            self.identity = "hf:" + hashlib.sha256(blob).hexdigest()

    def encode_prompt(self, text: str) -> list[int]:
        if self.kind == "char":
            return self.inner.encode(text, add_bos=True)
        return list(self.inner(text, add_special_tokens=False)["input_ids"])

    def encode_target(self, text: str) -> list[int]:
        """Ids of a solution, EOS appended (for SFT)."""
        if self.kind == "char":
            return self.inner.encode(text, add_eos=True)
        return list(self.inner(text, add_special_tokens=False)["input_ids"]) + [self.eos_ids[0]]

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
    from erpo_jax.model.hf import load_tokenizer as load_hf_tokenizer
    return Tokenizer(load_hf_tokenizer(directory), "hf")


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


def _check_prompt_lengths(prompts: list[list[int]], problems: list[Problem], limit: int,
                          where: str) -> None:
    for p, ids in zip(problems, prompts):
        if len(ids) > limit:
            raise ValueError(f"{where}: problem {p.id} has a {len(ids)}-token prompt, longer than "
                             f"data.max_prompt_len={limit}; raise the limit or drop the problem.")


def load_task(cfg: RunConfig, tokenizer: Tokenizer) -> Task:
    d = cfg.data
    if d.task == "arithmetic":
        from erpo_jax.data import arithmetic
        from erpo_jax.rewards.arithmetic_reward import arithmetic_rewards
        splits = arithmetic.split(d.seed, d.n_train, d.n_test)
        task = Task("arithmetic", splits.train, [], dict(splits.test), tokenizer,
                    "arithmetic-v1", lambda texts, golds: arithmetic_rewards(
                        list(zip(texts, golds))))
    else:
        from erpo_jax.data.benchmarks import load_benchmark, load_jsonl
        from erpo_jax.data.templates import format_prompt
        from erpo_jax.rewards.math_verify_pool import MathVerifyPool
        train = load_jsonl(d.train_file, d.question_field, d.answer_field,
                           source=Path(d.train_file).stem).problems
        evals = {name: load_benchmark(name, d.benchmarks_dir).problems
                 for name in d.eval_benchmarks}
        pool = MathVerifyPool()
        inner = tokenizer.inner if tokenizer.kind == "hf" else None

        def fmt(p: Problem) -> str:
            return format_prompt(p.question, d.template, tokenizer=inner,
                                 instruction=d.instruction)

        task = Task("jsonl", train, [], evals, tokenizer, f"{d.template}:{d.instruction}",
                    lambda texts, golds: pool.verify_batch(list(zip(texts, golds))),
                    close=pool.close, format=fmt)
    task.train_prompts = task.prompts(task.train)
    _check_prompt_lengths(task.train_prompts, task.train, d.max_prompt_len, "training set")
    return task
