"""Scale-out: DDP against FSDP2-QLoRA (`hardware.strategy`) on the same GPUs, side by side in one run; or, with
--launchers, one host against two "nodes" of multi-node torchrun and of Ray (benchmarks/scale_launchers.py).

    make bench-scale                                          # generated:qwen3-8b on 2 GPUs: ddp, then fsdp
    python benchmarks/scale_out.py --shape qwen3-8b --gpus 2 --steps 20
    python benchmarks/scale_out.py --smoke                    # tiny model, 2 CPU ranks over gloo (in `make test`)
    python benchmarks/scale_out.py --launchers host,torchrun-2node,ray-2node --shape qwen3-0.6b --gpus 2

Every run trains the project's training worker (finetune_flows/training/worker.py, with the memory planner, as a flow
run would) on the same synthetic rows (the Markov workload of benchmarks/train_speed.py), with the same seed, steps
and effective batch. Strategies: each on its own 4-bit base: bitsandbytes' packed weights stored as uint8 for DDP, in
the compute dtype for FSDP (finetune_flows/training/sharding.py). Reported per run: steady tokens/s (median and
min..max over windows of 5 steps after warm-up, real tokens of all ranks), the peak memory the allocator reserved on
the busiest rank, the peak nvidia-smi showed on any of the GPUs, the MiB of parameters each rank holds (the base
weights' shard under FSDP), and the training loss curve; the report sets FSDP against DDP (memory, parameters and
tokens/s ratios, the largest loss difference at any logged step). Results go to --out (default
benchmarks/results/scale-out-<N>xGPU-<UTC time>/report.{md,json}), with the hardware and library versions, rewritten
after every run; each run's row is also kept in --state, so the runs can be made in separate calls and still make one
report.
"""

from __future__ import annotations

import argparse
import json
import platform
import signal
import sys
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from finetune_flows.files import write_atomic, write_json  # noqa: E402  (the path above first)
from finetune_flows.packages import installed_version  # noqa: E402
from benchmarks.scale_common import (  # noqa: E402  (the path above first)
    config, fresh, head_lines, host_hardware, loss_difference, metrics_row, quantized_base, resolved, workload_dataset)
from benchmarks.train_report import versions  # noqa: E402
from benchmarks.train_speed import MemoryPoller, child_env, gpu_name, workload_for  # noqa: E402


def run(args, env, state: Path, cache: Path, strategy: str, data: Path, stats: dict) -> dict:
    from finetune_flows.runtime.launcher import run_worker, torchrun_module, training_env
    from finetune_flows.training.train import training_plan, write_train_job

    ids = [g.index for g in env.gpus][:args.gpus]
    cfg = config(args, cache, strategy, host_hardware(args, ids))
    sel, plan = resolved(cfg, env, ids)
    base = quantized_base(cfg, plan, sel, state / "work" / strategy)
    out = fresh(state / "out" / strategy)
    dataset = workload_dataset(data, stats)
    tplan = training_plan(cfg, dataset, base, plan, sel)
    plan = plan.with_training(tplan)
    job = write_train_job(out, cfg, plan, base, dataset, ids, strategy)
    with MemoryPoller(ids) as mem:
        run_worker("train", torchrun_module("finetune_flows.training.worker", job, plan.nproc),
                   training_env(child_env(ids)), out)
    r = json.loads((out / "train_metrics.json").read_text())
    row = {"strategy": strategy, "model": cfg.model.source, "device": gpu_name(ids),
           "quant_storage": base.quant_storage, **metrics_row(r, mem.peak), "param_mib_per_rank": r["rank_param_mb"],
           "micro_batch_tokens": tplan.micro_batch_tokens, "gradient_checkpointing": tplan.gradient_checkpointing,
           "predicted_peak_gib": tplan.predicted_peak_gib}
    print(f"[{strategy}] {row['tokens_per_second']} tokens/s steady ({row['whole_run_tokens_per_second']} whole run), "
          f"peak reserved {row['peak_reserved_gib']} GiB, parameters per rank {row['param_mib_per_rank']} MiB, "
          f"final loss {row['final_loss']:.4f}", flush=True)
    return row


def compare(rows: dict[str, dict]) -> dict:
    """FSDP against DDP: ratios of memory, parameters and speed, and the largest loss difference at a logged step."""
    ddp, fsdp = rows.get("ddp"), rows.get("fsdp")
    if not (ddp and fsdp):
        return {}

    def ratio(key: str) -> float | None:
        a, b = fsdp.get(key), ddp.get(key)
        return round(a / b, 3) if a and b else None

    diff, compared = loss_difference(fsdp["loss_curve"], ddp["loss_curve"])
    return {"peak_reserved_fsdp_over_ddp": ratio("peak_reserved_gib"),
            "params_per_rank_fsdp_over_ddp": round(max(fsdp["param_mib_per_rank"]) / max(ddp["param_mib_per_rank"]),
                                                   3),
            "tokens_per_second_fsdp_over_ddp": ratio("tokens_per_second"),
            "max_loss_difference": diff, "loss_steps_compared": compared}


def markdown(rep: dict) -> str:
    lines = head_lines(rep, "Scale-out benchmark") + [
        "| strategy | ranks | 4-bit storage | tokens/s (steady) | min..max | whole run | peak reserved GiB "
        "(busiest rank) | nvidia-smi GiB | parameters MiB per rank | final loss | layout |",
        "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rep["runs"]:
        lines.append(f"| {r['strategy']} | {r['ranks']} | {r['quant_storage']} | {r['tokens_per_second']} | "
                     f"{r['tokens_per_second_min']}..{r['tokens_per_second_max']} | "
                     f"{r['whole_run_tokens_per_second']} | {r['peak_reserved_gib']} | {r['nvidia_smi_peak_gib']} | "
                     f"{', '.join(f'{m:.4g}' for m in r['param_mib_per_rank'])} | {r['final_loss']:.4f} | "
                     f"{r['layout']} |")
    if rep["fsdp_vs_ddp"]:
        lines += ["", "## FSDP against DDP", ""] + [f"- {k}: {v}" for k, v in rep["fsdp_vs_ddp"].items()]
    return "\n".join(lines) + "\n"


def write_report(out: Path, report: dict, render) -> None:
    """Rewritten after every run, so a call cut short still leaves the report of what finished."""
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "report.json", report)
    write_atomic(out / "report.md", render(report))


def main(argv: list[str] | None = None) -> int:
    from finetune_flows.runtime.environment import run_probe

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", help="a generated model shape (finetune_flows/models/sources.py ARCHS; default "
                        "qwen3-8b, with --launchers qwen3-0.6b)")
    parser.add_argument("--strategies", default="ddp,fsdp")
    parser.add_argument("--launchers", nargs="?", const="host,torchrun-2node,ray-2node",
                        help="instead of strategies: DDP started by each of host, torchrun-2node, ray-2node (all three "
                        "when given no list; benchmarks/scale_launchers.py)")
    parser.add_argument("--launch-timeout", type=float, default=300,
                        help="seconds one launch may take (--launchers): past it its processes are killed and the "
                        "report says so")
    parser.add_argument("--gpus", type=int, default=2, help="GPUs to train on (the first N)")
    parser.add_argument("--ranks", type=int, default=2, help="CPU ranks where there is no GPU")
    parser.add_argument("--rows", type=int, default=4000)
    parser.add_argument("--steps", type=int, help="optimizer steps (default 20; 3 with --smoke)")
    parser.add_argument("--warmup", type=int, default=4, help="learning-rate warm-up steps")
    parser.add_argument("--accumulation", type=int, default=4, help="x 8 rows = the effective batch per rank")
    parser.add_argument("--learning-rate", type=float, default=2e-4,
                        help="2e-4, chosen when a 2-GPU DDP run of train_speed.py at 1e-3 went NaN; the cause was the "
                             "workload (rows starting with the pad token), fixed since (benchmarks/README.md)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override for every run, e.g. train.micro_batch_tokens=8192 (the same "
                        "micro-batch for both strategies; by default the planner fills each rank's memory)")
    parser.add_argument("--state", default="/tmp/finetune-flows-scale-bench")
    parser.add_argument("--cache", help="the store to keep models and 4-bit bases in (default: <state>/cache)")
    parser.add_argument("--out", help="report directory (default benchmarks/results/scale-out-<N>xGPU-<time>)")
    parser.add_argument("--smoke", action="store_true", help="tiny model, CPU ranks: the machinery end to end")
    args = parser.parse_args(argv)
    args.shape = args.shape or ("qwen3-0.6b" if args.launchers else "qwen3-8b")
    if args.smoke:
        args.shape, args.rows, args.warmup, args.accumulation = "tiny-llama", 64, 1, 1
    args.steps = args.steps or (3 if args.smoke else 20)
    # a `timeout` or a scheduler's SIGTERM unwinds like Ctrl-C: the finally blocks stop the workers and Ray
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    state = Path(args.state).resolve()
    cache = Path(args.cache).resolve() if args.cache else state / "cache"
    env = run_probe(state / "probe")
    if env.gpus and len(env.gpus) < args.gpus:
        raise SystemExit(f"--gpus {args.gpus}: this host has {len(env.gpus)} GPU(s)")
    gpus = env.gpus[:args.gpus]
    data, stats = workload_for(args.shape, args.rows, state, cache, args.smoke)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    out = Path(args.out) if args.out else REPO / "benchmarks" / "results" / f"scale-out-{len(gpus)}xGPU-{stamp}"
    report = {"date": stamp, "command": "python benchmarks/scale_out.py " + " ".join(
                  argv if argv is not None else sys.argv[1:]),
              "host": platform.node(), "python": platform.python_version(), "gpus": [g.model_dump() for g in gpus],
              "ranks": len(gpus) or args.ranks, "driver": env.driver_version, "cuda": env.cuda_version,
              "versions": versions(), "workload": stats, "steps": args.steps}
    # each run's row, so runs made in separate calls (`--strategies ddp`, then `--strategies fsdp`) build one report
    if args.launchers:
        from benchmarks import scale_launchers

        kept = state / "runs" / "launchers"
        report["versions"]["ray"] = installed_version("ray")
        names = scale_launchers.names(args.launchers)
        bench = scale_launchers.LaunchBench(args, env, state, cache, data, stats)
        run_one, key, finish, render = bench.run, "launcher", scale_launchers.finish, scale_launchers.markdown
    else:
        kept = state / "runs" / "strategies"
        names = [s for s in args.strategies.split(",") if s]
        run_one = lambda strategy: run(args, env, state, cache, strategy, data, stats)  # noqa: E731
        key, finish, render = "strategy", (lambda rows: {"fsdp_vs_ddp": compare(rows)}), markdown
    kept.mkdir(parents=True, exist_ok=True)
    failed = False
    for name in names:
        row = run_one(name)
        failed |= "error" in row
        write_json(kept / f"{args.shape}-{args.steps}-{name}.json", row)  # read back as done by a later call
        rows = {r[key]: r for r in (json.loads(p.read_text())
                                    for p in sorted(kept.glob(f"{args.shape}-{args.steps}-*.json")))}
        report.update({"runs": list(rows.values()), **finish(rows)})  # finish may order the runs
        write_report(out, report, render)
    print(render(report))
    print(f"report: {out}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
