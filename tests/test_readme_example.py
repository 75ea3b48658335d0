"""README.md's commands and its Python example stay true: the example runs,
as printed, on a tiny checkpoint built here, and every experiment file the
README or `erpo --help` names exists and loads."""

from __future__ import annotations

import re
from pathlib import Path

import jax
import numpy as np

from erpo_jax import cli
from erpo_jax.train.config import load_config, validate

from real_path import build_model, build_tokenizer, word_problems, write_generation_config

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _python_example() -> str:
    blocks = re.findall(r"```python\n(.*?)```", README, re.S)
    assert len(blocks) == 1, "README should hold one Python example"
    return blocks[0]


def test_the_python_example_runs_and_gives_an_erpo_gradient(tmp_path):
    rows = word_problems(64)
    tok = build_tokenizer(tmp_path, [r["question"] + r["answer"] for r in rows] +
                          ["What is 17 + 25? Please reason step by step"], vocab_size=300)
    build_model(tmp_path, vocab_size=320)
    write_generation_config(tmp_path, tok)
    code = _python_example()
    ckpt = re.search(r'ckpt, G = "([^"]+)"', code).group(1)
    scope: dict = {}
    exec(compile(code.replace(ckpt, str(tmp_path)), "README.md", "exec"), scope)
    G = scope["G"]
    assert scope["rewards"].shape == (G,) and len(scope["reasons"]) == G
    assert np.isfinite(float(scope["loss"]))
    # The Query-KL term ran on the cached reference (0 at the reference itself).
    assert abs(float(scope["metrics"]["query_kl_k3"])) < 1e-6
    norms = [float(np.linalg.norm(np.asarray(g))) for g in jax.tree_util.tree_leaves(
        scope["grads"])]
    assert all(np.isfinite(norms)) and max(norms) > 0


def test_every_experiment_file_the_docs_name_exists_and_loads():
    named = set(re.findall(r"experiments/\w+\.py", README + (cli.__doc__ or "")))
    assert "experiments/sft_arith.py" in named
    for rel in sorted(named):
        assert (ROOT / rel).is_file(), rel
        cfg = load_config(str(ROOT / rel))
        validate(cfg)
