"""Which run is "the previous run", and what counts as a regression (pure logic on run directories)."""

from __future__ import annotations

import json
from pathlib import Path

from finetune_flows.reporting.compare import comparison_rows, main, previous_run, render_comparison


def summary(adapter_loss: float, score: float, tokens_per_second: float = 100.0) -> dict:
    scores = lambda loss, s: {"loss": loss, "perplexity": 2.718 ** loss, "generation_score": s}  # noqa: E731
    return {"eval": {"metric": "exact_match", "eval_rows": 12, "base": scores(7.0, 0.0),
                     "adapter": scores(adapter_loss, score)},
            "train": {"final_loss": adapter_loss, "tokens_per_second": tokens_per_second, "steps": 40}}


def make_run(root: Path, name: str, stamp: str, data: dict | None, run_name: str | None = None) -> Path:
    run = root / f"{name}-{stamp}-abc123"
    run.mkdir(parents=True)
    (run / "config.resolved.yaml").write_text(f"run:\n  name: {run_name or name}\n")
    if data is not None:
        (run / "summary.json").write_text(json.dumps(data))
    return run


def test_previous_run_is_the_latest_earlier_completed_run_of_the_same_name(tmp_path):
    oldest = make_run(tmp_path, "nightly", "20261128-013000", summary(0.2, 0.8))
    previous = make_run(tmp_path, "nightly", "20261129-013000", summary(0.2, 0.8))
    make_run(tmp_path, "nightly", "20261129-120000", None)  # crashed: no summary.json
    make_run(tmp_path, "nightly-eval", "20261129-130000", summary(0.1, 0.9), run_name="nightly-eval")
    make_run(tmp_path, "demo", "20261129-140000", summary(0.1, 0.9))
    tonight = make_run(tmp_path, "nightly", "20261130-013000", summary(0.3, 0.7))
    assert previous_run(tonight) == previous and previous_run(previous) == oldest and previous_run(oldest) is None


def test_regressions_are_marked_and_noise_is_not(tmp_path):
    rows = {r["metric"]: r for r in comparison_rows(summary(0.30, 0.70, 99.0), summary(0.20, 0.80, 100.0))}
    assert rows["adapter: held-out loss"]["verdict"] == "WORSE"
    assert rows["adapter: exact_match"]["verdict"] == "WORSE"
    assert rows["adapter: exact_match"]["change"] == -0.10000000000000009
    assert rows["training: tokens/s"]["verdict"] == "same"  # 1% slower: within noise
    assert rows["base: held-out loss"]["verdict"] == "same" and rows["training: steps"]["verdict"] == ""
    better = {r["metric"]: r["verdict"] for r in comparison_rows(summary(0.1, 0.9), summary(0.2, 0.8))}
    assert better["adapter: held-out loss"] == better["adapter: exact_match"] == "better"



def test_perplexity_gets_the_verdict_of_the_held_out_loss_it_is_the_exp_of(tmp_path):
    """1% of a loss above 1 is more than 1% of its perplexity, and below 1 less: judged each on its own, one change
    read `same` beside `better` (6.722 -> 6.691, as measured) or `WORSE` beside `same` (0.150 -> 0.152)."""
    for before, after, verdict in ((6.722, 6.691, "same"), (0.150, 0.152, "WORSE"), (0.150, 0.120, "better")):
        rows = {r["metric"]: r["verdict"] for r in comparison_rows(summary(after, 0.5), summary(before, 0.5))}
        assert (rows["adapter: held-out loss"], rows["adapter: perplexity"]) == (verdict, verdict), (before, after)

def test_runs_that_headline_different_metrics_are_compared_on_the_current_ones(tmp_path):
    """The same answers, scored 0.0 by exact_match and 0.125 by contains: switching eval.metric is no change."""
    before, after = summary(0.2, 0.0), summary(0.2, 0.125)
    after["eval"]["metric"] = "contains"
    for s in (before, after):
        s["eval"]["rates"] = {m: {"exact_match": 0.0, "contains": 0.125} for m in ("base", "adapter")}
    rows = {r["metric"]: r for r in comparison_rows(after, before)}
    assert (rows["adapter: contains"]["previous"], rows["adapter: contains"]["verdict"]) == (0.125, "same")
    del before["eval"]["rates"]  # a run without every metric: its headline is another one, so no figure
    rows = {r["metric"]: r for r in comparison_rows(after, before)}
    assert (rows["adapter: contains"]["previous"], rows["adapter: contains"]["verdict"]) == (None, "")


def test_command_prints_the_table_and_refuses_what_is_not_a_run(tmp_path, capsys):
    make_run(tmp_path, "nightly", "20261129-013000", summary(0.2, 0.8))
    tonight = make_run(tmp_path, "nightly", "20261130-013000", summary(0.3, 0.7))
    assert main(["--output-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "**Regressions:** adapter: held-out loss, adapter: perplexity, adapter: exact_match" in out
    assert out.strip() == render_comparison(tonight.resolve(), previous_run(tonight).resolve()).strip()
    assert main([str(tmp_path / "nope")]) == 2 and "nope: no such directory" in capsys.readouterr().err
    assert main([str(tonight.parent / "nightly-20261129-013000-abc123"), str(tmp_path)]) == 2
    assert f"{tmp_path}: not a completed fine-tune run (no summary.json)" in capsys.readouterr().err


def test_a_directory_in_or_above_a_run_is_refused_naming_what_was_meant(tmp_path, capsys):
    """`compare runs/<run>/adapter` and `compare runs` said only "not a completed fine-tune run"."""
    run = make_run(tmp_path, "nightly", "20261129-013000", summary(0.2, 0.8))
    (run / "adapter").mkdir()
    assert main([str(run / "adapter")]) == 2
    assert capsys.readouterr().err == (f"error: {run / 'adapter'}: not a completed fine-tune run (no summary.json); "
                                       f"its run is {run}\n")
    assert main([str(tmp_path)]) == 2
    assert capsys.readouterr().err == (f"error: {tmp_path}: not a completed fine-tune run (no summary.json); it holds "
                                       f"runs: `--output-dir {tmp_path}` compares the latest of them with its "
                                       "previous run\n")


def test_a_run_and_an_output_dir_together_are_refused(tmp_path, capsys):
    """`compare RUN --output-dir X` compared RUN and never read X, without a word: --output-dir only says where the
    latest run is when none is given."""
    import pytest

    run = make_run(tmp_path / "a", "nightly", "20261129-013000", summary(0.2, 0.8))
    make_run(tmp_path / "b", "other", "20261129-013000", summary(0.2, 0.8))
    for runs in ([run], [run, run]):
        with pytest.raises(SystemExit) as exit_:
            main([*map(str, runs), "--output-dir", str(tmp_path / "b")])
        assert exit_.value.code == 2
        assert capsys.readouterr().err.endswith("error: --output-dir is where the latest run is looked for when no "
                                                "run is given; give run directories or --output-dir, not both\n")
    assert main([str(run)]) == 0 and main(["--output-dir", str(tmp_path / "a")]) == 0


def test_two_runs_given_newer_first_are_compared_with_a_note_that_says_so(tmp_path, capsys):
    """`compare NEW OLD` titled OLD "this run" and NEW "previous" and marked NEW's gains WORSE, without a word."""
    old = make_run(tmp_path, "nightly", "20261129-013000", summary(0.2, 0.8))
    new = make_run(tmp_path, "nightly", "20261130-013000", summary(0.1, 0.9))
    assert main([str(new), str(old)]) == 0
    out, err = capsys.readouterr()
    assert err == (f"note: {new}, given first as the previous run, is newer than {old}: each change reads from the "
                   "first to the second (swap them to see the newer run's change)\n") and "**Regressions:**" in out
    assert main([str(old), str(new)]) == 0 and capsys.readouterr().err == ""


def test_the_same_run_given_twice_is_refused_naming_it(tmp_path, capsys):
    """`compare A A` (or A and ./A/) printed a table of zero changes, "No regression.", with no word."""
    run = make_run(tmp_path, "nightly", "20261129-013000", summary(0.2, 0.8))
    for other in (run, tmp_path / "." / run.name):
        assert main([str(run), str(other)]) == 2
        err = capsys.readouterr().err
        assert err == (f"error: {run} and {other} are the same run ({run.resolve()}): give two different runs, or one "
                       "to compare it with its previous run\n")


def test_the_settings_in_which_the_two_runs_differ_are_named_beside_the_verdicts(tmp_path):
    """A 20-step run marked WORSE against a 40-step one read as a regression of the data or code."""
    previous = make_run(tmp_path, "nightly", "20261129-013000", summary(0.2, 0.8))
    tonight = make_run(tmp_path, "nightly", "20261130-013000", summary(0.3, 0.7))
    (previous / "config.resolved.yaml").write_text("run:\n  name: nightly\ntrain:\n  max_steps: 40\n  seed: 1\n"
                                                   "lora:\n  target_modules: all-linear\n")
    (tonight / "config.resolved.yaml").write_text("run:\n  name: nightly\ntrain:\n  max_steps: 20\n  seed: 1\n"
                                                  "lora:\n  target_modules: [q_proj]\n")
    text = render_comparison(tonight, previous)
    assert ("**Settings that differ** (a change below may come from them): `lora.target_modules` 'all-linear' -> "
            "['q_proj']; `train.max_steps` 40 -> 20\n") in text
    (tonight / "config.resolved.yaml").write_text((previous / "config.resolved.yaml").read_text())
    assert "Settings that differ" not in render_comparison(tonight, previous)
    # where the files went changes no number: two runs of one config in other directories (served from the
    # same cache) were said to differ in run.output_dir and run.cache_dir, "a change below may come from them"
    (tonight / "config.resolved.yaml").write_text((previous / "config.resolved.yaml").read_text()
                                                  .replace("name: nightly", "name: nightly\n  output_dir: /elsewhere"
                                                           "\n  cache_dir: /cache"))
    assert "Settings that differ" not in render_comparison(tonight, previous)


def test_the_command_read_through_a_closed_pipe_ends_quietly(tmp_path):
    """`python -m finetune_flows.reporting.compare | head` where the reader is gone: rc 1 and a BrokenPipeError
    traceback before; the output now ends quietly, as the CLI's --help-config does."""
    import os
    import subprocess
    import sys

    make_run(tmp_path, "nightly", "20261129-013000", summary(0.2, 0.8))
    make_run(tmp_path, "nightly", "20261130-013000", summary(0.3, 0.7))
    read, write = os.pipe()
    os.close(read)  # the reader stopped before the table was written
    try:
        done = subprocess.run([sys.executable, "-m", "finetune_flows.reporting.compare", "--output-dir", str(tmp_path)],
                              stdout=write, stderr=subprocess.PIPE, text=True, timeout=120,
                              cwd=Path(__file__).resolve().parent.parent)
    finally:
        os.close(write)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
