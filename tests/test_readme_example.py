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


def _real_path_recipe() -> list[list[str]]:
    """The README's real-path block (`erpo sft model.init=hf ...`, then `erpo
    train`), each command's arguments as a shell would split them."""
    import shlex
    block = next(b for b in re.findall(r"```bash\n(.*?)```", README, re.S)
                 if "erpo sft   model.init=hf" in b)
    joined = block.replace("\\\n", " ")
    return [shlex.split(line, comments=True) for line in joined.splitlines() if line.strip()]


def test_the_real_path_recipe_loads_its_task_as_printed(tmp_path, monkeypatch):
    """The README's real-path recipe, as printed with only its paths
    substituted (a tiny Qwen2.5-architecture checkpoint with a chat template,
    a GSM8K-style JSONL): each command validates and loads its task, the
    chat-templated prompts and the six benchmarks within the prompt length it
    sets (the recipe once failed here: templated prompts are longer than the
    default data.max_prompt_len)."""
    import shutil

    from benchmark_files import benchmarks_dir, require
    from erpo_jax.train.tasks import load_task, load_tokenizer
    from real_path import build_checkpoint, write_jsonl
    bench = benchmarks_dir()
    require(bench)
    problems = word_problems(64)
    base = build_checkpoint(tmp_path / "base", bench, problems)
    write_jsonl(problems, tmp_path / "gsm8k_train.jsonl")
    monkeypatch.chdir(tmp_path)   # the recipe's relative paths: runs/..., the JSONL
    paths = {"/local/Qwen2.5-Math-1.5B-Instruct": str(base)}
    commands = _real_path_recipe()
    assert [c[:2] for c in commands] == [["erpo", "sft"], ["erpo", "train"]], commands
    shutil.copytree(base, tmp_path / "runs" / "sft-gsm8k" / "model")   # what erpo sft exports
    def substitute(arg: str) -> str:
        field, _, value = arg.partition("=")
        return f"{field}={paths[value]}" if value in paths else arg

    for argv in commands:
        # The benchmarks' default directory is relative to the checkout: a path too.
        overrides = [*map(substitute, argv[2:]), f"data.benchmarks_dir={bench}"]
        cfg = validate(load_config(None, overrides))
        task = load_task(cfg, load_tokenizer(cfg.model.path), drift=argv[1] == "train")
        assert len(task.train) == len(problems) - (cfg.train.drift_queries
                                                   if argv[1] == "train" and not task.eval_sets
                                                   else 0)
        if argv[1] == "train":
            assert sorted(task.eval_sets) == sorted(cfg.data.eval_benchmarks)


def test_every_command_of_the_using_it_block_parses_and_its_config_validates():
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
