"""The FP8 base (`train.fp8_base`) against the dequantized base, on a few decoder layers of a real shape.

    python benchmarks/fp8_layers.py --shape qwen3-8b --layers 8          # on a GPU
    python benchmarks/fp8_layers.py --smoke                               # tiny model on the CPU: the machinery

A narrow measurement for deciding about FP8 where a full `train_speed.py` row costs minutes of generating an 8B
checkpoint: the same random weights (a shape of finetune_flows/models/sources.py ARCHS with `--layers` decoder
layers), LoRA on the config's default target modules, the decoder layers compiled as the training worker compiles
them (training/compiling.py; with CUDA graphs on a GPU, as the unlimited 8B plan has them), one micro-batch of
`--rows` x `--length` tokens. Each step is a forward pass and the backward pass the frozen base needs (input
gradients and the LoRA weights' gradients), timed by CUDA events (the host's clock on the CPU), median over the
steady steps. The loss is the mean square of the last hidden state: the decoder layers alone, no lm_head.

It prints and writes (`--out`, JSON) ms per step and tokens per second for each base, their ratio, each model's weights
(MiB) and, on a GPU, what its steps reserved beyond what was reserved before them, and how far the FP8 run's loss and
LoRA gradients are from the dequantized run's. A training speed-up is claimed from `train_speed.py`'s rows, not from
this.
"""

from __future__ import annotations

import argparse
import copy
import importlib.metadata
import json
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from finetune_flows.config.schema import FinetuneConfig  # noqa: E402
from finetune_flows.files import write_json  # noqa: E402
from finetune_flows.models.float8 import float8_base  # noqa: E402
from finetune_flows.models.sources import ARCHS  # noqa: E402
from finetune_flows.training.compiling import compile_decoder_layers, compile_stats  # noqa: E402


def build(shape: str, layers: int, device: str, dtype):
    """A PEFT model of `shape` with `layers` decoder layers, random weights made on `device`, base frozen."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    dims = dict(ARCHS[shape])
    model_type = dims.pop("model_type")
    dims.setdefault("vocab_size", 1024)
    config = AutoConfig.for_model(model_type, **{**dims, "num_hidden_layers": layers})
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    for p in model.parameters():
        p.requires_grad_(False)
    lora = FinetuneConfig().lora
    model = get_peft_model(model, LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=0.0,
                                             target_modules=lora.target_modules, task_type="CAUSAL_LM"))
    for module in model.modules():  # a non-zero B, so both LoRA matrices get gradients
        if hasattr(module, "lora_B"):
            torch.nn.init.normal_(module.lora_B["default"].weight, std=0.02)
    model.config.use_cache = False
    return model


def step(model, ids) -> "torch.Tensor":
    # The decoder alone, so not through the PEFT model, whose forward hook marks each step for the CUDA graphs
    # (compile_decoder_layers): marked here instead.
    torch.compiler.cudagraph_mark_step_begin()
    hidden = model.get_base_model().model(input_ids=ids).last_hidden_state
    loss = hidden.float().pow(2).mean()
    loss.backward()
    return loss


def measure(model, ids, device: str, warmup: int, steps: int) -> dict:
    """ms per step (median, min, max over the steady steps), the last loss and the LoRA gradients of the first step."""
    cuda = device == "cuda"
    times, grads, loss = [], None, None
    for i in range(warmup + steps):
        for p in model.parameters():
            p.grad = None
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        else:
            t0 = time.perf_counter()
        loss = step(model, ids)
        if cuda:
            end.record()
            end.synchronize()
            ms = start.elapsed_time(end)
        else:
            ms = (time.perf_counter() - t0) * 1000
        if i == 0:
            grads = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.requires_grad}
        if i >= warmup:
            times.append(ms)
    return {"ms_per_step": round(statistics.median(times), 2), "ms_min": round(min(times), 2),
            "ms_max": round(max(times), 2), "loss": float(loss), "grads": grads}


def relative_error(a, b) -> float:
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="qwen3-8b", choices=sorted(ARCHS))
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--length", type=int, default=316, help="tokens per row (the bench's mean row is 316)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--cuda-graphs", choices=["on", "off"], default=None,
                        help="default: on with a GPU, off on the CPU")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--smoke", action="store_true", help="tiny model on the CPU")
    args = parser.parse_args(argv)
    if args.smoke:
        args.shape, args.layers, args.rows, args.length, args.warmup, args.steps = "tiny-llama", 2, 2, 32, 1, 2
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    graphs = (args.cuda_graphs or ("on" if device == "cuda" else "off")) == "on"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32

    dequantized = build(args.shape, args.layers, device, dtype)
    fp8 = copy.deepcopy(dequantized)
    replaced = float8_base(fp8)
    ids = torch.randint(0, dequantized.config.vocab_size, (args.rows, args.length), device=device,
                        generator=torch.Generator(device).manual_seed(1))
    results = {}
    for name, model in (("dequantized", dequantized), ("fp8", fp8)):
        compile_decoder_layers(model, cuda_graphs=graphs)
        if device == "cuda":  # both models stay resident, and the first one's graph pool: count from here
            torch.cuda.synchronize()
            reserved = torch.cuda.memory_reserved()
            torch.cuda.reset_peak_memory_stats()
        results[name] = measure(model, ids, device, args.warmup, args.steps)
        results[name]["weights_mib"] = round(sum(t.nbytes for t in (*model.parameters(), *model.buffers())) / 2**20, 2)
        if device == "cuda":  # the step's activations, temporaries and graph pool: reserved beyond the weights
            results[name]["step_reserved_gib"] = round((torch.cuda.max_memory_reserved() - reserved) / 2**30, 2)
    tokens = args.rows * args.length
    grads_error = {n: relative_error(results["fp8"]["grads"][n], g) for n, g in results["dequantized"]["grads"].items()}
    report = {
        "command": "python benchmarks/fp8_layers.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "device": torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu",
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     **{name: importlib.metadata.version(name) for name in ("transformers", "peft")}},
        "shape": args.shape, "layers": args.layers, "tokens_per_step": tokens, "cuda_graphs": graphs,
        "fp8_layers": replaced, "compile": compile_stats(),
        **{name: {k: v for k, v in r.items() if k != "grads"} | {"tokens_per_s": round(tokens / r["ms_per_step"] * 1000)}
           for name, r in results.items()},
        "fp8_speedup": round(results["dequantized"]["ms_per_step"] / results["fp8"]["ms_per_step"], 3),
        "fp8_loss_relative": abs(results["fp8"]["loss"] - results["dequantized"]["loss"]) / abs(results["dequantized"]["loss"]),
        "fp8_grad_relative_error_max": max(grads_error.values()),
        "fp8_grad_relative_error_median": statistics.median(grads_error.values()),
    }
    print(json.dumps(report, indent=2))
    if args.out:
        write_json(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
