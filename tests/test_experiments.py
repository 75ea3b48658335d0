"""Experiment files and the sweep runner.

Every experiment config (full and CPU, every variant) parses and validates;
each variant differs from its reference only where the experiment says; one
representative CPU variant per experiment trains 2 steps, shrunk with the same
overrides; the real-scale configs plan and shard on their TPU meshes
abstractly; the sweep runner skips, flags stale runs, logs and reports.
"""

import argparse
import dataclasses
import json
import math
from pathlib import Path

import jax
import pytest
from jax.sharding import AbstractMesh, AxisType

from erpo_jax.tools import report as report_lib
from erpo_jax.tools import sweep as sweep_lib
from erpo_jax.tools.presets import METHODS
from erpo_jax.train.methods import resolve_method
from erpo_jax.runtime.distributed import abstract_mesh_shape, plan_mesh
from erpo_jax.model import model as model_lib
from erpo_jax.model.config import PRESETS
from erpo_jax.model.sharding import MESH_AXES, Sharding
from erpo_jax.train.config import apply_overrides, load_config, validate
from erpo_jax.train.loop import train

EXP = Path(__file__).resolve().parents[1] / "experiments"
FILES = ("main_comparison", "high_temperature", "long_horizon", "ablations", "real_scale")
HBM_GIB = {"v4-8": 32, "v5litepod-16": 16, "v5p-8": 95}

# The same shrink for every variant: tiny random model, 2 steps of 8 x 2, 6 new tokens,
# evaluation on 2 problems per set.
SHRINK = ["model.init=random", "model.preset=tiny", "data.n_train=64", "data.n_test=4",
          "rollout.group_size=2", "rollout.max_new_tokens=6", "train.batch_size=8",
          "train.steps=2", "train.eval_every=2", "train.eval_max_problems=2", "train.drift_every=2",
          "train.drift_queries=4",
          "train.ckpt_every=2", "train.ref_batch_size=64",
          "optim.micro_batches=1", "optim.num_minibatches=1"]


def _mod(name):
    return sweep_lib.load_experiment(EXP / f"{name}.py")


def _devices(cfg):
    return jax.device_count() if -1 in cfg.mesh.shape else math.prod(cfg.mesh.shape)


@pytest.mark.parametrize("name", FILES)
def test_every_config_parses_and_validates(name):
    mod = _mod(name)
    doc = mod.__doc__
    assert f"experiments/{name}.py" in doc and "erpo " in doc
    for cpu in (False, True):
        table = sweep_lib.variants(mod, cpu)
        assert len(table) >= 3
        for variant, cfg in table.items():
            validate(cfg, _devices(cfg))
            assert cfg.name == variant
            assert cfg.train.out_dir == f"runs/{name}/{variant}/seed0"
        one = load_config(str(EXP / f"{name}.py"), cpu=cpu)
        validate(one, _devices(one))
        assert one.name in table and one == table[one.name]
    for a, b in getattr(mod, "COMPARISONS", []):
        assert a in sweep_lib.variants(mod, True) and b in sweep_lib.variants(mod, True)


def _diff(a, b, path=()):
    """Dotted paths where two config dicts differ."""
    if isinstance(a, dict):
        return [p for k in a for p in _diff(a[k], b[k], path + (k,))]
    return [] if a == b else [".".join(path)]


def _changed(cfg, ref):
    return set(_diff(cfg.to_dict(), ref.to_dict())) - {"name", "train.out_dir"}


@pytest.mark.parametrize("cpu", [True, False])
def test_variants_change_only_what_the_experiment_says(cpu):
    main = sweep_lib.variants(_mod("main_comparison"), cpu)
    assert list(main) == list(METHODS)
    # Same budget: only the regulariser differs between the three methods.
    for m in METHODS:
        assert _changed(main[m], main["erpo"]) <= {
            "loss.beta_policy", "loss.beta_query", "algo.weight_scheme", "algo.method"}
    # Each run names its method, and its settings are that method's (resolving changes nothing).
    assert {m: main[m].algo.method for m in METHODS} == {
        "grpo+policy_kl": "grpo_policy_kl", "no_kl": "no_kl", "erpo": "erpo"}
    for m in METHODS:
        assert resolve_method(main[m]) == main[m], m
    assert main["erpo"].loss.beta_query > 0 and main["erpo"].loss.beta_policy == 0
    assert main["erpo"].algo.weight_scheme == "likelihood"
    assert main["grpo+policy_kl"].loss.beta_policy > 0 == main["grpo+policy_kl"].loss.beta_query
    assert main["no_kl"].loss.beta_policy == main["no_kl"].loss.beta_query == 0

    hot = sweep_lib.variants(_mod("high_temperature"), cpu)
    assert len(hot) == 9
    for t in (1.0, 1.2, 1.5):
        for m in METHODS:
            cfg = hot[f"{m}-T{t}"]
            assert cfg.rollout.temperature == t
            assert _changed(cfg, main[m]) <= {"rollout.temperature"}

    long = sweep_lib.variants(_mod("long_horizon"), cpu)
    for m in METHODS:
        assert long[m].train.steps == 4 * main[m].train.steps
        assert long[m].train.eval_every == main[m].train.eval_every
        assert _changed(long[m], main[m]) <= {"train.steps", "train.ckpt_every"}

    abl = sweep_lib.variants(_mod("ablations"), cpu)
    assert _changed(abl["erpo"], main["erpo"]) == set()
    expect = {
        "beta_q0.02": {"loss.beta_query": 0.02}, "beta_q0.5": {"loss.beta_query": 0.5},
        "qkl+uniform": {"algo.method": "custom", "algo.weight_scheme": "uniform"},
        "qkl+typicality": {"algo.method": "custom", "algo.weight_scheme": "typicality"},
        "noqkl+uniform": {"algo.method": "no_kl", "algo.weight_scheme": "uniform",
                          "loss.beta_query": 0.0},
        "noqkl+likelihood": {"algo.method": "custom", "loss.beta_query": 0.0},
        "noqkl+typicality": {"algo.method": "custom", "algo.weight_scheme": "typicality",
                             "loss.beta_query": 0.0},
        "qkl_k2": {"loss.query_kl_estimator": "k2"},
        "ppo+erpo": {"algo.advantage": "gae"},
        "ppo+no_kl": {"algo.advantage": "gae", "algo.method": "no_kl", "loss.beta_query": 0.0,
                      "algo.weight_scheme": "uniform"},
        "reinforce_pp+erpo": {"algo.advantage": "reinforce_pp"},
        "reinforce_pp+no_kl": {"algo.advantage": "reinforce_pp", "algo.method": "no_kl",
                               "loss.beta_query": 0.0, "algo.weight_scheme": "uniform"},
    }
    assert set(abl) == set(expect) | {"erpo"}
    for name, fields in expect.items():
        assert _changed(abl[name], main["erpo"]) == set(fields), name
        for path, value in fields.items():
            section, field = path.split(".")
            assert getattr(getattr(abl[name], section), field) == value, (name, path)
    # noqkl+uniform on GRPO is exactly the main comparison's no-KL run.
    assert _changed(abl["noqkl+uniform"], main["no_kl"]) == set()


@pytest.mark.parametrize("name,variant", [
    ("main_comparison", "erpo"), ("high_temperature", "grpo+policy_kl-T1.5"),
    ("long_horizon", "no_kl"), ("ablations", "qkl+typicality")])
def test_cpu_variant_trains_two_steps(tmp_path, name, variant):
    base = sweep_lib.variants(_mod(name), cpu=True)[variant]
    cfg = apply_overrides(base, SHRINK + [f"train.out_dir={tmp_path / variant}",
                                          f"train.ref_cache_dir={tmp_path / 'refcache'}"])
    out = train(cfg)
    assert out["status"] == "done" and out["step"] == 2
    rows = [json.loads(x) for x in (tmp_path / variant / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and "drift/qkl_k3" in rows[-1]
    saved = json.loads((tmp_path / variant / "config.json").read_text())
    # The shrink kept what makes the variant that variant.
    for section in ("loss", "algo"):
        assert saved[section] == json.loads(json.dumps(dataclasses.asdict(
            getattr(base, section)), default=list))
    assert saved["rollout"]["temperature"] == base.rollout.temperature
    assert (out["ref_forward_calls"] > 0) == (base.loss.beta_policy > 0)


def _real_scale_configs():
    rs = _mod("real_scale")
    cfgs = list(sweep_lib.variants(rs, cpu=False).values())
    for name in FILES[:4]:
        cfgs.append(_mod(name).get_config())
    assert all(c.rollout.temperature == 1.0 for c in cfgs[:len(cfgs) - 4])
    return rs, cfgs


def test_real_scale_configs_plan_and_shard_on_their_tpu_mesh():
    rs, cfgs = _real_scale_configs()
    seen = set()
    for cfg in cfgs:
        acc = rs.accelerator(cfg)
        tpu = abstract_mesh_shape(acc)
        plan = plan_mesh(tpu.devices, tpu.devices_per_host, *cfg.mesh.shape)
        assert plan.shape == tuple(cfg.mesh.shape), (cfg.name, plan)
        validate(cfg, tpu.devices)
        assert cfg.model.init == "hf" and cfg.data.task == "jsonl"
        assert set(cfg.data.eval_benchmarks) == {"gsm8k", "math500", "aime24", "amc23",
                                                 "minerva_math", "olympiadbench"}
        assert cfg.optim.lr == 1e-6 and cfg.train.batch_size == 128
        assert cfg.rollout.group_size == 8 and cfg.rollout.top_p == 1.0
        assert cfg.data.max_prompt_len + cfg.rollout.max_new_tokens == 4096
        key = (cfg.model.preset, acc, tuple(cfg.mesh.shape))
        if key in seen:
            continue
        seen.add(key)
        model_cfg = dataclasses.replace(PRESETS[cfg.model.preset],
                                        param_dtype=cfg.model.param_dtype,
                                        compute_dtype=cfg.model.compute_dtype)
        assert cfg.data.max_prompt_len + cfg.rollout.max_new_tokens <= \
            model_cfg.max_position_embeddings
        mesh = AbstractMesh(plan.shape, MESH_AXES, axis_types=(AxisType.Auto,) * 3)
        shardings = model_lib.param_shardings(model_cfg, Sharding(mesh))
        params = jax.eval_shape(jax.jit(lambda r: model_lib.init_params(model_cfg, r),
                                        out_shardings=shardings), jax.random.key(0))
        leaves = jax.tree_util.tree_leaves(params)
        n_params = sum(math.prod(x.shape) for x in leaves)
        per_device = sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
                         for x in leaves)
        assert per_device * tpu.devices >= n_params * 4 * 0.99  # really spread, not replicated
        # Parameters, gradients and two Adam moments, all float32, in at most half the HBM.
        assert 4 * per_device < HBM_GIB[acc] * 2 ** 30 / 2, (cfg.name, per_device / 2 ** 30)
        expected = {"qwen2.5-math-1.5b": 1.54e9, "qwen2.5-7b": 7.6e9}[cfg.model.preset]
        assert abs(n_params / expected - 1) < 0.02
    assert {k[1] for k in seen} == {"v4-8", "v5litepod-16", "v5p-8"}


# ----------------------------------------------------------------------------- the runner

TINY_EXPERIMENT = '''
"""Two variants of the main comparison, shrunk, for the sweep runner's test.

    erpo sweep {path} --seeds 0
"""
from erpo_jax.tools.sweep import load_experiment
from erpo_jax.train.config import apply_overrides

main = load_experiment({main!r})
STEPS = {steps}


def sweep(cpu=False):
    return {{m: apply_overrides(main.sweep(cpu=True)[m], {shrink!r} + [f"train.steps={{STEPS}}"])
            for m in ("erpo", "no_kl")}}


COMPARISONS = [("erpo", "no_kl")]
'''


def _tiny_experiment(tmp_path, steps=2):
    path = tmp_path / "tiny_exp.py"
    path.write_text(TINY_EXPERIMENT.format(path=path, steps=steps, shrink=SHRINK,
                                           main=str(EXP / "main_comparison.py")))
    return path


def test_plan_places_runs_and_rejects_unknown_variants(tmp_path):
    path = _tiny_experiment(tmp_path)
    runs = sweep_lib.plan(path, [0, 3], runs_root=tmp_path / "runs")
    assert [r.label for r in runs] == ["tiny_exp/erpo/seed0", "tiny_exp/erpo/seed3",
                                       "tiny_exp/no_kl/seed0", "tiny_exp/no_kl/seed3"]
    assert runs[1].cfg.train.seed == 3 and runs[1].variant == "erpo"
    assert runs[1].dir == tmp_path / "runs" / "tiny_exp" / "erpo" / "seed3"
    assert runs[1].cfg.train.ref_cache_dir == str(tmp_path / "runs" / "tiny_exp" / ".refcache")
    assert [r.variant for r in sweep_lib.plan(path, [0], only=["no_kl"])] == ["no_kl"]
    with pytest.raises(ValueError, match="--only c: not a variant of tiny_exp"):
        sweep_lib.plan(path, [0], only=["c"])


def test_sft_prerequisite(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    runs = sweep_lib.plan(EXP / "main_comparison.py", [0], cpu=True, only=["erpo"])
    sft = sweep_lib.sft_prerequisite(runs)
    assert sft is not None and sft.train.out_dir == "runs/sft-arith"
    moved = apply_overrides(runs[0].cfg, ["model.path=elsewhere"])
    other = dataclasses.replace(runs[0], cfg=moved)
    with pytest.raises(ValueError, match="elsewhere, which does not exist"):
        sweep_lib.sft_prerequisite([other])
    assert sweep_lib.sft_prerequisite(sweep_lib.plan(EXP / "real_scale.py", [0])) is None


def test_slip_testbed_trains_its_own_reference(tmp_path, monkeypatch):
    """An experiment file with sft_config(): the sweep trains that reference first."""
    monkeypatch.chdir(tmp_path)
    mod = _mod("slip_testbed")
    table = sweep_lib.variants(mod, True)
    assert list(table)[:3] == list(METHODS)
    # Ablations: the 'erpo' run with its ablations.py change, nothing else.
    for name, overrides in mod.ABLATIONS.items():
        changed = _changed(table[name], table["erpo"])
        assert changed and changed <= {o.split("=")[0] for o in overrides}, name
    assert {"qkl+uniform", "noqkl+likelihood", "qkl_k2", "ppo+erpo",
            "reinforce_pp+erpo"} <= set(mod.ABLATIONS)
    table = {m: table[m] for m in METHODS}
    sft = mod.sft_config()
    validate(sft)
    assert (sft.data.sft_slip, sft.model.preset, sft.data.n_val) == (0.6, "arith-medium", 100)
    for cfg in table.values():
        validate(cfg, _devices(cfg))
        assert cfg.model.path == f"{sft.train.out_dir}/model"
        # Trained without the validation problems, as the reference was; judged on the test sets.
        assert (cfg.data.n_val, cfg.train.eval_split) == (100, "test")
        assert _changed(cfg, table["erpo"]) <= {
            "loss.beta_policy", "loss.beta_query", "algo.weight_scheme", "algo.method"}
    runs = sweep_lib.plan(EXP / "slip_testbed.py", [0], cpu=True)
    assert sweep_lib.sft_prerequisite(runs, sft) == sft
    with pytest.raises(ValueError, match="not the shared one"):
        sweep_lib.sft_prerequisite(runs)
    with pytest.raises(ValueError, match="--cpu"):
        sweep_lib.variants(mod, False)


@pytest.mark.parametrize("name,suffix,changes", [
    ("slip_temperature", "-T1.5", {"rollout.temperature"}),
    ("slip_horizon", "", {"train.steps"}),
    ("slip_stress", "", {"optim.lr", "rollout.temperature", "train.eval_every", "train.eval_n",
                         "train.eval_k"}),
])
def test_slip_settings_change_only_what_they_say(name, suffix, changes):
    """The temperature, long-horizon and stress experiments are the main comparison's
    three runs (same reference, coefficients, split) with only their setting changed."""
    mod, main = _mod(name), sweep_lib.variants(_mod("slip_testbed"), True)
    assert f"experiments/{name}.py" in mod.__doc__ and "erpo sweep" in mod.__doc__
    table = sweep_lib.variants(mod, True)
    assert list(table) == [m + suffix for m in METHODS]
    for m in METHODS:
        cfg = table[m + suffix]
        validate(cfg, _devices(cfg))
        assert cfg.train.out_dir == f"runs/{name}/{m + suffix}/seed0"
        assert _changed(cfg, main[m]) == changes, m
    assert mod.get_cpu_config() == mod.get_config() == table["erpo" + suffix]
    for a, b in mod.COMPARISONS:
        assert a in table and b in table
    with pytest.raises(ValueError, match="--cpu"):
        sweep_lib.variants(mod, False)


def test_slip_searches_look_only_at_the_validation_split(tmp_path, monkeypatch):
    """The coefficient and stress-regime searches evaluate on validation problems, from
    the testbed's reference, and differ from its main runs only in what they search."""
    monkeypatch.chdir(tmp_path)
    main = sweep_lib.variants(_mod("slip_testbed"), True)
    tuning, search = _mod("slip_tuning"), _mod("slip_search")
    grid = sweep_lib.variants(tuning, True)
    assert len(grid) == 8 and tuning.sft_config() == _mod("slip_testbed").sft_config()
    searched = {"train.eval_split", "train.eval_every"}
    for name, cfg in grid.items():
        validate(cfg, _devices(cfg))
        method, beta = name.rsplit("-b", 1)
        field = "loss.beta_policy" if method == "grpo+policy_kl" else "loss.beta_query"
        assert _changed(cfg, main[method]) <= searched | {field}, name
        assert cfg.to_dict()["loss"][field.split(".")[1]] == float(beta)
        assert cfg.train.eval_split == "validation"
    for m in ("grpo+policy_kl", "erpo"):   # at least 3 values each, the default among them
        assert len(tuning.GRID[m]) >= 3
    regimes = sweep_lib.variants(search, True)
    assert len(regimes) >= 5
    for name, cfg in regimes.items():
        validate(cfg, _devices(cfg))
        assert cfg.train.eval_split == "validation" and cfg.algo.method == "no_kl"
        assert _changed(cfg, main["no_kl"]) <= searched | {
            "optim.lr", "rollout.temperature", "train.steps", "train.ckpt_every",
            "train.eval_n", "train.eval_k"}, name
    assert {c.rollout.temperature for c in regimes.values()} >= {1.5, 2.0}
    # chosen(): the best mean final validation accuracy per method.
    fake = [{"name": n, "evals": [{"average": {"greedy_acc": a}}]} for n, a in (
        ("erpo-b0.1", 0.5), ("erpo-b0.1", 0.7), ("erpo-b0.3", 0.65), ("erpo-b0.3", 0.6),
        ("grpo+policy_kl-b0.04", 0.4), ("grpo+policy_kl-b0.01", 0.45))]
    assert tuning.chosen(fake) == {"erpo": 0.3, "grpo+policy_kl": 0.01}


def test_sweep_runs_skips_flags_stale_and_reports(tmp_path, capsys, monkeypatch):
    # The run processes share this session's compilation cache: the same programs were
    # compiled by test_cpu_variant_trains_two_steps (same flags, same precision).
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", jax.config.jax_compilation_cache_dir)
    monkeypatch.setenv("JAX_DEFAULT_MATMUL_PRECISION", str(jax.config.jax_default_matmul_precision))
    path = _tiny_experiment(tmp_path)
    root = tmp_path / "runs"
    args = [str(path), "--seeds", "0", "--runs-root", str(root), "--only", "erpo"]
    assert sweep_lib.main(args) == 0
    log = (root / "tiny_exp" / "sweep.log").read_text().splitlines()
    assert len(log) == 1 and " tiny_exp/erpo/seed0 ok rc=0 steps=2 from=new " in log[0]
    assert log[0].split()[-1].startswith("wall=")
    assert sweep_lib.is_finished(root / "tiny_exp" / "erpo" / "seed0")
    # The run's log (a file, not a terminal) has progress lines, not a tqdm stream.
    run_log = (root / "tiny_exp" / "erpo" / "seed0" / "train.log").read_text()
    assert "\r" not in run_log
    assert [x.split(",")[0] for x in run_log.splitlines() if x.startswith("erpo: ")] == \
        ["erpo: 1/2 steps (50%)", "erpo: 2/2 steps (100%)"]
    assert not (root / "tiny_exp" / "no_kl").exists()
    md = (root / "tiny_exp" / "report" / "REPORT.md").read_text()
    assert (root / "tiny_exp" / "report" / "eval_average.png").is_file()
    # The table's final average is the run's own last evaluation.
    final = json.loads((root / "tiny_exp" / "erpo" / "seed0" / "evals.jsonl").read_text()
                       .splitlines()[-1])
    row = next(x for x in md.splitlines() if x.startswith("| erpo |"))
    assert row.split("|")[4].strip() == f"{100 * final['average']['greedy_acc']:.1f}"
    # The run keeps its wall time; the committable summaries beside the report remake
    # the same REPORT.md through `erpo report --experiment`.
    wall = json.loads((root / "tiny_exp" / "erpo" / "seed0" / "sweep_wall.jsonl").read_text())
    assert wall["state"] == "ok" and f"{wall['wall_s']:.0f}" == log[0].split("wall=")[1][:-1]
    summary = root / "tiny_exp" / "report" / "runs" / "erpo" / "seed0.json"
    assert json.loads(summary.read_text())["wall_s"] == wall["wall_s"]
    parser = argparse.ArgumentParser()
    report_lib.add_parser(parser.add_subparsers())
    remade = parser.parse_args(["report", str(summary.parent.parent), "--experiment", str(path),
                                "--out", str(tmp_path / "remade")])
    assert remade.func(remade) == 0
    assert (tmp_path / "remade" / "REPORT.md").read_text() == md

    # A second sweep skips it; a changed config is stale, not resumed.
    capsys.readouterr()
    assert sweep_lib.main(args) == 0
    assert "0 ran, 1 already done" in capsys.readouterr().out
    assert len((root / "tiny_exp" / "sweep.log").read_text().splitlines()) == 1
    _tiny_experiment(tmp_path, steps=3)
    runs = sweep_lib.plan(path, [0], runs_root=root)
    assert sweep_lib.status(runs[0]) == ("stale", "train.steps: 2 in the run dir, 3 now")
    assert sweep_lib.main(args + ["--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "STALE tiny_exp/erpo/seed0: train.steps: 2 in the run dir, 3 now" in out


def test_the_stability_grid_changes_only_lr_temperature_and_the_stress_evaluation():
    """slip_grid.py: the main comparison's runs at each (lr, T) it does not reuse,
    evaluated as slip_stress.py is; the reused cells are those experiments' settings."""
    grid, main = _mod("slip_grid"), sweep_lib.variants(_mod("slip_testbed"), True)
    table = sweep_lib.variants(grid, True)
    cells = {(lr, t) for lr in grid.LRS for t in grid.TEMPERATURES}
    assert len(table) == 3 * (len(cells) - len(grid.REUSED)) == 15   # x 3 seeds: 45 runs
    for (lr, t), exp in grid.REUSED.items():
        for cfg in sweep_lib.variants(_mod(exp), True).values():
            if cfg.name.split("-")[0] in METHODS:
                assert (cfg.optim.lr, cfg.rollout.temperature) == (lr, t), exp
    eval_fields = {"train.eval_every", "train.eval_n", "train.eval_k"}
    for (lr, t) in cells - set(grid.REUSED):
        for m in METHODS:
            cfg = table[grid.cell_name(m, lr, t)]
            validate(cfg, _devices(cfg))
            want = eval_fields | ({"optim.lr"} if lr != main[m].optim.lr else set()) | (
                {"rollout.temperature"} if t != 1.0 else set())
            assert _changed(cfg, main[m]) == want, (m, lr, t)
            assert cfg.train.eval_every == 20 and cfg.train.eval_n == 1


def test_stabilizer_experiments_change_only_the_technique_and_the_minibatches(monkeypatch):
    """The tuning and the comparison run each technique as its preset's overrides
    of a testbed method, with MINIBATCHES updates per rollout; the comparison
    plans from the values the tuning chose, and refuses without them."""
    from erpo_jax.tools.presets import STABILIZERS, stabilizer_overrides
    tuning, comp = _mod("slip_stabilizer_tuning"), _mod("slip_stabilizers")
    main = sweep_lib.variants(_mod("slip_testbed"), True)
    table = sweep_lib.variants(tuning, True)
    assert len(table) == sum(len(vs) for _, vs in tuning.GRID.values()) == 30   # x 2 seeds
    for name, (field, values) in tuning.GRID.items():
        base = STABILIZERS[name][0] if name in STABILIZERS else name
        fixed = {o.split("=")[0] for o in stabilizer_overrides(name, 44)[1]} \
            if name in STABILIZERS else set()
        fields = field if isinstance(field, tuple) else (field,)
        dapo = {o.split("=")[0] for o in tuning.STUDY_DAPO} if "dapo" in name else set()
        for v in values:
            cfg = table[tuning.variant_name(name, v)]
            assert tuning.variant_value(tuning.variant_name(name, v)) == (name, v)
            validate(cfg, _devices(cfg))
            assert cfg.train.eval_split == "validation" and cfg.optim.num_minibatches == 4
            assert _changed(cfg, main[base]) <= fixed | dapo | set(fields) | {
                "optim.num_minibatches", "rollout.temperature", "train.eval_split",
                "train.eval_every", "train.eval_n", "train.eval_k"}, name
            for f, x in zip(fields, v if isinstance(v, tuple) else (v,)):
                section, key = f.split(".")
                assert getattr(getattr(cfg, section), key) == x
            if name == "adaptive_kl":   # the controller can move >= 10% a step (issue 47)
                from erpo_jax.rl.kl_control import reach
                assert reach(cfg)["step"] >= 1.1
            if dapo:
                assert (cfg.algo.filter_max_batches, cfg.algo.filter_on_short) == (32, "pad")
    with pytest.raises(ValueError, match="run and commit"):
        comp.tuned_values(Path("/nonexistent"))
    monkeypatch.setattr(comp, "tuned_values", lambda *a: {n: vs[0] for n, (_, vs)
                                                          in tuning.GRID.items()})
    runs = sweep_lib.variants(comp, True)
    assert len(runs) == len(comp.METHODS) * len(comp.SETTINGS) == 20
    for key, cfg in runs.items():
        validate(cfg, _devices(cfg))
        name, setting = key.rsplit("-", 1)
        assert (cfg.rollout.temperature, cfg.train.steps) == comp.SETTINGS[setting]
        assert cfg.optim.num_minibatches == 4 and cfg.train.eval_split == "test"
        if name in tuning.GRID:
            field, values = tuning.GRID[name]
            fields = field if isinstance(field, tuple) else (field,)
            v = values[0] if isinstance(values[0], tuple) else (values[0],)
            for f, x in zip(fields, v):
                section, k = f.split(".")
                assert getattr(getattr(cfg, section), k) == x
    for a, b in comp.COMPARISONS:
        assert a in runs and b in runs
    assert runs["dapo-T1.5"].algo.filter_groups and runs["erpo+dapo-long200"].loss.beta_query == 0.3


def test_the_sweep_installs_the_shipped_slip_reference_not_a_retrained_one(tmp_path, monkeypatch):
    """Training the slip reference is bit-identical only on one CPU type (on
    another, the runs of one comparison would start from other weights): where
    the package ships the export of an experiment's SFT config, the sweep
    copies it in, and trains it only when asked (`--train-reference`) or when
    the config is another one."""
    import hashlib
    from erpo_jax.tools.demo import REFERENCE
    from erpo_jax.tools.presets import arith_sft_config, slip_sft_config
    monkeypatch.chdir(tmp_path)   # the experiments' runs/... paths land here
    sft = slip_sft_config()
    assert sweep_lib.shipped_reference(sft) == REFERENCE
    assert sweep_lib.shipped_reference(arith_sft_config()) is None
    longer = dataclasses.replace(sft, train=dataclasses.replace(sft.train, steps=sft.train.steps + 1))
    assert sweep_lib.shipped_reference(longer) is None

    calls = []
    monkeypatch.setattr(sweep_lib, "_subprocess",
                        lambda kind, cfg, log, root: calls.append(kind) or int(kind != "sft"))
    runs = sweep_lib.plan(EXP / "slip_testbed.py", [0], cpu=True, only=["erpo"])
    assert sweep_lib.sft_prerequisite(runs, sft) == sft   # absent: it is needed
    (Path(sft.train.out_dir) / "model").mkdir(parents=True)   # a cut-off export's leftovers
    (Path(sft.train.out_dir) / "model" / "model.safetensors").write_bytes(b"cut")
    sweep_lib.run_sweep(runs, sft=sft)
    assert calls == ["train"]   # installed, not trained
    model = Path(sft.train.out_dir) / "model"
    assert sorted(p.name for p in model.iterdir()) == sorted(
        p.name for p in REFERENCE.iterdir() if p.name not in sweep_lib._NOT_MODEL)
    digest = lambda p: hashlib.sha256(p.read_bytes()).hexdigest()
    assert digest(model / "model.safetensors") == digest(REFERENCE / "model.safetensors")
    assert "installed the shipped export" in Path("runs/slip_testbed/sweep.log").read_text()
    # Its config.json is the experiment's SFT config: a rerun neither retrains
    # it nor calls it a different config.
    assert sweep_lib.sft_prerequisite(runs, sft) is None

    import shutil
    shutil.rmtree(model)
    calls.clear()
    sweep_lib.run_sweep(runs, sft=sft, train_reference=True)
    assert calls[0] == "sft"
