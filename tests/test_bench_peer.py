"""`erpo bench --peer tunix`: the side-by-side harness. The peer here is a stand-in
script that prints what tunix_grpo.py prints, so the ratio arithmetic, the
interleaving and the no-venv path are checked exactly; the erpo-jax side is the
real Trainer in a fresh process."""

import sys
from pathlib import Path
from unittest import mock

import pytest

from erpo_jax.model.config import PRESETS
from erpo_jax.tools import bench
from erpo_jax.tools.bench import peer as bench_peer

FAKE_PEER = """
import os, sys
n = int(sys.argv[1])
walls = [2.0, 1.0] + [0.5 if os.environ["PEER_SIZE"] == "tiny" else 4.0] * (n - 2)
assert "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", "")
print("per-iteration wall (s): " + str(walls))
"""


def _fake_ours(size, iters, share_query=True):
    steady = {"tiny": 0.25, "small": 1.0}[size]
    return {"iter_s": [3.0] + [steady] * (iters - 1), "steady_s": steady, "update_s": 0.1,
            "breakdown_s": {}}


def test_compare_interleaves_and_takes_ratios_per_repetition(tmp_path):
    script = tmp_path / "tunix_grpo.py"
    script.write_text(FAKE_PEER)
    calls = []

    def ours(size, iters, share_query=True):
        calls.append(("ours", size, share_query))
        return _fake_ours(size, iters)
    real_peer = bench_peer.run_peer

    def peer(*a, **k):
        calls.append(("peer", a[0]))
        return real_peer(*a, **k)
    with mock.patch.object(bench_peer, "run_ours", ours), \
            mock.patch.object(bench_peer, "run_peer", peer):
        res = bench_peer.compare(("tiny", "small"), reps=2, iters=5, peak_flops=1e9,
                                 paths=(script, __import__("pathlib").Path(sys.executable)),
                                 say=lambda s: None)
    # Repetition 0: ours first; repetition 1: the peer first.
    assert calls[:4] == [("ours", "tiny", True), ("peer", "tiny"), ("peer", "tiny"),
                         ("ours", "tiny", True)]
    t, s = res["configs"]["tiny"], res["configs"]["small"]
    assert t["peer_steady_s"] == 0.5 and t["ratio"] == 0.5 and t["ratios"] == [0.5, 0.5]
    assert s["peer_steady_s"] == 4.0 and s["ratio"] == 0.25
    assert t["update_mfu"] == pytest.approx(bench_peer.update_flops("tiny") / 0.1 / 1e9)
    # The MFU counts the FLOPs the update executes: each group's query once.
    assert bench_peer.update_flops("tiny") < 0.7 * bench_peer.update_flops("tiny", False)
    assert res["peer_missing"] is None
    bench_peer.print_table(res)


def test_missing_venv_says_how_to_make_it_and_runs_ours_alone(tmp_path, capsys):
    script = tmp_path / "tunix_grpo.py"
    script.write_text(FAKE_PEER)
    with mock.patch.object(bench_peer, "run_ours", _fake_ours):
        res = bench_peer.compare(("tiny",), reps=1, iters=4,
                                 paths=(script, tmp_path / "venv" / "bin" / "python"))
    msg = res["peer_missing"]
    assert "setup_tunix.sh" in msg and "TUNIX_VENV" in msg
    assert "running erpo-jax alone" in capsys.readouterr().out
    row = res["configs"]["tiny"]
    assert row["ours_steady_s"] == 0.25 and "ratio" not in row
    assert "rl_tiny_vs_tunix" not in bench.targets({"peer": res})


def test_peer_output_without_the_wall_line_is_an_error():
    with pytest.raises(RuntimeError, match="per-iteration wall"):
        bench_peer.parse_peer("jax 0.7 devices [cpu]\nTraceback ...")


def test_our_side_runs_the_trainer_on_the_peer_config():
    """The real erpo-jax side (a fresh process, the tied-embedding Qwen3 tiny model,
    temperature 0.9, top-k 50, AdamW 1e-3): per-iteration times and the update's."""
    r = bench_peer.run_ours("tiny", iters=3)
    assert len(r["iter_s"]) == 3 and r["steady_s"] > 0 and r["update_s"] > 0
    assert PRESETS["peer-tiny"].tie_word_embeddings


def test_default_peer_paths_are_beside_the_checkout(monkeypatch):
    monkeypatch.delenv("ERPO_PEERS_DIR", raising=False)
    monkeypatch.setenv("TUNIX_VENV", "/nonexistent/venv")
    script, python = bench_peer.default_paths()
    repo = Path(__file__).resolve().parents[1]
    assert script == repo.parent / "shared" / "peers" / "tunix_grpo.py"
    assert python == Path("/nonexistent/venv/bin/python")


def test_the_varied_config_biases_eos_on_our_side():
    """The `varied` config's EOS bias reaches erpo-jax's sampling (a random tiny
    model's, through the continuous engine): a large bias ends nearly every
    response at its first token, where the unbiased random model's run
    on (their mean length is far above 1.5 of the 16 allowed)."""
    from erpo_jax.tools.bench.rl import rl_iteration
    spec = dict(name="v", preset="tiny", prompts=4, group=2, prompt_len=16, new_tokens=16,
                iters=1, engine="continuous")
    biased = rl_iteration(**spec, eos_bias=50.0)["response_len_mean"][0]
    assert biased < 1.5, biased
    assert "varied" in bench_peer.CONFIGS and bench_peer.VARIED["eos_bias"] > 0
