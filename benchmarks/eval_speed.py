"""Evaluation speed, the reference engine against the new ones, on the same adapter and prompts, in one run.

    make bench-eval                                   # GPU host: generated:qwen3-0.6b; CPU: a small shape
    python benchmarks/eval_speed.py --smoke           # a few prompts on the CPU (part of `make test`)
    python benchmarks/eval_speed.py --model generated:qwen3-0.6b --prompts 1000 --new-tokens 32
    python benchmarks/eval_speed.py --variants generate,static,continuous --backends sdpa,flash_attention_4

1. Data: ticket-triage prompts behind 0..`--history` earlier messages, so prompt lengths vary widely.
2. The pipeline's own steps (dataset, 4-bit base, a short QLoRA run of `--train-steps` on short rows), under a
   temporary Prefect server, so the adapter really changes the answers; all cached in `--work` for reruns.
3. Every variant answers every prompt greedily (`--new-tokens`), base then base + adapter, each after an untimed
   warm-up pass over the same prompts (no compilation or graph capture in the timed passes): `generate` is the
   reference engine (model.generate on the 4-bit model in batches of `--baseline-batch`); `static`/`continuous`
   are the new engines on the dequantized evaluation copy, with each attention backend that is installed and
   usable on this GPU; `generate-static` is transformers' own fast path on that same copy: generate() with
   `cache_implementation="static"`, whose decode steps generate compiles itself on CUDA (CompileConfig's
   defaults: torch.compile, mode reduce-overhead), the cache sized once for the longest prompt (`max_cache_len`)
   so every batch reuses one cache shape, batches as many rows as `--batch-tokens` holds at that length, prompts
   longest first as the static engine takes them.
4. benchmarks/results/eval-bench-<N>xGPU-<time>/report.{md,json}: per variant generation seconds, generated
   tokens/s, time to first result, peak memory (GPU: max reserved; CPU: peak RSS), exact match, and greedy
   agreement with the reference. `seconds`/`speedup` are for what `eval.engine: auto` with
   `hardware.attn_implementation: auto` runs here (the attention probe of finetune_flows/models/backends.py decides).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import resource
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from finetune_flows.files import write_atomic, write_json  # noqa: E402  (the path above first)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")  # before prefect reads its settings
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def write_data(path: Path, rows: int, history: int, seed: int) -> None:
    """Ticket-triage rows whose prompt carries 0..history earlier customer messages (varied lengths)."""
    from finetune_flows.data.demo import SHAPES, SYSTEM, make_example

    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(rows):
            ex = make_example(rng.choice(SHAPES), rng)
            earlier = [make_example(rng.choice(SHAPES), rng)["prompt"].removeprefix("Ticket: ")
                       for _ in range(rng.randint(0, history))]
            prompt = ("Earlier messages: " + " ".join(earlier) + "\n" if earlier else "") + ex["prompt"]
            f.write(json.dumps({"system": SYSTEM, "prompt": prompt, "response": ex["response"]}) + "\n")


def prepare(args, work: Path, device: str):
    """Dataset, 4-bit base and adapter, by the pipeline's own steps (reused when already there)."""
    from prefect.testing.utilities import prefect_test_harness

    from finetune_flows.orchestration.caching import run_step
    from finetune_flows.config.schema import load_config
    from tasks.prepare_dataset import prepare_dataset
    from finetune_flows.config.plan import Plan, training_settings
    from finetune_flows.runtime.environment import _cpu_bf16, auto_eval_dtype
    from finetune_flows.runtime.gpus import read_inventory, selection_for
    from finetune_flows.models.sources import materialize_tokenizer
    from tasks.quantize_base_model import quantize_base_model
    from tasks.train_adapter import train_adapter

    # Short rows to train on (the adapter learns fast), varied-length prompts to evaluate.
    train_file, eval_file = work / "train.jsonl", work / "eval.jsonl"
    # a quarter more than asked: the dataset step drops held-out prompts that copy a training prompt
    eval_rows = args.prompts + args.prompts // 4
    if not eval_file.is_file() or len(eval_file.read_text().splitlines()) != eval_rows:
        write_data(train_file, args.train_rows, 0, seed=1)
        write_data(eval_file, eval_rows, args.history, seed=2)
    gpu = device == "cuda"
    cfg = load_config(None, [
        f"model.source={args.model}", f"data.source={train_file}", f"data.eval_source={eval_file}",
        "data.max_length=1024", f"run.cache_dir={work / 'cache'}", f"hardware.gpus={'0' if gpu else 'cpu'}",
        f"train.max_steps={args.train_steps}", f"train.save_steps={args.train_steps}", "train.logging_steps=10",
        "train.per_device_batch_size=16", f"train.learning_rate={args.learning_rate}", "train.warmup_steps=2",
        f"eval.max_new_tokens={args.new_tokens}", f"eval.max_samples={args.prompts}",
        f"eval.batch_size={args.baseline_batch}",
    ])
    compute = "bfloat16" if gpu else "float32"
    plan = Plan(device=device, nproc=1, precision="bf16" if gpu else "fp32", compute_dtype=compute, train_attn="sdpa",
                eval_attn="sdpa", eval_dtype=auto_eval_dtype(cfg, gpu, _cpu_bf16(), compute),
                **training_settings(cfg, device, "ddp"))  # as resolve_plan does
    gpus = selection_for("0" if gpu else "cpu", read_inventory())
    with prefect_test_harness(server_startup_timeout=120):  # the steps hold device slots through Prefect
        # run_step unwraps what a step returns when it reuses its stored output (a `Cached` state)
        data, _ = run_step(prepare_dataset, cfg, materialize_tokenizer(cfg.model.source, cfg.cache_root))
        base, _ = run_step(quantize_base_model, cfg, plan, gpus, work)
        trained, _ = run_step(train_adapter, cfg, data, base, plan, gpus, work)
    print(f"adapter: loss {trained.first_loss:.4f} -> {trained.final_loss:.4f} in {trained.steps} steps", flush=True)
    return cfg, plan, data, base, trained.adapter_path


class PeakMemory:
    """GPU: max reserved bytes; CPU: peak resident set size, sampled while the block runs."""

    def __init__(self, device):
        self.device, self.peak = device, 0

    def __enter__(self):
        import torch

        if self.device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self.running = True
            self.thread = threading.Thread(target=self._sample, daemon=True)
            self.thread.start()
        return self

    def _sample(self):
        page = os.sysconf("SC_PAGE_SIZE")
        while self.running:
            with open("/proc/self/statm") as f:
                self.peak = max(self.peak, int(f.read().split()[1]) * page)
            time.sleep(0.01)

    def __exit__(self, *exc):
        import torch

        if self.device.type == "cuda":
            self.peak = torch.cuda.max_memory_reserved(self.device)
        else:
            self.running = False
            self.thread.join()

    @property
    def mib(self) -> float:
        return round(self.peak / 2**20, 1)


def run_variant(name, model, generate, tokenizer, references, metric, device, repeats: int = 1) -> dict:
    """Base then base + adapter, each after an untimed warm-up pass over the same prompts (so every batch shape the
    timed runs meet is compiled or captured already: steady passes), timed `repeats` times: the row's seconds are
    the median run's, with every run's kept (two engines within that spread are a tie). Greedy decoding must give
    the same answers on every repeat."""
    from finetune_flows.evaluation.metrics import score_answer

    row = {"variant": name, "attention": model.config._attn_implementation}
    for side in ("base", "adapter"):
        (model.base_model.disable_adapter_layers if side == "base" else model.base_model.enable_adapter_layers)()
        warmup = generate(None)
        with PeakMemory(device) as memory:
            runs = [generate(None) for _ in range(repeats)]
        for gen in runs:
            if gen.failures:
                raise RuntimeError(f"{name}: {len(gen.failures)} prompts failed: {gen.failures[:3]}")
        if any(gen.tokens != runs[0].tokens for gen in runs):
            raise RuntimeError(f"{name}: greedy answers differ between repeats")
        gen = sorted(runs, key=lambda g: g.seconds)[len(runs) // 2]  # the median run
        answers = tokenizer.batch_decode(gen.tokens, skip_special_tokens=True)
        tokens = sum(map(len, gen.tokens))
        row[side] = {"seconds": round(gen.seconds, 3), "runs_seconds": [round(g.seconds, 3) for g in runs],
                     "first_result_seconds": round(gen.first_result_seconds, 3),
                     "generated_tokens": tokens, "tokens_per_second": round(tokens / max(gen.seconds, 1e-9), 1),
                     "peak_memory_mib": memory.mib, "details": gen.details, "warmup_prompts": len(warmup.tokens),
                     "exact_match": round(sum(score_answer(a, r, metric) for a, r in zip(answers, references))
                                          / len(references), 4), "answers": answers}
        print(f"  {name} {side}: {gen.seconds:.2f} s (runs {row[side]['runs_seconds']}), "
              f"{row[side]['tokens_per_second']} tokens/s, exact match {row[side]['exact_match']}", flush=True)
    row["seconds"] = round(row["base"]["seconds"] + row["adapter"]["seconds"], 3)
    row["runs_seconds"] = [round(b + a, 3) for b, a in zip(row["base"]["runs_seconds"], row["adapter"]["runs_seconds"])]
    return row


def fastest_and_ties(rows: list[dict]) -> tuple[str | None, list[str]]:
    """The fastest measured variant by median seconds, and every variant whose runs overlap the fastest's (a
    tie: the same as the fastest within the spread of repeated runs)."""
    measured = [r for r in rows if "error" not in r and r["variant"] != "generate"]
    if not measured:
        return None, []
    best = min(measured, key=lambda r: r["seconds"])
    top = max(best.get("runs_seconds") or [best["seconds"]])
    return best["variant"], [r["variant"] for r in measured if min(r.get("runs_seconds") or [r["seconds"]]) <= top]


def agreement(row: dict, reference: dict) -> float:
    pairs = [(a, b) for side in ("base", "adapter") for a, b in zip(row[side]["answers"], reference[side]["answers"])]
    return round(sum(a == b for a, b in pairs) / max(len(pairs), 1), 4)


def usable_backends(device, requested: list[str] | None) -> list[str]:
    """Attention backends installed and usable on this GPU (sdpa alone on the CPU), as the pipeline judges them."""
    import torch

    from finetune_flows.models.backends import candidates, installed, usable
    from finetune_flows.packages import installed_version
    from finetune_flows.runtime.environment import STACK
    from finetune_flows.runtime.gpus import GpuInfo

    if device.type != "cuda":
        return ["sdpa"]
    cc = torch.cuda.get_device_capability(device)
    gpu = GpuInfo(index=0, name=torch.cuda.get_device_name(device), memory_total_mib=0, memory_free_mib=0,
                  capability=cc)
    attention = installed(True, {d: installed_version(d) for d in STACK})
    if requested is None:
        return candidates(attention, [gpu], "bf16")
    return [n for n in requested if "/" in n or usable(n, attention, [gpu], "bf16") is None]  # Hub ids: as given


def markdown(report: dict) -> str:
    lines = [f"# Evaluation speed: {report['gpu']}", "", f"- date: {report['date']}", f"- host: {report['host']}",
             f"- command: `{report['command']}`", f"- shape: {report['shape']}", f"- CPU: {report['cpu']}",
             "- versions: " + ", ".join(f"{k} {v}" for k, v in report["versions"].items() if v),
             f"- auto chose: engine `{report['auto']['engine']}`, attention `{report['auto']['attention']}` "
             f"({report['auto']['why']})", "",
             f"**reference (`generate`) {report['baseline_seconds']} s, auto (`{report['auto']['variant']}`) "
             f"{report['seconds']} s: speedup {report['speedup']}x, greedy agreement {report['greedy_agreement']}**",
             "", f"Fastest by median of {report['shape'].get('repeats', 1)} run(s): "
             f"`{report['auto'].get('fastest_variant')}`; within its spread (a tie): "
             f"{', '.join(f'`{v}`' for v in report['auto'].get('tied_with_fastest', [])) or '-'}; auto's choice "
             f"is {'the fastest or tied with it' if report['auto'].get('auto_is_fastest_or_tied') else 'SLOWER'}.",
             "", "| variant | attention | seconds (base + adapter, median) | runs s | tokens/s | first result s | "
             "peak MiB | exact match base / adapter | agreement with reference | speedup |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        if "error" in r:
            lines.append(f"| {r['variant']} | {r.get('attention', '')} | failed: {r['error'][:120]} | | | | | | | |")
            continue
        tps = round((r["base"]["generated_tokens"] + r["adapter"]["generated_tokens"]) / max(r["seconds"], 1e-9), 1)
        runs = ", ".join(map(str, r.get("runs_seconds", [r["seconds"]])))
        lines.append(f"| {r['variant']} | {r['attention']} | {r['seconds']} | {runs} | {tps} | "
                     f"{r['base']['first_result_seconds']} / {r['adapter']['first_result_seconds']} | "
                     f"{max(r['base']['peak_memory_mib'], r['adapter']['peak_memory_mib'])} | "
                     f"{r['base']['exact_match']} / {r['adapter']['exact_match']} | {r['agreement']} | "
                     f"{r['speedup']} |")
    phased = [r for r in report["rows"] if "error" not in r and "prefill_seconds" in r["base"].get("details", {})]
    if phased:
        lines += ["", "## Where the static engines' time goes (device synchronised per batch)", "",
                  "| variant | attention | prefill s (base / adapter) | decode s | decode steps |",
                  "|---|---|---|---|---|"]
        for r in phased:
            b, a = r["base"]["details"], r["adapter"]["details"]
            lines.append(f"| {r['variant']} | {r['attention']} | {b['prefill_seconds']} / {a['prefill_seconds']} | "
                         f"{b['decode_seconds']} / {a['decode_seconds']} | {b['decode_steps']} / {a['decode_steps']} |")
    if report.get("attention_probe"):
        lines += ["", "## Attention probe (what `auto` measured)", "", "| backend | eval ms | padded train ms | "
                  "packed train ms | max rel diff | error |", "|---|---|---|---|---|---|"]
        lines += [f"| {t['backend']} | {t['eval_ms']} | {t['train_ms']} | {t.get('packed_train_ms')} | "
                  f"{t['max_rel_diff']} | {t['error'] or ''} |" for t in report["attention_probe"]]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: generated:qwen3-0.6b on a GPU, tiny-llama on CPU")
    parser.add_argument("--prompts", type=int, default=1000)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--history", type=int, default=None, help="max earlier messages per prompt (12 GPU, 6 CPU)")
    parser.add_argument("--train-rows", type=int, default=2000)
    parser.add_argument("--train-steps", type=int, default=None, help="QLoRA steps (60 GPU, 120 CPU)")
    parser.add_argument("--learning-rate", type=float, default=None, help="QLoRA learning rate (1e-3 GPU, 5e-3 CPU)")
    parser.add_argument("--baseline-batch", type=int, default=50, help="reference engine batch size")
    parser.add_argument("--batch-tokens", type=int, default=None, help="static/continuous tokens per batch "
                        "(default: what the eval worker picks)")
    parser.add_argument("--variants", default="generate,static,static-sdpa-decode,static-eager,continuous,"
                        "generate-static",
                        help="comma list from generate, static (the default engine: on CUDA its decode steps run "
                        "graphed on a grouped-query attention that reads each KV head once), static-sdpa-decode "
                        "(the decode steps on transformers' sdpa instead), static-eager, continuous, "
                        "continuous-graphs, generate-static (transformers' generate() with its static cache and "
                        "compiled decode steps on the same copy)")
    parser.add_argument("--backends", default=None, help="comma list of attention backends (default: those `auto` "
                        "considers that are usable here; add flex_attention or a Hub kernel id by name)")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs of each fast variant, median "
                        "reported (default 3 on a GPU, 1 on the CPU); the reference engine runs once")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--work", default=None, help="work directory (default /tmp/finetune-flows-eval-bench-<model>)")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    parser.add_argument("--smoke", action="store_true", help="a few prompts on the CPU: the machinery end to end "
                        "(part of `make test`)")
    args = parser.parse_args()
    if args.smoke:
        args.prompts, args.new_tokens, args.train_rows, args.train_steps = 40, 8, 64, 4
        args.history = args.history if args.history is not None else 2

    import torch

    from finetune_flows.models.backends import attention_shape, choose, measure_on_device
    from finetune_flows.packages import installed_version
    from finetune_flows.runtime.environment import STACK
    from finetune_flows.evaluation.worker import _load_with_adapter, auto_batch_tokens
    from finetune_flows.evaluation.generation import (
        choose_engine, continuous_supports, generate_continuous, generate_reference, stop_token_ids,
    )
    from finetune_flows.evaluation.static_engine import generate_static

    if args.threads:
        torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    gpu = torch.cuda.is_available()
    device = torch.device("cuda:0" if gpu else "cpu")
    args.model = args.model or ("generated:qwen3-0.6b" if gpu else "generated:tiny-llama")
    args.history = args.history if args.history is not None else (12 if gpu else 6)
    args.train_steps = args.train_steps or (60 if gpu else 120)
    args.learning_rate = args.learning_rate or (1e-3 if gpu else 5e-3)
    args.repeats = args.repeats or (3 if gpu else 1)
    work = Path(args.work or f"/tmp/finetune-flows-eval-bench-{args.model.split(':')[-1]}")
    work.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    cfg, plan, data, base, adapter = prepare(args, work, device.type)
    print(f"prepared in {time.perf_counter() - started:.1f} s", flush=True)

    pairs = [json.loads(line) for line in (data.path / "eval_prompts.jsonl").read_text().splitlines()][: args.prompts]
    if len(pairs) < args.prompts:
        raise SystemExit(f"only {len(pairs)} distinct held-out prompts of the {args.prompts} asked for (--prompts)")
    prompts, references = [p["prompt"] for p in pairs], [p["reference"] for p in pairs]
    reference_model = _load_with_adapter(cfg, base, adapter, plan, device, "generate")  # the 4-bit model
    copy_model = _load_with_adapter(cfg, base, adapter, plan, device, "static")  # the dequantized copy
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(adapter)
    ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    stops, pad = stop_token_ids(copy_model, tokenizer), tokenizer.pad_token_id
    batch_tokens = args.batch_tokens or auto_batch_tokens(copy_model, device)
    new, metric = args.new_tokens, cfg.eval.metric
    memory = lambda: int(0.6 * torch.cuda.mem_get_info(device)[0]) if gpu else 2**30  # noqa: E731

    def static(graphs, grouped=None):
        return lambda k: generate_static(copy_model, ids[:k] if k else ids, new, stops, pad, batch_tokens, graphs,
                                         grouped_decode=grouped)

    def continuous(graphs):
        return lambda k: generate_continuous(copy_model, ids[:k] if k else ids, new, stops, pad,
                                             min(batch_tokens, 16384), memory(), cuda_graphs=graphs)

    cache_len = max(map(len, ids)) + new
    library_batch = max(1, batch_tokens // cache_len)

    def library(k):
        order = sorted(range(k or len(ids)), key=lambda i: -len(ids[i]))
        gen = generate_reference(copy_model, tokenizer, [prompts[i] for i in order], new, library_batch,
                                 cache_implementation="static", max_cache_len=cache_len)
        tokens = [[]] * len(order)
        for position, i in enumerate(order):
            tokens[i] = gen.tokens[position]
        gen.tokens = tokens  # in prompt order, as every engine answers
        gen.details["compiled_decode"] = hasattr(copy_model.get_base_model(), "_compiled_call")
        return gen

    engines = {"static": static(None), "static-sdpa-decode": static(None, grouped=False), "static-eager": static(False),
               "generate-static": library,
               "continuous": continuous(None),
               "continuous-graphs": continuous(True)}
    wanted = args.variants.split(",")
    backends = usable_backends(device, args.backends.split(",") if args.backends else None)
    rows = []
    baseline = run_variant("generate", reference_model, lambda k: generate_reference(
        reference_model, tokenizer, prompts[:k] if k else prompts, new, args.baseline_batch), tokenizer, references,
        metric, device)
    rows.append(baseline)
    reference_model = None  # the 4-bit model is done: free its memory for the variants
    for backend in backends:
        try:
            copy_model.set_attn_implementation(backend)
        except Exception as exc:
            rows.append({"variant": f"*[{backend}]", "attention": backend, "error": f"{type(exc).__name__}: {exc}"})
            continue
        for name in wanted:
            if name == "generate" or (name.endswith(("eager", "graphs")) and not gpu) or \
                    (name.startswith("continuous") and not continuous_supports(backend)) or \
                    (backend == "flex_attention" and name != "static"):  # flex compiles per shape: one row
                continue
            label = name if backend == "sdpa" else f"{name}[{backend}]"
            try:
                rows.append(run_variant(label, copy_model, engines[name], tokenizer, references, metric, device,
                                        args.repeats))
            except Exception as exc:  # one failing variant must not lose the others' measurements
                rows.append({"variant": label, "attention": backend, "error": f"{type(exc).__name__}: {exc}"[:500]})
                print(f"  {label} FAILED: {exc}", flush=True)
    for r in rows:
        if "error" not in r:
            r["agreement"] = agreement(r, baseline)
            r["speedup"] = round(baseline["seconds"] / max(r["seconds"], 1e-9), 2)
    for r in rows:  # the answers were needed for agreement; the report keeps a few
        for side in ("base", "adapter"):
            if side in r:
                r[side]["samples"] = r[side].pop("answers")[:5]

    probe, attention = [], "sdpa"
    why = "sdpa: the only backend installed and usable on this GPU" if gpu else "CPU: sdpa"
    if gpu and len(backends) > 1:
        probe = measure_on_device(0, backends, attention_shape(cfg), "bfloat16")
        attention, why = choose(probe, backends, "eval")
    engine = choose_engine("auto", attention)
    auto_name = engine if attention == "sdpa" else f"{engine}[{attention}]"
    auto_row = next((r for r in rows if r["variant"] == auto_name and "error" not in r), None)
    fastest, ties = fastest_and_ties(rows)

    n_gpu = torch.cuda.device_count() if gpu else 0
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    out = Path(args.out) / f"eval-bench-{n_gpu}xGPU-{stamp}"
    out.mkdir(parents=True, exist_ok=True)
    name = torch.cuda.get_device_name(device) if gpu else f"CPU ({platform.processor() or platform.machine()}, " \
        f"{os.cpu_count()} cores)"
    report = {
        "gpu": name, "date": stamp, "host": platform.node(), "command": " ".join(sys.argv),
        "shape": {"model": args.model, "prompts": len(prompts), "new_tokens": new, "history": args.history,
                  "prompt_tokens_min_mean_max": [min(map(len, ids)), round(sum(map(len, ids)) / len(ids), 1),
                                                 max(map(len, ids))],
                  "train_steps": args.train_steps, "learning_rate": args.learning_rate,
                  "baseline_batch": args.baseline_batch, "repeats": args.repeats,
                  "batch_tokens": batch_tokens, "dtype": plan.compute_dtype,
                  "eval_dtype": str(copy_model.dtype).removeprefix("torch.")},
        "cpu": {"torch_threads": torch.get_num_threads(), "cores": os.cpu_count(),
                "load_average_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)]},
        "versions": {"python": platform.python_version(), **{d: installed_version(d) for d in STACK},
                     "cuda": torch.version.cuda},
        "baseline_seconds": baseline["seconds"],
        "seconds": auto_row["seconds"] if auto_row else None,
        "speedup": auto_row["speedup"] if auto_row else None,
        "greedy_agreement": auto_row["agreement"] if auto_row else None,
        "exact_match": {"reference": [baseline["base"]["exact_match"], baseline["adapter"]["exact_match"]],
                        "auto": [auto_row["base"]["exact_match"], auto_row["adapter"]["exact_match"]] if auto_row
                        else None},
        "auto": {"engine": engine, "attention": attention, "why": why, "variant": auto_name,
                 "fastest_variant": fastest, "tied_with_fastest": ties,
                 "auto_is_fastest_or_tied": auto_name in ties},
        "attention_probe": [t.model_dump() for t in probe],
        "rows": rows,
    }
    write_json(out / "report.json", report)
    write_atomic(out / "report.md", markdown(report))
    print(markdown(report).split("\n\n| variant")[0].splitlines()[-1])
    print("\n| variant" + markdown(report).split("\n\n| variant")[1].split("\n\n")[0])
    print(f"report: {out}  (peak RSS of this process {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024} "
          "MiB)")
    return 0 if auto_row else 1


if __name__ == "__main__":
    sys.exit(main())
