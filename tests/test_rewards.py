"""Tests for erpo_jax/rewards: extraction, math-verify pool, arithmetic reward."""

import os
import threading
import time
import uuid

import numpy as np
import pytest

from erpo_jax.rewards.arithmetic_reward import arithmetic_rewards, parse_int_answer
from erpo_jax.rewards.extract import ExtractConfig, extract_answer, last_boxed
from erpo_jax.rewards.math_verify_pool import MathVerifyPool
from erpo_jax.rewards.normalize import normalize_answer
from erpo_jax.rewards.outcome import REASONS, count_reasons

TIMEOUT_S = 2.0
# A call may overrun the limit by process kill/replace and IPC; this bounds it.
SLACK_S = 1.5

# (gold, prediction) pairs that a human grader calls equal.
EQUIVALENT = [
    (r"\frac{1}{2}", "0.5"),
    (r"\frac12", r"\dfrac{1}{2}"),
    ("0.75", r"\tfrac{3}{4}"),
    (r"\frac{3}{4}", "0.75"),
    ("5", "5 cm"),
    ("5", r"5\text{ cm}"),
    ("5", r"5\,\text{cm}"),
    ("10", r"10\,\mathrm{cm}"),
    ("3", "x=3"),
    ("3", "x = 3"),
    ("1000", "1,000"),
    ("1000", "1{,}000"),
    ("1000", r"1\,000"),  # needs normalize_answer rule 1
    ("1000000", "1,000,000"),
    ("1000000", r"1\,000\,000"),
    ("1{,}234", "1234"),
    ("-1,234", "-1234"),
    ("-7", "-7"),
    ("-3", "- 3"),
    (r"\frac{-1}{3}", r"-\frac{1}{3}"),
    (r"-\frac{2}{5}", "-0.4"),
    (r"\{3,2,1\}", r"\{1,2,3\}"),
    (r"\{-1, 1\}", r"\{1, -1\}"),
    ("3, 2", "2, 3"),
    ("[1,2)", "[1, 2)"),
    ("(1, 2]", "(1,2]"),
    (r"(-\infty,3]", r"(-\infty, 3]"),
    ("[1,2]", r"x \in [1,2]"),
    (r"x \in (0, 1)", "(0,1)"),
    ("3", r"3\!"),
    (r"\frac{\sqrt{2}}{2}", r"\sqrt{2}/2"),
    (r"\sqrt{2}", r"\sqrt 2"),
    (r"\sqrt{12}", r"2\sqrt{3}"),
    ("18", r"\$18"),
    ("18", "18 dollars"),  # needs normalize_answer rule 3
    (r"\frac{\pi}{2}", r"\pi/2"),
    (r"2\pi", "6.283185"),
    ("1000", "10^{3}"),
    (r"\left( 3, \frac{\pi}{2} \right)", r"(3,\frac{\pi}{2})"),
    ("0.5", "1/2"),
    ("25", "025"),
    ("90", r"90^\circ"),
    ("2x+1", "y=2x+1"),
    ("12", "12.0"),
    (r"4\frac{2}{3}", r"\frac{14}{3}"),
    ("6", r"2\cdot 3"),
    ("(x+1)^2", "x^2+2x+1"),
    ("0.25", r"25\%"),
    (r"\dfrac{7}{2}", "3.5"),
    (r"\frac{1}{3}", "0.333333"),
    (r"\text{(B)}", "B"),
]

# (gold, prediction) pairs that must be scored wrong.
DIFFERENT = [
    ("4", "3"),
    ("0.51", r"\frac{1}{2}"),
    ("3", "x=4"),
    (r"\{1,2,3\}", r"\{1,2\}"),
    ("(1,2)", "[1,2]"),
    ("[1,2)", "[1,2]"),
    (r"\frac13", "0.333"),
    ("-7", "7"),
    ("1000", "100"),
    ("1000", "1,0000"),
    (r"\sqrt{2}", "2"),
    ("2x+1", "2x-1"),
    ("18", "81"),
    ("5", "5 cm^2"),
    (r"\frac{1}{2}", r"\frac{1}{3}"),
    ("(3, 4)", "(4, 3)"),
]


@pytest.fixture(scope="module")
def pool():
    with MathVerifyPool(num_workers=2, timeout_s=TIMEOUT_S) as p:
        yield p


def _assert_pool_healthy(pool):
    rewards, reasons = pool.verify_batch([(r"so \boxed{\frac{1}{2}}", "0.5")])
    assert reasons == ["correct"] and rewards.tolist() == [1.0]


# ---------------------------------------------------------------- extraction


def test_extract_rules_and_priority():
    assert extract_answer(r"a \boxed{1} then \boxed{\frac{2}{3}}.") == r"\frac{2}{3}"
    assert extract_answer(r"\fbox{7}") == "7"
    assert extract_answer(r"$\boxed 5$") == "5"
    assert extract_answer(r"\boxed{ {a}_{b} }") == "{a}_{b}"
    # An unclosed last box falls back to the previous well-formed one.
    assert extract_answer(r"\boxed{3} and \boxed{4") == "3"
    assert extract_answer("Step 1...\n#### 1,234\n") == "1,234"
    assert extract_answer("So the answer is $42$.") == "42"
    assert extract_answer("The final answer is: \\(x+1\\)") == "x+1"
    assert extract_answer(r"answer is 3 but \boxed{5}") == "5"  # boxed wins
    assert extract_answer("I think 12 or 13") is None
    assert extract_answer("I think 12 or -1,300.5", ExtractConfig(fallbacks=("last_number",))) == "-1,300.5"
    assert extract_answer("") is None


def test_extract_unknown_fallback_names_it():
    with pytest.raises(ValueError, match="nearest_number"):
        ExtractConfig(fallbacks=("nearest_number",))


def test_extract_deeply_nested_braces_iteratively():
    depth = 10_000
    text = r"\boxed{" + "{" * depth + "1" + "}" * depth + "}"
    t0 = time.monotonic()
    got = extract_answer(text, ExtractConfig(max_chars=None))
    assert time.monotonic() - t0 < 1.0
    assert got == "{" * depth + "1" + "}" * depth
    assert last_boxed(r"\boxed{" + "{" * depth) is None


def test_extract_window_and_bytes():
    big = "x" * 1_000_000 + r" \boxed{7}"
    t0 = time.monotonic()
    assert extract_answer(big) == "7"
    assert time.monotonic() - t0 < 0.5
    # Only the last max_chars are looked at.
    assert extract_answer(r"\boxed{7}" + "y" * 100, ExtractConfig(max_chars=50)) is None
    assert extract_answer(b"\\boxed{5}\xff\xfe") == "5"
    with pytest.raises(TypeError, match="str or bytes"):
        extract_answer(123)


def test_normalize_rules():
    assert normalize_answer(r"1\,000\,000") == "1000000"
    assert normalize_answer(r"1\!000") == "1000"
    assert normalize_answer(r"3\!") == "3"
    assert normalize_answer("18 dollars") == "18"
    assert normalize_answer("1,000 square feet.") == "1,000"
    # Not a thousands separator, not a bare number: left alone.
    assert normalize_answer(r"1\,00") == r"1\,00"
    assert normalize_answer("x y") == "x y"


# ---------------------------------------------------------------- equivalence


def test_equivalences_all_correct(pool):
    assert len(EQUIVALENT) >= 40
    pairs = [(f"Reasoning... so the result is \\boxed{{{pred}}}.", gold) for gold, pred in EQUIVALENT]
    rewards, reasons = pool.verify_batch(pairs)
    bad = [(c, r) for c, r in zip(EQUIVALENT, reasons) if r != "correct"]
    assert not bad, bad
    assert rewards.dtype == np.float32 and rewards.shape == (len(EQUIVALENT),)
    assert rewards.sum() == len(EQUIVALENT)


def test_wrong_answers_all_wrong(pool):
    pairs = [(f"\\boxed{{{pred}}}", gold) for gold, pred in DIFFERENT]
    rewards, reasons = pool.verify_batch(pairs)
    bad = [(c, r) for c, r in zip(DIFFERENT, reasons) if r != "wrong"]
    assert not bad, bad
    assert rewards.sum() == 0


def test_batch_mixed_reasons_and_duplicates(pool):
    pairs = [
        (r"\boxed{2}", "2"),
        ("no final answer here", "2"),
        (r"\boxed{3}", "2"),
        ("#### 2", "2"),
        (r"\boxed{2}", "2"),
        (r"\boxed{1}", "}{"),  # gold that cannot be parsed
    ]
    rewards, reasons = pool.verify_batch(pairs)
    assert reasons == ["correct", "no_answer", "wrong", "correct", "correct", "error"]
    assert rewards.tolist() == [1, 0, 0, 1, 1, 0]
    assert pool.verify(r"\boxed{9}", "9") == (1.0, "correct")
    assert pool.verify_batch([]) [1] == []


def test_pool_works_off_the_main_thread(pool):
    # The reason the pool exists: math-verify's signal.alarm fails off the main thread.
    result = {}
    t = threading.Thread(target=lambda: result.update(r=pool.verify_batch([(r"\boxed{0.5}", r"\frac12")])))
    t.start()
    t.join(timeout=10)
    assert result["r"][1] == ["correct"]


def test_count_reasons():
    m = count_reasons(["correct", "wrong", "correct", "timeout"])
    assert m["reward/n"] == 4 and m["reward/correct"] == 2 and m["reward/correct_frac"] == 0.5
    assert m["reward/error"] == 0 and set(REASONS) <= {k.split("/")[1] for k in m}
    with pytest.raises(ValueError, match="bogus"):
        count_reasons(["bogus"])


# ---------------------------------------------------------------- hostile input


def test_code_in_answer_is_not_executed(pool):
    marker = f"/tmp/pwned-{uuid.uuid4().hex}"
    for response in (
        rf"\boxed{{__import__('os').system('touch {marker}')}}",
        f"The answer is __import__('os').system('touch {marker}')",
        f"#### __import__('os').system('touch {marker}')",
    ):
        _, reasons = pool.verify_batch([(response, "0")])
        assert reasons[0] in ("wrong", "error")
    assert not os.path.exists(marker)
    assert not os.path.exists("/tmp/pwned") or os.path.getmtime("/tmp/pwned") < time.time() - 3600


def test_hostile_inputs_return_in_time_and_pool_survives(pool):
    depth = 2000  # fits the extraction window, so math-verify really sees it
    fast = [
        ("x" * 1_000_000 + r"\boxed{7}", "7"),
        (b"\\boxed{5}\xff\xfe\x80 end", "5"),
    ]
    for pair in fast:
        t0 = time.monotonic()
        _, reasons = pool.verify_batch([pair])
        assert time.monotonic() - t0 < 1.0 and reasons == ["correct"], pair
    # Slow for sympy; two workers take one each, so one limit bounds the call.
    slow = [
        (r"\boxed{" + "{" * depth + "1" + "}" * depth + "}", "1"),
        (r"\boxed{9^{9^{9^{9}}}}", "3"),
    ]
    t0 = time.monotonic()
    _, reasons = pool.verify_batch(slow)
    assert time.monotonic() - t0 < TIMEOUT_S + SLACK_S, reasons
    assert reasons[0] in ("timeout", "wrong", "error") and reasons[1] == "timeout"
    t0 = time.monotonic()
    _, reasons = pool.verify_batch([(r"\boxed{(10^{10^{7}})!}", "3")])
    assert time.monotonic() - t0 < TIMEOUT_S + SLACK_S
    assert reasons[0] in ("timeout", "wrong")
    _assert_pool_healthy(pool)


def test_parent_kills_stuck_worker_and_replaces_it():
    # Without the workers' own alarm only the parent's kill can stop this one.
    with MathVerifyPool(num_workers=1, timeout_s=TIMEOUT_S, worker_soft_timeout=False) as p:
        _assert_pool_healthy(p)
        t0 = time.monotonic()
        rewards, reasons = p.verify_batch([(r"\boxed{9^{9^{9}}}", "3"), (r"\boxed{2}", "2")])
        assert time.monotonic() - t0 < TIMEOUT_S + SLACK_S + 1.0
        assert reasons == ["timeout", "correct"] and rewards.tolist() == [0.0, 1.0]
        assert p.restarts == 1
        # A worker that dies while verifying: reason "error", pool carries on.
        pid = p._workers[0].proc.pid
        threading.Timer(0.3, lambda: os.kill(pid, 9)).start()
        _, reasons = p.verify_batch([(r"\boxed{9^{9^{9}}}", "3")])
        assert reasons == ["error"]
        # A worker that died while idle is replaced without charging anyone.
        p._workers[0].proc.kill()
        p._workers[0].proc.join()
        _assert_pool_healthy(p)
        assert p.restarts == 3


def test_pool_rejects_fork_and_use_after_close():
    with pytest.raises(ValueError, match="fork"):
        MathVerifyPool(start_method="fork")
    p = MathVerifyPool(num_workers=1)
    procs = [w.proc for w in p._workers]
    p.close()
    p.close()
    assert not any(proc.is_alive() for proc in procs)
    with pytest.raises(RuntimeError, match="closed"):
        p.verify_batch([(r"\boxed{1}", "1")])


# ---------------------------------------------------------------- arithmetic


def test_arithmetic_reward_exact():
    pairs = [
        ("3+8=11;2+5+1=8;A:81", "81"),
        ("A:80", "81"),
        ("no marker", "81"),
        ("A:81x", "81"),
        ("A:1\nA:-007\n", -7),
        ("A: +0 ", "-0"),
        ("A:" + "9" * 10_000, "9" * 10_000),
        (b"A:5\xff", "5"),
    ]
    rewards, reasons = arithmetic_rewards(pairs)
    assert reasons == ["correct", "wrong", "no_answer", "no_answer", "correct", "correct", "correct", "no_answer"]
    assert rewards.dtype == np.float32 and rewards.tolist() == [1, 0, 0, 0, 1, 1, 1, 0]
    assert parse_int_answer("A:12;A:34") == "34"  # the last marker counts
    assert parse_int_answer("x A:0042 ") == "42"
    with pytest.raises(ValueError, match="pair 0"):
        arithmetic_rewards([("A:1", "1.5")])
