"""train.fp8_base: the frozen base's matmuls in FP8 (finetune_flows/models/float8.py), on the CPU's own _scaled_mm."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import REPO, child_env

from eval_support import tiny_quantized, trained_once
from finetune_flows.models.sources import ARCHS
from finetune_flows.training.planner import ModelShape, TrainingPlan, plan_training, with_fp8_base


def relative_error(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_an_fp8_layer_computes_the_linear_layer_and_its_input_gradient_within_fp8_rounding(dtype):
    import torch

    from finetune_flows.models.float8 import float8_linear

    dtype = getattr(torch, dtype)
    torch.manual_seed(0)
    linear = torch.nn.Linear(256, 512, bias=False).to(dtype).requires_grad_(False)
    fp8 = float8_linear(linear)
    x = torch.randn(3, 100, 256, dtype=dtype, requires_grad=True)
    x8 = x.detach().clone().requires_grad_(True)
    y, y8 = linear(x), fp8(x8)
    assert y8.shape == y.shape and y8.dtype == dtype
    assert relative_error(y8, y) < 0.06  # e4m3's 3-bit mantissa on both operands: ~4% on Gaussian data
    grad = torch.randn_like(y)
    y.backward(grad)
    y8.backward(grad)
    assert relative_error(x8.grad, x.grad) < 0.06
    assert not list(fp8.parameters()), "an FP8 layer trains nothing"
    buffers = dict(fp8.named_buffers())
    assert buffers["weight_fp8"].dtype == buffers["weight_t_fp8"].dtype == torch.float8_e4m3fn
    assert buffers["weight_fp8"].shape == (512, 256) and buffers["weight_t_fp8"].shape == (256, 512)
    fp8_bytes = buffers["weight_fp8"].nbytes + buffers["weight_t_fp8"].nbytes
    assert fp8_bytes == linear.weight.numel() * 2  # the planner's bytes: one bf16 copy


def test_fp8_rounding_is_not_the_exact_product():
    """The error the docs state is real, not a layer that quietly computes in full precision."""
    import torch

    from finetune_flows.models.float8 import float8_linear

    torch.manual_seed(0)
    linear = torch.nn.Linear(256, 512, bias=False).requires_grad_(False)
    x = torch.randn(64, 256)
    assert relative_error(float8_linear(linear)(x), linear(x)) > 0.01


def test_training_on_an_fp8_base_trains_the_same_adapter_parameters_close_to_the_dequantized_base(shared_cache):
    """build_model with fp8_base: every LoRA-adapted projection's frozen base layer in FP8, the same trainable
    parameters, and a loss and LoRA gradients close to those on the dequantized base."""
    import torch

    base = tiny_quantized(shared_cache / "dequantize", "float32")
    fp8, loss8, grads8 = trained_once(base, dequantize_base=True, fp8_base=True)
    plain, loss, grads = trained_once(base, dequantize_base=True)
    assert sum(type(m).__name__ == "Float8Linear" for m in fp8.modules()) == 14
    assert not any(type(m).__name__ == "Float8Linear" for m in plain.modules())
    assert grads8.keys() == grads.keys() and len(grads) == 28
    print("FP8 loss", loss8, "dequantized", loss, "largest gradient error",
          max(relative_error(grads8[n], g) for n, g in grads.items()))
    assert abs(loss8 - loss) / loss < 0.01, (loss8, loss)
    for name, g in grads.items():
        assert torch.isfinite(grads8[name]).all() and relative_error(grads8[name], g) < 0.15, name


def plan(dequantized: bool = True, compiled: bool = True) -> TrainingPlan:
    return TrainingPlan(packing=True, micro_batch_tokens=4096, micro_batch_rows=0, gradient_accumulation_steps=1,
                        gradient_checkpointing=False, tokens_per_step=4096.0, predicted_peak_gib=10.0,
                        budget_gib=20.0, reasons=[], dequantize_base=dequantized, compile_layers=compiled)


@pytest.mark.parametrize("dequantized, compiled, capabilities, dtype, why_not", [
    (False, True, [(9, 0)], "bfloat16", "the base stays 4-bit"),
    (True, True, [(9, 0), (8, 0)], "bfloat16", "a GPU of compute capability 8.0 has no FP8 tensor cores (8.9+)"),
    (True, True, [(9, 0)], "float16", "the compute dtype is float16"),
    (True, False, [(9, 0)], "bfloat16", "the decoder layers are not compiled (train.compile)"),
])
def test_the_planner_leaves_the_fp8_base_off_where_it_cannot_run_or_pay_and_says_why(dequantized, compiled,
                                                                                    capabilities, dtype, why_not):
    chosen = with_fp8_base(plan(dequantized, compiled), True, capabilities, dtype)
    assert not chosen.fp8_base
    assert any(r.startswith("FP8 base off (train.fp8_base=true): " + why_not) for r in chosen.reasons), chosen.reasons


@pytest.mark.parametrize("capabilities", [[(9, 0)], [(8, 9)], []], ids=["H100/H200", "Ada", "CPU"])
def test_the_planner_holds_the_fp8_base_where_asked_and_possible_with_the_same_memory_plan(capabilities):
    chosen = with_fp8_base(plan(), True, capabilities, "bfloat16" if capabilities else "float32")
    assert chosen.fp8_base and chosen.predicted_peak_gib == 10.0 and chosen.micro_batch_tokens == 4096
    assert not with_fp8_base(plan(), False, capabilities).fp8_base  # off unless asked
    if not capabilities:  # the CPU runs it eagerly too: the tests' path, where speed is not the point
        assert with_fp8_base(plan(compiled=False), True, [], "float32").fp8_base


def qwen3_8b_plan(budget: float | None, fp8: bool, cuda_graphs: bool | str = "auto") -> TrainingPlan:
    """The benchmark's Qwen3-8B plan on an 80 GB H100 (32 rows a step, 317 tokens on average, the longest 1,024)."""
    return plan_training(ModelShape.from_config(ARCHS["qwen3-8b"]), free_mib=80 * 1024, max_row=1024, mean_row=317.0,
                         rows_per_step=32, packing=True, micro_batch_tokens=None, checkpointing="auto",
                         four_bit=True, lora_r=16, lora_targets="all-linear", fused_ce=True, upcast=False,
                         dequantize=True, compile_layers=True, cuda_graphs=cuda_graphs, budget_gib=budget,
                         loss_chunk_tokens="auto", fp8_base=fp8, capabilities=[(9, 0)])


@pytest.mark.parametrize("cuda_graphs", ["auto", True])
def test_an_fp8_plan_with_activation_checkpointing_leaves_cuda_graphs_out(cuda_graphs):
    """Within 24 GiB the Qwen3-8B plan checkpoints, and replayed FP8 layers overran it on an H100: the FP8 plan
    drops the graphs (saying why) and still fits; the same budget without FP8 keeps them, as does FP8 without a
    budget (no checkpointing)."""
    fp8 = qwen3_8b_plan(24, True, cuda_graphs)
    assert fp8.fp8_base and fp8.gradient_checkpointing and not fp8.cuda_graphs
    assert fp8.dequantize_base and fp8.predicted_peak_gib <= 22.5  # the budget less what lies outside the allocator
    assert any(r.startswith(f"CUDA graphs off (train.cuda_graphs={str(cuda_graphs).lower()}): with the FP8 base "
                            "and activation checkpointing") for r in fp8.reasons), fp8.reasons
    plain = qwen3_8b_plan(24, False, cuda_graphs)
    assert plain.cuda_graphs and plain.gradient_checkpointing and not plain.fp8_base
    unlimited = qwen3_8b_plan(None, True, cuda_graphs)
    assert unlimited.fp8_base and unlimited.cuda_graphs and not unlimited.gradient_checkpointing


def test_an_fp8_layer_compiles_into_one_graph_with_its_lora_branch():
    """The decoder layers are compiled (train.compile): the FP8 matmul and its backward trace without a graph break,
    and compute what they compute eagerly."""
    import torch

    from finetune_flows.models.float8 import float8_linear

    torch.manual_seed(0)
    base = float8_linear(torch.nn.Linear(256, 512, bias=False).requires_grad_(False))
    lora_a, lora_b = torch.nn.Linear(256, 8, bias=False), torch.nn.Linear(8, 512, bias=False)

    def layer(x):
        return torch.nn.functional.silu(base(x) + lora_b(lora_a(x)))

    x = torch.randn(40, 256, requires_grad=True)
    layer(x).sum().backward()
    eager = x.grad.clone()
    x.grad = None
    compiled = torch.compile(layer, fullgraph=True)  # fullgraph: a graph break is an error
    assert torch.allclose(compiled(x), layer(x), atol=1e-5)
    compiled(x).sum().backward()
    assert torch.allclose(x.grad, eager, atol=1e-5)


def test_an_activation_checkpoint_compiled_over_fp8_layers_keeps_only_the_layer_input():
    """The 24 GiB plans checkpoint inside the compiled layer (training/compiling.py, with CUDA graphs): over the FP8
    layers the backward graph recomputes the layer, keeping its input and nothing more, as the planner assumes."""
    import torch
    from torch.utils.checkpoint import checkpoint

    from finetune_flows.models.float8 import float8_linear

    torch.manual_seed(0)
    up = float8_linear(torch.nn.Linear(256, 1024, bias=False).requires_grad_(False))
    down = float8_linear(torch.nn.Linear(1024, 256, bias=False).requires_grad_(False))
    lora_a, lora_b = torch.nn.Linear(256, 8, bias=False), torch.nn.Linear(8, 1024, bias=False)
    weights = {t.untyped_storage().data_ptr() for t in [*up.buffers(), *down.buffers(), lora_a.weight, lora_b.weight]}

    def layer(x):
        h = torch.nn.functional.silu(up(x) + lora_b(lora_a(x)))
        return down(h * h) + x

    def kept_bytes(fn, x) -> int:
        """Bytes autograd keeps for fn's backward pass, beyond the layers' weights."""
        kept = {}

        def pack(t):
            storage = t.untyped_storage()
            if storage.data_ptr() not in weights:
                kept[storage.data_ptr()] = storage.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = fn(x)
        out.sum().backward()
        return sum(kept.values())

    x = torch.randn(1024, 256, requires_grad=True)
    plain = kept_bytes(torch.compile(layer, fullgraph=True), x)
    checkpointed = kept_bytes(torch.compile(lambda x: checkpoint(layer, x, use_reentrant=False), fullgraph=True), x)
    assert checkpointed == x.nbytes and plain > 4 * x.nbytes, (plain, checkpointed)


DDP_OVER_FP8 = """
import sys, torch, torch.distributed as dist
from peft import LoraConfig, get_peft_model
from finetune_flows.models.float8 import float8_base

class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(32, 48, bias=False)

    def forward(self, x):
        return self.proj(x)

model = get_peft_model(Tiny().requires_grad_(False), LoraConfig(r=4, target_modules=["proj"]))
print("replaced", float8_base(model))
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
wrapped = torch.nn.parallel.DistributedDataParallel(model)
wrapped(torch.randn(5, 32)).sum().backward()
print("trained", all(p.grad is not None for p in model.parameters() if p.requires_grad), flush=True)
del wrapped  # DDP's reducer holds the group: destroyed first, or gloo may abort (or hang) at exit
dist.destroy_process_group()
"""


def test_ddp_leaves_the_fp8_weights_alone(tmp_path):
    """DDP broadcasts a module's buffers when it wraps it, and gloo cannot carry float8 ("Invalid scalar type", the
    first end-to-end run): the FP8 weights, made alike on every rank, are kept out of its reach. In a process of its
    own, as the training worker's ranks run DDP (in the pytest process, a gloo group left behind sometimes hung it)."""
    done = subprocess.run([sys.executable, "-c", DDP_OVER_FP8, str(tmp_path / "rendezvous")], capture_output=True,
                          text=True, timeout=120, env=child_env())
    assert done.returncode == 0 and done.stdout.split() == ["replaced", "1", "trained", "True"], (
        done.stdout + done.stderr[-3000:])


def test_a_flow_run_on_an_fp8_base_trains_two_ranks_and_evaluates_its_adapter(prefect_server, shared_cache, tmp_path):
    """The whole pipeline with train.fp8_base, over two gloo ranks: the plan says so, each rank converts its base, and
    the adapter is evaluated on the NF4 base as usual."""
    from conftest import tiny_overrides
    from finetune_flows.config.schema import load_config
    from flows.finetune import finetune

    args = tiny_overrides(shared_cache / "float8", tmp_path / "runs", **{
        "train.dequantize_base": True, "train.fp8_base": True, "hardware.cpu_processes": 2})
    result = finetune(load_config(None, args))
    log = (result.train.adapter_path.parent / "train.log").read_text()
    assert log.count("FP8 base: 14 frozen linear layers in float8_e4m3fn") == 2, log[-3000:]
    assert result.train.steps == 6 and result.eval.adapter.loss < result.eval.base.loss


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
def test_the_worker_compiles_its_decoder_layers_over_an_fp8_base(shared_cache, checkpointing):
    """build_model with compiled layers (dynamic shapes, as train.compile compiles them) over the FP8 base, also with
    activation checkpointing (the 24 GiB plan's): both layers and two lengths train through one compiled frame, to
    the eager loss. A float constant in the traced FP8 code once failed here: Dynamo lifts a module-level float into a
    graph input, which the autograd Function's subgraph cannot take. A class per FP8 layer once recompiled the frame
    for each layer (Dynamo guards on the modules' types), and past its recompile limit left layers uncompiled."""
    import torch

    from finetune_flows.training.compiling import compile_stats

    base = tiny_quantized(shared_cache / "dequantize", "float32")
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    _, loss, grads = trained_once(base, lengths=(20, 33), dequantize_base=True, fp8_base=True, compile_layers=True,
                                  gradient_checkpointing=checkpointing)
    stats = compile_stats()
    assert stats["frames_compiled"] == 1 and stats["graph_breaks"] == 0, stats
    _, eager_loss, eager_grads = trained_once(base, lengths=(20, 33), dequantize_base=True, fp8_base=True)
    assert abs(loss - eager_loss) < 1e-4 * eager_loss and len(grads) == 28
    for name, g in grads.items():  # the compiled kernels round to FP8 in their own order
        assert torch.isfinite(g).all() and relative_error(g, eager_grads[name]) < 0.05, name


def test_the_fp8_layers_benchmark_compares_both_bases_on_the_same_weights(tmp_path):
    """benchmarks/fp8_layers.py --smoke: both bases timed, their losses within FP8 rounding of each other but not
    equal, every FP8-eligible layer converted, one compiled frame per base."""
    import json

    out = tmp_path / "fp8.json"
    proc = subprocess.run([sys.executable, "benchmarks/fp8_layers.py", "--smoke", "--out", str(out)], cwd=REPO,
                          env=child_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["fp8_layers"] == 14 and report["compile"]["frames_compiled"] == 2, report
    assert report["dequantized"]["ms_per_step"] > 0 and report["fp8"]["ms_per_step"] > 0
    assert 0 < report["fp8"]["weights_mib"] < report["dequantized"]["weights_mib"]  # fp32 here: 4 bytes against 2
    assert 0 < report["fp8_loss_relative"] < 1e-3
    assert 0 < report["fp8_grad_relative_error_median"] < 0.2
