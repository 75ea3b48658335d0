"""Gradient-flow inspector on the real tiny model, its table and its CLI."""

import json

import jax

import pytest

from erpo_jax.model.config import ModelConfig
from erpo_jax.rl import grad_flow
from erpo_jax.rl.loss import LossConfig
from erpo_jax.rl.synthetic import random_params, synthetic_batch

# The CLI defaults (beta_policy 0.05, beta_query 0.1, entropy 0.01) with these shapes,
# so the CLI test reuses the compiled inspector.
SHAPES = dict(num_queries=2, group_size=2, query_width=6, response_width=6)
CLI_ARGS = ["--queries", "2", "--group-size", "2", "--query-width", "6", "--response-width", "6",
            "--temperature", "0.7"]
CFG = LossConfig(beta_policy=0.05, beta_query=0.1, entropy_coef=0.01)


@pytest.fixture(scope="module")
def report():
    cfg = ModelConfig()
    params = random_params(cfg, 0)
    batch = synthetic_batch(params, cfg, 0, temperature=0.7, **SHAPES)
    return grad_flow.inspect_gradients(params, cfg, batch, CFG, temperature=0.7)


def test_gradient_routing_on_the_model(report):
    t = report["terms"]
    assert list(t) == ["pg", "policy_kl", "query_kl", "entropy", "total"]
    assert t["query_kl"]["logit_grad_response"] == 0.0
    assert t["query_kl"]["logit_grad_query"] > 0
    for name in ("pg", "policy_kl", "entropy"):
        assert t[name]["logit_grad_query"] == 0.0, name
        assert t[name]["logit_grad_response"] > 0, name
    for name in t:
        assert t[name]["logit_grad_other"] == 0.0, name
        assert t[name]["param_grad_norm"] > 0, name
    total = sum(t[n]["value"] for n in ("pg", "policy_kl", "query_kl", "entropy"))
    assert t["total"]["value"] == pytest.approx(total, rel=1e-6)


def test_cosines_are_consistent(report):
    t, cos = report["terms"], report["cosine"]
    assert len(cos) == 10 and all(-1 - 1e-5 <= c <= 1 + 1e-5 for c in cos.values())
    # <g_total, g_total> = sum over terms of <g_total, g_term>, i.e. |total| = sum of
    # |term| * cos(term, total): the total's parameter gradient is the sum of the terms'.
    norms = {n: t[n]["param_grad_norm"] for n in t}
    proj = sum(norms[n] * cos[f"{n}|total"] for n in ("pg", "policy_kl", "query_kl", "entropy"))
    assert proj == pytest.approx(norms["total"], rel=1e-4)


def test_format_table(report):
    table = grad_flow.format_table(report)
    lines = table.splitlines()
    assert lines[0].split()[0] == "term"
    for name in report["terms"]:
        assert any(line.startswith(name) for line in lines)
    assert "cosine" in table


def test_cli_main(tmp_path, capsys):
    out = tmp_path / "report.json"
    rep = grad_flow.main(CLI_ARGS + ["--json", str(out)])
    printed = capsys.readouterr().out
    assert "query_kl" in printed and "|dL/dz| query" in printed
    assert rep["terms"]["query_kl"]["logit_grad_response"] == 0.0
    saved = json.loads(out.read_text())
    assert saved["terms"]["pg"]["logit_grad_query"] == 0.0
    assert saved["loss_config"]["beta_query"] == 0.1
    with pytest.raises(SystemExit, match="cannot load --checkpoint.*no config.json"):
        grad_flow.main(CLI_ARGS + ["--checkpoint", "/nonexistent"])
    with pytest.raises(SystemExit, match="LossConfig.seq_sum_norm_const"):
        grad_flow.main(CLI_ARGS + ["--agg-mode", "seq_sum_norm", "--seq-sum-norm-const", "0"])


def test_add_parser_registers_subcommand():
    import argparse

    parser = argparse.ArgumentParser(prog="erpo")
    grad_flow.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["inspect-grads", "--beta-query", "0.3", "--unit"])
    assert args.func is grad_flow.run and args.beta_query == 0.3 and args.unit
    assert {"checkpoint", "preset", "temperature", "agg_mode"} <= set(vars(args))


def test_cli_loads_an_hf_checkpoint(tmp_path):
    from erpo_jax.model import model as model_lib
    from erpo_jax.model.config import PRESETS
    from erpo_jax.model.hf import export_hf
    cfg = PRESETS["tiny"]
    export_hf(model_lib.init_params(cfg, jax.random.key(5)), cfg, tmp_path / "ckpt")
    rep = grad_flow.main(CLI_ARGS + ["--checkpoint", str(tmp_path / "ckpt")])
    assert rep["terms"]["query_kl"]["logit_grad_response"] == 0.0
    assert rep["terms"]["query_kl"]["logit_grad_query"] > 0.0


def test_a_zero_term_has_a_zero_parameter_gradient_at_longer_lengths():
    """At the arithmetic task's shapes (68 positions) the inspector's parameter
    gradients of terms whose coefficient is 0 are exactly 0, and the terms'
    parameter gradients add up to the total's (a vmapped backward through the
    attention mixed the terms' cotangents: 0.116 for a zero term)."""
    from erpo_jax.model.config import PRESETS
    cfg = PRESETS["arith-small"]
    params = random_params(cfg, 0)
    batch = synthetic_batch(params, cfg, 0, num_queries=2, group_size=2, query_width=24,
                            response_width=44)
    rep = grad_flow.inspect_gradients(params, cfg, batch, LossConfig(beta_query=0.1))
    t, cos = rep["terms"], rep["cosine"]
    for name in ("policy_kl", "entropy"):
        assert t[name]["param_grad_norm"] == 0.0, name
    proj = sum(t[n]["param_grad_norm"] * cos[f"{n}|total"] for n in ("pg", "query_kl"))
    assert proj == pytest.approx(t["total"]["param_grad_norm"], rel=1e-4)
