"""Progress output a person can read (issue 37): on a terminal a tqdm bar;
redirected to a file or pipe, one line every tenth of the loop (or minute) and
at the end, never a carriage-return stream. `erpo train` and `erpo sft` are
checked here; `erpo sweep`'s run logs in test_experiments.py, the demo's in
test_readme_example.py."""

import io

from erpo_jax import cli
from erpo_jax.runtime.progress import LineProgress, progress_bar
from tiny_runs import TINY


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_lines_every_tenth_with_what_the_caller_shows():
    out = io.StringIO()
    bar = progress_bar(60, desc="run", stream=out)
    assert isinstance(bar, LineProgress)
    for i in range(60):
        bar.set_postfix(reward=f"{i / 60:.3f}")
        bar.update(1)
    bar.close()
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue() and len(lines) == 10
    assert lines[0].startswith("run: 6/60 steps (10%), ") and lines[0].endswith("reward=0.083")
    assert lines[-1].startswith("run: 60/60 steps (100%), ") and lines[-1].endswith("reward=0.983")


def test_a_resumed_loop_counts_from_where_it_starts_and_close_shows_the_last_step():
    out = io.StringIO()
    bar = progress_bar(100, initial=80, desc="run", stream=out)   # a tenth of the 20 left: 2
    for _ in range(5):
        bar.update(1)
    bar.close()   # stopped early (a preemption): the step it reached is shown
    assert [x.split(",")[0] for x in out.getvalue().splitlines()] == \
        ["run: 82/100 steps (82%)", "run: 84/100 steps (84%)", "run: 85/100 steps (85%)"]


def test_a_minute_without_a_line_gives_one(monkeypatch):
    import erpo_jax.runtime.progress as progress
    clock = iter([0.0, 1.0, 61.0, 62.0])
    monkeypatch.setattr(progress.time, "perf_counter", lambda: next(clock))
    out = io.StringIO()
    bar = progress_bar(1000, stream=out, desc="slow")   # every_n 100
    bar.update(1)   # t=1: no line
    bar.update(1)   # t=61: a minute since the start
    assert out.getvalue().splitlines() == ["slow: 2/1000 steps (0%), 30.50 s/step"]


def test_a_terminal_gets_tqdm():
    from tqdm import tqdm
    bar = progress_bar(3, stream=_Terminal(), desc="run")
    assert isinstance(bar, tqdm)
    bar.close()


def _progress_lines(err: str, desc: str) -> list[str]:
    assert "\r" not in err
    return [x for x in err.splitlines() if x.startswith(f"{desc}: ")]


def test_train_and_sft_write_progress_lines_when_stderr_is_not_a_terminal(tmp_path, capsys):
    common = [*TINY, "train.progress=true", "train.steps=20", "train.tensorboard=false"]
    assert cli.main(["sft", *common, "train.drift_queries=4",
                     f"train.out_dir={tmp_path / 'sft'}"]) == 0
    lines = _progress_lines(capsys.readouterr().err, "run (sft)")
    assert [x.split(",")[0] for x in lines] == [f"run (sft): {n}/20 steps ({5 * n}%)"
                                                for n in range(2, 21, 2)]
    assert all("loss=" in x for x in lines)
    assert cli.main(["train", *common, "model.init=sft", f"model.path={tmp_path / 'sft/model'}",
                     "train.steps=4", f"train.out_dir={tmp_path / 'rl'}"]) == 0
    lines = _progress_lines(capsys.readouterr().err, "run")
    assert [x.split(",")[0] for x in lines] == [f"run: {n}/4 steps ({25 * n}%)"
                                                for n in range(1, 5)]
    assert all("reward=" in x and "acc=" in x for x in lines)
