"""The lists of loss terms and policy losses outside the registries are read
from them: a term or policy loss registered for one test is in the gradient
inspector's `--unit` coefficients, its synthetic loss and CLI flags and
choices, and the run header (`methods.describe`), with no edit elsewhere."""

from __future__ import annotations

import argparse
import dataclasses

import jax.numpy as jnp
import pytest

from erpo_jax.rl import grad_flow
from erpo_jax.rl.loss import LossConfig
from erpo_jax.rl.policy_losses import POLICY_LOSSES, PolicyLoss, register_policy_loss
from erpo_jax.rl.terms import TERMS, Term, register
from erpo_jax.train.config import RunConfig
from erpo_jax.train.methods import describe


@dataclasses.dataclass(frozen=True)
class ProbeLossConfig(LossConfig):
    """LossConfig with the probe term's coefficient, as a new term's field would be."""
    probe_coef: float = 0.0


def _probe(inputs):
    return inputs.agg(jnp.square(inputs.logp)), {}


def _probe_pg(inputs, adv, log_ratio, ratio, selected=None):
    return -adv * ratio, {}


@pytest.fixture
def probe_term():
    """A loss term with its own coefficient field, registered for one test."""
    term = register(Term("probe", _probe, coef="probe_coef", normaliser="response"))
    try:
        yield term
    finally:
        del TERMS["probe"]


@pytest.fixture
def probe_pg_loss():
    """A policy loss registered for one test."""
    entry = register_policy_loss(PolicyLoss("probe_pg", _probe_pg, doc="-A r"))
    try:
        yield entry
    finally:
        del POLICY_LOSSES["probe_pg"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="erpo")
    grad_flow.add_parser(parser.add_subparsers(dest="command"))
    return parser


def _choices(parser: argparse.ArgumentParser, dest: str) -> tuple:
    sub = parser._subparsers._group_actions[0].choices["inspect-grads"]
    return tuple(next(a for a in sub._actions if a.dest == dest).choices)


def test_the_lists_are_the_registries_today():
    """Without a new entry the lists are the ones these modules spelled out."""
    assert grad_flow.coefficient_fields() == ("beta_policy", "beta_query", "entropy_coef")
    assert grad_flow.LOSS_FLAGS == ("beta_policy", "beta_query", "entropy_coef",
                                    "policy_kl_estimator", "query_kl_estimator", "agg_mode",
                                    "seq_sum_norm_const", "pg_loss")
    assert grad_flow.SYNTHETIC_LOSS["beta_policy"] == 0.05
    assert _choices(_parser(), "pg_loss") == ("ppo_clip", "clip_cov", "kl_cov")
    unit = grad_flow.unit_coefficients(LossConfig(kl_target=0.0), has_ref_logp=True)
    assert (unit.beta_policy, unit.beta_query, unit.entropy_coef) == (1.0, 1.0, 1.0)
    no_ref = grad_flow.unit_coefficients(
        LossConfig(beta_policy=0.04, policy_kl_mode="reward"), has_ref_logp=False)
    assert (no_ref.beta_policy, no_ref.beta_query, no_ref.policy_kl_mode) == (0.0, 1.0, "loss")


def test_a_registered_term_is_in_unit_the_cli_and_the_header(probe_term):
    cfg = ProbeLossConfig(beta_query=0.1)
    unit = grad_flow.unit_coefficients(cfg, has_ref_logp=True)
    assert unit.probe_coef == 1.0 and probe_term.is_on(unit)
    assert (unit.beta_policy, unit.beta_query, unit.entropy_coef) == (1.0, 1.0, 1.0)

    assert grad_flow.coefficient_fields()[-1] == "probe_coef"
    assert "probe_coef" in grad_flow.LOSS_FLAGS
    assert grad_flow.SYNTHETIC_LOSS["probe_coef"] == grad_flow.SYNTHETIC_COEF > 0
    args = _parser().parse_args(["inspect-grads", "--probe-coef", "0.25"])
    assert args.probe_coef == 0.25
    assert _parser().parse_args(["inspect-grads"]).probe_coef is None

    on = describe(RunConfig(loss=ProbeLossConfig(probe_coef=0.25)))
    assert "probe=0.25" in on, on
    off = describe(RunConfig(loss=ProbeLossConfig()))
    assert "probe" not in off and "policy_kl=off, query_kl=off, weights=" in off, off


def test_a_term_the_coefficient_cannot_turn_on_is_refused_by_unit(probe_term):
    """A term whose `active` reads more than its coefficient would be silently
    off under --unit; unit_coefficients says so instead."""
    del TERMS["probe"]
    register(dataclasses.replace(probe_term, active=lambda c: False))
    with pytest.raises(ValueError, match=r"leave the terms \['probe'\] off"):
        grad_flow.unit_coefficients(ProbeLossConfig(), has_ref_logp=True)


def test_a_registered_policy_loss_is_a_cli_choice_and_in_the_header(probe_pg_loss):
    assert _choices(_parser(), "pg_loss")[-1] == "probe_pg"
    assert _parser().parse_args(["inspect-grads", "--pg-loss", "probe_pg"]).pg_loss == "probe_pg"
    line = describe(RunConfig(loss=LossConfig(pg_loss="probe_pg")))
    assert "pg_loss=probe_pg" in line, line


def test_a_registered_rollout_correction_is_a_config_choice_and_masks_the_pg_term():
    """`loss.rollout_correction` reads its registry: an entry registered for
    one test is accepted by the config, named in the header, and its mask is
    what the PG term keeps (this one drops the second half of each response);
    Query-KL is unchanged by it."""
    import jax
    import numpy as np

    from erpo_jax.rl.loss import loss_terms, stats_from_logits
    from erpo_jax.rl.rollout_correction import (ROLLOUT_CORRECTIONS, RolloutCorrection,
                                                register_rollout_correction)
    from test_loss import TEMP, toy_batch

    def first_half(cfg, log_ratio, rm):
        pos = jnp.cumsum(rm, axis=-1)
        return pos <= (jnp.sum(rm, axis=-1, keepdims=True) + 1) // 2

    with pytest.raises(ValueError, match=r"rollout_correction is 'first_half'; choose one of "
                                         r"\['none', 'sequence_mask', 'token_mask'\]"):
        LossConfig(rollout_correction="first_half")
    register_rollout_correction(RolloutCorrection("first_half", first_half, "probe"))
    try:
        cfg = LossConfig(rollout_correction="first_half", beta_query=0.5)
        assert "rollout_correction=first_half" in describe(RunConfig(loss=cfg))
        logits, batch = toy_batch(seed=1, B=2, G=3, R=6)
        st = stats_from_logits(logits, batch.tokens[:, 1:], TEMP)
        rm = np.asarray(batch.response_mask)
        keep = rm & np.asarray(first_half(cfg, None, jnp.asarray(rm)))
        assert 0 < keep.sum() < rm.sum()

        def grads(c):
            return {k: np.asarray(jax.grad(lambda lp: loss_terms(st._replace(logp=lp), batch,
                                                                 c)[0][k])(st.logp))
                    for k in ("pg", "query_kl")}
        g, g0 = grads(cfg), grads(dataclasses.replace(cfg, rollout_correction="none"))
        assert np.all(g["pg"][rm & ~keep] == 0) and np.any(g0["pg"][rm & ~keep] != 0)
        np.testing.assert_array_equal(g["pg"][keep], g0["pg"][keep])
        np.testing.assert_array_equal(g["query_kl"], g0["query_kl"])
    finally:
        del ROLLOUT_CORRECTIONS["first_half"]
