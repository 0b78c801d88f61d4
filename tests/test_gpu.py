"""GPU tier (`make test-gpu`): the real pipeline steps on CUDA. Skipped where there is no NVIDIA GPU.

The model is `generated:qwen3-0.6b` by default (Qwen3-0.6B's real shapes, random weights, no download);
FINETUNE_FLOWS_GPU_MODEL picks another source, e.g. builtin:smollm2-135m-instruct.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from finetune_flows.config.schema import load_config
from finetune_flows.runtime.environment import resolve_plan, run_probe
from finetune_flows.runtime.gpus import read_inventory, selection_for
from finetune_flows.runtime.launcher import worker_env

INVENTORY = read_inventory()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not INVENTORY, reason="needs an NVIDIA GPU (NVML finds none)")]
two_gpus = pytest.mark.skipif(len(INVENTORY) < 2, reason="needs 2 GPUs")
MODEL = os.environ.get("FINETUNE_FLOWS_GPU_MODEL", "generated:qwen3-0.6b")


def value_of(returned):
    """A step's `.fn` returns a `Cached` state, not the value, when the shared GPU cache already holds its output
    (another part of the tier, or an earlier tier run, made it)."""
    from prefect.states import State

    return returned.result() if isinstance(returned, State) else returned


def smi(query: str) -> list[list[str]]:
    out = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, check=True).stdout
    return [[c.strip() for c in line.split(",")] for line in out.strip().splitlines()]


@pytest.fixture(scope="module")
def gpu_setup(prefect_server, gpu_cache, tmp_path_factory):
    """Environment, plan, dataset and 4-bit base model on GPU 0, shared by the tests below."""
    from tasks.prepare_dataset import prepare_dataset
    from finetune_flows.models.sources import materialize_tokenizer
    from tasks.quantize_base_model import quantize_base_model

    work = tmp_path_factory.mktemp("gpu")
    cfg = load_config(None, [f"model.source={MODEL}", "data.builtin_examples=600", "data.max_length=128",
                             "train.max_steps=30", "train.save_steps=10", "train.logging_steps=5",
                             "train.per_device_batch_size=8", "train.learning_rate=1e-3", "eval.max_samples=32",
                             "eval.batch_size=32", f"run.cache_dir={gpu_cache}", "hardware.gpus=0"])
    env = run_probe(work, {}, gpu_cache)
    sel = selection_for("0", env.gpus)
    plan = resolve_plan(cfg, env, sel)
    data = value_of(prepare_dataset.fn(cfg, materialize_tokenizer(cfg.model.source, cfg.cache_root)))
    base = value_of(quantize_base_model.fn(cfg, plan, sel, work))
    return dict(cfg=cfg, env=env, plan=plan, data=data, base=base, work=work)


def test_environment_report_matches_nvidia_smi(gpu_setup):
    env = gpu_setup["env"]
    rows = smi("index,name,memory.total,compute_cap")
    assert env.cuda_available and env.driver_version
    assert len(env.gpus) == len(rows)
    for g, (index, name, total, cap) in zip(env.gpus, rows):
        assert (g.index, g.name, g.memory_total_mib) == (int(index), name, int(total))
        assert f"{g.capability[0]}.{g.capability[1]}" == cap
        assert g.supports_bf16 == (g.capability >= (8, 0))


def test_bf16_is_chosen_on_ampere_or_later(gpu_setup):
    plan, gpu = gpu_setup["plan"], gpu_setup["env"].gpus[0]
    expected = "bf16" if gpu.capability >= (8, 0) else "fp16"
    assert plan.precision == expected and plan.compute_dtype == {"bf16": "bfloat16", "fp16": "float16"}[expected]


def test_base_model_layers_are_bitsandbytes_4bit_on_cuda(gpu_setup):
    import bitsandbytes as bnb
    import torch
    from transformers import AutoModelForCausalLM

    base = gpu_setup["base"]
    assert base.load_in_4bit and base.linear4bit_layers > 0
    model = AutoModelForCausalLM.from_pretrained(base.path, device_map={"": 0}, dtype=torch.bfloat16)
    layers = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(layers) == base.linear4bit_layers
    assert all(m.weight.device.type == "cuda" and m.weight.dtype == torch.uint8 for m in layers)
    assert layers[0].weight.quant_state.quant_type == "nf4"
    del model
    torch.cuda.empty_cache()


def _train(gpu_setup, gpu_spec: str):
    from tasks.train_adapter import train_adapter

    cfg, env = gpu_setup["cfg"], gpu_setup["env"]
    cfg = cfg.model_copy(update={"hardware": cfg.hardware.model_copy(update={"gpus": gpu_spec})})
    sel = selection_for(gpu_spec, env.gpus)
    plan = resolve_plan(cfg, env, sel)
    result = value_of(train_adapter.fn(cfg, gpu_setup["data"], gpu_setup["base"], plan, sel, gpu_setup["work"]))
    return result, plan, sel


def test_training_on_one_gpu_lowers_the_loss(gpu_setup):
    result, plan, _ = _train(gpu_setup, "0")
    assert result.device == "cuda" and result.world_size == 1 and result.backend == "nccl"
    assert result.final_loss < result.first_loss * 0.7
    assert result.tokens_per_second > 0 and result.peak_memory_mb > 0
    gpu_setup["one_gpu"] = result


def test_adapter_evaluates_with_the_resolved_attention_backend(gpu_setup):
    from tasks.evaluate_adapter import evaluate_adapter

    one = gpu_setup.get("one_gpu") or _train(gpu_setup, "0")[0]
    plan = gpu_setup["plan"]
    report = value_of(evaluate_adapter.fn(gpu_setup["cfg"], gpu_setup["data"], gpu_setup["base"], one.adapter_path,
                                          plan, selection_for("0", gpu_setup["env"].gpus)))
    assert report.attn_implementation == plan.eval_attn and report.device == "cuda:0"
    assert report.adapter.loss < report.base.loss


@two_gpus
def test_two_gpus_run_two_nccl_ranks_in_step(gpu_setup):
    result, plan, _ = _train(gpu_setup, "0,1")
    assert plan.nproc == 2
    assert result.world_size == 2 and result.backend == "nccl"
    assert result.rank_steps == [30, 30]  # DDP: both ranks took every optimizer step
    assert len(result.devices) == 2 and all(d.startswith("NVIDIA") for d in result.devices)
    assert result.final_loss < result.first_loss
    print(f"\n2 GPUs: {result.tokens_per_second} tokens/s; 1 GPU: "
          f"{getattr(gpu_setup.get('one_gpu'), 'tokens_per_second', 'n/a')} tokens/s")


def _first_visible_uuid(env: dict[str, str]) -> str:
    code = "import torch; print(torch.cuda.get_device_properties(0).uuid)"
    return subprocess.run([sys.executable, "-c", code], env=worker_env(env), capture_output=True, text=True,
                          check=True).stdout.strip()


@two_gpus
def test_visible_device_order_follows_nvidia_smi_ids():
    uuids = {g.index: g.uuid.removeprefix("GPU-") for g in INVENTORY}
    assert _first_visible_uuid(selection_for("1,0", INVENTORY).env) == uuids[1]
    assert _first_visible_uuid(selection_for("0,1", INVENTORY).env) == uuids[0]


@two_gpus
def test_auto_1_picks_the_gpu_with_most_free_memory():
    hog = ("import torch, time; x = torch.empty(40 * 2**30, dtype=torch.uint8, device='cuda'); "
           "print('ok', flush=True); time.sleep(600)")
    for busy, expected in ((0, 1), (1, 0)):
        proc = subprocess.Popen([sys.executable, "-c", hog], env=worker_env(selection_for(str(busy), INVENTORY).env),
                                stdout=subprocess.PIPE, text=True)
        try:
            assert proc.stdout.readline().strip() == "ok"
            time.sleep(1)
            assert selection_for("auto:1", read_inventory()).ids == [expected]
        finally:
            proc.kill()
            proc.wait()
