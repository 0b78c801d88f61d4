"""The memory planner against every GPU measurement the training benchmark committed.

    python benchmarks/plan_accuracy.py                         # every benchmarks/results/train-bench-*/report.json
    python benchmarks/plan_accuracy.py path/to/report.json ... --out accuracy.md

For each row of ours that ran on one GPU with the training worker's allocator (expandable segments; rows joined from
another report are left out), the peak the planner predicted then (`training_plan.predicted_peak_gib`), the peak
today's planner predicts for the same plan (finetune_flows/training/planner.py: the row's micro-batch, checkpointing,
base, CUDA graphs and loss chunks, with the bench's LoRA and the GPU's defaults: frozen weights in the compute dtype,
Liger's fused loss), and the peaks the allocator reserved and allocated. A peak reserved above today's prediction is
a plan that could run out of memory where it fills its budget; one far below is room a budgeted plan leaves unused
(fewer, larger micro-batches were possible). Each row measured the code of its day: the summary takes the newest row
of each GPU, shape and plan. What to tune the planner's constants against, rather than one report.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

UNDER_GIB = 0.5  # reserved above today's prediction by more than this: a risk at a full budget
# Reserved below today's prediction by more than this, in a plan predicted to fill >= 90% of what it plans with:
# room the plan left.
OVER_GIB = 1.5


def row_of(run: dict, report: str) -> dict | None:
    """The tool's row for one run of a report: a GPU run of ours with a plan and a measured peak, on one GPU with the
    training worker's allocator, in the report it first ran in; else None."""
    plan = run.get("training_plan")
    if (not run.get("name", "").startswith("ours") or run.get("joined_from") or not plan or not plan.get("packing")
            or not run.get("peak_reserved_gib") or not run.get("gpu") or run.get("gpus", 1) != 1
            or "expandable_segments:True" not in (run.get("allocator") or "")):
        return None
    return {"report": report, "name": run["name"], "gpu": run["gpu"], "plan": plan,
            "shape": run.get("shape") or run["model"].removeprefix("generated:"), "reserved": run["peak_reserved_gib"],
            "allocated": run.get("peak_allocated_gib"), "overrides": run.get("overrides") or []}


def rows_of(reports: list[Path]) -> list[dict]:
    """The rows of these reports, each with its report's date (report.json's `date`, else one in its folder's name)."""
    rows = []
    for path in reports:
        try:
            report = json.loads(path.read_text())
        except ValueError as exc:
            raise ValueError(f"{path}: not a report ({exc})") from None
        named = re.search(r"\d{8}-\d{6}", path.parent.name)
        date = report.get("date") or (named.group() if named else "")
        rows += [r | {"date": date} for r in (row_of(run, path.parent.name) for run in report.get("runs", [])) if r]
    return rows


def predicted_now(row: dict) -> float | None:
    """Today's planner's peak (GiB) for the row's plan; None where the row's shape or settings are not the bench's
    defaults (a shape not generated, another LoRA, fp32 frozen weights, no Liger, another compute dtype)."""
    from finetune_flows.config.schema import load_config
    from finetune_flows.models.sources import ARCHS
    from finetune_flows.training.planner import GIB, ModelShape, peak_bytes

    keys = {o.partition("=")[0] for o in row["overrides"]}
    if row["shape"] not in ARCHS or keys & {"lora.r", "lora.target_modules", "train.upcast_frozen", "train.liger",
                                            "hardware.compute_dtype"}:
        return None
    plan = row["plan"]
    lora = load_config(None, []).lora
    peak = peak_bytes(ModelShape.from_config(ARCHS[row["shape"]]), plan["micro_batch_tokens"],
                      checkpointing=plan["gradient_checkpointing"], four_bit=not plan.get("dequantize_base"),
                      lora_r=lora.r, lora_targets=lora.target_modules, fused_ce=True, upcast=False,
                      graphs=bool(plan.get("cuda_graphs")), loss_chunk_tokens=plan.get("loss_chunk_tokens"))
    return round(peak / GIB, 2)


def newest(rows: list[dict]) -> list[dict]:
    """The newest row (by report time) of each GPU, shape and plan."""
    latest: dict[tuple, dict] = {}
    for r in sorted(rows, key=lambda r: r.get("date", "")):
        p = r["plan"]
        latest[(r["gpu"], r["shape"], p["micro_batch_tokens"], p["gradient_accumulation_steps"], flags(p),
                p.get("loss_chunk_tokens"), tuple(sorted(r["overrides"])))] = r
    return list(latest.values())


def flags(plan: dict) -> str:
    return " ".join(f for f, on in (("ckpt", plan.get("gradient_checkpointing")), ("graphs", plan.get("cuda_graphs")),
                                    ("bf16-base" if plan.get("dequantize_base") else "4bit-base", True),
                                    ("fp8", plan.get("fp8_base"))) if on)


def table(rows: list[dict]) -> tuple[str, dict]:
    """The markdown table and its summary: the newest rows today's planner under- or over-predicts."""
    lines = ["| report | row | GPU | tokens x accumulation | plan | predicted then | predicted now | reserved | "
             "allocated | now - reserved |", "|---|---|---|---|---|---|---|---|---|---|"]
    summary = {"rows": 0, "compared": 0, "under": [], "over": []}
    current = {id(r) for r in newest(rows)}
    for r in sorted(rows, key=lambda r: (r["shape"], r["plan"]["micro_batch_tokens"], r["report"], r["name"])):
        now, plan = predicted_now(r), r["plan"]
        gap = None if now is None else round(now - r["reserved"], 2)
        summary["rows"] += 1
        if gap is not None and id(r) in current:
            summary["compared"] += 1
            if gap < -UNDER_GIB:
                summary["under"].append((r["report"], r["name"], gap))
            elif gap > OVER_GIB and plan.get("budget_gib") and now >= 0.9 * plan["budget_gib"]:
                summary["over"].append((r["report"], r["name"], gap))
        lines.append(f"| {r['report'].removeprefix('train-bench-')} | {r['name']} | {r['gpu']} | "
                     f"{plan['micro_batch_tokens']} x {plan['gradient_accumulation_steps']} | {flags(plan)} | "
                     f"{plan.get('predicted_peak_gib')} | {'-' if now is None else now} | {r['reserved']} | "
                     f"{r['allocated']} | {'-' if gap is None else f'{gap:+.2f}'} |")
    return "\n".join(lines) + "\n", summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("reports", nargs="*", type=Path, help="report.json files (default: every committed one)")
    parser.add_argument("--out", type=Path, help="write the table and summary here too (markdown)")
    args = parser.parse_args(argv)
    reports = args.reports or sorted((REPO / "benchmarks" / "results").glob("train-bench-*/report.json"))
    try:
        rows = rows_of(reports)
    except OSError as exc:
        parser.error(f"{exc.filename}: {exc.strerror}")
    except ValueError as exc:
        parser.error(str(exc))
    md, s = table(rows)
    md += (f"\n{s['rows']} rows of ours on one GPU; {s['compared']} newest of their GPU, shape and plan with the "
           f"bench's defaults (predicted now). Reserved above today's prediction by more than {UNDER_GIB} GiB: "
           f"{len(s['under'])}"
           + "".join(f"\n- {rep} {name}: {gap:+.2f} GiB" for rep, name, gap in s["under"])
           + f"\nPlans near their budget that left more than {OVER_GIB} GiB unreserved: {len(s['over'])}"
           + "".join(f"\n- {rep} {name}: {gap:+.2f} GiB" for rep, name, gap in s["over"]) + "\n")
    print(md, end="")
    if args.out:
        from finetune_flows.files import write_atomic

        write_atomic(args.out, md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
