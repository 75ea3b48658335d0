"""A math JSONL training file on the real path: answer formats and the
up-front format check, golds math-verify cannot parse, bad bytes, missing
files and tokenizers, stop ids from generation_config.json, drift queries
held out of training, and the verifier's knobs."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest

from erpo_jax.train import startup
from erpo_jax import cli
from erpo_jax.data.benchmarks import BadRowError
from erpo_jax.data.math_jsonl import (check_answer_format, drop_unparseable, gsm8k_solution,
                                      load_training_file)
from erpo_jax.data.problem import Problem
from erpo_jax.model.hf import CheckpointError, generation_eos_ids
from erpo_jax.rewards.math_verify_pool import MathVerifyPool
from erpo_jax.train.config import RunConfig, apply_overrides
from erpo_jax.train.tasks import load_task, load_tokenizer

from real_path import CHAT_TEMPLATE, build_model, build_tokenizer, word_problems, write_generation_config


def _write(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def pool():
    with MathVerifyPool(num_workers=1, timeout_s=5.0) as p:
        yield p


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    """A chat tokenizer with Qwen's stop ids in generation_config.json."""
    d = tmp_path_factory.mktemp("tok")
    rows = word_problems(64)
    tok = build_tokenizer(d, [r["question"] + r["answer"] for r in rows], vocab_size=300)
    build_model(d, vocab_size=320)
    write_generation_config(d, tok)
    return d


# ----------------------------------------------------------------------------- answer formats


def test_each_answer_format_reads_its_gold_and_solution(tmp_path):
    f = _write(tmp_path / "g.jsonl", [{"question": "q", "answer": "3 + 4 = <<3+4=7>>7\n#### 1,007"}])
    (p,), skipped = load_training_file(f, "question", "answer", "gsm8k")
    assert (p.answer, skipped) == ("1007", 0)
    assert p.solution == "3 + 4 = 7\nThe answer is \\boxed{1007}."
    f = _write(tmp_path / "b.jsonl", [{"question": "q", "answer": "So $x=\\boxed{\\frac{1}{2}}$."}])
    (p,), _ = load_training_file(f, "question", "answer", "boxed")
    assert (p.answer, p.solution) == ("\\frac{1}{2}", "So $x=\\boxed{\\frac{1}{2}}$.")
    f = _write(tmp_path / "p.jsonl", [{"question": "q", "answer": "18", "worked": "9+9=18"}])
    (p,), _ = load_training_file(f, "question", "answer", "plain")
    assert (p.answer, p.solution) == ("18", None)
    (p,), _ = load_training_file(f, "question", "answer", "plain", solution_field="worked")
    assert p.solution == "9+9=18"
    assert gsm8k_solution("#### 5") == "The answer is \\boxed{5}."


@pytest.mark.parametrize("fmt,answers,use", [
    ("plain", ["2 + 2 = 4\n#### 4"] + ["7"] * 9, "gsm8k"),
    ("boxed", ["2 + 2 = 4\n#### 4"] * 6, "gsm8k"),
    ("boxed", ["4"] * 6, "plain"),
    ("gsm8k", ["so it is \\boxed{4}"] * 6, "boxed"),
    ("gsm8k", ["4"] * 6, "plain"),
])
def test_a_file_in_another_format_fails_up_front(tmp_path, fmt, answers, use):
    f = _write(tmp_path / "x.jsonl", [{"question": "q", "answer": a} for a in answers])
    with pytest.raises(ValueError, match=rf"data\.answer_format.*set data\.answer_format={use}\."):
        check_answer_format(f, "answer", fmt)


def test_a_few_rows_without_the_marker_are_bad_rows_not_a_format_error(tmp_path):
    rows = [{"question": "q", "answer": "x\n#### 4"}] * 5 + [{"question": "q", "answer": "4"}]
    f = _write(tmp_path / "x.jsonl", rows)
    check_answer_format(f, "answer", "gsm8k")
    with pytest.raises(BadRowError, match=rf"{f}:6: .*####"):
        load_training_file(f, "question", "answer", "gsm8k")
    probs, skipped = load_training_file(f, "question", "answer", "gsm8k", skip_bad_rows=True)
    assert (len(probs), skipped) == (5, 1)


def test_gsm8k_golds_score_a_correct_boxed_answer(pool, tmp_path):
    """The silent failure this format fixes: under 'plain' the gold would be
    the whole worked solution and every correct answer scored 0."""
    f = _write(tmp_path / "g.jsonl", [{"question": "q", "answer": "Half of 36.\n#### 18"}])
    (p,), _ = load_training_file(f, "question", "answer", "gsm8k")
    rewards, _ = pool.verify_batch([("so \\boxed{18}", p.answer), ("\\boxed{17}", p.answer)])
    assert rewards.tolist() == [1.0, 0.0]


# ----------------------------------------------------------------------------- bad input


def test_non_utf8_bytes_are_a_bad_row_with_file_and_line(tmp_path):
    f = tmp_path / "bytes.jsonl"
    f.write_bytes(b'{"question": "q", "answer": "1"}\n{"question": "caf\xe9", "answer": "2"}\n')
    with pytest.raises(BadRowError, match=rf"{f}:2: byte \d+ is not UTF-8"):
        load_training_file(f, "question", "answer")
    probs, skipped = load_training_file(f, "question", "answer", skip_bad_rows=True)
    assert ([p.answer for p in probs], skipped) == (["1"], 1)


def test_a_missing_training_file_names_data_train_file(tmp_path):
    with pytest.raises(ValueError, match=r"config field data\.train_file: .*nope\.jsonl does not"):
        load_training_file(tmp_path / "nope.jsonl", "question", "answer")


def test_unparseable_golds_are_counted_then_refused_or_dropped(pool):
    probs = [Problem(f"t/{i}", "q", g, "t") for i, g in enumerate(["1", "}", "3", "}{"])]
    ok = pool.check_golds([p.answer for p in probs])
    assert ok == [True, False, True, False]
    with pytest.raises(ValueError, match=r"cannot parse 2 of 4 gold answers \(first: t/1 .*"
                                         r"data\.skip_bad_rows=true"):
        drop_unparseable(probs, ok, "train.jsonl", skip_bad_rows=False)
    kept, report = drop_unparseable(probs, ok, "train.jsonl", skip_bad_rows=True)
    assert [p.id for p in kept] == ["t/0", "t/2"]
    assert report == {"unparseable": 2, "first_ids": ["t/1", "t/3"]}


def _cfg(tmp_path, tok_dir, train: Path, *extra) -> RunConfig:
    return apply_overrides(RunConfig(), [
        "data.task=jsonl", f"data.train_file={train}", f"model.path={tok_dir}",
        "data.template=chat", "data.max_prompt_len=256", "train.batch_size=4",
        "reward.workers=1", *extra])


def test_skip_bad_rows_from_the_command_line(tmp_path, tok_dir, capsys):
    rows = [{"question": f"q{i}", "answer": "}{" if i == 1 else str(i)} for i in range(6)]
    rows.insert(3, "{not json")
    train = _write(tmp_path / "t.jsonl", rows)
    base = _cfg(tmp_path, tok_dir, train, "train.drift_every=0")
    tok = load_tokenizer(tok_dir)
    with pytest.raises(BadRowError, match=rf"{train}:4"):
        load_task(base, tok)
    cfg = apply_overrides(base, ["data.skip_bad_rows=true"])   # the CLI's override path
    task = load_task(cfg, tok)
    task.close()
    assert [p.answer for p in task.train] == ["0", "2", "3", "4", "5"]
    assert task.load_report == {"unparseable": 1, "first_ids": ["t/1"], "bad_rows": 1}
    assert "dropped 1 bad rows and 1 golds" in capsys.readouterr().out
    # And through `erpo eval`, on one held-out validation row (with no evaluation
    # set at all, erpo eval is refused before the data loads: issue 49).
    argv = ["eval", "--checkpoint", str(tok_dir), "--out", str(tmp_path / "ev"),
            "data.task=jsonl", f"data.train_file={train}", "data.template=chat",
            "data.max_prompt_len=256", "train.drift_every=0", "reward.workers=1",
            "data.n_val=1", "train.eval_split=validation", "train.batch_size=1",
            "train.eval_max_problems=1", "rollout.max_new_tokens=4"]
    assert cli.main(argv) == 1                     # one sentence, no traceback
    err = capsys.readouterr().err
    assert f"{train}:4" in err and "data.skip_bad_rows=true" in err and "Traceback" not in err
    assert cli.main([*argv, "data.skip_bad_rows=true"]) == 0
    assert "dropped 1 bad rows and 1 golds" in capsys.readouterr().out
    assert cli.main([*argv, "data.skip_bad_rows=maybe"]) == 2
    assert "data.skip_bad_rows: expects true/false" in capsys.readouterr().err


def test_drift_rows_are_a_data_split_held_out_of_training_or_refused(tmp_path, tok_dir):
    """data.n_drift holds rows out to measure query drift on; the training set
    depends on data fields only, never on train.drift_every or drift_queries
    (issue 37), and drift with nothing held out to measure it on is refused."""
    rows = [{"question": f"q{i}", "answer": str(i)} for i in range(20)]
    train = _write(tmp_path / "t.jsonl", rows)
    tok = load_tokenizer(tok_dir)
    task = load_task(_cfg(tmp_path, tok_dir, train, "train.drift_every=2", "data.n_drift=6"), tok)
    task.close()
    held = {p.id for p in task.drift_set}
    assert len(held) == 6 and len(task.train) == 14
    assert not held & {p.id for p in task.train}
    # The logging settings change what is measured, not what trains.
    for logging in (["train.drift_every=0"], ["train.drift_every=5", "train.drift_queries=2"]):
        other = load_task(_cfg(tmp_path, tok_dir, train, "data.n_drift=6", *logging), tok)
        other.close()
        assert [p.id for p in other.train] == [p.id for p in task.train]
        assert [p.id for p in other.drift_set] == [p.id for p in task.drift_set]
    with pytest.raises(ValueError, match=r"config field data\.n_drift: holding 18 rows"):
        load_task(_cfg(tmp_path, tok_dir, train, "data.n_drift=18"), tok)
    # Nothing held out: drift is refused for train, which measures it ...
    with pytest.raises(ValueError, match=r"config field data\.n_drift: train\.drift_every=2 "):
        load_task(_cfg(tmp_path, tok_dir, train, "train.drift_every=2"), tok)
    # ... and every row trains where none is measured, or it runs on the validation rows.
    task = load_task(_cfg(tmp_path, tok_dir, train, "train.drift_every=0"), tok)
    task.close()
    assert len(task.train) == 20 and task.drift_set == []
    task = load_task(_cfg(tmp_path, tok_dir, train, "train.drift_every=2", "data.n_val=4"), tok)
    task.close()
    assert len(task.train) == 16 and len(task.drift_set) == 4
    assert not {p.id for p in task.drift_set} & {p.id for p in task.train}


def test_sft_trains_on_every_row_and_held_out_rows_are_counted(tmp_path, tok_dir, capsys,
                                                              monkeypatch):
    """`erpo sft` measures no drift, so it holds no rows out for it (a 100-row file
    trained on 36 rows, issue 36); `erpo train` counts what it holds out."""
    rows = [{"question": f"q{i}", "answer": str(i)} for i in range(20)]
    train = _write(tmp_path / "t.jsonl", rows)
    tok = load_tokenizer(tok_dir)
    task = load_task(_cfg(tmp_path, tok_dir, train, "train.drift_every=2",
                          "data.n_drift=6", "data.n_val=2"), tok)
    task.close()
    assert len(task.train) == 12 and task.load_report["held_out"] == {
        "validation (data.n_val)": 2, "drift (data.n_drift)": 6}
    assert (f"{train}: 12 training rows; held out of training: 2 for validation (data.n_val), "
            "6 for drift (data.n_drift)") in capsys.readouterr().out
    loaded = []

    def load_and_stop(*a, **k):
        loaded.append(load_task(*a, **k))
        loaded[-1].close()
        raise ValueError("stop here")
    monkeypatch.setattr(startup, "load_task", load_and_stop)
    assert cli.main(["sft", "data.task=jsonl", f"data.train_file={train}", "model.init=hf",
                     f"model.path={tok_dir}", "data.template=chat", "data.max_prompt_len=256",
                     "train.batch_size=8", "reward.workers=1", "train.drift_queries=6",
                     "train.progress=false", "train.tensorboard=false",
                     f"train.out_dir={tmp_path / 'sft'}"]) == 1
    assert "stop here" in capsys.readouterr().err
    assert len(loaded[0].train) == 20 and loaded[0].drift_set == []


# ----------------------------------------------------------------------------- tokenizer


def test_a_missing_or_empty_tokenizer_names_the_directory_and_files(tmp_path, tok_dir):
    empty = tmp_path / "ckpt"
    empty.mkdir()
    (empty / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match=rf"{empty}: no tokenizer files; expected "
                                              r"tokenizer\.json .*save_pretrained"):
        load_tokenizer(empty)
    (empty / "tokenizer.json").write_text("")
    with pytest.raises(CheckpointError, match=rf"{empty}: tokenizer file tokenizer\.json is empty"):
        load_tokenizer(empty)
    (empty / "tokenizer.json").write_text("{\"version\": 1}")
    with pytest.raises(CheckpointError, match=rf"{empty}: transformers cannot load the tokenizer"):
        load_tokenizer(empty)


def test_stop_ids_come_from_generation_config_and_the_tokenizer(tok_dir, tmp_path):
    tok = load_tokenizer(tok_dir)
    inner = tok.inner
    im_end, eot = (inner.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>"))
    assert generation_eos_ids(tok_dir) == ((im_end, eot), eot)
    assert tok.eos_ids == (im_end, eot) and tok.pad_id == eot
    assert tok.turn_end_id() == im_end
    # Saved beside an exported model, the stop ids survive the round trip.
    tok.save(tmp_path)
    assert load_tokenizer(tmp_path).eos_ids == (im_end, eot)
    assert inner.chat_template == CHAT_TEMPLATE


# ----------------------------------------------------------------------------- verifier knobs


def test_reward_knobs_are_config_fields_and_validated(tmp_path):
    from erpo_jax.train.config import validate
    cfg = apply_overrides(RunConfig(), ["reward.workers=3", "reward.timeout_s=2.5",
                                        "reward.batch_budget_s=4"])
    assert (cfg.reward.workers, cfg.reward.timeout_s, cfg.reward.batch_budget_s) == (3, 2.5, 4.0)
    for bad, field in [("reward.workers=0", "reward.workers"),
                       ("reward.timeout_s=0", "reward.timeout_s"),
                       ("reward.batch_budget_s=-1", "reward.batch_budget_s"),
                       ("data.answer_format=latex", "data.answer_format")]:
        with pytest.raises(ValueError, match=rf"config field {field}"):
            validate(apply_overrides(RunConfig(), [bad]))


def test_a_batch_over_its_budget_scores_the_rest_as_over_budget():
    """Slow comparisons (9^{9^{9}} stalls sympy in C code; 6 of them under a
    30 s limit each would take minutes on one worker) stop at the budget: what
    finished keeps its score, the rest is 0 with reason 'over_budget'."""
    pairs = [("\\boxed{2}", "2")] + [("\\boxed{9^{9^{9}}}", str(k)) for k in range(3, 9)]
    with MathVerifyPool(num_workers=1, timeout_s=30.0) as pool:
        pool.verify_batch([("\\boxed{1}", "1")])     # workers started
        t0 = time.monotonic()
        rewards, reasons = pool.verify_batch(pairs, budget_s=1.0)
        took = time.monotonic() - t0
    assert took < 5.0, took
    assert reasons[0] == "correct" and rewards[0] == 1.0
    assert reasons[1:] == ["over_budget"] * 6 and np.all(rewards[1:] == 0.0)
    from erpo_jax.rewards.outcome import count_reasons
    assert count_reasons(reasons)["reward/over_budget"] >= 1


def test_validation_rows_are_held_out_of_a_training_file(tmp_path, tok_dir):
    rows = [{"question": f"q{i}", "answer": str(i)} for i in range(20)]
    train = _write(tmp_path / "t.jsonl", rows)
    tok = load_tokenizer(tok_dir)
    base = _cfg(tmp_path, tok_dir, train, "data.n_val=5", "train.drift_every=0")
    kept = load_task(base, tok)
    kept.close()
    task = load_task(apply_overrides(base, ["train.eval_split=validation",
                                            "train.drift_every=2"]), tok)
    task.close()
    val = {p.id for p in task.eval_sets["validation"]}
    assert list(task.eval_sets) == ["validation"] and len(val) == 5 and len(task.train) == 15
    assert not val & {p.id for p in task.train} and kept.train == task.train
    assert {p.id for p in task.drift_set} == val      # drift on validation, no further hold-out
    with pytest.raises(ValueError, match=r"config field data\.n_val: holding 18 .*lower"):
        load_task(_cfg(tmp_path, tok_dir, train, "data.n_val=18"), tok)


def test_golds_that_parse_to_no_math_object_are_refused_with_file_and_line(tmp_path, tok_dir,
                                                                          pool, capsys):
    """'#### ???' parses to math-verify's bare string fallback and '#### seven' to a
    product of five symbols: no response can score on either (issue 36)."""
    golds = ["18", "???", "seven", "x+1", "\\frac{1}{2}", "\\{1, 2\\}"]
    assert pool.check_golds(golds) == [True, False, True, True, True, True]
    assert pool.check_golds(golds, numeric=True) == [True, False, False, False, True, True]
    rows = [{"question": f"q{i}", "answer": f"{i} apples.\n#### {i}"} for i in range(6)]
    rows[1]["answer"], rows[3]["answer"] = "Unknown.\n#### ???", "She has\n#### seven"
    train = _write(tmp_path / "gsm.jsonl", rows)
    cfg = _cfg(tmp_path, tok_dir, train, "data.answer_format=gsm8k", "train.drift_every=0")
    tok = load_tokenizer(tok_dir)
    with pytest.raises(ValueError, match=rf"cannot parse 2 of 6 gold answers \(first: "
                                         rf"{train}:2 \('\?\?\?'\), {train}:4 \('seven'\)\) "
                                         r"to a number;.*data\.skip_bad_rows=true"):
        load_task(cfg, tok)
    task = load_task(apply_overrides(cfg, ["data.skip_bad_rows=true"]), tok)
    task.close()
    assert [p.answer for p in task.train] == ["0", "2", "4", "5"]
    assert task.load_report["unparseable"] == 2
    assert "2 golds math-verify cannot parse" in capsys.readouterr().out


def test_a_verifier_timeout_is_named_as_the_verifiers(tmp_path, tok_dir, monkeypatch):
    """reward.timeout_s too short for the gold check is not 'cannot parse' (issue 36)."""
    from erpo_jax.rewards.outcome import CORRECT, TIMEOUT
    monkeypatch.setattr(MathVerifyPool, "_run", lambda self, keys, budget_s=None:
                        [TIMEOUT] * len(keys))
    train = _write(tmp_path / "t.jsonl", [{"question": f"q{i}", "answer": str(i)}
                                          for i in range(6)])
    tok = load_tokenizer(tok_dir)
    for extra in ([], ["data.skip_bad_rows=true"]):   # dropping every row is no fix
        cfg = _cfg(tmp_path, tok_dir, train, "train.drift_every=0", *extra)
        with pytest.raises(ValueError, match=r"config field reward\.timeout_s: math-verify ran "
                                             r"out of time on 6 of 6 gold answers .*verifier's "
                                             r"time limit, not the data"):
            load_task(cfg, tok)
    probs = [Problem(f"t/{i}", "q", str(i), "t") for i in range(3)]
    reasons = [CORRECT, TIMEOUT, CORRECT]
    with pytest.raises(ValueError, match="reward.timeout_s"):
        drop_unparseable(probs, reasons, "t.jsonl", skip_bad_rows=False)
    kept, report = drop_unparseable(probs, reasons, "t.jsonl", skip_bad_rows=True)
    assert [p.id for p in kept] == ["t/0", "t/2"]
    assert report == {"unparseable": 0, "first_ids": ["t/1"], "timed_out": 1}


def test_held_out_rows_beyond_the_file_and_the_drift_set_size_are_said(tmp_path, tok_dir,
                                                                      capsys):
    """Issue 49: data.n_drift past the file's rows is one sentence (not 'leaves -10 of
    20'); train.drift_queries above the drift set's size is said at start."""
    train = _write(tmp_path / "t.jsonl", [{"question": f"q{i}", "answer": str(i)}
                                           for i in range(20)])
    tok = load_tokenizer(tok_dir)
    with pytest.raises(ValueError, match=r"config field data.n_drift: holds 30 rows .* has 20 "
                                         r"training rows"):
        load_task(_cfg(tmp_path, tok_dir, train, "data.n_drift=30"), tok)
    task = load_task(_cfg(tmp_path, tok_dir, train, "data.n_drift=4", "train.drift_every=2",
                          "train.drift_queries=100"), tok)
    task.close()
    assert len(task.drift_set) == 4
    assert ("train.drift_queries=100 but the held-out drift set has 4 queries"
            in capsys.readouterr().out)


def test_training_evaluation_with_no_evaluation_set_is_refused(tmp_path, tok_dir, capsys):
    train = _write(tmp_path / "t.jsonl", [{"question": f"q{i}", "answer": str(i)}
                                           for i in range(20)])
    argv = ["train", "data.task=jsonl", f"data.train_file={train}", "data.template=chat",
            "model.init=hf", f"model.path={tok_dir}", "data.max_prompt_len=256",
            "train.batch_size=4", "reward.workers=1", "data.n_drift=4", "train.eval_every=1",
            f"train.out_dir={tmp_path / 'run'}", "train.progress=false"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("erpo train: config field train.eval_every: is 1, but the task has "
                          "no evaluation set") and len(err.splitlines()) == 1
