"""This run beside the previous one: did last night's retraining get better or worse?

The previous run is the latest earlier *completed* fine-tune run (one with `summary.json`) of the same
`run.name` in the same `run.output_dir`: the runs of one deployment (e.g. `nightly`) share both. Every run
publishes the comparison as the `eval-vs-previous` artifact and writes it to `<run>/comparison.md`.

    python -m finetune_flows.reporting.compare                       # the latest run in runs/ against its previous run
    python -m finetune_flows.reporting.compare --output-dir DIR      # the latest run in DIR (only without RUN)
    python -m finetune_flows.reporting.compare runs/<run>            # that run against its previous run
    python -m finetune_flows.reporting.compare runs/<a> runs/<b>     # b against a
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

import yaml

from finetune_flows.cli import print_to_pipe
from finetune_flows.config.schema import dotted
from finetune_flows.files import write_atomic

STAMP = re.compile(r"-(\d{8}-\d{6})-[0-9a-f]+$")

# (label, how to read it from summary.json given the current run's headline metric, which way is better, the smallest
# change that counts: relative for losses and speed, absolute for scores between 0 and 1)
METRICS: list[tuple[str, Any, str | None, float, bool]] = [
    ("adapter: held-out loss", lambda s, m: s["eval"]["adapter"]["loss"], "lower", 0.01, True),
    ("adapter: perplexity", lambda s, m: s["eval"]["adapter"]["perplexity"], "lower", 0.01, True),
    ("adapter: {metric}", lambda s, m: score(s, "adapter", m), "higher", 0.005, False),
    ("base: held-out loss", lambda s, m: s["eval"]["base"]["loss"], "lower", 0.01, True),
    ("base: {metric}", lambda s, m: score(s, "base", m), "higher", 0.005, False),
    ("training: final loss", lambda s, m: s["train"]["final_loss"], "lower", 0.01, True),
    ("training: tokens/s", lambda s, m: s["train"]["tokens_per_second"], "higher", 0.05, True),
    ("training: steps", lambda s, m: s["train"]["steps"], None, 0.0, False),
    ("held-out rows", lambda s, m: s["eval"]["eval_rows"], None, 0.0, False),
]


def score(summary: dict, model: str, metric: str) -> float | None:
    """A model's rate on `metric` (the current run's headline): from `rates`, which holds every metric, so two runs
    whose eval.metric differs are compared on the same one; a run without it, only if it headlined that metric."""
    rates = summary["eval"].get("rates") or {}
    if metric in rates.get(model, {}):
        return rates[model][metric]
    return summary["eval"][model]["generation_score"] if summary["eval"].get("metric") == metric else None


def run_name_of(run_dir: Path) -> str | None:
    try:
        return yaml.safe_load((run_dir / "config.resolved.yaml").read_text())["run"]["name"]
    except (OSError, KeyError, TypeError, yaml.YAMLError):
        return None


def _order(run_dir: Path) -> tuple[str, float]:
    match = STAMP.search(run_dir.name)
    summary = run_dir / "summary.json"
    return (match.group(1) if match else "", summary.stat().st_mtime if summary.exists() else 0.0)


def completed_runs(output_dir: Path, name: str) -> list[Path]:
    """Completed fine-tune runs named `name` under output_dir, oldest first."""
    found = [p for p in output_dir.glob(f"{name}-*") if (p / "summary.json").is_file() and run_name_of(p) == name]
    return sorted(found, key=_order)


def previous_run(run_dir: Path) -> Path | None:
    name = run_name_of(run_dir)
    if name is None:
        return None
    earlier = [p for p in completed_runs(run_dir.parent, name) if p != run_dir and _order(p) < _order(run_dir)]
    return earlier[-1] if earlier else None


def _value(summary: dict, read, metric: str) -> float | None:
    try:
        value = read(summary, metric)
    except (KeyError, TypeError):
        return None
    return None if value is None else float(value)


def _verdict(before: float | None, after: float | None, better: str | None, tolerance: float,
             relative: bool) -> str:
    if before is None or after is None or better is None:
        return ""
    change = after - before
    if abs(change) <= tolerance * (abs(before) if relative else 1.0):
        return "same"
    return "better" if (change < 0) == (better == "lower") else "WORSE"

def comparison_rows(current: dict, previous: dict) -> list[dict[str, Any]]:
    metric = current.get("eval", {}).get("metric", "score")
    rows, verdicts = [], {}
    for label, read, better, tolerance, relative in METRICS:
        before, after = _value(previous, read, metric), _value(current, read, metric)
        if before is None and after is None:
            continue
        verdict = verdicts[label] = _verdict(before, after, better, tolerance, relative)
        if label.endswith(": perplexity"):  # exp(held-out loss): the loss's verdict, not a second one that differs
            verdict = verdicts.get(label.replace("perplexity", "held-out loss"), verdict)
        rows.append({"metric": label.format(metric=metric), "previous": before, "this run": after,
                     "change": None if before is None or after is None else after - before, "verdict": verdict})
    return rows


def _fmt(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.0f}" if value == int(value) and abs(value) >= 10 else f"{value:.4g}"


WHERE_FILES_GO = {"run.output_dir", "run.cache_dir"}  # no number changes with them: not listed as differences


def settings_that_differ(previous_dir: Path, current_dir: Path) -> list[tuple[str, Any, Any]]:
    """The resolved settings (config.resolved.yaml) in which the two runs differ: (key, previous, this run); where
    their files went left out."""
    try:
        before, after = (dotted(yaml.safe_load((d / "config.resolved.yaml").read_text()) or {})
                         for d in (previous_dir, current_dir))
    except (OSError, yaml.YAMLError):
        return []
    return [(k, before.get(k), after.get(k)) for k in sorted((before.keys() | after.keys()) - WHERE_FILES_GO)
            if before.get(k) != after.get(k)]


def render_comparison(current_dir: Path, previous_dir: Path | None, current: dict | None = None) -> str:
    """Markdown: the two runs' headline numbers side by side, regressions marked WORSE. `current` is the
    run's summary when it is not on disk yet."""
    title = f"# {current_dir.name} vs the previous run\n\n"
    if previous_dir is None:
        return (title + f"No earlier completed run named `{run_name_of(current_dir)}` in `{current_dir.parent}`: "
                "nothing to compare with yet.\n")
    current = current or json.loads((current_dir / "summary.json").read_text())
    previous = json.loads((previous_dir / "summary.json").read_text())
    rows = comparison_rows(current, previous)
    worse = [r["metric"] for r in rows if r["verdict"] == "WORSE"]
    differ = settings_that_differ(previous_dir, current_dir)
    lines = [title + f"Previous run: `{previous_dir.name}`\n",
             ("**Regressions:** " + ", ".join(worse) if worse else "No regression.") + "\n",
             *(["**Settings that differ** (a change below may come from them): " + "; ".join(
                 f"`{key}` {before!r} -> {after!r}" for key, before, after in differ) + "\n"] if differ else []),
             "| metric | previous | this run | change | verdict |", "|---|---|---|---|---|"]
    for r in rows:
        change = "-" if r["change"] is None else f"{r['change']:+.4g}"
        lines.append(f"| {r['metric']} | {_fmt(r['previous'])} | {_fmt(r['this run'])} | {change} | "
                     f"{'**WORSE**' if r['verdict'] == 'WORSE' else r['verdict']} |")
    return "\n".join(lines) + "\n"


def publish_comparison(run_dir: Path, summary: dict) -> Path | None:
    """Write `<run>/comparison.md` and publish it as the `eval-vs-previous` artifact; return the previous run."""
    from prefect.artifacts import create_markdown_artifact

    previous = previous_run(run_dir)
    text = render_comparison(run_dir, previous, summary)
    write_atomic(run_dir / "comparison.md", text)
    create_markdown_artifact(text, key="eval-vs-previous",
                             description="This run's evaluation beside the previous run of the same name")
    return previous


def not_a_run(path: Path) -> str:
    """Why `path` is not a completed fine-tune run, naming the directory meant where that is plain: the run of an
    adapter (or merged/, plots/) given, or `--output-dir` for a directory of runs."""
    if not path.exists():
        return "no such directory"
    why = "not a completed fine-tune run (no summary.json)"
    if (path.parent / "summary.json").is_file():
        return f"{why}; its run is {path.parent}"
    if path.is_dir() and any((p / "summary.json").is_file() for p in path.iterdir() if p.is_dir()):
        return f"{why}; it holds runs: `--output-dir {path}` compares the latest of them with its previous run"
    return why


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="*", type=Path, help="RUN (against its previous run) or PREVIOUS RUN")
    parser.add_argument("--output-dir", type=Path,
                        help="where to find the latest run when none is given (default: runs)")
    args = parser.parse_args(argv)
    if len(args.runs) > 2:
        parser.error("give at most two run directories")
    if args.runs and args.output_dir is not None:  # it only says where the latest run is: with RUN it went unread
        parser.error("--output-dir is where the latest run is looked for when no run is given; give run "
                     "directories or --output-dir, not both")
    output_dir = args.output_dir or Path("runs")
    for path in args.runs:
        if not (path / "summary.json").is_file():
            print(f"error: {path}: {not_a_run(path)}", file=sys.stderr)
            return 2
    if len(args.runs) == 2:
        previous, current = args.runs
        if previous.resolve() == current.resolve():  # a table of zero changes would read as "no regression"
            print(f"error: {previous} and {current} are the same run ({current.resolve()}): give two different runs, "
                  "or one to compare it with its previous run", file=sys.stderr)
            return 2
        stamps = [STAMP.search(p.resolve().name) for p in (previous, current)]
        if all(stamps) and stamps[0].group(1) > stamps[1].group(1):  # the table reads "previous" -> "this run"
            print(f"note: {previous}, given first as the previous run, is newer than {current}: each change reads "
                  "from the first to the second (swap them to see the newer run's change)", file=sys.stderr)
    elif args.runs:
        current, previous = args.runs[0], previous_run(args.runs[0])
    else:
        done = sorted((p for p in output_dir.glob("*") if (p / "summary.json").is_file()), key=_order)
        if not done:
            print(f"error: no completed run in {output_dir}", file=sys.stderr)
            return 2
        current = done[-1]
        previous = previous_run(current)
    print_to_pipe(render_comparison(current.resolve(), previous.resolve() if previous else None))  # `| head`
    return 0


if __name__ == "__main__":
    sys.exit(main())
