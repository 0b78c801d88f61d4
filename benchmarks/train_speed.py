"""Training speed, the seed recipe against this project's own training path, side by side in one run.

    make bench-train                                  # every shape and run this host can do
    python benchmarks/train_speed.py --shapes qwen3-0.6b --runs seed,ours --steps 20
    python benchmarks/train_speed.py --smoke          # tiny model on the CPU (part of `make test`)

The workload: synthetic rows (default 4,000) whose lengths are lognormal (median 256, sigma 0.7, clipped to
32..1024), loss on every token, drawn from a sparse Markov chain (each token has 4 successors), so there is
structure to learn: 1,024 token ids, so a short run moves the loss from ~12 nats (random init) towards the
entropy floor ln 4 = 1.39. Both runs train on the same rows for the same number of optimizer steps with the same
effective batch (32 rows per step and GPU) and learning rate: the seed and the peers draw 32 rows a step with the
Trainer's sampler; ours packs the rows in its own order into steps of at most 32 x the mean row length in tokens
(about 31 rows, so a few % fewer tokens in its steps: tokens/s counts each row's real tokens).

Runs: `seed` (benchmarks/seed_recipe.py: the Transformers NVIDIA-GPU guide's QLoRA recipe), `ours` (the project's
training worker, finetune_flows/training/worker.py, with its defaults and memory planner; `train.compile=true`, as
`auto` compiles in a run long enough to repay it), `ours-2gpu` (the same on two GPUs, DDP), and `ours-<label>`
variants with extra config overrides (`--variant label:key=value,key=value`; a key in capitals, e.g.
`PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False`, is an environment variable of that run's training worker instead;
a label starting with `2gpu-` runs on two GPUs and gets its own `ddp_2gpu_scaling:<label>` beside `ours-<label>`).
A one-GPU variant gets its own ratios too, keyed `<shape>[-<budget>gib]:<label>`: over the seed, and in
`speedup.vs_best_peer` over the fastest peer of its shape and budget.
Memory budgets: `--budgets` (below); a variant can set `hardware.memory_budget_gib` too, but its row is not compared
with the peers under that budget. Each run is a fresh process; each step boundary is a CUDA event on the device's
timeline (finetune_flows/training/clock.py; on the CPU the host's clock);
steady state skips the warm-up steps and takes the median (and min/max) of tokens/s over windows of 5 steps; tokens
are real (non-pad) tokens; memory is the peak the allocator reserved and the peak nvidia-smi showed for the run's own
processes (the whole GPU's figure beside it); MFU counts 4 x (linear + lm_head parameters) FLOPs per token (a frozen
base: forward and input-gradient backward) plus causal attention, against 989 TFLOP/s (H200 dense bf16). After
training, each adapter's eval loss on 200 held-out rows is measured the same way for every run.

Peers (benchmarks/peer_recipe.py), rows of the same run: `unsloth` (Unsloth's QLoRA path), `trl` (TRL's SFTTrainer,
padding-free, Liger, NF4 base), `trl-padded` (the same with TRL's default padded batches) and `trl-bf16` (`trl` on a
bf16 base), each in a process of its own whose PYTHONPATH is `--peer-site` (Unsloth pins an older transformers than this project's). `--budgets none,24` runs every
row once per memory budget (GiB of device memory; ours through `hardware.memory_budget_gib`, the seed and the peers
through `torch.cuda.set_per_process_memory_fraction`), named `<run>-<shape>-<N>gib`. A row that fails (a peer that
cannot run here, a run out of memory under its budget) is kept with its error and the bench goes on.
`speedup.vs_best_peer` is ours over the fastest peer that ran, per shape and budget, e.g. `--shapes qwen3-8b --runs
ours,unsloth,trl --budgets none,24`. The peers batch 8 rows a micro-step, as the seed does; `--peer-rows 8,32` runs
each peer once per listed micro-batch (same effective batch: fewer accumulation steps), the other sizes named
`<peer>-r<N>-<shape>`, each counted for the fastest peer (a user who tunes a peer's batch to the GPU gets that row).

Results accumulate in --state (so several calls on one machine build one report); the report is written to
--out (default benchmarks/results/train-bench-<N>xGPU-<UTC time>/report.{md,json}).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import re
import subprocess
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")  # before prefect reads its settings

from benchmarks.train_report import (  # noqa: E402 (needs REPO on sys.path)
    PEERS, budget_suffix, host_dispatch_us, markdown, resume_rows, write_report)
# rows and workload stats mark work as done: written whole or not at all, so a kill cannot leave half
from finetune_flows.files import write_json  # noqa: E402

PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0}
EVAL_ROWS = 200
SUCCESSORS = 4
CHAIN_VOCAB = 1024  # tokens the chain uses: small enough that a short run learns it
ENV_NAME = re.compile(r"[A-Z][A-Z0-9_]*$")  # a variant's KEY=value in capitals sets the training worker's environment


# ---------------------------------------------------------------- workload


def markov_rows(n: int, vocab: int, seed: int, median: int = 256, sigma: float = 0.7, lo: int = 32,
                hi: int = 1024, first: int = 0) -> list[list[int]]:
    """Token rows from a fixed sparse Markov chain over ids first..vocab-1, lengths lognormal(ln median, sigma)
    clipped to [lo, hi]."""
    rng = random.Random(seed)
    table = random.Random(1234)
    states = vocab - first
    succ = [[table.randrange(states) for _ in range(SUCCESSORS)] for _ in range(states)]
    rows = []
    for _ in range(n):
        length = int(min(hi, max(lo, round(math.exp(rng.gauss(math.log(median), sigma))))))
        tok = rng.randrange(states)
        row = [tok]
        for _ in range(length - 1):
            tok = succ[tok][rng.randrange(SUCCESSORS)]
            row.append(tok)
        rows.append([first + t for t in row])
    return rows


def write_workload(path: Path, rows: int, vocab: int, smoke: bool, first: int = 0) -> dict:
    import pyarrow as pa
    import pyarrow.parquet as pq

    if (path / "stats.json").is_file():
        return json.loads((path / "stats.json").read_text())
    path.mkdir(parents=True, exist_ok=True)
    kw = dict(median=48, lo=8, hi=128) if smoke else {}
    data = markov_rows(rows + EVAL_ROWS, vocab, seed=7, first=first, **kw)
    train, evaluation = data[:rows], data[rows:]
    for name, split in (("train", train), ("eval", evaluation)):
        pq.write_table(pa.table({"input_ids": split, "labels": split}), path / f"{name}.parquet")
    lengths = [len(r) for r in train]
    stats = {"rows": rows, "eval_rows": EVAL_ROWS, "vocab": vocab, "first_id": first, "tokens": sum(lengths),
             "mean_length": round(sum(lengths) / rows, 1), "median_length": sorted(lengths)[rows // 2],
             "max_length": max(lengths), "min_length": min(lengths)}
    write_json(path / "stats.json", stats)
    return stats


def workload_for(shape: str, rows: int, state: Path, cache: Path, smoke: bool) -> tuple[Path, dict]:
    """The synthetic workload for a generated shape: its path and statistics.

    The chain never emits the tokenizer's special ids. The generated models' initialisation zeroes the pad token's
    embedding row, so a row that *starts* with it keeps an all-zero hidden state through every layer; each RMSNorm
    then multiplies the gradient by 1/sqrt(eps) on the way back, and 28 layers of that overflow bf16: the 2-GPU run of
    the Qwen3-0.6B shape went NaN at the step whose micro-batch held such a row (a row of the first 4,000 starts with
    id 0 = <|endoftext|>), and so did 1 GPU once it trained that far, on every attention kernel.
    """
    from transformers import AutoTokenizer

    from finetune_flows.models.sources import ARCHS, materialize_tokenizer

    tok = AutoTokenizer.from_pretrained(materialize_tokenizer(f"generated:{shape}", cache))
    vocab = min(ARCHS[shape].get("vocab_size") or len(tok), CHAIN_VOCAB)
    first = 1 + max(tok.all_special_ids, default=-1)
    data = state / "workload" / f"{shape}-{rows}-from{first}"
    return data, write_workload(data, rows, vocab, smoke, first)


# ---------------------------------------------------------------- one run


def parse_budgets(text: str) -> list[int | None]:
    """`--budgets none,24`: None for no budget, else whole GiB."""
    budgets: list[int | None] = []
    for item in [x.strip() for x in text.split(",") if x.strip()]:
        if item == "none":
            budgets.append(None)
        elif item.isdigit() and int(item) > 0:
            budgets.append(int(item))
        else:
            raise SystemExit(f"--budgets: {item!r} is neither 'none' nor a whole number of GiB")
    return budgets or [None]


def parse_peer_rows(text: str, effective: int) -> list[int]:
    """`--peer-rows 8,32`: the peers' rows per micro-step, each dividing the effective batch (8 x --accumulation)."""
    sizes: list[int] = []
    for item in [x.strip() for x in text.split(",") if x.strip()]:
        if not (item.isdigit() and int(item) > 0 and effective % int(item) == 0):
            raise SystemExit(f"--peer-rows: {item!r} is not a whole number of rows dividing the effective batch of "
                             f"{effective} rows (8 x --accumulation)")
        sizes.append(int(item))
    return sizes or [8]


def peer_label(peer: str, rows: int) -> str:
    """A peer's row label: the peer's name at the seed's 8 rows a micro-step, else `<peer>-r<rows>`."""
    return peer if rows == 8 else f"{peer}-r{rows}"


def split_overrides(overrides: list[str]) -> tuple[list[str], dict[str, str]]:
    """A variant's `key=value` items: config overrides, and (keys in capitals) the training worker's environment."""
    for o in overrides:
        if "=" not in o:
            raise SystemExit(f"--variant: {o!r} is not key=value (a config key, or an environment variable in "
                             "capitals)")
    config = [o for o in overrides if not ENV_NAME.match(o.partition("=")[0])]
    env = dict(o.split("=", 1) for o in overrides if ENV_NAME.match(o.partition("=")[0]))
    return config, env


class MemoryPoller:
    """GPU memory nvidia-smi reports for the given device ids while a run is going, on the busiest of them.

    `peak`: the largest total of the processes that appeared on a GPU after the poller started (the run's own:
    launcher, ranks, their helpers), so memory another process already held (e.g. the benchmark's own, or a
    lingering one) is not counted against the run; where nvidia-smi lists no processes (a container that does not
    see the host's process ids), the GPU's figure less what it showed when the poller started. `device_peak`: the
    whole GPU's figure, as nvidia-smi shows it; `processes`: the peak of each process ("<pid> <name>" -> MiB) on those
    GPUs, including ones that were there before.
    """

    def __init__(self, ids: list[int]):
        self.ids = ids
        self.peak = 0
        self.device_peak = 0
        self.processes: dict[str, int] = {}
        self.before: set[str] | None = None
        self.device_before: dict[int, int] = {}
        self.done = threading.Event()
        self.lock = threading.Lock()  # the poller thread and a caller's own sample() update the same peaks
        self.thread = threading.Thread(target=self._poll, daemon=True)

    @staticmethod
    def _query(what: str) -> list[list[str]]:
        out = subprocess.run(["nvidia-smi", f"--query-{what}", "--format=csv,noheader,nounits"], capture_output=True,
                             text=True, timeout=10).stdout
        return [[x.strip() for x in line.split(",")] for line in out.strip().splitlines() if line.strip()]

    def sample(self) -> None:
        with self.lock:
            self._sample()

    def _sample(self) -> None:
        rows = self._query("gpu=index,uuid,memory.used")
        device = {int(index): int(used) for index, _, used in rows if int(index) in self.ids}
        gpus = {uuid: int(index) for index, uuid, _ in rows}
        apps: dict[str, tuple[int, int]] = {}  # "<pid> <name>" -> (GPU, MiB)
        for pid, name, uuid, used in self._query("compute-apps=pid,process_name,gpu_uuid,used_memory"):
            if gpus.get(uuid) in self.ids and used.isdigit():
                key = f"{pid} {Path(name).name}"
                apps[key] = (gpus[uuid], apps.get(key, (0, 0))[1] + int(used))
        if self.before is None:
            self.before, self.device_before = set(apps), dict(device)
        for key, (_, used) in apps.items():
            self.processes[key] = max(self.processes.get(key, 0), used)
        for index, used in device.items():
            self.device_peak = max(self.device_peak, used)
            own = (sum(mib for key, (gpu, mib) in apps.items() if gpu == index and key not in self.before)
                   if self.processes else used - self.device_before.get(index, 0))
            self.peak = max(self.peak, own)

    def _poll(self) -> None:
        while True:
            try:
                self.sample()
            except (OSError, ValueError, subprocess.TimeoutExpired):
                return
            if self.done.wait(0.5):
                return

    def __enter__(self):
        if self.ids:
            try:
                self.sample()  # before the run starts: what is on the GPUs already
            except (OSError, ValueError, subprocess.TimeoutExpired):
                self.before = set()
            self.thread.start()
        return self

    def __exit__(self, *exc):
        # Wait for the thread: a sample still running after the run would be counted against it, or the next one.
        self.done.set()
        if self.thread.is_alive():
            self.thread.join()


def run_logged(argv: list[str], env: dict, log: Path, timeout: float) -> None:
    with open(log, "w") as f:
        proc = subprocess.run(argv, env=env, stdout=f, stderr=subprocess.STDOUT, cwd=REPO, timeout=timeout)
    if proc.returncode != 0:
        tail = "\n".join(log.read_text().splitlines()[-30:])
        raise RuntimeError(f"{' '.join(argv[:4])}... exited {proc.returncode}:\n{tail}")


def child_env(ids: list[int]) -> dict:
    from finetune_flows.runtime.launcher import worker_env

    return worker_env({"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": ",".join(map(str, ids))})


def eval_loss(base: Path, adapter: Path, data: Path, ids: list[int], log: Path) -> float:
    """Mean token loss of base + adapter on the held-out rows, in a fresh process, the same for every run."""
    code = (
        "import json,sys,torch; sys.path.insert(0, %r)\n"
        "from peft import PeftModel\nfrom transformers import AutoModelForCausalLM\n"
        "from finetune_flows.data.dataset import load_split\nfrom finetune_flows.data.packing import PadCollator\n"
        "dev = 'cuda:0' if torch.cuda.is_available() else 'cpu'\n"
        "dt = torch.bfloat16 if dev != 'cpu' else torch.float32\n"
        "m = AutoModelForCausalLM.from_pretrained(%r, device_map={'': dev}, dtype=dt, attn_implementation='sdpa')\n"
        "m = PeftModel.from_pretrained(m, %r).eval()\n"
        "rows = load_split(__import__('pathlib').Path(%r), 'eval'); tot = n = 0.0\n"
        "for i in range(0, len(rows), 16):\n"
        "    b = {k: v.to(dev) for k, v in PadCollator(0)(rows[i:i+16]).items()}\n"
        "    with torch.no_grad():\n"
        "        lg = m(input_ids=b['input_ids'], attention_mask=b['attention_mask']).logits.float()\n"
        "    lab = b['labels'][:, 1:]; l = torch.nn.functional.cross_entropy(lg[:, :-1].reshape(-1, lg.size(-1)),"
        " lab.reshape(-1), ignore_index=-100, reduction='sum')\n"
        "    tot += float(l); n += int((lab != -100).sum())\n"
        "print('EVAL_LOSS', tot / n)\n"
    ) % (str(REPO), str(base), str(adapter), str(data))
    run_logged([sys.executable, "-c", code], child_env(ids), log, timeout=1800)
    line = next(x for x in log.read_text().splitlines() if x.startswith("EVAL_LOSS"))
    return float(line.split()[1])


def generate_on_gpu(source: str, cache_root: Path, gpu: int = 0) -> None:
    """Random weights initialised on the GPU (an 8B model initialises in seconds there, minutes on the CPU), saved
    where materialize_model looks. Only for the benchmark's private cache: the bytes differ from a CPU-made copy.
    In a child process: the benchmark's own process then holds no GPU memory beside the runs it measures (the 8B
    shape's weights left 16 GiB in its allocator, which nvidia-smi counted in every run's figure)."""
    from finetune_flows.models.sources import _cache_entry

    if _cache_entry("models", source, cache_root, None).manifest_path.is_file():
        return  # made before (materialize_model verifies it)
    code = (f"import sys; sys.path.insert(0, {str(REPO)!r}); from pathlib import Path; "
            f"from benchmarks.train_speed import generate_here; generate_here({source!r}, Path({str(cache_root)!r}))")
    cache_root.mkdir(parents=True, exist_ok=True)
    run_logged([sys.executable, "-c", code], child_env([gpu]), cache_root / "generate.log", timeout=1800)


def generate_here(source: str, cache_root: Path) -> None:
    import torch

    from finetune_flows.models.sources import _cache_entry, _materialize_generated, _materialized

    def build(out: Path) -> None:
        with torch.device("cuda"):
            _materialize_generated(source.split(":", 1)[1], out)

    _materialized(_cache_entry("models", source, cache_root, None), build)


def logged(log: Path, key: str) -> list[list]:
    """[step, value] of `key` in every train_log event of a worker's log (a diverging run shows where it starts)."""
    if not log.is_file():
        return []
    events = (json.loads(line.split(" ", 1)[1]) for line in log.read_text().splitlines()
              if line.startswith("@@event ") and '"train_log"' in line)
    return [[e["step"], e[key]] for e in events if e.get(key) is not None]


def gpu_name(ids: list[int]) -> str:
    from finetune_flows.runtime.gpus import read_inventory

    names = {g.index: g.name for g in read_inventory()}
    return names.get(ids[0], "cpu") if ids else "cpu"


def peak_tflops(name: str) -> float | None:
    return next((v for k, v in PEAK_TFLOPS.items() if k in name), None)


class Bench:
    def __init__(self, args, env):
        self.args, self.env = args, env
        self.state = Path(args.state).resolve()
        self.cache = self.state / "cache"
        self.runs_dir = self.state / "runs"
        self.runs_dir.mkdir(parents=True, exist_ok=True)
        self.gpu_ids = [g.index for g in env.gpus]
        # the card the rows ran on, by UUID: rows joined from other calls (--resume-from) name theirs
        self.machine = env.gpus[0].uuid if env.gpus else None

    def config(self, shape: str, extra: list[str]):
        from finetune_flows.config.schema import load_config

        a = self.args
        return load_config(None, [f"model.source=generated:{shape}", f"run.cache_dir={self.cache}",
                                  f"train.max_steps={a.steps}", "train.per_device_batch_size=8",
                                  f"train.gradient_accumulation_steps={a.accumulation}",
                                  f"train.learning_rate={a.learning_rate}", f"train.warmup_steps={a.warmup}",
                                  "train.logging_steps=5", f"train.save_steps={10**6}", "train.save_total_limit=1",
                                  "hardware.gpus=" + ("cpu" if not self.gpu_ids else "auto"), *extra])

    def base_model(self, shape: str) -> tuple[Path, "object", "object", "object"]:
        """(bf16 checkpoint, the project's 4-bit QuantizedModel, cfg, plan) for a generated shape, built once."""
        from finetune_flows.runtime.environment import resolve_plan
        from finetune_flows.runtime.gpus import selection_for
        from finetune_flows.runtime.launcher import python_module, run_worker, write_job
        from finetune_flows.models.sources import materialize_model
        from finetune_flows.models.quantize import QuantizedModel, quantize_fingerprint

        cfg = self.config(shape, [])
        sel = selection_for("0" if self.gpu_ids else "cpu", self.env.gpus)
        plan = resolve_plan(cfg, self.env, sel)
        started = time.perf_counter()
        if self.gpu_ids:
            generate_on_gpu(cfg.model.source, cfg.cache_root, self.gpu_ids[0])
        src = materialize_model(cfg.model.source, cfg.cache_root)
        out = cfg.cache_root / "quantized" / quantize_fingerprint(cfg, plan)
        if not (out / "quantization.json").is_file():
            work = self.state / "work" / shape
            job = write_job(work, "quantize", config=cfg.model_dump(mode="json"), out=str(out),
                            compute_dtype=plan.compute_dtype, fingerprint=out.name)
            run_worker("quantize", python_module("finetune_flows.models.quantize", job), sel.env, work)
        print(f"[{shape}] base model ready in {time.perf_counter() - started:.0f} s", flush=True)
        return src, QuantizedModel.model_validate_json((out / "quantization.json").read_text()), cfg, plan

    def record(self, name: str, result: dict) -> None:
        result = {**result, "host_dispatch_us": host_dispatch_us(),  # the host's speed, right after the row
                  "machine": self.machine, "finished": datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")}
        write_json(self.runs_dir / f"{name}.json", result)

    def record_error(self, name: str, shape: str, run: str, budget: int | None, error: str,
                     rows_per_micro_batch: int | None = None) -> None:
        """A row that did not run: its error, so the report shows why (the bench goes on with the next). A peer's row
        names the peer as its run and its batch size, like a row that ran."""
        print(f"[{name}] FAILED: {error.splitlines()[0] if error else ''}", flush=True)
        row = {"name": name, "run": run, "shape": shape, "model": f"generated:{shape}", "memory_budget_gib": budget,
               "gpus": len(self.gpu_ids[:1]), "host": platform.node(), "error": error, "tokens_per_second": None}
        if rows_per_micro_batch is not None:
            row["rows_per_micro_batch"] = rows_per_micro_batch
        self.record(name, row)

    def recipe_job(self, shape: str, name: str, data: Path, stats: dict, budget: int | None, **extra) -> tuple:
        """(bf16 checkpoint, 4-bit base, out dir, job file) for a run of a recipe script (seed, peers); `extra`'s keys
        join the job or replace its defaults (a peer's rows per micro-step and accumulation)."""
        src, base, _, _ = self.base_model(shape)
        out = self.state / "out" / name
        if out.exists():
            import shutil

            shutil.rmtree(out)  # a fresh run: nothing left from an earlier attempt
        out.mkdir(parents=True)
        from transformers import AutoTokenizer

        pad = AutoTokenizer.from_pretrained(src).pad_token_id or 0
        job = out / "job.json"
        job.write_text(json.dumps({"out": str(out), "model": str(src), "data": str(data), "steps": self.args.steps,
                                   "gradient_accumulation_steps": self.args.accumulation, "seed": 42,
                                   "learning_rate": self.args.learning_rate, "warmup_steps": self.args.warmup,
                                   "warmup": self.args.warmup, "pad_token_id": pad, "memory_budget_gib": budget,
                                   "max_length": stats["max_length"], **extra}))  # extra's keys win
        return src, base, out, job

    def run_seed(self, shape: str, data: Path, stats: dict, budget: int | None = None) -> None:
        name = f"seed-{shape}{budget_suffix(budget)}"
        _, base, out, job = self.recipe_job(shape, name, data, stats, budget)
        ids = self.gpu_ids[:1]
        with MemoryPoller(ids) as mem:
            run_logged([sys.executable, str(REPO / "benchmarks" / "seed_recipe.py"), str(job)], child_env(ids),
                       out / "train.log", timeout=3600)
        result = json.loads((out / "result.json").read_text())
        result["eval_loss"] = eval_loss(base.path, Path(result["adapter_path"]), data, ids, out / "eval.log")
        self.record(name, self.summarize(name, shape, ids, result, mem, stats, "seed", budget))

    def run_peer(self, peer: str, shape: str, data: Path, stats: dict, budget: int | None = None,
                 rows: int = 8) -> None:
        """A peer (benchmarks/peer_recipe.py) in its own process, with --peer-site as its PYTHONPATH, batching `rows`
        rows a micro-step within the effective batch of 8 x --accumulation."""
        name = f"{peer_label(peer, rows)}-{shape}{budget_suffix(budget)}"
        _, base, out, job = self.recipe_job(shape, name, data, stats, budget, peer=peer, rows_per_micro_batch=rows,
                                            gradient_accumulation_steps=8 * self.args.accumulation // rows)
        ids = self.gpu_ids[:1]
        env = child_env(ids)
        if self.args.peer_site:
            env["PYTHONPATH"] = self.args.peer_site  # the peers' site alone: never this project's transformers
        with MemoryPoller(ids) as mem:
            run_logged([sys.executable, str(REPO / "benchmarks" / "peer_recipe.py"), str(job)], env,
                       out / "train.log", timeout=3600)
        result = json.loads((out / "result.json").read_text())
        result["eval_loss"] = eval_loss(base.path, Path(result["adapter_path"]), data, ids, out / "eval.log")
        row = self.summarize(name, shape, ids, result, mem, stats, peer, budget)
        row["versions"], row["rows_per_micro_batch"] = result.get("versions"), rows
        self.record(name, row)

    def run_ours(self, shape: str, data: Path, stats: dict, label: str, gpus: int, overrides: list[str],
                 profile: bool, budget: int | None = None) -> None:
        from finetune_flows.data.dataset import PreparedDataset
        from finetune_flows.runtime.environment import measured_plan
        from finetune_flows.runtime.gpus import selection_for
        from finetune_flows.runtime.launcher import compile_caches, run_worker, torchrun_module, training_env
        from finetune_flows.training.train import training_plan, write_train_job

        overrides, env_overrides = split_overrides(overrides)
        _, base, _, _ = self.base_model(shape)
        # A bench run is a few dozen steps of what stands for a long run, whose steady state it measures: there,
        # train.compile=auto compiles the layers after its first steps (finetune_flows/training/compiling.py); here it
        # never would.
        if budget:
            overrides = [f"hardware.memory_budget_gib={budget}", *overrides]
        cfg = self.config(shape, ["train.compile=true", *overrides])
        ids = self.gpu_ids[:gpus]
        sel = selection_for(",".join(map(str, ids)) if ids else "cpu", self.env.gpus)
        plan, _ = measured_plan(cfg, self.env, sel, self.state / "work" / shape)  # as a flow run plans it
        print(f"[{label}-{shape}] training attention {plan.train_attn}: {plan.attention_choice['train']}", flush=True)
        name = f"{label}-{shape}{budget_suffix(budget)}"
        out = self.state / "out" / name
        if out.exists():
            import shutil

            shutil.rmtree(out)  # a fresh run: no resume from an earlier attempt's checkpoints
        out.mkdir(parents=True)
        data_obj = PreparedDataset(path=data, fingerprint="bench", format="text", train_rows=stats["rows"],
                                   eval_rows=EVAL_ROWS, train_tokens=stats["tokens"], truncated=0, dropped=0)
        tplan = training_plan(cfg, data_obj, base, plan, sel)
        extra = {"steady_warmup": self.args.warmup}  # the steps the seed's and the peers' steady state leave out
        if profile:
            extra["profile"] = {"path": str(out / "profile.json"), "start": self.args.warmup + 2, "steps": 3}
        plan = plan.with_training(tplan)
        job = write_train_job(out, cfg, plan, base, data_obj, ids, name, **extra)
        # the compilers' caches in <state>/cache/compile/<GPU model>/, as a flow run keeps them in its store
        worker_env = {**training_env({**sel.env, **compile_caches(self.cache, sel)}), **env_overrides}
        with MemoryPoller(ids) as mem:
            run_worker("train", torchrun_module("finetune_flows.training.worker", job, plan.nproc), worker_env, out)
        result = json.loads((out / "train_metrics.json").read_text())
        result["eval_loss"] = eval_loss(base.path, Path(result["adapter_path"]), data, ids[:1], out / "eval.log")
        result["overrides"] = [*overrides, *(f"{k}={v}" for k, v in env_overrides.items())]
        result["allocator"] = worker_env.get("PYTORCH_CUDA_ALLOC_CONF", os.environ.get("PYTORCH_CUDA_ALLOC_CONF"))
        result["attention_choice"] = f"{plan.train_attn}: {plan.attention_choice['train']}"
        result["grad_norms"] = logged(out / "train.log", "grad_norm")
        if (out / "profile.json").is_file():
            result["profile"] = json.loads((out / "profile.json").read_text())
        self.record(name, self.summarize(name, shape, ids, result, mem, stats, label, budget))

    def summarize(self, name: str, shape: str, ids: list[int], r: dict, mem: MemoryPoller, stats: dict,
                  run: str, budget: int | None) -> dict:
        from finetune_flows.training.planner import ModelShape
        from finetune_flows.models.sources import ARCHS

        cfg = dict(ARCHS[shape])
        cfg.setdefault("vocab_size", stats["vocab"])
        mshape = ModelShape.from_config(cfg)
        steady = r["steady_state"]["tokens_per_second"]
        gname = gpu_name(ids)
        peak = peak_tflops(gname)
        mfu = None
        if steady and peak:
            mfu = round(steady * mshape.flops_per_token(stats["mean_length"]) / (peak * 1e12 * len(ids)), 4)
        total_gib = None
        if ids:
            from finetune_flows.runtime.gpus import read_inventory

            total_gib = round(next(g.memory_total_mib for g in read_inventory() if g.index == ids[0]) / 1024, 1)
        row = {
            "name": name, "run": run, "shape": shape, "memory_budget_gib": budget, "model": f"generated:{shape}",
            "gpus": len(ids), "gpu": gname, "host": platform.node(),
            "tokens_per_second": steady, "tokens_per_second_min": r["steady_state"]["min"],
            "tokens_per_second_max": r["steady_state"]["max"], "windows": r["steady_state"]["windows"],
            "whole_run_tokens_per_second": r["tokens_per_second"], "train_tokens": r["train_tokens"],
            "train_seconds": r.get("train_seconds"),
            # what the run took beyond its steady rate: warm-up, compilation, checkpoint saves (the seconds a short
            # run pays whatever its length; compilation pays for itself only past some number of tokens)
            "warmup_overhead_seconds": None if not (steady and r.get("train_seconds")) else
            round(r["train_seconds"] - r["train_tokens"] / steady, 1),
            "steps": r["steps"], "peak_reserved_gib": None if r.get("peak_memory_mb") is None else
            round(r["peak_memory_mb"] / 1024, 2),
            "peak_allocated_gib": None if r.get("peak_allocated_mb") is None else
            round(r["peak_allocated_mb"] / 1024, 2),
            **{f"{k}_gib": None if r.get(f"{k}_mb") is None else round(r[f"{k}_mb"] / 1024, 2)
               for k in ("loaded_allocated", "load_peak_reserved", "outside_allocator")},
            "nvidia_smi_peak_gib": round(mem.peak / 1024, 2) if mem.peak else None,
            "nvidia_smi_device_peak_gib": round(mem.device_peak / 1024, 2) if mem.device_peak else None,
            "nvidia_smi_processes": mem.processes, "gpu_total_gib": total_gib,
            "mfu": mfu, "eval_loss": round(r["eval_loss"], 4), "final_train_loss": r["loss_curve"][-1][1],
            "loss_curve": r["loss_curve"], "grad_norms": r.get("grad_norms", []),
            "layout": r.get("layout", ""), "overrides": r.get("overrides", []), "allocator": r.get("allocator"),
            "attention_choice": r.get("attention_choice"),
            "training_plan": r.get("training_plan"), "profile": r.get("profile"),
            # each step's seconds (every row); ours: the allocator's frees-and-retries at its cap (None on the CPU)
            "step_seconds": r.get("step_seconds"), "alloc_retries": r.get("alloc_retries"),
            "compile_stats": r.get("compile_stats"),
            "flops_per_token": mshape.flops_per_token(stats["mean_length"]),
        }
        print(f"[{name}] {steady} tokens/s (min {row['tokens_per_second_min']}, max {row['tokens_per_second_max']}), "
              f"peak reserved {row['peak_reserved_gib']} GiB, eval loss {row['eval_loss']}", flush=True)
        return row


def jobs_for(bench: Bench, args, shape: str, data: Path, stats: dict, budget: int | None,
             peer_rows: list[int]) -> list[tuple]:
    """The rows of one shape and budget, in order: (row label, the row's run, a peer's rows a micro-step, callable)."""
    jobs = []
    for run in [r for r in args.runs.split(",") if r]:
        if run == "seed":
            jobs.append(("seed", "seed", None, lambda: bench.run_seed(shape, data, stats, budget)))
        elif run == "ours":
            jobs.append(("ours", "ours", None,
                         lambda: bench.run_ours(shape, data, stats, "ours", 1, [], False, budget)))
            if args.profile:  # a separate run, so the profiler never slows the measured one
                jobs.append(("ours-profile", "ours", None, lambda: bench.run_ours(
                    shape, data, stats, "ours-profile", 1, [], True, budget)))
        elif run == "ours-2gpu":
            if len(bench.gpu_ids) >= 2:
                jobs.append(("ours-2gpu", "ours-2gpu", None, lambda: bench.run_ours(
                    shape, data, stats, "ours-2gpu", 2, [], False, budget)))
            else:
                print(f"[{shape}] ours-2gpu skipped: {len(bench.gpu_ids)} GPU(s) here", flush=True)
        else:
            jobs += [(peer_label(run, n), run, n, lambda run=run, n=n: bench.run_peer(
                run, shape, data, stats, budget, n)) for n in peer_rows]
    for variant in args.variant:
        label, _, kv = variant.partition(":")
        gpus = 2 if label.startswith("2gpu-") else 1  # 2gpu-<label>: the variant on two GPUs (DDP)
        if gpus > max(1, len(bench.gpu_ids)):
            print(f"[{shape}] ours-{label} skipped: {len(bench.gpu_ids)} GPU(s) here", flush=True)
            continue
        items = [x for x in kv.split(",") if x]
        jobs.append((f"ours-{label}", f"ours-{label}", None,
                     lambda label=label, gpus=gpus, items=items: bench.run_ours(
                         shape, data, stats, f"ours-{label}", gpus, items, args.profile, budget)))
    return jobs


def main(argv: list[str] | None = None) -> int:
    from finetune_flows.runtime.environment import run_probe

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="qwen3-0.6b,qwen3-8b")
    parser.add_argument("--runs", help="seed, ours, ours-2gpu (where 2 GPUs), and the peers: " + ", ".join(PEERS) +
                        " (default seed,ours,ours-2gpu; with --smoke seed,ours)")
    parser.add_argument("--budgets", default="none", help="memory budgets in GiB, e.g. none,24: every row once each")
    parser.add_argument("--peer-site", help="PYTHONPATH of the peers' processes (their own site; default: ours)")
    parser.add_argument("--peer-rows", default="8", help="the peers' rows per micro-step, e.g. 8,32: each peer once "
                        "per size, within the same effective batch (default 8, the seed's)")
    parser.add_argument("--variant", action="append", default=[], metavar="LABEL:key=value,...",
                        help="an extra run of ours with config overrides, named ours-LABEL; a LABEL starting "
                        "with 2gpu- runs on two GPUs (DDP), e.g. 2gpu-noliger:train.liger_kernel=false")
    parser.add_argument("--profile", action="store_true", help="profile 3 steady steps of each ours run")
    parser.add_argument("--rows", type=int, default=4000)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=4, help="steps left out of the steady state")
    parser.add_argument("--accumulation", type=int, default=4, help="x 8 rows = the effective batch per GPU")
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--state", default="/tmp/finetune-flows-train-bench")
    parser.add_argument("--out", help="report directory (default benchmarks/results/train-bench-<N>xGPU-<time>)")
    parser.add_argument("--report-only", action="store_true", help="write the report from --state and stop")
    parser.add_argument("--resume-from", metavar="REPORT_JSON", help="a report whose rows --state lacks (an earlier "
                        "call's, on a machine that did not keep --state): they join this report, each row naming "
                        "its host; refused where its GPU is not this host's")
    parser.add_argument("--smoke", action="store_true", help="tiny model on the CPU: the machinery end to end")
    args = parser.parse_args(argv)
    for variant in args.variant:  # a malformed variant stops the bench before any run, not after the first ones
        split_overrides([x for x in variant.partition(":")[2].split(",") if x])
    budgets = parse_budgets(args.budgets)
    if args.runs is None:  # `--runs=` (none: variants alone) stays empty
        args.runs = "seed,ours" if args.smoke else "seed,ours,ours-2gpu"

    unknown = [r for r in args.runs.split(",") if r and r not in ("seed", "ours", "ours-2gpu", *PEERS)]
    if unknown:
        parser.error(f"unknown run(s) {', '.join(unknown)}: seed, ours, ours-2gpu, {', '.join(PEERS)}")
    if args.smoke:
        args.shapes, args.rows, args.steps, args.warmup, args.accumulation = "tiny-llama", 160, 8, 2, 1
    peer_rows = parse_peer_rows(args.peer_rows, 8 * args.accumulation)  # before anything runs
    state = Path(args.state)
    env = run_probe(state / "probe")
    if args.resume_from:
        try:
            resume_rows(Path(args.resume_from), state, [g.name for g in env.gpus])
        except ValueError as exc:
            parser.error(str(exc))
    command = "python benchmarks/train_speed.py " + " ".join(argv if argv is not None else sys.argv[1:])
    bench = Bench(args, env)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    out = Path(args.out) if args.out else REPO / "benchmarks" / "results" / f"train-bench-{len(env.gpus)}xGPU-{stamp}"
    failures = 0
    if not args.report_only:
        for shape in [s for s in args.shapes.split(",") if s]:
            data, stats = workload_for(shape, args.rows, state, bench.cache, args.smoke)
            for budget in budgets:
                jobs = jobs_for(bench, args, shape, data, stats, budget, peer_rows)
                for name, run, rows, job in jobs:
                    try:
                        job()
                    except Exception as exc:  # the row keeps its error; the others still run
                        failures += 1
                        cause = getattr(exc, "message", "")  # a WorkerOOM's own line, under torchrun's tail
                        bench.record_error(f"{name}-{shape}{budget_suffix(budget)}", shape, run, budget,
                                           f"{type(exc).__name__}: {exc}" + (f"\n{cause}" if cause else ""), rows)
                    write_report(state, env, command, out)
    print(markdown(write_report(state, env, command, out)))
    print(f"report: {out}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
