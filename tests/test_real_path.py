"""The real-model path end to end on the CPU, as a researcher runs it on a TPU.

One module fixture builds a Qwen2.5-architecture checkpoint with a byte-level
BPE tokenizer, a chat template and a generation_config.json (tests/real_path.py),
writes a math JSONL of word problems with GSM8K-style answers, then runs
`erpo sft` on it (chat template, loss on the response), `erpo train
model.init=sft data.task=jsonl` three ways (GRPO + Policy-KL, no KL, ERPO) and
`erpo eval` of the exported ERPO policy (of each, with ERPO_REAL_PATH_DIR) on
the six benchmark files.

Set ERPO_REAL_PATH_DIR=DIR to keep the runs in DIR and write DIR/SUMMARY.md
(the per-method table); ERPO_REAL_PATH_RL_STEPS / ERPO_REAL_PATH_SFT_STEPS
lengthen the runs.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np
import pytest

from erpo_jax import cli
from erpo_jax.data.benchmarks import BENCHMARKS

from benchmark_files import benchmarks_dir, require
from real_path import build_checkpoint, word_problems, write_jsonl

BENCH_DIR = benchmarks_dir()   # $ERPO_BENCHMARKS_DIR or ../shared/data/benchmarks
RL_STEPS = int(os.environ.get("ERPO_REAL_PATH_RL_STEPS", "6"))
SFT_STEPS = int(os.environ.get("ERPO_REAL_PATH_SFT_STEPS", "60"))
METHODS = ("grpo_policy_kl", "no_kl", "erpo")   # algo.method: beta 0.04 / none / 0.1
N_PROBLEMS = 256


def _common(root: Path, model: Path) -> list[str]:
    return ["data.task=jsonl", f"data.train_file={root / 'train.jsonl'}",
            "data.answer_format=gsm8k", "data.template=chat", "data.max_prompt_len=128",
            f"data.benchmarks_dir={BENCH_DIR}", f"model.path={model}",
            "rollout.max_new_tokens=32", "train.progress=false", "train.eval_every=0"]


def _rows(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def real_path(tmp_path_factory):
    require(BENCH_DIR)   # fails in CI when the benchmark files are missing, else skips
    keep = os.environ.get("ERPO_REAL_PATH_DIR")
    root = Path(keep) if keep else tmp_path_factory.mktemp("real_path")
    root.mkdir(parents=True, exist_ok=True)
    problems = word_problems(N_PROBLEMS)
    write_jsonl(problems, root / "train.jsonl")
    base = build_checkpoint(root / "base", BENCH_DIR, problems)
    out = {"root": root, "base": base, "runs": {}}
    t0 = time.perf_counter()
    assert cli.main(["sft", *_common(root, base), "model.init=hf", "train.drift_every=0",
                     f"train.steps={SFT_STEPS}", "train.batch_size=32", "optim.lr=3e-3",
                     f"train.out_dir={root / 'sft'}", "train.ckpt_every=100000"]) == 0
    out["sft_seconds"] = time.perf_counter() - t0
    sft_model = root / "sft" / "model"
    out["sft"] = sft_model
    for name in METHODS:
        run = root / name
        t0 = time.perf_counter()
        summary = _cli_json(["train", *_common(root, sft_model), "model.init=sft",
                             f"train.out_dir={run}", f"train.ref_cache_dir={root / 'refcache'}",
                             f"train.steps={RL_STEPS}", "train.batch_size=8",
                             "rollout.group_size=8", "optim.lr=1e-4", "train.drift_every=3",
                             "data.n_drift=8", f"algo.method={name}"])
        wall = time.perf_counter() - t0
        # `erpo eval` of the ERPO policy, and of the other two for SUMMARY.md
        # (the same programs on another export of the same architecture).
        evals = []
        if keep or name == "erpo":
            _cli_json(["eval", "--checkpoint", summary["model_dir"], "--out", str(run / "eval"),
                       *_common(root, sft_model), f"data.eval_benchmarks={','.join(BENCHMARKS)}",
                       "train.eval_max_problems=2", "data.max_prompt_len=1024"])
            evals = _rows(run / "eval" / "evals.jsonl")
        out["runs"][name] = {"dir": run, "summary": summary, "wall_s": wall,
                             "metrics": _rows(run / "metrics.jsonl"), "evals": evals}
    if keep:
        (root / "SUMMARY.md").write_text(summary_table(out))
    return out


def _cli_json(argv: list[str]) -> dict:
    """Run the CLI in this process and parse the JSON it prints."""
    import contextlib
    import io
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert cli.main(argv) == 0
    text = buf.getvalue()
    return json.loads(text[text.index("{"):])


def summary_table(out: dict) -> str:
    sets = list(BENCHMARKS)
    lines = [f"SFT: {SFT_STEPS} steps, {out['sft_seconds']:.0f} s. RL: {RL_STEPS} steps of "
             "8 prompts x 8 samples.", "",
             "| method | reward mean (first -> last step) | batch QKL k3 (last) | held-out drift "
             "QKL k3 (last) | ref forwards / step | " + " | ".join(f"{s} pass@1" for s in sets)
             + " | wall s (train) |",
             "|---" * (6 + len(sets)) + "|"]
    for name, r in out["runs"].items():
        m = r["metrics"]
        drift = [x["drift/qkl_k3"] for x in m if "drift/qkl_k3" in x]
        ev = r["evals"][-1]["sets"]
        lines.append(
            f"| {name} | {m[0]['reward_mean']:.3f} -> {m[-1]['reward_mean']:.3f} | "
            f"{m[-1]['query_kl_k3']:.4f} | {drift[-1]:.4f} | "
            f"{r['summary']['ref_forward_calls'] / len(m):g} | "
            + " | ".join(f"{ev[s]['greedy_acc']:.2f}" for s in sets) + f" | {r['wall_s']:.0f} |")
    return "\n".join(lines) + "\n"


def _templated_prompts(model_dir: Path, questions: list[str]):
    from transformers import AutoTokenizer

    from erpo_jax.data.templates import format_prompt
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    texts = [format_prompt(q, "chat", tokenizer=tok) for q in questions]
    return tok, texts, [tok(t, add_special_tokens=False)["input_ids"] for t in texts]


def test_rl_sees_positive_math_verify_rewards(real_path):
    for name, r in real_path["runs"].items():
        m = r["metrics"]
        assert len(m) == RL_STEPS, name
        # Correct \boxed{} answers exist, and some groups are mixed: non-zero advantages.
        assert max(x["reward/correct"] for x in m) > 0, name
        assert min(x["zero_var_group_frac"] for x in m) < 1.0, name
        assert all(x["reward/no_answer"] < 0.5 for x in m), name


def test_policy_kl_alone_runs_the_reference_per_step(real_path):
    calls = {n: r["summary"]["ref_forward_calls"] for n, r in real_path["runs"].items()}
    assert calls == {"grpo_policy_kl": RL_STEPS, "no_kl": 0, "erpo": 0}
    erpo = real_path["runs"]["erpo"]["metrics"]
    assert max(x["term_query_kl"] for x in erpo) > 0
    assert all("drift/qkl_k3" in x for x in erpo[2::3])


def test_reference_pass_covers_the_whole_chat_templated_prompt(real_path):
    """Query-KL's reference values are one per target token of the templated
    prompt (system turn and template tokens included), and equal the SFT
    model's log-probs from transformers on those tokens."""
    import torch
    import transformers as tf

    from erpo_jax.train.config import RunConfig, apply_overrides
    from erpo_jax.train.tasks import load_task, load_tokenizer
    root, sft = real_path["root"], real_path["sft"]
    cfg = apply_overrides(RunConfig(), [*_common(root, sft), "model.init=sft",
                                        "train.drift_every=3", "train.drift_queries=8",
                                        "data.n_drift=8",
                                        "train.batch_size=8"])
    task = load_task(cfg, load_tokenizer(sft))
    task.close()
    _, texts, ids = _templated_prompts(sft, [p.question for p in task.train])
    assert texts[0].startswith("<|im_start|>system\n") and ids == task.train_prompts
    caches = [np.load(f) for f in sorted((root / "refcache").glob("refpass-*.npz"))]
    cache = next(c for c in caches if len(c["offsets"]) == len(ids) + 1)
    np.testing.assert_array_equal(np.diff(cache["offsets"]), [len(x) - 1 for x in ids])
    model = tf.AutoModelForCausalLM.from_pretrained(str(sft)).float().eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids[0]])).logits[0, :-1].double()
    want = torch.log_softmax(logits, -1)[torch.arange(len(ids[0]) - 1), ids[0][1:]].numpy()
    off = cache["offsets"]
    np.testing.assert_allclose(cache["logp"][off[0]:off[1]], want, atol=2e-4)


def test_config_json_counts_every_row_held_out_or_dropped(real_path):
    """Each run's config.json says what it trained on (issue 36): SFT every row,
    RL all but the data.n_drift rows it measures drift on (no
    data.eval_benchmarks here); and the recorded counts do not stop the file
    from loading as a config again."""
    from erpo_jax.train.config import config_dict, load_config
    sft = _rows_json(real_path["sft"].parent / "config.json")
    assert sft["data_rows"] == {"train": N_PROBLEMS, "held_out": {}, "dropped": {}, "eval": {}}
    run = real_path["runs"]["erpo"]["dir"] / "config.json"
    rows = _rows_json(run)["data_rows"]
    assert rows["train"] == N_PROBLEMS - 8 and rows["held_out"] == {
        "drift (data.n_drift)": 8}
    assert "data_rows" not in config_dict(load_config(str(run)))


def _rows_json(path: Path) -> dict:
    return json.loads(path.read_text())


def test_every_benchmark_has_a_pass_at_1_row(real_path):
    evaluated = {n: r for n, r in real_path["runs"].items() if r["evals"]}
    assert "erpo" in evaluated
    for name, r in evaluated.items():
        rows = r["evals"]
        assert len(rows) == 1, name
        assert set(rows[0]["sets"]) == set(BENCHMARKS), name
        for s, res in rows[0]["sets"].items():
            assert res["n_problems"] == 2 and 0.0 <= res["greedy_acc"] <= 1.0, (name, s)


def test_sft_answers_in_boxed_and_exported_policy_matches_transformers(real_path):
    """The exported ERPO policy loads in transformers; transformers' greedy
    `generate` (stop ids from generation_config.json) gives the same tokens
    as the project's sampler; the SFT model answers some problems correctly
    inside \\boxed{}."""
    import torch
    import transformers as tf

    from erpo_jax.model.hf import load_hf
    from erpo_jax.rewards.math_verify_pool import MathVerifyPool
    from erpo_jax.rollout.static import StaticEngine
    from erpo_jax.rollout.types import SamplingConfig
    from erpo_jax.train.tasks import load_tokenizer
    problems = word_problems(N_PROBLEMS)[:8]
    golds = [p["answer"].rsplit("####", 1)[1].strip() for p in problems]
    for which in ("sft", "erpo"):
        model_dir = real_path["sft"] if which == "sft" else real_path["runs"]["erpo"]["dir"] / "model"
        tok, _, prompts = _templated_prompts(model_dir, [p["question"] for p in problems])
        model = tf.AutoModelForCausalLM.from_pretrained(str(model_dir)).float().eval()
        ours = load_tokenizer(model_dir)
        n_new, T = 64, max(len(p) for p in prompts)   # the decode loop in cache phases
        ids = torch.full((len(prompts), T), ours.pad_id)
        mask = torch.zeros((len(prompts), T), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, T - len(p):], mask[i, T - len(p):] = torch.tensor(p), 1
        with torch.no_grad():
            gen = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n_new,
                                 do_sample=False)[:, T:].numpy()
        ref = np.pad(gen, ((0, 0), (0, n_new - gen.shape[1])), constant_values=ours.pad_id)
        cfg, params = load_hf(model_dir)
        sampler = StaticEngine(cfg, SamplingConfig(max_new_tokens=n_new, greedy=True,
                                                   eos_ids=ours.eos_ids, pad_id=ours.pad_id,
                                                   max_prompt_len=128))
        assert len(sampler.cache_phases(len(prompts), T)) > 1
        import jax
        out = sampler(params, prompts, jax.random.key(0))
        np.testing.assert_array_equal(np.asarray(out.response_tokens), ref, err_msg=which)
        assert np.asarray(out.response_mask).sum(1).min() < n_new, "no response stopped"
        if which == "sft":
            texts = tok.batch_decode(gen, skip_special_tokens=True)
            assert all("\\boxed{" in t for t in texts), texts
            with MathVerifyPool(num_workers=1) as pool:
                rewards, _ = pool.verify_batch(list(zip(texts, golds)))
            assert rewards.sum() > 0, texts


def test_continuous_and_paged_engines_equal_static_on_the_chat_checkpoint(real_path):
    """The SFT'd Qwen2-architecture checkpoint, chat-templated word problems,
    4 samples each at temperature 1 (responses end at EOS after their boxed
    answer, or run to max_new_tokens): the continuous engine draws the static
    engine's samples with pools smaller than, equal to and larger than G,
    none dividing the 32 samples, and so does the paged engine. (The RL runs above used it: data.task=jsonl
    resolves rollout.engine=auto to continuous.)"""
    import jax

    from engine_checks import assert_same_samples
    from erpo_jax.model.hf import load_hf
    from erpo_jax.rollout.continuous import ContinuousEngine
    from erpo_jax.rollout.paged import PagedEngine
    from erpo_jax.rollout.static import StaticEngine
    from erpo_jax.rollout.types import SamplingConfig
    from erpo_jax.train.tasks import load_tokenizer
    model_dir = real_path["sft"]
    problems = word_problems(N_PROBLEMS)[:8]
    _, _, prompts = _templated_prompts(model_dir, [p["question"] for p in problems])
    ours = load_tokenizer(model_dir)
    cfg, params = load_hf(model_dir)
    sc = SamplingConfig(max_new_tokens=48, num_samples=4, eos_ids=ours.eos_ids,
                        pad_id=ours.pad_id, max_prompt_len=128)
    key = jax.random.key(11)
    want = StaticEngine(cfg, sc).sample(params, prompts, key)
    assert want.lengths.min() < sc.max_new_tokens and len(set(want.lengths)) > 3, want.lengths
    for slots in (3, 4, 7):
        got = ContinuousEngine(cfg, sc, slots=slots).sample(params, prompts, key)
        assert_same_samples(want, got, f"slots={slots}")
    # The paged engine: prompts of several lengths in pages of 16 shared by
    # their 4 samples, pools smaller and larger than G.
    for slots in (3, 7):
        got = PagedEngine(cfg, sc, slots=slots, page_size=16).sample(params, prompts, key)
        assert_same_samples(want, got, f"paged slots={slots}")
    assert real_path["runs"]["erpo"]["metrics"][-1]["rollout/slot_utilization"] > 0


def test_the_stability_techniques_run_on_the_real_path(real_path):
    """ERPO + DAPO (clip-higher, dynamic sampling, overlong shaping) with the
    adaptive Policy-KL controller and KL-Cov, on the chat checkpoint, the
    continuous engine and math-verify rewards (issue 35)."""
    root = real_path["root"]
    run = root / "stabilizers"
    summary = _cli_json(["train", *_common(root, real_path["sft"]), "model.init=sft",
                         f"train.out_dir={run}", f"train.ref_cache_dir={root / 'refcache'}",
                         "train.steps=2", "train.batch_size=8", "rollout.group_size=8",
                         "optim.lr=1e-4", "optim.num_minibatches=2", "train.drift_every=0",
                         "algo.method=custom", "loss.beta_query=0.1",
                         "algo.weight_scheme=likelihood", "loss.beta_policy=0.02",
                         "loss.kl_target=0.001", "loss.kl_horizon=64", "loss.pg_loss=kl_cov",
                         "loss.kl_cov_ratio=0.01", "loss.eps_high=0.28",
                         "algo.filter_groups=true", "algo.filter_max_batches=2",
                         "algo.overlong_buffer=8"])
    assert summary["status"] == "done" and summary["ref_forward_calls"] == 2
    m = _rows(run / "metrics.jsonl")
    assert [x["step"] for x in m] == [1, 2]
    for x in m:
        assert x["rollout/prompts_sampled"] == 8 * x["filter/batches"]
        assert x["reward/overlong_penalty_mean"] <= 0 and x["kl_coef"] > 0
        assert x["term_query_kl"] > 0 and x["cov_selected_frac"] > 0
    assert m[0]["kl_coef"] != m[1]["kl_coef"]
    from erpo_jax.rollout.engine import engine_name
    from erpo_jax.train.config import load_config
    assert engine_name(load_config(str(run / "config.json"))) == "continuous"
