"""Issue 49, items 7-8: validation sees the final config (the order of
`key=value` arguments never changes the verdict, the CLI and a JSON config
agree, every message names the field), a setting that cannot act is warned
about at start, and a non-finite abort names the term and its coefficient."""

import json
from pathlib import Path

import pytest

from erpo_jax.train.config import (ConfigError, RunConfig, apply_overrides, config_dict,
                                   load_config, validate)

PAIRS = [
    # (overrides, None if valid else the field the refusal names)
    (["loss.kl_target=0.01", "loss.beta_policy=0.04"], None),
    (["algo.method=grpo_policy_kl", "loss.kl_target=0.01"], None),
    (["loss.pg_loss=clip_cov", "loss.clip_cov_lb=6", "loss.clip_cov_ub=10"], None),
    (["loss.kl_horizon=0", "loss.beta_policy=0.04", "loss.kl_target=0.01"], "loss.kl_horizon"),
    (["loss.kl_target=0.01"], "loss.kl_target"),
    (["loss.pg_loss=clip_cov", "loss.clip_cov_lb=6"], "loss.clip_cov_lb"),
    (["algo.filter_on_short=drop"], "algo.filter_on_short"),
    (["algo.filter_max_batches=-1"], "algo.filter_max_batches"),
    (["loss.pg_loss=kl_cov", "loss.kl_cov_tol=-1"], "loss.kl_cov_tol"),
]


def _verdict(fn):
    try:
        validate(fn())
        return None
    except ConfigError as e:
        return str(e)


@pytest.mark.parametrize("overrides,field", PAIRS)
def test_the_verdict_does_not_depend_on_the_order_or_the_source(overrides, field, tmp_path):
    base = ["model.init=random"]
    verdicts = [_verdict(lambda o=o: load_config(None, base + o))
                for o in (overrides, overrides[::-1])]
    # The same fields from a JSON config.
    cfg = {}
    for item in base + overrides:
        key, value = item.split("=")
        section, name = key.split(".")
        cfg.setdefault(section, {})[name] = value
    full = config_dict(RunConfig())
    for section, fields in cfg.items():
        for name, value in fields.items():
            typ = type(full[section][name])
            full[section][name] = ({"true": True, "false": False}[value] if typ is bool
                                   else typ(value) if typ in (int, float) else value)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(full))
    verdicts.append(_verdict(lambda: load_config(str(path))))
    if field is None:
        assert verdicts == [None] * 3, verdicts
    else:
        for v in verdicts:
            assert v is not None and v.startswith(f"config field {field}:"), (field, v)


def test_a_clip_that_cannot_act_is_warned_about_at_start():
    from erpo_jax.train.loop import _no_effect
    cfg = apply_overrides(RunConfig(), ["loss.eps_high=0.28"])
    (note,) = _no_effect(cfg)
    assert "loss.eps_high=0.28" in note and "never acts" in note
    assert _no_effect(apply_overrides(cfg, ["optim.num_minibatches=4"])) == []
    (kl,) = _no_effect(apply_overrides(RunConfig(), ["loss.pg_loss=kl_cov"]))
    assert "kl_cov" in kl
    assert _no_effect(RunConfig()) == []


def test_a_non_finite_abort_names_the_term_and_its_coefficient():
    from erpo_jax.train.loop import _nonfinite_cause
    from erpo_jax.rl.loss import LossConfig
    lc = LossConfig(entropy_coef=1e38)
    msg = _nonfinite_cause({"term_pg": 0.1, "term_entropy": float("-inf")}, lc)
    assert "term entropy is -inf (loss.entropy_coef=1e+38)" in msg and "lower that" in msg
    assert "optim.lr" in _nonfinite_cause({"term_pg": float("nan")}, lc)
    assert _nonfinite_cause({"term_pg": 0.1}, lc) == "Lower optim.lr or check the data."


def test_config_show_refuses_what_train_refuses(capsys):
    from erpo_jax import cli
    assert cli.main(["config", "--show", "algo.filter_max_batches=-1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("erpo config: config field algo.filter_max_batches:") and \
        len(err.splitlines()) == 1
    assert cli.main(["config", "--show", "algo.filter_max_batches=0"]) == 0   # no cap
    assert "algo.filter_max_batches = 0" in capsys.readouterr().out


def test_a_mesh_that_does_not_fit_the_devices_names_mesh_shape(tmp_path, capsys):
    from erpo_jax import cli
    import jax
    n = jax.device_count()
    assert cli.main(["train", "model.init=random", f"mesh.shape={2 * n},1,1",
                     f"train.out_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("erpo train: config field mesh.shape:") and "-1" in err


@pytest.mark.parametrize("arg,text", [("--step=-1", "--step is -1"),
                                      ("--queries=0", "--queries is 0")])
def test_inspect_grads_names_the_one_argument_that_is_wrong(arg, text, tmp_path, capsys):
    from erpo_jax import cli
    exp = Path(__file__).resolve().parent.parent / "experiments" / "main_comparison.py"
    assert cli.main(["inspect-grads", "--config", str(exp), "--cpu",
                     "--checkpoint", str(tmp_path), arg]) == 2
    err = capsys.readouterr().err.strip()
    assert text in err and len(err.splitlines()) == 1
    other = "--queries" if text.startswith("--step") else "--step"
    assert other not in err
