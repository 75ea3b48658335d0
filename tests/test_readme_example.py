"""README.md's commands and its Python example stay true: the example runs,
as printed, on a tiny checkpoint built here, and every experiment file the
README or `erpo --help` names exists and loads."""

from __future__ import annotations

import re
from pathlib import Path

import jax
import numpy as np

from erpo_jax import cli
from erpo_jax.data.benchmarks import BENCHMARKS
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


def _real_path_recipe() -> list[list[str]]:
    """The README's real-path block (`erpo sft model.init=hf ...`, then `erpo
    train`), each command's arguments as a shell would split them."""
    import shlex
    block = next(b for b in re.findall(r"```bash\n(.*?)```", README, re.S)
                 if "erpo sft   model.init=hf" in b)
    joined = block.replace("\\\n", " ")
    return [shlex.split(line, comments=True) for line in joined.splitlines() if line.strip()]


# What the recipe runs test sizes with: appended to each command as printed,
# which sets every other field (the fields here are all of what is added).
RECIPE_SCALE = ["train.steps=1", "train.batch_size=8", "rollout.group_size=2",
                "rollout.max_new_tokens=8", "train.eval_max_problems=1", "train.eval_n=1",
                "reward.workers=1", "train.progress=false", "train.tensorboard=false",
                "train.drift_queries=4"]


def test_the_real_path_recipe_runs_as_printed(tmp_path, monkeypatch, capsys):
    """The README's real-path recipe run through the CLI, each command as
    printed with its paths substituted and only RECIPE_SCALE's sizes added:
    `erpo sft` exports runs/sft-gsm8k/model, `erpo train` starts from it (the
    next command's model.path), evaluates on the six benchmarks and exports
    runs/train/model, as the recipe's comment says. (The recipe once failed
    here: its chat-templated prompts are longer than the default
    data.max_prompt_len.)"""
    import json

    from benchmark_files import benchmarks_dir, require
    from real_path import build_checkpoint, write_jsonl
    bench = benchmarks_dir()
    require(bench)
    problems = word_problems(32)
    base = build_checkpoint(tmp_path / "base", bench, problems)
    write_jsonl(problems, tmp_path / "gsm8k_train.jsonl")
    monkeypatch.chdir(tmp_path)
    paths = {"/local/Qwen2.5-Math-1.5B-Instruct": str(base)}
    for argv in _real_path_recipe():
        args = [f"{a.partition('=')[0]}={paths[a.partition('=')[2]]}"
                if a.partition("=")[2] in paths else a for a in argv[1:]]
        assert cli.main([*args, f"data.benchmarks_dir={bench}", *RECIPE_SCALE]) == 0, argv
    out = capsys.readouterr().out
    assert (tmp_path / "runs" / "sft-gsm8k" / "model" / "config.json").is_file()
    assert (tmp_path / "runs" / "train" / "model" / "config.json").is_file(), out[-2000:]
    evals = [json.loads(x) for x in
             (tmp_path / "runs" / "train" / "evals.jsonl").read_text().splitlines()]
    assert sorted(evals[-1]["sets"]) == sorted(BENCHMARKS)


def test_every_command_of_the_using_it_block_parses_and_its_config_validates(monkeypatch,
                                                                             capsys):
    """Each `erpo` line of the README's "Using it" block, as printed (FILE and
    runs/x/model stand for a path the reader has): the command line parses,
    and its config file with its overrides loads and validates (--cpu where
    the line asks for it). Running them is the experiments' own tests' job
    (a full SFT, training runs, a TPU plan, the tunix peer)."""
    import shlex
    block = next(b for b in re.findall(r"```bash\n(.*?)```", README, re.S)
                 if "erpo sft   --config" in b)
    lines = [shlex.split(x, comments=True) for x in block.splitlines()]
    lines = [x for x in lines if x]
    assert [x[1] for x in lines] == ["sft", "train", "eval", "inspect-grads", "plan", "bench",
                                     "config"], lines
    for argv in lines:
        argv = [("experiments/main_comparison.py" if a == "FILE" else a) for a in argv]
        args = cli._parse(argv[1:])
        assert args.command == argv[1]
        if getattr(args, "config", None):
            cfg = load_config(str(ROOT / args.config), getattr(args, "overrides", None) or [],
                              cpu=getattr(args, "cpu", False))
            validate(cfg)
    # The one line that runs in a moment runs here, from the checkout as printed.
    config_line = next(x for x in lines if x[1] == "config")
    monkeypatch.chdir(ROOT)
    assert cli.main(config_line[1:]) == 0
    shown = capsys.readouterr().out
    assert "loss.beta_query" in shown and "rollout.engine" in shown
