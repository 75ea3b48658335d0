"""RESULTS.md's tables, from the run summaries committed in experiments/results/*/runs.

    .venv/bin/python experiments/results_tables.py            # every table, in order
    .venv/bin/python experiments/results_tables.py drift      # one of them
    .venv/bin/python experiments/results_tables.py --grid-png # results/slip_grid/grid.png

Each table is printed under a `<!-- table: NAME -->` line, as RESULTS.md holds
it; `tests/test_results_tables.py` checks that RESULTS.md holds every one of
them verbatim, so no number in a table can drift from the committed runs.
The summaries are written by `erpo sweep` (report/runs/, copied here with the
REPORT.md) and read by `erpo report`, whose helpers compute every cell.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from erpo_jax.tools import report

RESULTS = Path(__file__).resolve().parent / "results"
LABELS = {"grpo+policy_kl": "GRPO + Policy-KL", "no_kl": "no KL", "erpo": "ERPO"}
TEMPERATURES = (1.2, 1.5)
ABLATION_CHANGES = {
    "erpo": "nothing: QKL k3, β_q = 0.1, likelihood weights",
    "beta_q0.02": "β_q = 0.02",
    "beta_q0.5": "β_q = 0.5",
    "qkl+uniform": "uniform weights",
    "qkl+typicality": "typicality weights",
    "qkl_k2": "Query-KL estimator k2",
    "noqkl+likelihood": "no Query-KL (weights only)",
    "noqkl+typicality": "no Query-KL, typicality weights",
    "noqkl+uniform": "no Query-KL, uniform (= GRPO, no KL)",
    "ppo+erpo": "PPO (GAE, learned critic) + ERPO",
    "ppo+no_kl": "PPO, no KL",
    "reinforce_pp+erpo": "REINFORCE++ + ERPO",
    "reinforce_pp+no_kl": "REINFORCE++, no KL",
}
SWEEPS = (("main_comparison", "main comparison"),
          ("high_temperature", "high temperature (T = 1.2, 1.5)"),
          ("long_horizon", "long horizon"), ("ablations", "ablations"))


def runs(experiment: str) -> dict[str, list[dict]]:
    """{variant: its runs, by seed} from experiments/results/<experiment>/runs."""
    found = report.expand_run_dirs([RESULTS / experiment / "runs"])
    by = report.group([report.load_run(p) for p in found])
    return {k: sorted(v, key=lambda r: r["config"]["train"]["seed"]) for k, v in by.items()}


def _pct(values) -> str:
    return report.fmt(*report.mean_ci(values))


def _num(values, digits: int = 3) -> str:
    return report.fmt(*report.mean_ci(values), pct=False, digits=digits)


def _per_seed(values, digits: int = 3) -> str:
    return " / ".join(f"{v:.{digits}f}" for v in values)


def _drifts(rs) -> list[float]:
    """Each run's last held-out query drift (QKL k3)."""
    return [report._last(r, "drift/qkl_k3") for r in rs]


def _final(r, key: str):
    """A final-evaluation average: 'greedy_acc' or a sampled 'pass@k'."""
    return r["evals"][-1]["average"].get(key)


def _eval_at(r, step: int, key: str = "greedy_acc"):
    return next(e["average"].get(key) for e in r["evals"] if e["step"] == step)


def main_table() -> list[str]:
    by = runs("main_comparison")
    lines = ["| method | final greedy pass@1 | final sampled pass@1 | final pass@4 |",
             "|---|---|---|---|"]
    for m, label in LABELS.items():
        rs = by[m]
        lines.append(f"| {label} | {_pct([_final(r, 'greedy_acc') for r in rs])} | "
                     f"{_pct([_final(r, 'pass@1') for r in rs])} | "
                     f"{_pct([_final(r, 'pass@4') for r in rs])} |")
    return lines


def drift_table() -> list[str]:
    by = runs("main_comparison")
    seeds = [r["config"]["train"]["seed"] for r in by["erpo"]]
    lines = ["| method | " + " | ".join(f"seed {s}" for s in seeds) + " |",
             "|---|" + "---|" * len(seeds)]
    for m, label in LABELS.items():
        lines.append(f"| {label} | " + " | ".join(f"{d:.3f}" for d in _drifts(by[m])) + " |")
    return lines


def temperature_table() -> list[str]:
    rows = [(1.0, runs("main_comparison"), "{m}")]
    hot = runs("high_temperature")
    rows += [(t, hot, "{m}-T" + str(t)) for t in TEMPERATURES]
    lines = ["| T | method | final greedy pass@1 | final sampled pass@1 | final drift | "
             "final entropy |", "|---|---|---|---|---|---|"]
    for t, by, pattern in rows:
        for m, label in LABELS.items():
            rs = by[pattern.format(m=m)]
            ent = np.mean([report._last(r, "entropy") for r in rs])
            lines.append(f"| {t:.1f} | {label} | {_pct([_final(r, 'greedy_acc') for r in rs])} | "
                         f"{_pct([_final(r, 'pass@1') for r in rs])} | "
                         f"{_num(_drifts(rs))} | {ent:.3f} |")
    return lines


def long_horizon_table() -> list[str]:
    by = runs("long_horizon")
    lines = ["| method | greedy pass@1 at 60 → 240 | sampled pass@1 at 240 | drift at 240 | "
             "max drift | min entropy |", "|---|---|---|---|---|---|"]
    for m, label in LABELS.items():
        rs = by[m]
        at60 = np.mean([_eval_at(r, 60) for r in rs])
        lines.append(
            f"| {label} | {100 * at60:.1f} → {_pct([_final(r, 'greedy_acc') for r in rs])} | "
            f"{_pct([_final(r, 'pass@1') for r in rs])} | "
            f"{_per_seed(_drifts(rs))} | "
            f"{_per_seed([report._max(r, 'drift/qkl_k3') for r in rs])} | "
            f"{_per_seed([report._min(r, 'entropy') for r in rs])} |")
    return lines


def ablations_table() -> list[str]:
    by = runs("ablations")
    lines = ["| variant | what changes | final drift, per seed | final greedy pass@1 | "
             "best greedy pass@1 |", "|---|---|---|---|---|"]
    for name, change in ABLATION_CHANGES.items():
        rs = by[name]
        tabs = [report.eval_table(r) for r in rs]
        lines.append(f"| {name} | {change} | "
                     f"{_per_seed(_drifts(rs))} | "
                     f"{_pct([t['final']['average'] for t in tabs])} | "
                     f"{_pct([t['best']['average'] for t in tabs])} |")
    return lines


def _wall_lines(sweeps) -> list[str]:
    """The wall-time table of `sweeps`, (label, runs) pairs, with a total row."""
    lines = ["| sweep | runs | wall |", "|---|---:|---:|"]
    total_n = total_s = total_missing = 0
    for label, rs in sweeps:
        # A run whose sweep was killed after it ended, before it wrote
        # sweep_wall.jsonl, has none: it is counted, not guessed.
        walls = [r["wall_s"] for r in rs if r["wall_s"] is not None]
        s, missing = sum(walls), len(rs) - len(walls)
        total_n, total_s, total_missing = total_n + len(rs), total_s + s, total_missing + missing
        lines.append(f"| {label} | {len(rs)} | {s:,.0f} s{_unrecorded(missing)} |")
    lines.append(f"| **total** | **{total_n}** | **{total_s:,.0f} s "
                 f"({int(total_s // 3600)} h {int(total_s % 3600 // 60)} min)"
                 f"{_unrecorded(total_missing)}** |")
    return lines


def _unrecorded(n: int) -> str:
    return f" (+ {n} run{'s' if n > 1 else ''} without a recorded wall)" if n else ""


def _all_runs(experiment: str) -> list[dict]:
    return [r for v in runs(experiment).values() for r in v]


def wall_table() -> list[str]:
    sweeps = []
    for exp, label in SWEEPS:
        rs = _all_runs(exp)
        if exp == "high_temperature":   # its T = 1.0 variants repeat the main comparison
            rs = [r for r in rs if not r["name"].endswith("-T1.0")]
        sweeps.append((label, rs))
    return _wall_lines(sweeps)


# ---------------------------------------------------------------- the slip testbed (issue 19)


def _mean(values) -> float:
    return float(np.mean([v for v in values if v is not None]))


def _experiment(name: str):
    from erpo_jax.tools.sweep import load_experiment
    return load_experiment(Path(__file__).with_name(f"{name}.py"))


def slip_tuning_table() -> list[str]:
    tuning, by = _experiment("slip_tuning"), runs("slip_tuning")
    chosen = tuning.chosen(_all_runs("slip_tuning"))
    lines = ["| method | coefficient | final validation greedy pass@1, per seed | mean | "
             "final validation pass@8 (mean) | final drift (mean) | chosen |",
             "|---|---|---|---|---|---|---|"]
    for method, betas in tuning.GRID.items():
        symbol = "β_policy" if method == "grpo+policy_kl" else "β_q"
        for b in betas:
            rs = by[f"{method}-b{b}"]
            greedy = [_final(r, "greedy_acc") for r in rs]
            lines.append(f"| {LABELS[method]} | {symbol} = {b:g} | "
                         f"{' / '.join(f'{100 * g:.1f}' for g in greedy)} | "
                         f"{100 * _mean(greedy):.1f} | "
                         f"{100 * _mean([_final(r, 'pass@8') for r in rs]):.1f} | "
                         f"{_mean(_drifts(rs)):.3f} | {'**yes**' if chosen[method] == b else ''} |")
    return lines


def _diff(a, b, scale: float = 100.0, digits: int = 1) -> tuple[str, dict]:
    e = report.effect(a, b)
    return (f"{e['diff'] * scale:+.{digits}f} [{(e['diff'] - e['half']) * scale:+.{digits}f}, "
            f"{(e['diff'] + e['half']) * scale:+.{digits}f}]", e)


def _ci_verdict(effects: list[dict], sign: int) -> str:
    """The CI rule over ERPO − each baseline (`report.effect`s): held when every
    95% CI is on ERPO's side of 0 (sign +1: above, -1: below), did not hold when
    one is on the other side, otherwise inconclusive."""
    sides = [sorted((sign * (e["diff"] - e["half"]), sign * (e["diff"] + e["half"])))
             for e in effects]
    return ("held" if all(lo > 0 for lo, _ in sides) else
            "did not hold" if any(hi < 0 for _, hi in sides) else "inconclusive")


def _reference_evals() -> list[dict]:
    """The step-0 evaluation of every main-comparison run: the reference, sampled
    with each run's seed."""
    by = runs("slip_testbed")
    return [r["evals"][0] for m in LABELS for r in by[m]]


def slip_reference_table() -> list[str]:
    evs = _reference_evals()
    five = [f for f in evs[0]["sets"] if f != "add_long"]
    lines = ["| families | greedy pass@1 | sampled pass@1 | pass@8 | pass@8 − pass@1 |",
             "|---|---|---|---|---|"]
    for label, fams in (("all six", list(evs[0]["sets"])), ("the five training families", five)):
        def avg(e, key):
            return float(np.mean([e["sets"][f][key] for f in fams]))
        p1, p8 = [avg(e, "pass@1") for e in evs], [avg(e, "pass@8") for e in evs]
        lines.append(f"| {label} | {100 * avg(evs[0], 'greedy_acc'):.1f} | {_pct(p1)} | "
                     f"{_pct(p8)} | {_pct(np.subtract(p8, p1))} |")
    return lines


def _ref_seconds(rs) -> float:
    """Median reference-forward seconds per step over the runs' steps."""
    return float(np.median(np.concatenate([report.series(r, "time/ref")[1] for r in rs])))


def slip_main_table() -> list[str]:
    by = runs("slip_testbed")
    lines = ["| method | final greedy pass@1 | gain over the reference | final sampled pass@1 | "
             "final pass@8 | final drift, per seed | reference forward s/step |",
             "|---|---|---|---|---|---|---|"]
    for m, label in LABELS.items():
        rs = by[m]
        gain = [_final(r, "greedy_acc") - _eval_at(r, 0) for r in rs]
        lines.append(f"| {label} | {_pct([_final(r, 'greedy_acc') for r in rs])} | "
                     f"{_pct(gain)} | {_pct([_final(r, 'pass@1') for r in rs])} | "
                     f"{_pct([_final(r, 'pass@8') for r in rs])} | {_per_seed(_drifts(rs), 2)} | "
                     f"{_ref_seconds(rs):.3f} |")
    return lines


def _collapses(rs, mod) -> list[int | None]:
    return [report.collapse_step(r, mod.COLLAPSE_DROP, mod.ENTROPY_FLOOR) for r in rs]


def _collapse_steps(rs, mod) -> list[int]:
    """The first collapse step of each run that collapsed under `mod`'s definition."""
    return [c for c in _collapses(rs, mod) if c is not None]


def _collapse_cells(rs, mod) -> str:
    """'k/n | first collapse steps' under `mod`'s collapse definition."""
    steps = _collapse_steps(rs, mod)
    return f"{len(steps)}/{len(rs)} | {', '.join(map(str, steps)) or '-'}"


def slip_search_table() -> list[str]:
    mod, by = _experiment("slip_search"), runs("slip_search")
    lines = ["| lr | T | steps | collapses | collapse steps | validation greedy: best → final, "
             "per seed | min entropy (mean) | final drift (mean) |", "|---|---|---|---|---|---|---|---|"]
    for lr, t, steps in mod.GRID:
        rs = by[mod.name("no_kl", lr, t, steps)]
        tabs = [report.eval_table(r) for r in rs]
        accs = " / ".join(f"{100 * tb['best']['average']:.1f} → {100 * tb['final']['average']:.1f}"
                          for tb in tabs)
        lines.append(f"| {lr:g} | {t:g} | {steps} | {_collapse_cells(rs, mod)} | {accs} | "
                     f"{_mean([report._min(r, 'entropy') for r in rs]):.4f} | "
                     f"{_mean(_drifts(rs)):.2f} |")
    return lines


def slip_stress_table() -> list[str]:
    mod, by = _experiment("slip_stress"), runs("slip_stress")
    lines = ["| method | collapses | collapse steps | best greedy pass@1 | final greedy pass@1 | "
             "final drift, per seed | min entropy (mean) |", "|---|---|---|---|---|---|---|"]
    for m, label in LABELS.items():
        rs = by[m]
        tabs = [report.eval_table(r) for r in rs]
        lines.append(f"| {label} | {_collapse_cells(rs, mod)} | "
                     f"{_pct([t['best']['average'] for t in tabs])} | "
                     f"{_pct([t['final']['average'] for t in tabs])} | "
                     f"{_per_seed(_drifts(rs), 2)} | "
                     f"{_mean([report._min(r, 'entropy') for r in rs]):.4f} |")
    return lines


SLIP_ABLATIONS = {
    "erpo": "nothing: QKL k3, tuned β_q = 1, likelihood weights",
    "beta_q0.03": "β_q = 0.03",
    "beta_q0.1": "β_q = 0.1",
    "beta_q0.3": "β_q = 0.3",
    "qkl+uniform": "uniform weights (Query-KL only)",
    "noqkl+likelihood": "no Query-KL (weights only)",
    "no_kl": "neither (= GRPO, no KL)",
    "qkl_k2": "Query-KL estimator k2",
    "ppo+erpo": "PPO (GAE, learned critic) + ERPO",
    "ppo+no_kl": "PPO, no KL",
    "reinforce_pp+erpo": "REINFORCE++ + ERPO",
    "reinforce_pp+no_kl": "REINFORCE++, no KL",
}


def slip_ablations_table() -> list[str]:
    by = runs("slip_testbed")
    lines = ["| variant | what changes | seeds | final greedy pass@1 | final sampled pass@1 | "
             "final drift, per seed |", "|---|---|---|---|---|---|"]
    for name, change in SLIP_ABLATIONS.items():
        rs = [r for r in by.get(name, []) if r["config"]["train"]["seed"] < 3]
        if not rs:
            continue
        lines.append(f"| {name} | {change} | {len(rs)} | "
                     f"{_pct([_final(r, 'greedy_acc') for r in rs])} | "
                     f"{_pct([_final(r, 'pass@1') for r in rs])} | {_per_seed(_drifts(rs), 2)} |")
    return lines


def _slip_settings(which=("main", "temperature", "horizon")
                   ) -> list[tuple[str, dict[str, list[dict]], str]]:
    """(label, runs, variant pattern) of the settings the three methods ran in at the
    slip budget's learning rate: the main comparison, hot rollouts, a longer horizon."""
    temp, horizon = _experiment("slip_temperature"), _experiment("slip_horizon")
    settings = {
        "main": lambda: ("T 1, 100 steps", runs("slip_testbed"), "{m}"),
        "temperature": lambda: (f"T {temp.TEMPERATURE:g}, 100 steps", runs("slip_temperature"),
                                "{m}-T" + str(temp.TEMPERATURE)),
        "horizon": lambda: (f"T 1, {horizon.FACTOR * 100} steps", runs("slip_horizon"), "{m}")}
    out = [settings[w]() for w in which]
    return [(f"{label} ({len(by[pattern.format(m='erpo')])} seeds)", by, pattern)
            for label, by, pattern in out]


def slip_verdict_table() -> list[str]:
    """Claim, the numbers that test it (ERPO − each baseline, 95% Welch CI over
    seeds), and the verdict by a fixed rule: held when every CI is on ERPO's side
    of 0, did not hold when one is on the other side, otherwise inconclusive.
    Claim 3 counts collapses: held when a baseline collapses in at least 2 seeds
    and ERPO less often than each such baseline, did not hold when a baseline does
    and ERPO does not collapse less, inconclusive when no baseline does.
    Claim 4 is timed, not counted here: ERPO's 'reference forward' time is the
    step's bookkeeping (microseconds), held when under 1% of Policy-KL's."""
    settings = _slip_settings()
    main = settings[0][1]
    lines = ["| claim | setting | measure (ERPO − baseline, 95% CI) | vs GRPO + Policy-KL | "
             "vs no KL | verdict |", "|---|---|---|---|---|---|"]

    def row(claim, setting, by, pattern, measure, fn, scale, digits, sign):
        cells, effects = [], []
        erpo = [fn(r) for r in by[pattern.format(m="erpo")]]
        for b in ("grpo+policy_kl", "no_kl"):
            text, e = _diff(erpo, [fn(r) for r in by[pattern.format(m=b)]], scale, digits)
            cells.append(text)
            effects.append(e)
        verdict = _ci_verdict(effects, sign)
        lines.append(f"| {claim} | {setting} | {measure} | {cells[0]} | {cells[1]} | **{verdict}** |")

    def collapse_row(setting, by, pattern, mod):
        counts = {m: len(_collapse_steps(by[pattern.format(m=m)], mod)) for m in LABELS}
        n = len(by[pattern.format(m="erpo")])
        collapsing = [counts[b] for b in ("grpo+policy_kl", "no_kl") if counts[b] >= 2]
        verdict = ("inconclusive" if not collapsing else
                   "held" if counts["erpo"] < min(collapsing) else "did not hold")
        lines.append(f"| 3. more stable | {setting} | collapses, ERPO {counts['erpo']}/{n} | "
                     f"{counts['grpo+policy_kl']}/{n} | {counts['no_kl']}/{n} | **{verdict}** |")

    for setting, by, pattern in settings:
        row("1. higher accuracy", setting, by, pattern, "final greedy pass@1, points",
            lambda r: _final(r, "greedy_acc"), 100, 1, 1)
        row("1. higher accuracy", setting, by, pattern, "final sampled pass@1, points",
            lambda r: _final(r, "pass@1"), 100, 1, 1)
    for setting, by, pattern in settings:
        row("2. lower query drift", setting, by, pattern, "final held-out QKL k3 (lower is better)",
            lambda r: report._last(r, "drift/qkl_k3"), 1, 2, -1)
    stress = _experiment("slip_stress")
    lr, t, steps = stress.REGIME
    collapse_row(f"stress regime: lr {lr:g}, T {t:g}, {steps} steps ({len(runs('slip_stress')['erpo'])} "
                 "seeds)", runs("slip_stress"), "{m}", stress)
    for (setting, by, pattern), mod in zip(settings[1:], (_experiment("slip_temperature"),
                                                          _experiment("slip_horizon"))):
        collapse_row(setting, by, pattern, mod)
    ref = {m: _ref_seconds(main[m]) for m in LABELS}
    lines.append(f"| 4. no extra forward pass | T 1, 100 steps | reference forward s/step, "
                 f"ERPO {ref['erpo']:.3f} | {ref['grpo+policy_kl']:.3f} | {ref['no_kl']:.3f} | "
                 f"**{'held' if ref['erpo'] < 0.01 * ref['grpo+policy_kl'] else 'did not hold'}** |")
    return lines


def _claim2_verdict(erpo, base_sides) -> str:
    """RESULTS.md's pre-declared rule for claim 2 (section 'The verdict rule'):
    an exact two-sided Mann-Whitney test on final held-out drift against each
    baseline at p < 0.05. Held when ERPO's drift is the lower in every such test
    and each is significant; did not hold when one is significant the other
    way; otherwise inconclusive. With fewer than 4 seeds a side no split can
    reach 0.05 (3 vs 3: 0.1), so such a setting gets no verdict."""
    if any(min(t["n"]) < 4 for t, _ in base_sides):
        return "n/a (under 4 seeds)"
    lower = [(np.median(erpo) < np.median(b), t["p"] < 0.05) for t, b in base_sides]
    if all(lo and sig for lo, sig in lower):
        return "held"
    if any(sig and not lo for lo, sig in lower):
        return "did not hold"
    return "inconclusive"


def slip_claim2_table() -> list[str]:
    """Claim 2 re-derived under the pre-declared rule, from the same runs as the
    verdict table: per setting, ERPO's and each baseline's median final drift,
    the exact Mann-Whitney p (primary), the ratio of geometric means with the
    95% Welch CI on log drift (the effect size), the Welch CI on raw drift as the
    old table had it (secondary), and the verdicts by both rules."""
    stress = _experiment("slip_stress")
    lr, t, steps = stress.REGIME
    by_stress = runs("slip_stress")
    settings = _slip_settings() + [
        (f"stress regime: lr {lr:g}, T {t:g}, {steps} steps ({len(by_stress['erpo'])} seeds)",
         by_stress, "{m}")]
    lines = ["| setting | median drift: ERPO / GRPO + Policy-KL / no KL | Mann-Whitney p vs "
             "GRPO + Policy-KL, vs no KL | drift ratio ERPO / baseline (95% CI on log): vs "
             "GRPO + Policy-KL | vs no KL | raw Welch CI (secondary): vs GRPO + Policy-KL | "
             "vs no KL | verdict, pre-declared rule | verdict, old rule |",
             "|---|---|---|---|---|---|---|---|---|"]
    for setting, by, pattern in settings:
        erpo = _drifts(by[pattern.format(m="erpo")])
        bases = [_drifts(by[pattern.format(m=b)]) for b in ("grpo+policy_kl", "no_kl")]
        tests = [report.rank_test(erpo, b) for b in bases]
        ratios, raws, raw_effects = [], [], []
        for b in bases:
            e = report.effect(np.log(erpo), np.log(b))
            ratios.append(f"{np.exp(e['diff']):.2g} [{np.exp(e['diff'] - e['half']):.2g}, "
                          f"{np.exp(e['diff'] + e['half']):.2g}]")
            text, raw = _diff(erpo, b, 1, 2)
            raws.append(text)
            raw_effects.append(raw)
        old = _ci_verdict(raw_effects, -1)   # lower drift is ERPO's side
        medians = " / ".join(f"{np.median(x):.3g}" for x in [erpo, *bases])
        lines.append(f"| {setting} | {medians} | {tests[0]['p']:.4f}, {tests[1]['p']:.4f} | "
                     f"{ratios[0]} | {ratios[1]} | {raws[0]} | {raws[1]} | "
                     f"**{_claim2_verdict(erpo, list(zip(tests, bases)))}** | {old} |")
    return lines


def _tuning_label(field, value) -> str:
    """'loss.x = v' (or 'loss.a = v1, loss.b = v2' for a tuple of fields)."""
    if isinstance(field, tuple):
        return ", ".join(f"{f} = {v:g}" for f, v in zip(field, value))
    return f"{field} = {value:g}"


def _tuning_row(tuning, name: str, label: str, rs: list[dict], chosen: bool) -> str:
    greedy = [_final(r, "greedy_acc") for r in rs]
    return (f"| {name} | {label} | {' / '.join(f'{100 * g:.1f}' for g in greedy)} | "
            f"{100 * _mean(greedy):.1f} | {len(_collapse_steps(rs, tuning))}/{len(rs)} | "
            f"{_mean(_drifts(rs)):.3f} | {'**yes**' if chosen else ''} |")


TUNING_HEAD = ["| method or technique | field = value | final validation greedy pass@1, per seed "
               "| mean | collapses | final drift (mean) | chosen |",
               "|---|---|---|---|---|---|---|"]


def slip_stabilizer_tuning_table() -> list[str]:
    """Each method's or technique's values on the validation split, and the
    chosen one; a value whose runs are not committed yet says so."""
    tuning, by = _experiment("slip_stabilizer_tuning"), runs("slip_stabilizer_tuning")
    chosen = tuning.chosen(_all_runs("slip_stabilizer_tuning"))
    lines = list(TUNING_HEAD)
    for name, (field, values) in tuning.GRID.items():
        seeds = {len(by.get(tuning.variant_name(name, v), [])) for v in values}
        complete = len(seeds) == 1 and 0 not in seeds   # chosen only over the whole grid
        for v in values:
            rs = by.get(tuning.variant_name(name, v))
            if not rs:
                lines.append(f"| {name} | {_tuning_label(field, v)} | not run yet | | | | |")
                continue
            lines.append(_tuning_row(tuning, name, _tuning_label(field, v), rs,
                                     complete and chosen.get(name) == v))
    return lines


# The first grid of the rows issue 47 re-tuned (issue 35's runs, kept apart).
FIRST_GRID_FIELDS = {"adaptive_kl": "loss.kl_target", "clip_cov": "loss.clip_cov_ratio",
                     "kl_cov": "loss.kl_cov_ratio", "dapo": "loss.eps_high",
                     "erpo+dapo": "loss.beta_query"}


def slip_stabilizer_tuning_v1_table() -> list[str]:
    """The re-tuned rows' first grid (experiments/results/slip_stabilizer_tuning_v1)."""
    tuning, by = _experiment("slip_stabilizer_tuning"), runs("slip_stabilizer_tuning_v1")
    chosen = tuning.chosen(_all_runs("slip_stabilizer_tuning_v1"))
    lines = list(TUNING_HEAD)
    for variant in sorted(by, key=tuning.variant_value):
        name, v = tuning.variant_value(variant)
        lines.append(_tuning_row(tuning, name, _tuning_label(FIRST_GRID_FIELDS[name], v),
                                 by[variant], chosen.get(name) == v))
    return lines


GRID_SEEDS = (0, 1, 2)   # slip_grid.py declares 3 seeds; a reused cell gives its seeds 0-2


def _grid_cells() -> dict[tuple[float, float], dict]:
    """{(lr, T): {'source': experiment, 'runs': {method: runs of GRID_SEEDS}}} over
    the declared grid, slip_grid.py's own cells and the ones it reuses."""
    grid = _experiment("slip_grid")
    cells = {}
    for t in grid.TEMPERATURES:
        for lr in grid.LRS:
            exp = grid.REUSED.get((lr, t), "slip_grid")
            by = runs(exp)
            name = {"slip_grid": lambda m: grid.cell_name(m, lr, t),
                    "slip_temperature": lambda m: f"{m}-T{t:g}"}.get(exp, lambda m: m)
            cells[(lr, t)] = {"source": exp, "runs": {
                m: [r for r in by[name(m)] if r["config"]["train"]["seed"] in GRID_SEEDS]
                for m in LABELS}}
    return cells


def _grid_counts(cells) -> dict[str, tuple[int, int]]:
    """{method: (collapsed runs, runs)} pooled over the grid."""
    grid = _experiment("slip_grid")
    out = {m: [0, 0] for m in LABELS}
    for cell in cells.values():
        for m, rs in cell["runs"].items():
            out[m][0] += len(_collapse_steps(rs, grid))
            out[m][1] += len(rs)
    return {m: tuple(v) for m, v in out.items()}


def slip_grid_table() -> list[str]:
    """Each grid cell: collapses and final greedy pass@1 per method (3 seeds)."""
    grid, cells = _experiment("slip_grid"), _grid_cells()
    heads = " | ".join(f"{LABELS[m]}: collapses" for m in LABELS)
    lines = [f"| lr | T | runs from | {heads} | final greedy pass@1: "
             + " / ".join(LABELS.values()) + " |", "|---|---|---|---|---|---|---|"]
    for (lr, t), cell in cells.items():
        cols = [f"{len(_collapse_steps(cell['runs'][m], grid))}/{len(cell['runs'][m])}"
                for m in LABELS]
        accs = " / ".join(f"{100 * _mean([_final(r, 'greedy_acc') for r in cell['runs'][m]]):.1f}"
                          for m in LABELS)
        lines.append(f"| {lr:g} | {t:g} | {cell['source']} | {' | '.join(cols)} | {accs} |")
    return lines


def slip_grid_claim3_table() -> list[str]:
    """Claim 3 over the whole grid by the pre-declared rule: ERPO's pooled
    collapses against each baseline's, a two-sided Fisher exact test."""
    from scipy.stats import fisher_exact
    counts = _grid_counts(_grid_cells())
    e, n = counts["erpo"]
    lines = ["| pooled over the grid | collapsed runs | vs ERPO: Fisher exact p (two-sided) |",
             "|---|---|---|", f"| ERPO | {e}/{n} | |"]
    tests = {}
    for b in ("grpo+policy_kl", "no_kl"):
        k, m = counts[b]
        p = fisher_exact([[e, n - e], [k, m - k]])[1]
        tests[b] = (k, p)
        lines.append(f"| {LABELS[b]} | {k}/{m} | {p:.3g} |")
    if all(e < k and p < 0.05 for k, p in tests.values()):
        verdict = "held"
    elif any(k >= 2 and e >= k for k, _ in tests.values()):
        verdict = "did not hold"
    else:
        verdict = "inconclusive"
    lines.append(f"| **claim 3 over the grid** | **{verdict}** | |")
    return lines


def slip_grid_heatmap(path) -> None:
    """The grid as a PNG: per method (columns), its collapses out of its runs
    (top) and its mean final greedy pass@1 (bottom), T (rows) by lr (columns)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    grid, cells = _experiment("slip_grid"), _grid_cells()
    lrs, temps = grid.LRS, grid.TEMPERATURES
    fig, axes = plt.subplots(2, len(LABELS), figsize=(4 * len(LABELS), 5.5), squeeze=False)
    for j, (m, label) in enumerate(LABELS.items()):
        coll = np.array([[len(_collapse_steps(cells[(lr, t)]["runs"][m], grid)) for lr in lrs]
                         for t in temps])
        size = np.array([[len(cells[(lr, t)]["runs"][m]) for lr in lrs] for t in temps])
        acc = np.array([[100 * _mean([_final(r, "greedy_acc") for r in cells[(lr, t)]["runs"][m]])
                         for lr in lrs] for t in temps])
        for i, (values, title, vmax, cmap) in enumerate((
                (coll / size, f"{label}: collapses", 1.0, "Reds"),
                (acc, f"{label}: final greedy pass@1 (%)", 100.0, "viridis"))):
            ax = axes[i, j]
            ax.imshow(values, vmin=0.0, vmax=vmax, cmap=cmap, aspect="auto", origin="lower")
            for r, t in enumerate(temps):
                for c, lr in enumerate(lrs):
                    text = f"{coll[r, c]}/{size[r, c]}" if i == 0 else f"{acc[r, c]:.1f}"
                    ax.text(c, r, text, ha="center", va="center",
                            color="black" if i == 0 and values[r, c] < 0.6 else "white")
            ax.set_xticks(range(len(lrs)), [f"{lr:g}" for lr in lrs])
            ax.set_yticks(range(len(temps)), [f"{t:g}" for t in temps])
            ax.set_xlabel("learning rate")
            ax.set_ylabel("rollout temperature")
            ax.set_title(title, fontsize=10)
    fig.suptitle(f"Slip testbed stability grid: 100 steps, seeds {GRID_SEEDS[0]}-{GRID_SEEDS[-1]}")
    fig.tight_layout()
    fig.savefig(path, dpi=100, metadata={"Software": None})
    plt.close(fig)


def slip_temperature_table() -> list[str]:
    """The three methods at rollout temperature 1 (the main comparison) and hot."""
    lines = ["| T | method | final greedy pass@1 | final sampled pass@1 | final pass@8 | "
             "collapses | final drift, per seed | min entropy (mean) |",
             "|---|---|---|---|---|---|---|---|"]
    temp = _experiment("slip_temperature")
    for (_, by, pattern), t in zip(_slip_settings(("main", "temperature")),
                                   (1.0, temp.TEMPERATURE)):
        for m, label in LABELS.items():
            rs = by[pattern.format(m=m)]
            n = len(_collapse_steps(rs, temp))
            lines.append(f"| {t:g} | {label} | {_pct([_final(r, 'greedy_acc') for r in rs])} | "
                         f"{_pct([_final(r, 'pass@1') for r in rs])} | "
                         f"{_pct([_final(r, 'pass@8') for r in rs])} | {n}/{len(rs)} | "
                         f"{_per_seed(_drifts(rs), 2)} | "
                         f"{_mean([report._min(r, 'entropy') for r in rs]):.4f} |")
    return lines


def slip_horizon_table() -> list[str]:
    mod, by = _experiment("slip_horizon"), runs("slip_horizon")
    half = mod.FACTOR * 100 // 2
    lines = [f"| method | greedy pass@1 at {half} → {2 * half} | best greedy pass@1 | collapses | "
             f"collapse steps | sampled pass@1 at {2 * half} | pass@8 at {2 * half} | "
             f"drift at {half} → {2 * half} (mean) | max drift, per seed |",
             "|---|---|---|---|---|---|---|---|---|"]
    for m, label in LABELS.items():
        rs = by[m]
        mid = []   # each run's last drift measurement at or before step `half`
        for r in rs:
            steps, drift = report.series(r, "drift/qkl_k3")
            mid.append(float(drift[steps <= half][-1]))
        lines.append(f"| {label} | {100 * _mean([_eval_at(r, half) for r in rs]):.1f} → "
                     f"{_pct([_final(r, 'greedy_acc') for r in rs])} | "
                     f"{_pct([report.eval_table(r)['best']['average'] for r in rs])} | "
                     f"{_collapse_cells(rs, mod)} | {_pct([_final(r, 'pass@1') for r in rs])} | "
                     f"{_pct([_final(r, 'pass@8') for r in rs])} | "
                     f"{_mean(mid):.2f} → {_mean(_drifts(rs)):.2f} | "
                     f"{_per_seed([report._max(r, 'drift/qkl_k3') for r in rs], 2)} |")
    return lines


def slip_wall_table() -> list[str]:
    def seeds(exp):
        return len({r["config"]["train"]["seed"] for r in _all_runs(exp)})

    return _wall_lines([
        (label, _all_runs(exp)) for exp, label in (
            ("slip_tuning", "coefficients on validation (2 seeds)"),
            ("slip_search", "stress-regime search on validation (2 seeds)"),
            ("slip_testbed", "main comparison (5 seeds) and ablations (3 seeds)"),
            ("slip_temperature", f"temperature ({seeds('slip_temperature')} seeds)"),
            ("slip_horizon", f"long horizon ({seeds('slip_horizon')} seeds)"),
            ("slip_stress", f"stress regime ({seeds('slip_stress')} seeds)"))])


# ---------------------------------------------------------------- the stabilizer comparison (issue 35)

STABILIZER_LABELS = {"erpo": "ERPO", **LABELS,
                     "adaptive_kl": "adaptive KL", "clip_higher": "clip-higher",
                     "entropy_bonus": "entropy bonus", "clip_cov": "Clip-Cov",
                     "kl_cov": "KL-Cov", "dapo": "DAPO", "erpo+dapo": "ERPO + DAPO"}
# (ERPO's side, the other side) of each verdict row: ERPO against every method
# and technique, and ERPO + DAPO against DAPO alone (does ERPO add to DAPO?).
STABILIZER_PAIRS = ([("erpo", m) for m in STABILIZER_LABELS if m not in ("erpo", "erpo+dapo")]
                    + [("erpo+dapo", "dapo")])


def _stabilizer_settings() -> list[tuple[str, dict[str, list[dict]]]]:
    """(setting, {method: runs}) of each slip_stabilizers.py setting whose runs are
    committed, in the order the experiment declares them."""
    mod = _experiment("slip_stabilizers")
    if not (RESULTS / mod.EXPERIMENT / "runs").is_dir():
        return []
    by = runs(mod.EXPERIMENT)
    out = []
    for s in mod.SETTINGS:
        found = {m: by[f"{m}-{s}"] for m in STABILIZER_LABELS if f"{m}-{s}" in by}
        if found:
            out.append((s, found))
    return out


def _setting_label(setting: str) -> str:
    t, steps = _experiment("slip_stabilizers").SETTINGS[setting]
    return f"T {t:g}, {steps} steps"


def _step_seconds(r) -> float:
    """Median wall seconds of a training step: rollout, reference and update."""
    parts = [report.series(r, k)[1] for k in ("time/rollout", "time/ref", "time/update")]
    return float(np.median(np.sum(parts, axis=0)))


def _sampled_prompts(r) -> np.ndarray:
    """Prompts sampled by the end of each logged step (dynamic sampling draws more)."""
    return np.cumsum(report.series(r, "rollout/prompts_sampled")[1])


def _greedy_within(r, budget: float) -> tuple[float, int]:
    """(greedy pass@1, step) at the run's last evaluation whose prompts sampled so
    far are within `budget`: the accuracy at equal sampled responses."""
    steps, sampled = report.series(r, "rollout/prompts_sampled")[0], _sampled_prompts(r)
    best = (r["evals"][0]["average"]["greedy_acc"], r["evals"][0]["step"])
    for e in r["evals"]:
        used = sampled[steps <= e["step"]]
        if e["step"] == 0 or (used.size and used[-1] <= budget):
            best = (e["average"]["greedy_acc"], e["step"])
    return best


def slip_stabilizers_table() -> list[str]:
    """Each method and technique of the comparison, per setting: final test
    accuracy, drift, collapses, and what a step costs."""
    mod = _experiment("slip_stabilizers")
    lines = ["| setting | method or technique | final greedy pass@1 | final sampled pass@1 | "
             "final pass@8 | final drift (median) | collapses | s per step (median) | "
             "prompts sampled per step |", "|---|---|---|---|---|---|---|---|---|"]
    for setting, by in _stabilizer_settings():
        for m, rs in by.items():
            prompts = np.mean([_sampled_prompts(r)[-1] / len(r["metrics"]) for r in rs])
            lines.append(f"| {_setting_label(setting)} | {STABILIZER_LABELS[m]} | "
                         f"{_pct([_final(r, 'greedy_acc') for r in rs])} | "
                         f"{_pct([_final(r, 'pass@1') for r in rs])} | "
                         f"{_pct([_final(r, 'pass@8') for r in rs])} | "
                         f"{np.median(_drifts(rs)):.3g} | {len(_collapse_steps(rs, mod))}/{len(rs)} | "
                         f"{np.mean([_step_seconds(r) for r in rs]):.2f} | {prompts:.1f} |")
    return lines


def _series(r, key) -> list[float]:
    return [m[key] for m in r["metrics"] if m.get(key) is not None]


def _mechanics_rows(tuning, by: dict, label) -> list[str]:
    lines = []
    for variant in sorted(by):
        for r in by[variant]:
            kl = _series(r, "kl_coef") + _series(r, "kl_coef_next")
            short = _series(r, "filter/short")
            if not kl and not short:
                continue
            steps = len(r["metrics"])
            kl_cell = f"{min(kl):.3g} – {max(kl):.3g}" if kl else ""
            short_cell = (f"{sum(1 for x in short if x > 0)}/{steps} "
                          f"({100 * sum(1 for x in short if x > 0) / steps:.0f}%)"
                          if short else "")
            prompts = (f"{_sampled_prompts(r)[-1] / steps:.1f}" if short else "")
            lines.append(f"| {label(variant)} | {r['config']['train']['seed']} | {kl_cell} | "
                         f"{short_cell} | {prompts} |")
    return lines


MECHANICS_HEAD = ["| run | seed | kl_coef over the run (min – max) | steps dynamic sampling "
                  "left short | prompts sampled per step |", "|---|---|---|---|---|"]


def slip_stabilizer_mechanics_table() -> list[str]:
    """What the adaptive controller and dynamic sampling did in each run of the
    stabilizer tuning and comparison: the coefficient's range, the steps left
    short of varied groups, the prompts a step sampled (issue 47)."""
    tuning = _experiment("slip_stabilizer_tuning")
    lines = list(MECHANICS_HEAD)
    for exp, tag in (("slip_stabilizer_tuning_v1", "tuning, first grid"),
                     ("slip_stabilizer_tuning", "tuning"),
                     ("slip_stabilizers", "comparison")):
        lines += _mechanics_rows(tuning, runs(exp), lambda v, t=tag: f"{t}: {v}")
    return lines


def _accuracy_verdict(e: dict) -> str:
    """Claim 1's rule (`_ci_verdict`) on one difference, ERPO's side first."""
    return {"held": "wins", "did not hold": "loses", "inconclusive": "ties"}[_ci_verdict([e], 1)]


def _drift_cell(a, b) -> str:
    """Median final drift of each side and the exact Mann-Whitney p (claim 2's rule)."""
    t = report.rank_test(a, b)
    side = ("lower" if np.median(a) < np.median(b) else "higher") if t["p"] < 0.05 else "n.s."
    return f"{np.median(a):.3g} / {np.median(b):.3g}, p {t['p']:.3f} ({side})"


def slip_stabilizer_verdicts_table() -> list[str]:
    """ERPO − each method or technique (and ERPO + DAPO − DAPO), 95% Welch CIs
    over seeds, per setting; accuracy also at equal sampled responses (the
    filtering side's last evaluation within the other side's prompts); the
    verdict is claim 1's rule on final greedy pass@1 at equal steps."""
    mod = _experiment("slip_stabilizers")
    lines = ["| setting | ERPO side − other side | greedy pass@1, points | sampled pass@1 | "
             "pass@8 | greedy pass@1 at equal sampled responses (steps reached) | "
             "final drift: medians, Mann-Whitney | collapses | s per step, ratio | "
             "accuracy verdict |", "|---|---|---|---|---|---|---|---|---|---|"]
    for setting, by in _stabilizer_settings():
        for a, b in STABILIZER_PAIRS:
            if a not in by or b not in by:
                continue
            ra, rb = by[a], by[b]
            cells, effects = [], []
            for key in ("greedy_acc", "pass@1", "pass@8"):
                text, e = _diff([_final(r, key) for r in ra], [_final(r, key) for r in rb])
                cells.append(text)
                effects.append(e)
            budget = min(np.mean([_sampled_prompts(r)[-1] for r in side]) for side in (ra, rb))
            at_a, at_b = ([_greedy_within(r, budget) for r in side] for side in (ra, rb))
            text, _ = _diff([g for g, _ in at_a], [g for g, _ in at_b])
            reached = (f"{int(np.mean([s for _, s in at_a]))} / "
                       f"{int(np.mean([s for _, s in at_b]))}")
            cost = np.mean([_step_seconds(r) for r in ra]) / np.mean([_step_seconds(r) for r in rb])
            lines.append(f"| {_setting_label(setting)} | {STABILIZER_LABELS[a]} − "
                         f"{STABILIZER_LABELS[b]} | {' | '.join(cells)} | {text} ({reached}) | "
                         f"{_drift_cell(_drifts(ra), _drifts(rb))} | "
                         f"{len(_collapse_steps(ra, mod))}/{len(ra)} vs "
                         f"{len(_collapse_steps(rb, mod))}/{len(rb)} | {cost:.2f} | "
                         f"**{_accuracy_verdict(effects[0])}** |")
    return lines


def slip_stabilizer_old_new_table() -> list[str]:
    """ERPO − each row issue 47 re-ran (and ERPO + DAPO − DAPO), before (issue
    35's runs of the row, experiments/results/slip_stabilizers_v1) and now,
    with the verdict of claim 1's rule on final greedy pass@1 each time; ERPO
    was not re-run, so its runs are the same on both sides."""
    lines = ["| setting | ERPO side − other side | before: greedy pass@1, points | before | "
             "now: greedy pass@1, points | now | verdict |", "|---|---|---|---|---|---|---|"]
    if not (RESULTS / "slip_stabilizers_v1" / "runs").is_dir():
        return lines
    old = runs("slip_stabilizers_v1")
    for setting, by in _stabilizer_settings():
        for a, b in STABILIZER_PAIRS:
            ka, kb = f"{a}-{setting}", f"{b}-{setting}"
            if a not in by or b not in by or (ka not in old and kb not in old):
                continue
            acc = lambda rs: [_final(r, "greedy_acc") for r in rs]
            before, eb = _diff(acc(old.get(ka, by[a])), acc(old.get(kb, by[b])))
            now, en = _diff(acc(by[a]), acc(by[b]))
            vb, vn = _accuracy_verdict(eb), _accuracy_verdict(en)
            lines.append(f"| {_setting_label(setting)} | {STABILIZER_LABELS[a]} − "
                         f"{STABILIZER_LABELS[b]} | {before} | {vb} | {now} | {vn} | "
                         f"{'stands' if vb == vn else '**reversed**'} |")
    return lines


def slip_stabilizer_wall_table() -> list[str]:
    mods = [("slip_grid", "stability grid (new cells, 3 seeds)"),
            ("slip_stabilizer_tuning_v1", "stabilizer tuning, the first grid of the rows "
             "issue 47 re-tuned (2 seeds)"),
            ("slip_stabilizer_tuning", "stabilizer tuning on validation (2 seeds)"),
            ("slip_stabilizers_v1", "stabilizer comparison, issue 35's runs of the rows "
             "issue 47 re-ran (5 seeds)")]
    sweeps = [(label, _all_runs(exp)) for exp, label in mods]
    for setting, by in _stabilizer_settings():
        n = len({r["config"]["train"]["seed"] for rs in by.values() for r in rs})
        sweeps.append((f"stabilizer comparison, {_setting_label(setting)} ({n} seeds)",
                       [r for rs in by.values() for r in rs]))
    return _wall_lines(sweeps)


def slip_lora_tuning_table() -> list[str]:
    """LoRA's learning rate per method on the validation split (rank 8, seed 0)."""
    mod, by = _experiment("slip_lora"), runs("slip_lora")
    lines = ["| method | lr | final validation greedy pass@1 | final drift | chosen |",
             "|---|---|---|---|---|"]
    for m in mod.METHODS:
        for lr in mod.TUNE_LRS:
            rs = by[mod.tuning_name(m, lr)]
            greedy = " / ".join(f"{100 * _final(r, 'greedy_acc'):.1f}" for r in rs)
            lines.append(f"| {LABELS[m]} | {lr:g} | {greedy} | "
                         f"{_mean(_drifts(rs)):.3f} | "
                         f"{'**yes**' if mod.CHOSEN_LR[m] == lr else ''} |")
    return lines


def _lora_rows(mod) -> dict:
    """{(method, rank or 'full'): runs of seeds 0..2}: LoRA from slip_lora,
    full fine-tuning from slip_temperature (the same runs at rank 0)."""
    by, full = runs("slip_lora"), runs("slip_temperature")
    seeds = {0, 1, 2}
    out = {}
    for m in mod.METHODS:
        out[m, "full"] = [r for r in full[f"{m}-T{mod.TEMPERATURE:g}"]
                          if r["config"]["train"]["seed"] in seeds]
        for rank in mod.RANKS:
            out[m, rank] = by.get(f"{m}-lora{rank}", [])
    return out


def slip_lora_table() -> list[str]:
    """ERPO and GRPO + Policy-KL under LoRA ranks 1, 8, 32 against full
    fine-tuning (T 1.5, 100 steps, 3 seeds): final greedy pass@1, ERPO's lead
    under the CI rule, and each rank's cost against full fine-tuning."""
    mod = _experiment("slip_lora")
    rows = _lora_rows(mod)
    lines = ["| trained | ERPO final greedy pass@1 | GRPO + Policy-KL | ERPO − GRPO + Policy-KL "
             "(95% CI) | ERPO's lead | ERPO: this − full | GRPO + Policy-KL: this − full | "
             "final drift ERPO / GRPO + PKL |",
             "|---|---|---|---|---|---|---|---|"]
    acc = lambda rs: [_final(r, "greedy_acc") for r in rs]
    for key in ("full", *mod.RANKS):
        e, g = rows["erpo", key], rows["grpo+policy_kl", key]
        if not e or not g:
            continue
        diff, eff = _diff(acc(e), acc(g))
        label = "full fine-tuning" if key == "full" else f"LoRA rank {key}"
        cost = ["", ""] if key == "full" else [
            _diff(acc(rows[m, key]), acc(rows[m, "full"]))[0] for m in mod.METHODS]
        lines.append(f"| {label} | {_pct(acc(e))} | {_pct(acc(g))} | {diff} | "
                     f"{_ci_verdict([eff], +1)} | {cost[0]} | {cost[1]} | "
                     f"{_mean(_drifts(e)):.2f} / {_mean(_drifts(g)):.2f} |")
    return lines


TABLES = {"wall": wall_table, "main": main_table, "drift": drift_table,
          "temperature": temperature_table, "long_horizon": long_horizon_table,
          "ablations": ablations_table, "slip_verdicts": slip_verdict_table,
          "slip_claim2": slip_claim2_table,
          "slip_reference": slip_reference_table, "slip_tuning": slip_tuning_table,
          "slip_search": slip_search_table, "slip_main": slip_main_table,
          "slip_stress": slip_stress_table, "slip_ablations": slip_ablations_table,
          "slip_temperature": slip_temperature_table, "slip_horizon": slip_horizon_table,
          "slip_wall": slip_wall_table, "slip_grid": slip_grid_table,
          "slip_grid_claim3": slip_grid_claim3_table,
          "slip_stabilizer_tuning": slip_stabilizer_tuning_table,
          "slip_stabilizer_tuning_v1": slip_stabilizer_tuning_v1_table,
          "slip_stabilizer_mechanics": slip_stabilizer_mechanics_table,
          "slip_stabilizers": slip_stabilizers_table,
          "slip_stabilizer_verdicts": slip_stabilizer_verdicts_table,
          "slip_stabilizer_old_new": slip_stabilizer_old_new_table,
          "slip_stabilizer_wall": slip_stabilizer_wall_table,
          "slip_lora_tuning": slip_lora_tuning_table, "slip_lora": slip_lora_table}
GRID_PNG = RESULTS / "slip_grid" / "grid.png"


def render(name: str) -> str:
    return f"<!-- table: {name} -->\n" + "\n".join(TABLES[name]()) + "\n"


def main(argv: list[str]) -> int:
    if argv[:1] == ["--grid-png"]:   # the stability grid's heat-map
        slip_grid_heatmap(argv[1] if len(argv) > 1 else GRID_PNG)
        return 0
    names = argv or list(TABLES)
    unknown = [n for n in names if n not in TABLES]
    if unknown:
        print(f"unknown table(s) {unknown}; choose from {list(TABLES)}", file=sys.stderr)
        return 2
    print("\n".join(render(n) for n in names))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
