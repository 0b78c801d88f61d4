"""The memory planner's decisions on injected GPU inventories (no GPU needed): micro-batch tokens, accumulation,
checkpointing, and what wins when the user sets a value."""

from __future__ import annotations

import pytest

from finetune_flows.models.sources import ARCHS
from finetune_flows.runtime.gpus import GpuInfo, GpuSelection
from finetune_flows.training.planner import (BUDGET_FRACTION, GIB, OUTSIDE_ALLOCATOR, ModelShape, TrainingPlan,
                                             allocator_bytes, peak_bytes, plan_training, planning_bytes)

SHAPES = {name: ModelShape.from_config(ARCHS[name]) for name in ("qwen3-0.6b", "qwen3-8b")}
GPUS = {"H100-80GB": 80 * 1024, "RTX4090-24GB": 24 * 1024, "H200-141GB": 141 * 1024}
WORKLOAD = dict(max_row=1024, mean_row=317.0)  # lognormal, median 256, clipped to 1024


def plan(shape: str, free_mib: int | None, rows: int = 32, **kw) -> TrainingPlan:
    args = dict(free_mib=free_mib, rows_per_step=rows, packing=True, micro_batch_tokens=None, checkpointing="auto",
                four_bit=True, lora_r=16, lora_targets="all-linear", fused_ce=True, upcast=False, **WORKLOAD)
    args.update(kw)
    return plan_training(SHAPES[shape], **args)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("gpu", GPUS)
def test_every_plan_fits_its_budget_and_covers_the_effective_batch(shape, gpu):
    p = plan(shape, GPUS[gpu])
    assert p.predicted_peak_gib <= p.budget_gib
    assert p.micro_batch_tokens >= WORKLOAD["max_row"]  # the longest row always fits
    covered = p.micro_batch_tokens * p.gradient_accumulation_steps
    assert covered >= 32 * WORKLOAD["mean_row"] * 0.999  # one optimizer step still sees ~32 rows


def test_small_model_on_big_gpus_needs_no_checkpointing_and_one_micro_batch():
    for gpu in ("H200-141GB", "H100-80GB", "RTX4090-24GB"):
        p = plan("qwen3-0.6b", GPUS[gpu])
        assert not p.gradient_checkpointing and p.gradient_accumulation_steps == 1, gpu


def test_8b_on_a_24gb_card_checkpoints_but_not_on_an_h200():
    assert plan("qwen3-8b", GPUS["RTX4090-24GB"]).gradient_checkpointing
    h200 = plan("qwen3-8b", GPUS["H200-141GB"])
    assert not h200.gradient_checkpointing and h200.gradient_accumulation_steps == 1


def test_a_bigger_effective_batch_is_cut_into_micro_batches_that_fit():
    small = plan("qwen3-8b", GPUS["H100-80GB"], rows=256)
    assert small.gradient_accumulation_steps > 1
    big = plan("qwen3-8b", GPUS["H200-141GB"], rows=256)
    assert big.micro_batch_tokens > small.micro_batch_tokens  # more memory: fewer, larger micro-batches
    assert big.gradient_accumulation_steps < small.gradient_accumulation_steps


def test_explicit_settings_win():
    p = plan("qwen3-0.6b", GPUS["H200-141GB"], micro_batch_tokens=2048, checkpointing=True)
    assert p.micro_batch_tokens == 2048 and p.gradient_checkpointing
    assert p.gradient_accumulation_steps == -(-int(32 * WORKLOAD["mean_row"]) // 2048)
    assert any("train.micro_batch_tokens" in r for r in p.reasons)


def test_the_cpu_has_no_memory_budget_and_no_checkpointing():
    p = plan("qwen3-0.6b", None)
    assert p.budget_gib is None and not p.gradient_checkpointing and p.gradient_accumulation_steps == 1


def test_a_row_longer_than_any_micro_batch_that_fits_is_a_clear_error():
    with pytest.raises(ValueError, match="longest row"):
        plan("qwen3-8b", 12 * 1024, checkpointing=False, max_row=32768)


def test_a_configured_micro_batch_shorter_than_the_longest_row_names_the_key():
    with pytest.raises(ValueError, match=r"one micro-batch of train.micro_batch_tokens=16: set at least 83, or lower "
                       r"data.max_length"):
        plan("qwen3-0.6b", None, micro_batch_tokens=16, max_row=83)


def test_upcast_and_unfused_loss_cost_the_memory_measured_on_an_h200():
    """Measured (benchmarks/results/train-bench-2xGPU-20261130-185446): 10,146-token micro-batches of the Qwen3-0.6B
    shape peaked at 28.9 GiB reserved with PEFT's fp32 upcast and 14.4 GiB without; the model must see that gap."""
    shape = SHAPES["qwen3-0.6b"]
    kw = dict(checkpointing=False, four_bit=True, lora_r=16, lora_targets="all-linear", fused_ce=True)
    up, down = (peak_bytes(shape, 10146, upcast=u, **kw) / GIB for u in (True, False))
    assert down == pytest.approx(14.4, rel=0.15)
    assert up == pytest.approx(28.9, rel=0.15)
    unfused = peak_bytes(shape, 10146, upcast=False, **{**kw, "fused_ce": False}) / GIB
    assert unfused > down + 10  # 10k x 152k-vocab logits in bf16 + fp32 + grad


def test_the_dequantized_compiled_path_predicts_the_peak_measured_on_an_h200():
    """benchmarks/results/train-bench-1xGPU-20261202-230939: the step's peak allocation on one H200 for both shapes,
    with the base dequantized and the layers compiled. Without the rotated q/k the attention keeps, the 8B prediction
    was 9% under; the planner stays within 7% of what was measured."""
    import json

    from conftest import REPO

    report = json.loads((REPO / "benchmarks/results/train-bench-1xGPU-20261202-230939/report.json").read_text())
    for run in report["runs"]:
        tplan = run["training_plan"]
        assert tplan["dequantize_base"] and not tplan["gradient_checkpointing"]
        predicted = peak_bytes(SHAPES[run["model"].split(":")[1]], tplan["micro_batch_tokens"], checkpointing=False,
                               four_bit=False, lora_r=16, lora_targets="all-linear", fused_ce=True, upcast=False) / GIB
        assert predicted == pytest.approx(run["peak_allocated_gib"], rel=0.07), run["name"]


def test_padded_plan_keeps_the_configured_rows():
    p = plan("qwen3-0.6b", GPUS["H200-141GB"], packing=False, per_device_rows=8, accumulation=4)
    assert not p.packing and p.micro_batch_rows == 8 and p.gradient_accumulation_steps == 4


def test_padded_batches_checkpoint_under_auto_only_where_they_do_not_fit_without_it():
    # before: train.packing=false turned checkpointing on under `auto` everywhere, the CPU included, unexplained
    cpu = plan("qwen3-0.6b", None, packing=False, per_device_rows=8)
    assert not cpu.gradient_checkpointing
    assert "no activation checkpointing: a padded batch of 8192 tokens fits without it" in cpu.reasons
    roomy = plan("qwen3-0.6b", GPUS["H200-141GB"], packing=False, per_device_rows=8)
    assert not roomy.gradient_checkpointing and roomy.predicted_peak_gib <= roomy.budget_gib
    tight = plan("qwen3-8b", GPUS["RTX4090-24GB"], packing=False, per_device_rows=8)
    assert tight.gradient_checkpointing
    assert "activation checkpointing on: without it a padded batch of 8192 tokens does not fit" in tight.reasons
    assert plan("qwen3-0.6b", None, packing=False, checkpointing=True).gradient_checkpointing  # as configured


def test_dequantized_base_is_held_where_it_fits_and_kept_4bit_where_it_does_not():
    small = plan("qwen3-0.6b", GPUS["H200-141GB"], dequantize=True, compile_layers=True)
    assert small.dequantize_base and small.compile_layers
    assert small.predicted_peak_gib <= small.budget_gib
    big = plan("qwen3-8b", GPUS["RTX4090-24GB"], dequantize=True, compile_layers=True)  # 16 GB of bf16 weights
    assert not big.dequantize_base and any("kept 4-bit" in r for r in big.reasons)
    assert not plan("qwen3-0.6b", GPUS["H200-141GB"]).dequantize_base  # only when asked for


def test_layers_over_a_base_kept_4bit_compile_only_with_compile_true_and_not_under_fsdp():
    """bitsandbytes' dequantize and matmul trace into a compiled layer (tests/test_compiling.py trains through
    them); `auto` still leaves them eager, since its decision counts on the speed-up measured over the dequantized
    base, and FSDP shards the 4-bit base."""
    forced = plan("qwen3-8b", GPUS["RTX4090-24GB"], dequantize=True, compile_layers=True)  # train.compile=true
    assert not forced.dequantize_base and forced.compile_layers and not forced.compile_deferred
    assert forced.reasons[-1].startswith("decoder layers compiled through the 4-bit matmuls")
    kept = plan("qwen3-8b", GPUS["RTX4090-24GB"], compile_layers=True)  # train.dequantize_base=false
    assert not kept.dequantize_base and kept.compile_layers
    auto = plan("qwen3-8b", GPUS["RTX4090-24GB"], dequantize=True, compile_layers=True, compile_deferred=True)
    assert not auto.compile_layers and auto.reasons[-1].endswith("leaves the 4-bit layers eager (true compiles them)")
    sharded = plan("qwen3-8b", GPUS["H200-141GB"], compile_layers=True, shards=2)
    assert not sharded.compile_layers and sharded.reasons[-1].endswith("FSDP shards the 4-bit base")
    graphs = plan("qwen3-8b", GPUS["RTX4090-24GB"], compile_layers=True, cuda_graphs=True)
    assert graphs.compile_layers and graphs.cuda_graphs  # the 4-bit layers' graphs replay as well


def test_auto_compilation_waits_for_the_first_steps_and_never_outlives_the_compilation_itself():
    deferred = plan("qwen3-0.6b", GPUS["H200-141GB"], dequantize=True, compile_layers=True, compile_deferred=True)
    assert deferred.compile_layers and deferred.compile_deferred
    assert any("compiled (torch.compile, dynamic shapes) once the first steps' measured time shows" in r
               for r in deferred.reasons)
    at_once = plan("qwen3-0.6b", GPUS["H200-141GB"], dequantize=True, compile_layers=True)  # train.compile=true
    assert at_once.compile_layers and not at_once.compile_deferred
    kept = plan("qwen3-8b", GPUS["RTX4090-24GB"], dequantize=True, compile_layers=True, compile_deferred=True)
    assert not kept.compile_layers and not kept.compile_deferred  # auto leaves a 4-bit base eager, now and later
    plain = plan("qwen3-0.6b", GPUS["H200-141GB"], four_bit=False, compile_layers=True, compile_deferred=True)
    assert plain.compile_layers and plain.compile_deferred  # a bf16 base compiles like a dequantized one
    assert not plan("qwen3-0.6b", GPUS["H200-141GB"], compile_deferred=True).compile_deferred  # nothing to defer


def test_dequantized_base_costs_its_bf16_weights_in_the_prediction():
    kept = plan("qwen3-8b", GPUS["H200-141GB"])
    held = plan("qwen3-8b", GPUS["H200-141GB"], dequantize=True)
    assert held.dequantize_base
    extra = held.predicted_peak_gib - kept.predicted_peak_gib
    assert 8 < extra < 14  # ~2 bytes instead of ~0.5 per weight of 8B parameters (~11 GiB more)


@pytest.mark.parametrize("device,strategy,overrides,want", [
    ("cuda", "ddp", [], (True, "deferred")),  # auto: measured faster on an H200 (benchmarks/README.md)
    ("cuda", "fsdp", [], (False, "off")),  # FSDP keeps its sharded 4-bit base
    ("cpu", "ddp", [], (False, "off")),  # the CPU keeps the 4-bit path
    ("cuda", "ddp", ["train.compile=false"], (True, "off")),
    ("cuda", "ddp", ["train.dequantize_base=false"], (False, "off")),
    ("cpu", "ddp", ["train.dequantize_base=true", "train.compile=true"], (True, "start")),
])
def test_dequantize_and_compile_auto(device, strategy, overrides, want):
    from finetune_flows.config.schema import load_config
    from finetune_flows.config.plan import compile_setting, dequantize_setting

    cfg = load_config(None, overrides)
    assert (dequantize_setting(cfg, device, strategy), compile_setting(cfg, device, strategy)) == want


# hardware.memory_budget_gib on one H200 (141 GiB free): the planner plans with the budget less what the process holds
# outside the allocator, where the workers cap the allocator, instead of the 70% it keeps of a (possibly shared) GPU's
# free memory
H200 = GpuSelection(ids=[0], gpus=[GpuInfo(index=0, name="NVIDIA H200", memory_total_mib=143771,
                                           memory_free_mib=141 * 1024, capability=(9, 0))])


def budgeted(shape: str, budget: float | None, **kw) -> TrainingPlan:
    """The plan a GPU run makes by default (train.dequantize_base and train.compile auto) within `budget` GiB."""
    return plan(shape, H200.planning_mib(), budget_gib=budget, dequantize=True, compile_layers=True,
                compile_deferred=True, **kw)


def test_the_budget_caps_the_memory_planned_with():
    assert H200.planning_mib() == 141 * 1024
    assert GpuSelection(ids=[], gpus=[]).planning_mib() is None  # the CPU
    assert planning_bytes(141 * 1024) == (141 * GIB * BUDGET_FRACTION, "70% of the free memory")
    assert planning_bytes(141 * 1024, 24) == (24 * GIB - OUTSIDE_ALLOCATOR,
                                              "hardware.memory_budget_gib=24 less 1.5 GiB outside the allocator")
    assert allocator_bytes(24) == 22.5 * GIB
    assert planning_bytes(141 * 1024, 500)[1] == "70% of the free memory"  # never more than is free
    # a shared GPU with little more free than the budget: 70% of its free memory is the smaller share
    assert planning_bytes(25 * 1024, 24) == (25 * GIB * BUDGET_FRACTION, "70% of the free memory")
    assert planning_bytes(None, 24) == (None, "")


def test_24gib_holds_the_8b_base_dequantized_compiled_and_checkpointed_in_one_micro_batch():
    """70% of 24 GiB (16.8) could not hold the bf16 weights (~15.3 GiB) beside the adapter, the reserve and a
    micro-batch: the 4-bit base stayed, uncompiled. The allocator's 22.5 GiB hold them with the whole step in one
    checkpointed micro-batch (at 90%, 21.6 GiB, it took two)."""
    whole = budgeted("qwen3-8b", None)
    assert whole.dequantize_base and whole.compile_layers and not whole.gradient_checkpointing
    four_bit = plan("qwen3-8b", H200.planning_mib(), budget_gib=24)
    assert four_bit.gradient_checkpointing and four_bit.gradient_accumulation_steps == 1
    p = budgeted("qwen3-8b", 24)
    assert p.budget_gib == 22.5
    assert p.dequantize_base and p.compile_layers and p.compile_deferred
    assert p.gradient_checkpointing  # as the 4-bit base needs: without it not even the longest row fits
    assert (p.micro_batch_tokens, p.gradient_accumulation_steps) == (10144, 1)  # 10,144 tokens a step
    assert p.predicted_peak_gib <= p.budget_gib
    assert any("22.5 GiB = hardware.memory_budget_gib=24 less 1.5 GiB outside the allocator" in r for r in p.reasons)
    # the same GPU without a budget but with only 24 GiB free (shared) still plans with 70%: the 4-bit base stays
    shared = plan("qwen3-8b", 24 * 1024, dequantize=True, compile_layers=True)
    assert not shared.dequantize_base and shared.budget_gib == pytest.approx(24 * BUDGET_FRACTION, abs=0.01)
    assert any("kept 4-bit" in r and "16.8 GiB" in r for r in shared.reasons)


def test_12gib_holds_the_0_6b_base_dequantized_in_two_micro_batches():
    assert budgeted("qwen3-0.6b", None).gradient_accumulation_steps == 1
    p = budgeted("qwen3-0.6b", 12)
    assert p.dequantize_base and p.compile_layers and not p.gradient_checkpointing
    assert (p.micro_batch_tokens, p.gradient_accumulation_steps) == (5072, 2)  # three of 3,382 at 70%
    assert p.predicted_peak_gib <= p.budget_gib == 10.5


def test_the_dequantized_base_gets_micro_batches_of_its_own():
    """At 17.7 GiB the 4-bit base takes the whole step in one micro-batch, beside which the bf16 weights do not fit;
    two micro-batches of half the size do (taking the 4-bit base's micro-batch, the planner kept the base 4-bit)."""
    four_bit = plan("qwen3-0.6b", H200.planning_mib(), budget_gib=17.7)
    assert four_bit.gradient_accumulation_steps == 1
    p = budgeted("qwen3-0.6b", 17.7)
    assert p.dequantize_base and p.gradient_accumulation_steps == 2 and p.predicted_peak_gib <= p.budget_gib


@pytest.mark.parametrize("shape", SHAPES)
def test_under_every_budget_the_plan_fits_and_dequantizing_adds_no_checkpointing(shape):
    planned = 0
    for budget in [b / 2 for b in range(6, 200)]:
        try:
            four_bit = plan(shape, H200.planning_mib(), budget_gib=budget)
        except ValueError:  # not even the 4-bit model fits
            continue
        p = budgeted(shape, budget)
        assert p.predicted_peak_gib <= p.budget_gib, budget
        assert p.gradient_checkpointing == four_bit.gradient_checkpointing, budget
        assert p.dequantize_base == p.compile_layers, budget
        planned += 1
    assert planned > 150


def test_cuda_graphs_where_the_layers_are_compiled_and_nothing_is_recomputed():
    """train.cuda_graphs: on where the plan compiles the layers of packed micro-batches (the small model on a big
    GPU, the 8B within 24 GiB with its checkpointing inside the compiled layers, several micro-batches a step within
    12 GiB), off with the reason where it compiles nothing, runs FSDP or has no GPU."""
    small = plan("qwen3-0.6b", GPUS["H200-141GB"], dequantize=True, compile_layers=True, cuda_graphs=True)
    assert small.cuda_graphs and small.reasons[-1] == (f"CUDA graphs: each compiled layer's passes replayed, every "
                                                       f"micro-batch padded to {small.micro_batch_tokens} tokens "
                                                       "(2 GiB planned for their pool)")
    tight = plan("qwen3-8b", GPUS["H200-141GB"], dequantize=True, compile_layers=True, cuda_graphs=True, budget_gib=24)
    assert tight.gradient_checkpointing and tight.cuda_graphs
    sharded = plan("qwen3-8b", GPUS["H200-141GB"], cuda_graphs=True, compile_layers=True, dequantize=True, shards=2)
    assert not sharded.cuda_graphs and sharded.reasons[-1].endswith("=true): FSDP shards the layers")
    eager = plan("qwen3-0.6b", GPUS["H200-141GB"], dequantize=True, cuda_graphs=True)
    assert not eager.cuda_graphs and eager.reasons[-1].endswith("the decoder layers are not compiled")
    shared = plan("qwen3-0.6b", GPUS["H200-141GB"], dequantize=True, compile_layers=True, cuda_graphs=True,
                  budget_gib=12)
    assert shared.gradient_accumulation_steps > 1 and shared.cuda_graphs  # gradients in buffers of their own
    cpu = plan("qwen3-0.6b", None, cuda_graphs=True)
    assert not cpu.cuda_graphs and cpu.reasons[-1].endswith(": no GPU")
    assert not plan("qwen3-0.6b", GPUS["H200-141GB"], dequantize=True, compile_layers=True).cuda_graphs


def test_cuda_graphs_true_plans_the_micro_batches_around_their_pool():
    """The 8B within 24 GiB ran out of memory recording the graphs with 0.78 GiB of head-room: `true` now plans the
    micro-batches with the pool counted, so the plan with graphs holds fewer tokens and still fits."""
    common = dict(dequantize=True, compile_layers=True, upcast=False, budget_gib=24)
    without = plan("qwen3-8b", GPUS["H200-141GB"], **common)
    graphs = plan("qwen3-8b", GPUS["H200-141GB"], cuda_graphs=True, **common)
    assert graphs.cuda_graphs and graphs.predicted_peak_gib <= graphs.budget_gib
    assert graphs.micro_batch_tokens < without.micro_batch_tokens
    assert graphs.reasons[-1].endswith(f"padded to {graphs.micro_batch_tokens} tokens (2 GiB planned for their pool)")


@pytest.mark.parametrize("case, kw, why_not", [
    ("the CPU", dict(free_mib=None), "no GPU"),
    ("two DDP ranks", dict(ranks=2), "2 ranks (measured on one)"),
    ("FSDP", dict(shards=2), "FSDP shards the layers"),
    ("train.compile=auto", dict(compile_deferred=True),
     "the layers compile mid-run (train.compile=auto; true compiles them before the first step)"),
    ("train.compile=false", dict(compile_layers=False), "the decoder layers are not compiled"),
    ("train.dequantize_base=false", dict(dequantize=False),
     "the base stays 4-bit (measured over the dequantized base)"),
    ("train.packing=false", dict(packing=False), "the rows are not packed"),
])
def test_cuda_graphs_auto_stays_off_outside_what_was_measured(case, kw, why_not):
    """`auto` holds graphs only as measured (+85% on the Qwen3-0.6B shape: one GPU, compiled before the first step,
    dequantized base), and says why not elsewhere."""
    args = dict(free_mib=GPUS["H200-141GB"], dequantize=True, compile_layers=True, cuda_graphs="auto") | kw
    p = plan("qwen3-0.6b", **args)
    assert not p.cuda_graphs, case
    assert p.reasons[-1] == f"CUDA graphs off (train.cuda_graphs=auto): {why_not}", case


def test_cuda_graphs_auto_holds_them_where_measured_and_where_their_pool_fits():
    base = dict(dequantize=True, compile_layers=True, cuda_graphs="auto")
    small = plan("qwen3-0.6b", GPUS["H200-141GB"], **base)
    alone = plan("qwen3-0.6b", GPUS["H200-141GB"], **(base | dict(cuda_graphs=False)))
    assert small.cuda_graphs and small.micro_batch_tokens == alone.micro_batch_tokens  # the same plan, graphs added
    assert small.predicted_peak_gib == pytest.approx(alone.predicted_peak_gib + 2, abs=0.01)
    big = plan("qwen3-8b", GPUS["H200-141GB"], **base)
    assert big.cuda_graphs and not big.gradient_checkpointing
    ckpt = plan("qwen3-8b", GPUS["H200-141GB"], checkpointing=True, **base)  # measured with it too (within 24 GiB)
    assert ckpt.cuda_graphs and ckpt.gradient_checkpointing


@pytest.mark.parametrize("shape, budget", [("qwen3-0.6b", 12), ("qwen3-8b", 24)])
def test_cuda_graphs_auto_replans_a_budgets_micro_batches_around_their_pool(shape, budget):
    """Within the benchmark's budgets the plan without graphs fills the budget and leaves no room for the pool; `auto`
    then takes the plan `true` makes (measured faster: 1.53x on 0.6B within 12 GiB, 1.05x on 8B within 24 GiB) and
    says what it gave up."""
    base = dict(dequantize=True, compile_layers=True, budget_gib=budget)
    without = plan(shape, GPUS["H200-141GB"], cuda_graphs=False, **base)
    assert without.budget_gib - without.predicted_peak_gib < 2  # no room for the pool
    auto = plan(shape, GPUS["H200-141GB"], cuda_graphs="auto", **base)
    true = plan(shape, GPUS["H200-141GB"], cuda_graphs=True, **base)
    assert auto.cuda_graphs and auto.dequantize_base
    assert auto.micro_batch_tokens == true.micro_batch_tokens < without.micro_batch_tokens
    assert auto.predicted_peak_gib == true.predicted_peak_gib <= auto.budget_gib
    assert (f"micro-batches of {auto.micro_batch_tokens} tokens with graphs rather than {without.micro_batch_tokens} "
            "without (train.cuda_graphs=auto)") in auto.reasons[-2]


@pytest.mark.parametrize("shape, budget, why", [
    ("qwen3-8b", 21.5, "around it the micro-batches would hold 1268 tokens against 5072 (under 50%)"),
    ("qwen3-8b", 20, "a plan around it would keep the base 4-bit"),
    ("qwen3-8b", 30, "a plan around it would turn activation checkpointing on"),
    ("qwen3-0.6b", 5, "no micro-batch fits beside it"),
])
def test_cuda_graphs_auto_keeps_a_budgets_plan_that_making_room_would_change_too_much(shape, budget, why):
    """Where the pool would take more than half a micro-batch's tokens, the dequantized base or the whole budget, the
    plan stays as it was, without graphs, and says why."""
    base = dict(dequantize=True, compile_layers=True, budget_gib=budget)
    without = plan(shape, GPUS["H200-141GB"], cuda_graphs=False, **base)
    auto = plan(shape, GPUS["H200-141GB"], cuda_graphs="auto", **base)
    assert not auto.cuda_graphs and auto.micro_batch_tokens == without.micro_batch_tokens
    assert auto.reasons[-1].startswith("CUDA graphs off (train.cuda_graphs=auto): the plan leaves ")
    assert auto.reasons[-1].endswith(why)


def test_cuda_graphs_auto_keeps_a_fixed_micro_batch_the_pool_does_not_fit_beside():
    """train.micro_batch_tokens fixes the micro-batch: `auto` cannot shrink it for the pool, so within 12 GiB a 5,049
    micro-batch of the 0.6B shape on a bf16 base keeps its plan without graphs (`true` would plan past the budget)."""
    args = dict(budget_gib=12, micro_batch_tokens=5049, four_bit=False)
    auto = plan("qwen3-0.6b", GPUS["H100-80GB"], cuda_graphs="auto", compile_layers=True, **args)
    assert not auto.cuda_graphs and auto.micro_batch_tokens == 5049 and auto.predicted_peak_gib <= auto.budget_gib
    assert auto.reasons[-1].endswith("does not fit beside micro-batches of 5049 tokens (train.micro_batch_tokens)")


def test_the_plan_says_its_token_figures_are_per_rank_where_there_are_several(monkeypatch):
    """The effective batch and its tokens are each rank's: with 2 ranks the optimizer step takes twice them. The log
    line and the training-plan artifact said "302 tokens per optimizer step" for 2 ranks of 302 each."""
    import prefect.artifacts

    from finetune_flows.training.train import publish_training_plan

    one, two = (plan("qwen3-0.6b", None, rows=4, mean_row=75.6, ranks=ranks) for ranks in (1, 2))
    assert "4 rows x 76 mean tokens = 302 tokens per optimizer step -> 1 micro-batch(es)" in one.reasons[-1]
    assert ("4 rows x 76 mean tokens = 302 tokens per rank per optimizer step (605 over 2 ranks) -> 1 micro-batch(es)"
            in two.reasons[-1])
    assert one.tokens_per_step == two.tokens_per_step  # the field stays per rank (the workers plan with it)
    shown = []
    monkeypatch.setattr(prefect.artifacts, "create_markdown_artifact", lambda md, **kw: shown.append(md))
    publish_training_plan(two)
    assert "| tokens_per_step (per rank) | 302.4 |" in shown[0] and "(605 over 2 ranks)" in shown[0]
