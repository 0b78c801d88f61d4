"""The training benchmark's report (benchmarks/train_speed.py writes the rows): the ratios between its rows (ours over
the seed, over the fastest peer, two GPUs over one), report.json and report.md, and rows joined from an earlier
report (--resume-from)."""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# rows, workload stats and reports mark work as done: written whole or not at all, so a kill cannot leave half
from finetune_flows.files import write_atomic, write_json  # noqa: E402 (needs the repository on sys.path)
from finetune_flows.packages import installed_version  # noqa: E402

PEERS = ("unsloth", "trl", "trl-padded", "trl-bf16")  # benchmarks/peer_recipe.py


def budget_suffix(budget: int | None) -> str:
    """A row's name after its shape: nothing without a memory budget, `-<N>gib` with one."""
    return f"-{budget}gib" if budget else ""


def _layout(run: dict) -> str:
    """The run's batch layout and the planner's switches that change speed."""
    plan = run.get("training_plan") or {}
    extra = [text for key, text in (("gradient_checkpointing", "activation checkpointing"),
                                    ("dequantize_base", "NF4 base dequantized"), ("fp8_base", "base matmuls in FP8"),
                                    ("compile_layers", "decoder layers compiled")) if plan.get(key)]
    stats = run.get("compile_stats") or {}
    if stats.get("graph_breaks") or stats.get("cudagraph_skips"):  # a compiled row that may not be what it says
        extra.append(f"{stats['frames_compiled']} frames compiled, {stats['graph_breaks']} graph breaks, "
                     f"{stats['cudagraph_skips']} CUDA graph recordings skipped")
    return "; ".join([run.get("layout", "")] + extra)


def host_cpu() -> dict:
    """The host's CPU model and the cores this process may use: rows bound by the host (the peers', the small shape's)
    move with it."""
    info = Path("/proc/cpuinfo")
    names = [line.split(":", 1)[1].strip() for line in (info.read_text().splitlines() if info.is_file() else [])
             if line.startswith("model name")]
    return {"model": names[0] if names else platform.processor() or None, "cores": len(os.sched_getaffinity(0))}


def host_dispatch_us(ops: int = 2000, repeats: int = 5) -> float:
    """Microseconds per PyTorch op dispatched from Python on a one-element CPU tensor, the median of `repeats` runs:
    the host-side cost that bounds launch-bound rows, measured beside each row so that rows of a slow host, or of a
    host that slowed down, can be told apart."""
    import torch

    one, times = torch.ones(1), []
    for _ in range(repeats):
        started = time.perf_counter()
        for _ in range(ops):
            torch.add(one, one)
        times.append((time.perf_counter() - started) / ops * 1e6)
    return round(sorted(times)[len(times) // 2], 2)


def versions() -> dict[str, str | None]:
    return {d: installed_version(d) for d in ("torch", "transformers", "peft", "accelerate", "bitsandbytes",
                                               "liger-kernel", "flash-attn-4", "triton", "prefect")}


def machine_of(row: dict) -> str:
    """The machine a row ran on: its GPU's UUID, else the report it was joined from, else this call's (the CPU)."""
    joined = row.get("joined_from")
    return row.get("machine") or (f"unrecorded, {joined.get('report')}" if joined else "this call's")


def build_report(state: Path, env, command: str) -> dict:
    runs = [json.loads(p.read_text()) for p in sorted((state / "runs").glob("*.json"))]
    by = {r["name"]: r for r in runs}
    speedup: dict[str, float | None] = {}
    quality: dict[str, float | None] = {}
    across: list[str] = []  # the ratios whose two rows ran on different machines (calls joined by --resume-from)
    for r in runs:
        if r["name"].startswith("seed-"):
            shape = r["name"][5:]
            ours = by.get(f"ours-{shape}")
            if ours and ours["tokens_per_second"] and r["tokens_per_second"]:
                speedup[shape] = round(ours["tokens_per_second"] / r["tokens_per_second"], 2)
                quality[shape] = round((ours["eval_loss"] - r["eval_loss"]) / r["eval_loss"], 4)
                across += [shape] if machine_of(ours) != machine_of(r) else []
    for r in runs:
        if r["name"].startswith("ours-2gpu-"):  # ours-2gpu-<shape>, or a variant's ours-2gpu-<label>-<shape>
            rest = r["name"][len("ours-2gpu-"):]
            one = by.get("ours-" + rest)
            where = r["model"].split(":", 1)[1] + budget_suffix(r.get("memory_budget_gib"))
            key = "ddp_2gpu_scaling" if rest == where else f"ddp_2gpu_scaling:{rest[:-len(where) - 1]}"
            key += budget_suffix(r.get("memory_budget_gib"))
            if one and one["tokens_per_second"] and r["tokens_per_second"]:
                speedup[key] = round(r["tokens_per_second"] / one["tokens_per_second"], 2)
                across += [key] if machine_of(one) != machine_of(r) else []
    best_peer: dict[str, str] = {}
    # ours and each one-GPU variant of it (ours-<label>: the key gains ":<label>") against the seed and the fastest
    # peer of its shape and budget
    for ours in [r for r in runs if str(r.get("run", "")).startswith("ours") and r.get("gpus", 1) <= 1
                 and not str(r.get("run")).endswith("-profile") and r.get("tokens_per_second")]:
        where = ours["shape"] + budget_suffix(ours.get("memory_budget_gib"))
        key = where + ("" if ours["run"] == "ours" else ":" + ours["run"].removeprefix("ours-"))
        seed = by.get(f"seed-{where}")
        if ours["run"] != "ours" and seed and seed.get("tokens_per_second"):
            speedup[key] = round(ours["tokens_per_second"] / seed["tokens_per_second"], 2)
            quality[key] = round((ours["eval_loss"] - seed["eval_loss"]) / seed["eval_loss"], 4)
            across += [key] if machine_of(ours) != machine_of(seed) else []
        peers = [r for r in runs if r.get("run") in PEERS and r.get("tokens_per_second") and
                 r["shape"] == ours["shape"] and r.get("memory_budget_gib") == ours.get("memory_budget_gib")]
        if peers:
            best = max(peers, key=lambda r: r["tokens_per_second"])
            speedup.setdefault("vs_best_peer", {})[key] = round(ours["tokens_per_second"]
                                                                / best["tokens_per_second"], 2)
            best_peer[key] = best["name"]
            across += [f"vs_best_peer:{key}"] if machine_of(ours) != machine_of(best) else []
    imported = state / "imported-workload.json"
    workload = json.loads(imported.read_text()) if imported.is_file() else {}
    workload.update({p.parent.name: json.loads(p.read_text()) for p in (state / "workload").glob("*/stats.json")})
    return {"date": datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S"), "command": command,
            "host": platform.node(), "cpu": host_cpu(), "python": platform.python_version(),
            "gpus": [g.model_dump() for g in env.gpus], "driver": env.driver_version, "cuda": env.cuda_version,
            "versions": versions(), "workload": workload, "runs": runs, "speedup": speedup, "best_peer": best_peer,
            "across_machines": across, "eval_loss_relative_to_seed": quality,
            "flop_model": "4 x (linear + lm_head params) per token (frozen base: forward + input-gradient backward) "
                          "+ causal attention (QK^T and PV, backward 2x forward); MFU against 989 TFLOP/s dense bf16"}


def markdown(rep: dict) -> str:
    gpus = rep["gpus"]
    head = f"{len(gpus)} x {gpus[0]['name']}" if gpus else "CPU"
    lines = [f"# Training benchmark: {head}", "", f"- date: {rep['date']}", f"- command: `{rep['command']}`",
             f"- driver {rep['driver']}, CUDA {rep['cuda']}, python {rep['python']}",
             *([f"- host CPU: {rep['cpu']['model']}, {rep['cpu']['cores']} cores; `host us/op` below: a PyTorch op "
                "dispatched from Python after each row (host_dispatch_us), the host's speed then"] if rep.get("cpu")
               else []),
             "- versions: " + ", ".join(f"{k} {v}" for k, v in rep["versions"].items() if v),
             f"- FLOP model: {rep['flop_model']}", ""]
    for name, w in rep["workload"].items():
        lines.append(f"- workload `{name}`: {w['rows']} rows, lengths median {w['median_length']}, mean "
                     f"{w['mean_length']}, {w['min_length']}..{w['max_length']}; {w['tokens']} tokens")
    ran = [r for r in rep["runs"] if not r.get("error")]
    lines += ["", "| run | budget GiB | GPUs | tokens/s (steady, median) | min..max | MFU | peak reserved GiB | "
              "nvidia-smi GiB | eval loss | run s (beyond steady) | host us/op | layout |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in ran:
        lines.append(f"| {r['name']} | {r.get('memory_budget_gib') or '-'} | {r['gpus']} | {r['tokens_per_second']} | "
                     f"{r['tokens_per_second_min']}..{r['tokens_per_second_max']} | {r['mfu']} | "
                     f"{r['peak_reserved_gib']} | {r['nvidia_smi_peak_gib']} | {r['eval_loss']} | "
                     f"{r.get('train_seconds')} ({r.get('warmup_overhead_seconds')}) | "
                     f"{r.get('host_dispatch_us') or '-'} | {_layout(r)} |")
    lines += _where_rows_ran(rep)
    failed = [r for r in rep["runs"] if r.get("error")]
    if failed:
        lines += ["", "## Rows that did not run", ""]
        for r in failed:
            error = r["error"].splitlines()
            shown = error if len(error) <= 25 else [error[0], "...", *error[-23:]]  # what failed, then its tail
            lines += [f"- **{r['name']}** (budget {r.get('memory_budget_gib') or 'none'}):", "", "```", *shown,
                      "```", ""]
    lines += ["", "## Speedup (ours / seed, steady-state real tokens/s)", ""]
    across = set(rep.get("across_machines", []))
    apart = " (the two rows ran on different machines)"
    lines += [f"- {k}: {v}{apart if k in across else ''}" for k, v in rep["speedup"].items() if k != "vs_best_peer"]
    if rep["speedup"].get("vs_best_peer"):
        lines += ["", "## Ours over the fastest peer that ran (same shape and budget)", ""]
        lines += [f"- {k}: {v} (against {rep['best_peer'][k]}){apart if f'vs_best_peer:{k}' in across else ''}"
                  for k, v in rep["speedup"]["vs_best_peer"].items()]
    lines += ["", "## Eval loss of ours relative to the seed (same steps and effective batch)", ""]
    lines += [f"- {k}: {v:+.2%}" for k, v in rep["eval_loss_relative_to_seed"].items()]
    planned = [r for r in rep["runs"] if r.get("training_plan") and r.get("peak_allocated_gib") is not None]
    if planned:
        lines += ["", "## Memory: the planner's prediction against the allocator (GiB)", "",
                  "| run | predicted peak | allocated before step 1 | peak allocated | peak reserved | reserved while "
                  "loading | device memory outside the allocator | nvidia-smi: the run's processes | nvidia-smi: "
                  "whole GPU | PYTORCH_CUDA_ALLOC_CONF |", "|---|---|---|---|---|---|---|---|---|---|"]
        lines += [f"| {r['name']} | {r['training_plan']['predicted_peak_gib']} | {r.get('loaded_allocated_gib')} | "
                  f"{r['peak_allocated_gib']} | {r['peak_reserved_gib']} | {r.get('load_peak_reserved_gib')} | "
                  f"{r.get('outside_allocator_gib')} | {r['nvidia_smi_peak_gib']} | "
                  f"{r.get('nvidia_smi_device_peak_gib')} | {r.get('allocator') or '-'} |" for r in planned]
        listed = [f"{r['name']}: " + ", ".join(f"{k} {v}" for k, v in r["nvidia_smi_processes"].items())
                  for r in planned if r.get("nvidia_smi_processes")]
        if listed:
            lines += ["", "Processes nvidia-smi listed during each run (peak MiB): " + "; ".join(listed)]
    for r in rep["runs"]:
        if r.get("profile"):
            p = r["profile"]
            lines += ["", f"## Profile: {r['name']} ({p['wall_ms_per_step']} ms/step, GPU idle "
                      f"{p['gpu_idle_share']:.0%})", "", "| category | ms/step | share of wall |", "|---|---|---|"]
            lines += [f"| {k} | {v} | {p['share_of_wall'].get(k, 0):.1%} |" for k, v in p["kernel_ms_per_step"].items()]
            if "kernels_per_step" in p:
                host = ", ".join(f"{name} {ms} ms" for name, ms in p["top_host_ops_ms_per_step"][:6])
                lines += ["", f"Per step: {p['kernels_per_step']:g} kernels, {p['host_syncs_per_step']:g} host-GPU "
                          f"synchronisations; the host's largest self times: {host}"]
            if "gap_ms_per_step" in p:
                launch = ", ".join(f"{name} {ms} ms" for name, ms in p["gap_ms_per_step_by_next_launch"][:6])
                lines += ["", f"GPU idle between kernels {p['gap_ms_per_step']} ms per step "
                          f"({p['gaps_of_50us_or_more_per_step']:g} gaps of 50 us or more), before kernels launched "
                          f"by: {launch}"]
    return "\n".join(lines) + "\n"


def _where_rows_ran(rep: dict) -> list[str]:
    """Where rows ran on more than one machine (calls joined with --resume-from): which rows ran where, since the
    host's speed moves host-bound rows between machines of the same card."""
    here = {g.get("uuid") for g in rep["gpus"]}
    groups: dict[str, list[str]] = {}
    for r in rep["runs"]:
        joined, gpu = r.get("joined_from"), r.get("machine")
        if joined:
            origin = ", ".join(x for x in (joined.get("date") or "undated", gpu and f"GPU {gpu}") if x)
            where = f"joined from `{joined['report']}` ({origin})"
        elif gpu in here:
            where = "this report's machine"
        else:
            where = f"GPU {gpu or 'not recorded'}"
        groups.setdefault(where, []).append(r["name"])
    if len(groups) < 2:
        return []
    return ["", "## Where the rows ran", "", *[f"- {where}: {', '.join(names)}" for where, names in groups.items()]]


def resume_rows(report: Path, state: Path, gpu_names: list[str]) -> int:
    """The rows of an earlier report that --state lacks, written into it (a row already there is kept), and its
    workload statistics beside them; how many rows were added. Refuses a report from other GPUs (an H100's rows
    beside an H200's would read as one comparison)."""
    rep = json.loads(report.read_text())
    theirs = [g["name"] for g in rep.get("gpus", [])]
    if theirs[:1] != gpu_names[:1]:
        raise ValueError(f"--resume-from {report}: its rows ran on {theirs[:1] or ['the CPU']}, "
                         f"this host has {gpu_names[:1] or ['no GPU']}; rows from other cards are not comparable")
    (state / "runs").mkdir(parents=True, exist_ok=True)
    added = 0
    for run in rep["runs"]:
        path = state / "runs" / f"{run['name']}.json"
        if not path.exists():
            write_json(path, {**run, "joined_from": run.get("joined_from") or {"report": str(report),
                                                                                "date": rep.get("date")}})
            added += 1
    imported = state / "imported-workload.json"
    workload = json.loads(imported.read_text()) if imported.is_file() else {}
    write_json(imported, {**rep.get("workload", {}), **workload})
    print(f"{added} row(s) from {report}", flush=True)
    return added


def write_report(state: Path, env, command: str, out: Path) -> dict:
    """Rewritten after every run, so a run cut short still leaves the report of what finished."""
    report = build_report(state, env, command)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "report.json", report)
    write_atomic(out / "report.md", markdown(report))
    return report
