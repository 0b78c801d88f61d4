"""Prove a GPU host: the GPU test tier, then real `finetune` flow runs through Prefect, then a report.

    make gpu-proof                      # or: python benchmarks/gpu_proof.py [--model SOURCE] [--out DIR]
    python benchmarks/gpu_proof.py --tests only            # the GPU test tier alone (results kept in --work)
    python benchmarks/gpu_proof.py --tests reuse --runs 2gpu-ddp   # then flow runs, one report with both
    python benchmarks/gpu_proof.py --tests only --test-paths tests/test_gpu.py   # the tier split over calls:
    python benchmarks/gpu_proof.py --tests only --append-tests --test-paths tests/test_faults.py,...

Writes benchmarks/results/gpu-proof-<N>xGPU-<date>.{json,md}: environment and versions, the GPU test results,
flow wall times, tokens/s on 1 GPU (and 2 GPUs where there are two), peak memory, the eval table, and the
evaluation run twice on the same adapter, with the backend `auto` resolved to and with another one (sdpa, or when
auto chose sdpa the first other usable backend), compared; with no other usable backend it says so.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def run_gpu_tests(work: Path, paths: list[str], append: bool = False) -> dict:
    """The GPU tier (`make test-gpu`: every test marked `gpu`) in `paths`, its log (written as it runs, so a call cut
    short by a time limit still leaves it) and JUnit XML kept in `work` with a summary JSON, so a later call
    (`--tests reuse`) can put them in its report. With `append` the results join those an earlier call left there
    (the tier split over calls: `--test-paths`). The part is recorded before it starts: one that a time limit cuts
    short keeps its log and shows as not finished, and the next part is numbered after it."""
    from finetune_flows.files import write_atomic

    summary = work / "gpu-tests.json"
    parts = json.loads(summary.read_text()).get("parts", []) if append and summary.is_file() else []
    index = len(parts)
    xml, log = work / f"gpu-tests-{index}.xml", work / f"gpu-tests-{index}.log"
    parts.append({"exit_code": None, "seconds": None, "paths": paths, "results": [],
                  "summary": "not finished (stopped before pytest ended)"})

    def publish(parts: list[dict]) -> dict:
        codes = [124 if p["exit_code"] is None else p["exit_code"] for p in parts]
        result = {"exit_code": max(codes), "seconds": round(sum(p["seconds"] or 0 for p in parts), 1),
                  "results": [line for p in parts for line in p["results"]],
                  "summary": "; ".join(p["summary"] for p in parts), "parts": parts}
        write_atomic(summary, json.dumps(result, indent=2))
        return result

    work.mkdir(parents=True, exist_ok=True)
    publish(parts)
    # every part of the tier, and the flow runs after it, share one cache: the 4-bit base, probes (tests/conftest.py)
    env = {**os.environ, "FINETUNE_FLOWS_GPU_CACHE": str(work / "cache")}
    started = time.perf_counter()
    with log.open("w") as sink:
        code = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-rA", "-p", "no:cacheprovider",
                               "-s", "--durations=15", f"--junitxml={xml}", *paths],
                              cwd=REPO, env=env, stdout=sink, stderr=subprocess.STDOUT, text=True).returncode
    output = log.read_text()
    parts[index] = {"exit_code": code, "seconds": round(time.perf_counter() - started, 1), "paths": paths,
                    "results": [line for line in output.splitlines()
                                if line.startswith(("PASSED", "FAILED", "SKIPPED", "ERROR"))],
                    "summary": output.strip().splitlines()[-1] if output.strip() else ""}
    if xml.is_file():
        shutil.copyfile(xml, work / "gpu-tests.xml")
    return publish(parts)


def combined_log(work: Path) -> str:
    """Every part's log, in order (a part cut short included), for the report."""
    logs = sorted(work.glob("gpu-tests-*.log"), key=lambda p: int(p.stem.rsplit("-", 1)[1]))
    return "\n".join(f"===== {p.name}\n{p.read_text()}" for p in logs)


def gpu_tests(mode: str, work: Path, out: Path, paths: list[str] | None = None, append: bool = False) -> dict:
    """`run` the GPU tier now, `reuse` what an earlier `--tests only` call on this machine left in `work`, or
    `skip` it; the log and XML go beside the report either way."""
    if mode == "skip":
        return {"summary": "skipped", "results": [], "seconds": 0}
    if mode == "reuse" and not (work / "gpu-tests.json").is_file():
        raise SystemExit(f"--tests reuse: no earlier GPU test results in {work} (run with --tests only first)")
    out.mkdir(parents=True, exist_ok=True)
    try:
        if mode in ("run", "only"):
            result = run_gpu_tests(work, paths or ["tests/"], append)
        else:
            result = json.loads((work / "gpu-tests.json").read_text())
    finally:  # the logs go beside the report even when a signal stops the tier
        from finetune_flows.files import write_atomic

        write_atomic(out / "gpu-tests.log", combined_log(work))
        for xml in sorted(work.glob("gpu-tests*.xml")):
            shutil.copyfile(xml, out / xml.name)
    return result


def flow_run(name: str, config: str | None, overrides: list[str], cache: Path, runs: Path) -> dict:
    from finetune_flows.config.schema import load_config
    from flows.finetune import finetune

    started = time.perf_counter()
    result = finetune(load_config(config, [*overrides, f"run.cache_dir={cache}", f"run.output_dir={runs}",
                                           f"run.name={name}"]))
    seconds = time.perf_counter() - started
    t, e = result.train, result.eval
    return {
        "name": name, "overrides": overrides, "flow_seconds": round(seconds, 1), "run_dir": str(result.run_dir),
        "cached_steps": result.cached_steps, "step_seconds": result.step_seconds,
        "train": {k: getattr(t, k) for k in ("steps", "world_size", "backend", "devices", "rank_steps", "first_loss",
                                             "final_loss", "tokens_per_second", "steady_tokens_per_second",
                                             "train_tokens", "train_seconds", "peak_memory_mb", "layout")},
        "eval": {"attn_implementation": e.attn_implementation, "engine": e.engine, "metric": e.metric,
                 "table": e.table(),
                 "base_generate_seconds": e.base.generate_seconds,
                 "adapter_generate_seconds": e.adapter.generate_seconds},
        "_report": e,
    }


COMPARED_WITH = {"1gpu-other-attn-eval": "1gpu-auto-attn", "demo-model-other-attn-eval": "demo-model-auto-attn"}


def other_backend(auto: str | None, env) -> tuple[str | None, str]:
    """A backend other than auto's choice to compare it with: sdpa, or when auto chose sdpa, the first usable
    of flash_attention_4/3/2 on GPU 0; None (and why) when there is no other. flex_attention is never compared:
    `auto` never chooses it (finetune_flows/models/backends.py: transformers compiles it for every new input shape)."""
    from finetune_flows.models.backends import candidates

    if auto is None:
        return None, "the run with auto attention did not complete"
    if auto != "sdpa":
        return "sdpa", "auto chose another backend than sdpa"
    usable = [b for b in candidates(env.attention, env.gpus[:1], "bf16") if b != "sdpa"]
    preferred = [b for b in ("flash_attention_4", "flash_attention_3", "flash_attention_2") if b in usable]
    if not preferred:
        return None, ("auto chose sdpa and no other attention backend is installed and usable on GPU 0 (no "
                      "flash-attention 2/3/4; flex_attention, which auto never chooses, is not compared)")
    return preferred[0], f"auto chose sdpa; {preferred[0]} is the first other usable backend"


def compare(a, b) -> dict:
    """Greedy answers and losses of the same adapter under two attention backends."""
    same = {m: sum(x == y for x, y in zip(a.predictions[m], b.predictions[m])) / max(len(a.predictions[m]), 1)
            for m in ("base", "adapter")}
    rel = {m: abs(getattr(a, m).loss - getattr(b, m).loss) / max(abs(getattr(b, m).loss), 1e-9)
           for m in ("base", "adapter")}
    return {"backends": [a.attn_implementation, b.attn_implementation], "same_greedy_answers": same,
            "loss_relative_difference": rel, "agree": all(v < 2e-2 for v in rel.values()) and same["adapter"] >= 0.9,
            "generate_seconds": {a.attn_implementation: a.adapter.generate_seconds + a.base.generate_seconds,
                                 b.attn_implementation: b.adapter.generate_seconds + b.base.generate_seconds}}


def markdown(report: dict) -> str:
    env = report["environment"]
    lines = [f"# GPU proof: {report['gpu_count']} x {env['gpus'][0]['name'] if env['gpus'] else 'no GPU'}",
             "", f"- date: {report['date']}", f"- host: {report['host']}", f"- command: `{report['command']}`",
             f"- python {env['python']}, torch {env['torch']}, CUDA {env['cuda_version']}, driver "
             f"{env['driver_version']}",
             "- versions: " + ", ".join(f"{k} {v}" for k, v in env["versions"].items() if v),
             "- attention backends: " + ", ".join(f"{k}: {v}" for k, v in env["attention"].items()),
             "", "## GPU tests", "", f"{report['gpu_tests']['summary']} ({report['gpu_tests']['seconds']} s)", ""]
    lines += [f"- {line}" for line in report["gpu_tests"]["results"]]
    lines += ["", "## Flow runs (Prefect `finetune` flow, real workers)", "",
              "| run | hardware.gpus | ranks | backend | steps (per rank) | loss first -> final "
              "| tokens/s whole run (steady) | peak MiB | eval attention | flow s | seconds per step | cached steps |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["flow_runs"]:
        t = r["train"]
        gpus = next((o.split('=')[1] for o in r['overrides'] if o.startswith('hardware.gpus')), '')
        lines.append(f"| {r['name']} | {gpus}"
                     f" | {t['world_size']} | {t['backend']} | {t['rank_steps']} | {t['first_loss']:.3f} -> "
                     f"{t['final_loss']:.3f} | {t['tokens_per_second']} ({t.get('steady_tokens_per_second') or '-'}) | "
                     f"{t['peak_memory_mb']} | "
                     f"{r['eval']['attn_implementation']} | {r['flow_seconds']} | "
                     f"{', '.join(f'{n} {s}' for n, s in r.get('step_seconds', {}).items()) or '-'} | "
                     f"{', '.join(r['cached_steps']) or '-'} |")
    for r in report["flow_runs"]:
        lines += ["", f"### Eval: {r['name']}", "", "| " + " | ".join(r["eval"]["table"][0]) + " |",
                  "|" + "---|" * len(r["eval"]["table"][0])]
        lines += ["| " + " | ".join(str(v) for v in row.values()) + " |" for row in r["eval"]["table"]]
    for c in report["attention_comparisons"]:
        if "note" in c:
            lines += ["", f"## Attention comparison ({c['model']})", "", c["note"]]
            continue
        lines += ["", f"## {c['backends'][0]} vs {c['backends'][1]} ({c['model']})", "",
                  f"- same greedy answers: {c['same_greedy_answers']}",
                  f"- loss relative difference: {c['loss_relative_difference']}",
                  f"- generation seconds (base + adapter): {c['generate_seconds']}", f"- agree: {c['agree']}"]
    for f in report.get("failures", []):
        lines += ["", f"## FAILED: {f['run']}", "", "```", f["error"], "```"]
    if report.get("stopped"):
        lines += ["", f"## STOPPED by {report['stopped']['signal']} during {report['stopped']['run']}", "",
                  "The runs listed above finished; that one and any after it did not run to the end."]
    if report.get("demo_model_skipped"):
        lines += ["", f"Demo model not run: {report['demo_model_skipped']}"]
    return "\n".join(lines) + "\n"


def save(report: dict, out: Path) -> None:
    from finetune_flows.files import write_atomic

    write_atomic(out / "report.json", json.dumps(report, indent=2, default=str))
    write_atomic(out / "report.md", markdown(report))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="generated:qwen3-0.6b", help="model source for the flow runs")
    parser.add_argument("--demo-model", default="builtin:smollm2-135m-instruct",
                        help="also run the demo config on this model where it is installed ('' to skip)")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    parser.add_argument("--work", default="/tmp/finetune-flows-gpu-proof")
    parser.add_argument("--tests", choices=("run", "skip", "only", "reuse"), default="run",
                        help="the GPU test tier: run it, skip it, run only it (results kept in --work), or reuse "
                        "the results an earlier `--tests only` call left in --work (so tests and flow runs can go "
                        "in separate calls and make one report)")
    parser.add_argument("--test-paths", default="tests/", help="comma-separated test files for the GPU tier (default: "
                        "all); with --tests only and --append-tests the tier can be split over several calls")
    parser.add_argument("--append-tests", action="store_true", help="add these --tests only results to those an "
                        "earlier call left in --work instead of replacing them")
    parser.add_argument("--skip-tests", action="store_true", help="the same as --tests skip")
    parser.add_argument("--runs", default="", help="comma-separated flow runs to do (default: all that apply)")
    args = parser.parse_args()
    missing = [p for p in args.test_paths.split(",") if not (REPO / p.split("::")[0]).exists()]
    if missing:
        parser.error(f"--test-paths: no such test file in {REPO}: {', '.join(missing)}")

    from finetune_flows.cli import Stopped, stop_on_signals

    try:  # SIGTERM (a time limit, a lent machine's end) unwinds like Ctrl-C: the running flow stops its workers
        with stop_on_signals():
            return prove(args)
    except Stopped as stop:
        print(f"gpu-proof stopped by {stop}; the report keeps what was measured before", file=sys.stderr, flush=True)
        return 128 + stop.signum


def prove(args: argparse.Namespace) -> int:
    from prefect.testing.utilities import prefect_test_harness  # noqa: F401 (fail early if prefect is missing)

    from finetune_flows.runtime.environment import run_probe
    from finetune_flows.models.sources import check_model_source

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    env = run_probe(work, {}, work / "cache")  # the flow runs below reuse it (their run.cache_dir)
    n = len(env.gpus)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    out = Path(args.out) / f"gpu-proof-{n}xGPU-{stamp}"
    out.mkdir(parents=True, exist_ok=True)
    report = {"date": stamp, "host": platform.node(), "gpu_count": n, "command": " ".join(sys.argv),
              "environment": env.model_dump(mode="json"), "flow_runs": [], "attention_comparisons": []}
    report["gpu_tests"] = gpu_tests("skip" if args.skip_tests else args.tests, work, out,
                                    args.test_paths.split(","), args.append_tests)
    print("gpu tests:", report["gpu_tests"]["summary"], flush=True)
    if args.tests == "only":
        save(report, out)
        print(f"report (GPU tests only): {out}")
        return 0 if report["gpu_tests"]["exit_code"] == 0 else 1

    cache, runs = work / "cache", work / "runs"
    common = [f"model.source={args.model}", "data.builtin_examples=2000", "data.max_length=256", "train.max_steps=60",
              "train.save_steps=20", "train.per_device_batch_size=16", "train.learning_rate=5e-4",
              "eval.max_samples=200", "eval.batch_size=50", "hardware.attn_implementation=auto"]
    demo_config = str(REPO / "configs" / "demo.yaml")
    first = "0" if n else "cpu"  # on a machine without GPUs the script still runs end to end (a dry run)
    plan = [("1gpu-auto-attn", None, [*common, f"hardware.gpus={first}"])]
    if n >= 2:
        plan.append(("2gpu-ddp", None, [*common, "hardware.gpus=0,1"]))
    plan.append(("1gpu-other-attn-eval", None, [*common, f"hardware.gpus={first}"]))
    if args.demo_model:
        try:
            check_model_source(args.demo_model)
            demo = [f"model.source={args.demo_model}", f"hardware.gpus={first}"]
            plan.append(("demo-model-auto-attn", demo_config, demo))
            plan.append(("demo-model-other-attn-eval", demo_config, demo))
        except Exception as exc:
            report["demo_model_skipped"] = str(exc)
    if args.runs:
        plan = [p for p in plan if p[0] in args.runs.split(",")]
    results = {}
    save(report, out)  # written after every stage, so an interrupted proof still leaves what it measured
    for name, config, overrides in plan:
        if name in COMPARED_WITH:  # the same adapter evaluated with another backend than auto's choice
            auto = results.get(COMPARED_WITH[name])
            other, why = other_backend(auto.attn_implementation if auto else None, env)
            model = args.model if name.startswith("1gpu") else args.demo_model
            if other is None:
                report["attention_comparisons"].append({"model": model, "note": f"no comparison made: {why}"})
                print(f"flow run {name} skipped: {why}", flush=True)
                continue
            overrides = [*overrides, f"eval.attn_implementation={other}"]  # same adapter: training is cached
        print(f"flow run {name}: {config or 'defaults'} {overrides}", flush=True)
        try:
            r = flow_run(name, config, overrides, cache, runs)
        except KeyboardInterrupt as stop:  # a signal: this run is not finished, and no other starts
            report["stopped"] = {"run": name, "signal": str(stop)}
            save(report, out)
            raise
        except Exception as exc:  # record and go on: the report says what failed
            report.setdefault("failures", []).append({"run": name, "error": f"{type(exc).__name__}: {exc}"[:2000]})
            print(f"flow run {name} FAILED: {exc}", flush=True)
            continue
        results[name] = r.pop("_report")
        report["flow_runs"].append(r)
        save(report, out)
    for b, a in COMPARED_WITH.items():
        model = args.model if b.startswith("1gpu") else args.demo_model
        if a in results and b in results:
            report["attention_comparisons"].append({"model": model, **compare(results[a], results[b])})
    save(report, out)
    print(markdown(report))
    print(f"report: {out}")
    return 0 if report["gpu_tests"].get("exit_code", 0) == 0 and not report.get("failures") else 1


if __name__ == "__main__":
    sys.exit(main())
