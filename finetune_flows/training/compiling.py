"""Compiled decoder layers (`train.compile`): how they are compiled, and under `auto` whether the run repays it.

`torch.compile` of each decoder layer (dynamic shapes) fuses the elementwise work and cuts kernel launches, so
compiled steps run faster; but compiling costs time before the first compiled step, which a short run never earns
back (the figures: benchmarks/results/train-bench-1xGPU-20261201-032103/NOTE.md).

So under `auto` the layers start eager. After MEASURE_STEPS steps (an attempt's first step left out) the median
eager step time `t` and the optimizer steps left `n` give what compiling would save, n * t * (1 - 1/SPEEDUP), and
it is weighed against what compiling costs: the compilation last measured for this layer on this GPU model and
torch version (a record in the store: `<cache>/compile-costs/<GPU model>--<layer>/`), or DEFAULT_COST_S before any
was. Rank 0 decides for every rank. A run that compiles measures its compilation (its first compiled step's time
less `t`) and records it for the next one. `train.compile=true` compiles before the first step; `false` never.
"""

from __future__ import annotations

import re
import statistics
from pathlib import Path

from pydantic import BaseModel

from finetune_flows.store.entries import Entry, rewrite_record

MEASURE_STEPS = 5  # eager steps timed before deciding
# The lower of the speedups the benchmarks showed: a decision must not count on the larger one.
SPEEDUP = 1.45
# Compilation plus the first compiled step less an eager one, with an empty compile cache, as the benchmarks
# showed it; used until this GPU model has a measurement of its own.
DEFAULT_COST_S = 90.0
COSTS = "compile-costs"  # the store's kind of entry for measured compilations


def compile_decoder_layers(model, cuda_graphs: bool = False, checkpoint_in_graph: bool | None = None,
                           **compile_options) -> None:
    """torch.compile each decoder layer of the PEFT model: one graph serves every layer and any packed length.
    The frozen embedding's output does not require grad while every later layer's input does, and Dynamo guards on
    that, so the first layer alone would be compiled again (a recompile on "hidden_states requires_grad mismatch",
    which doubled the compilation); its input is made to require grad, at the cost of one input gradient more.

    A layer that checkpoints its activations (transformers' gradient checkpointing) runs its compiled forward a
    second time in the backward pass, from the eager checkpoint around it. With `checkpoint_in_graph` the checkpoint
    goes inside the compiled graph instead: the forward graph keeps the layer's input, and the backward graph
    recomputes the forward itself.

    With `cuda_graphs` the layers' forward and backward passes are recorded once as CUDA graphs and replayed
    (mode "reduce-overhead"), for micro-batches of one fixed shape (data/packing.py FixedShape): static shapes, and
    each micro-batch marked as a new step, so the graphs' outputs of the last one may be overwritten. A checkpoint
    then goes inside the graphs (`checkpoint_in_graph` defaults to `cuda_graphs`): around them, it would replay a
    forward graph within the backward pass."""
    import torch

    model.enable_input_require_grads()
    options = dict(dynamic=False, mode="reduce-overhead") if cuda_graphs else dict(dynamic=True)
    for layer in model.get_base_model().model.layers:
        if getattr(layer, "gradient_checkpointing", False) and (
                cuda_graphs if checkpoint_in_graph is None else checkpoint_in_graph):
            layer.gradient_checkpointing = False
            layer.forward = _checkpointed(layer.forward)
        layer.compile(**options, **compile_options)
    if cuda_graphs:
        model.register_forward_pre_hook(lambda module, args: torch.compiler.cudagraph_mark_step_begin())


def _checkpointed(forward):
    """forward, its activations recomputed in the backward pass (non-reentrant: what Dynamo traces into a graph)."""
    from torch.utils.checkpoint import checkpoint

    def run(*args, **kwargs):
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return run


def stable_gradients(model):
    """A Trainer callback for CUDA graphs: each optimizer step starts with every trainable parameter's .grad a zeroed
    buffer of its own, allocated once outside the graphs, so backward adds each micro-batch's gradients into it. Left
    to itself, the first micro-batch's backward hands .grad the graphs' own output memory, which the next replay
    overwrites (gradient accumulation, a split after running out of memory)."""
    import torch
    from transformers import TrainerCallback

    params = [p for p in model.parameters() if p.requires_grad]
    buffers = [torch.zeros_like(p) for p in params]

    class StableGradients(TrainerCallback):
        gradients = buffers

        def on_step_begin(self, args, state, control, **kwargs):
            torch._foreach_zero_(buffers)
            for param, buffer in zip(params, buffers):
                param.grad = buffer

    return StableGradients()


def compile_stats() -> dict:
    """What torch.compile did in this process: frames compiled (a recompile adds one), graphs, graph breaks (the
    first reasons' first lines), CUDA graph recordings Inductor skipped (`TORCH_LOGS=cudagraphs` prints why), and
    how many of Inductor's compiled graphs (a layer's forward and backward are two) came from its on-disk cache
    (launcher.compile_caches: the project's cache, per GPU model) rather than being compiled again.
    A compiled run's metrics carry it: a recompile per micro-batch, or skipped CUDA graphs, would otherwise show
    only as a slower row, and a run's warm-up time depends on whether its kernels were in the cache."""
    from torch._dynamo.utils import counters

    breaks = counters["graph_break"]
    return {"frames_compiled": counters["frames"]["ok"], "graphs": counters["stats"]["unique_graphs"],
            "graph_breaks": sum(breaks.values()),
            "graph_break_reasons": sorted({reason.strip().splitlines()[0] for reason in breaks})[:5],
            "cudagraph_skips": counters["inductor"]["cudagraph_skips"],
            "cache_hits": counters["inductor"]["fxgraph_cache_hit"],
            "cache_misses": counters["inductor"]["fxgraph_cache_miss"]}


def describe_compile(stats: dict) -> str:
    """One line for the log: what was compiled, from the cache or not, and anything that makes the row slower."""
    line = (f"torch.compile: {stats['frames_compiled']} frame(s) into {stats['graphs']} graph(s); Inductor graphs "
            f"{stats['cache_hits']} from the compile cache, {stats['cache_misses']} compiled")
    if stats["graph_breaks"]:
        line += f"; {stats['graph_breaks']} graph breaks ({'; '.join(stats['graph_break_reasons'])})"
    if stats["cudagraph_skips"]:
        line += f"; {stats['cudagraph_skips']} CUDA graph recordings skipped (TORCH_LOGS=cudagraphs prints why)"
    return line


def layer_key(model_config) -> str:
    """What a recorded compile time is for: the layer's architecture and width, and the compiler's version."""
    import torch

    return f"{model_config.model_type}-{model_config.hidden_size}-torch{torch.__version__}"


class CompileCost(BaseModel):
    seconds: float  # the first compiled step less an eager one


def cost_entry(cache_root: Path, gpus: str, layer: str) -> Entry:
    """The record of what compiling `layer` (layer_key) took on the GPU model `gpus` (launcher.gpu_models)."""
    return Entry(cache_root, COSTS, re.sub(r"[^A-Za-z0-9.+-]+", "-", f"{gpus}--{layer}"))


def recorded_cost(entry: Entry | None) -> float | None:
    found = entry.load(CompileCost, quiet=True) if entry is not None else None
    return found.seconds if found is not None else None


def record_cost(entry: Entry, seconds: float) -> None:
    """The last measurement wins; one writer at a time (the entry's lock), its manifest written atomically."""
    rewrite_record(entry, CompileCost(seconds=round(seconds, 1)))


def decide(eager_seconds: list[float], steps_left: int, cost: float | None) -> tuple[bool, str]:
    """Whether compiling now pays for itself, and the sentence that says why."""
    t = statistics.median(eager_seconds)
    gain = steps_left * t * (1 - 1 / SPEEDUP)
    known = cost is not None
    cost = cost if known else DEFAULT_COST_S
    worth = gain > cost
    why = (f"{steps_left} steps left x {t:.3f} s eager = {steps_left * t:.0f} s; compiled ({SPEEDUP}x) that saves "
           f"{gain:.0f} s {'>' if worth else '<='} {cost:.0f} s to compile ("
           + ("last measured on this GPU model" if known else "assumed: none measured on this GPU model yet") + ")")
    return worth, why


def compile_when_it_pays(model, clock, record: Entry | None, gather, say, **compile_options):
    """A Trainer callback (added after the one that feeds `clock`): times the eager steps, decides, compiles, and
    measures and records the compilation in `record` (cost_entry; None: none kept). `gather` collects one value per
    rank (rank 0's decides); `say` prints on rank 0."""
    from transformers import TrainerCallback

    class CompileWhenItPays(TrainerCallback):
        first = None  # the attempt's first step (a resumed attempt starts past 0)
        decided = False
        compiled_at = None
        eager = None  # median eager step seconds at the decision
        cost = None  # measured compilation seconds

        def on_train_begin(self, args, state, control, **kwargs):
            self.first = state.global_step

        def on_step_end(self, args, state, control, **kwargs):
            if self.compiled_at is not None and self.cost is None and state.global_step == self.compiled_at + 1:
                self.cost = max(0.0, clock.settle()[-1][1] - self.eager)
                say(f"decoder layers compiled in {self.cost:.1f} s (the first compiled step less an eager one)")
                if record is not None and state.is_world_process_zero:
                    record_cost(record, self.cost)
            if self.decided:
                return
            # every rank holds the same steps (saves land on the same ones), so all reach this point together
            eager = [sec for step, sec, _, excluded in clock.steps if step > self.first + 1 and not excluded]
            if len(eager) < MEASURE_STEPS:
                return
            self.decided = True
            worth, why = decide(eager, state.max_steps - state.global_step, recorded_cost(record))
            worth = bool(gather(worth)[0])
            say(f"train.compile=auto at step {state.global_step}: {why}: "
                + ("compiling the decoder layers now" if worth else "the layers stay eager"))
            if worth:
                self.eager = statistics.median(eager)
                clock.exclude()  # the compilation lands in the next step
                compile_decoder_layers(model, **compile_options)
                self.compiled_at = state.global_step

        def summary(self) -> dict:
            return {"compiled_at_step": self.compiled_at, "compile_seconds": self.cost}

    return CompileWhenItPays()
