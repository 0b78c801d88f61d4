"""GPU selection and the config-vs-environment check, on injected GPU inventories (no GPU on this machine)."""

import os

import pytest

from finetune_flows.config.schema import load_config
from finetune_flows.runtime.environment import EnvironmentReport, report_markdown, resolve_plan
from finetune_flows.errors import EnvironmentMismatch
from finetune_flows.runtime.gpus import GpuInfo, choose_gpu_ids, restrict, selection_for, visible_ids
from tasks.select_gpus import select_gpus
from finetune_flows.runtime.launcher import worker_env


def gpu(i, free, name="NVIDIA H200", cc=(9, 0), total=143771):
    return GpuInfo(index=i, name=name, memory_total_mib=total, memory_free_mib=free, capability=cc)


FOUR = [gpu(0, 1000), gpu(1, 90000), gpu(2, 50000), gpu(3, 90000)]


def report(gpus, fa4=False, fa2=False, bnb="available"):
    attention = {"eager": "available", "sdpa": "available",
                 "flash_attention_2": "available" if fa2 else "flash-attn 2 not installed",
                 "flash_attention_3": "flash-attn-3 not installed",
                 "flash_attention_4": "available" if fa4 else "flash-attn-4 not installed",
                 "hub_kernels": "kernels not installed"}
    return EnvironmentReport(python="3.11", platform="linux", torch="2.13", cuda_available=bool(gpus),
                             cuda_version="13.0" if gpus else None, driver_version=None, gpus=gpus, versions={},
                             attention=attention, bitsandbytes_4bit=bnb, hub_reachable=False)


def test_explicit_ids_keep_their_order_and_become_the_child_env():
    sel = selection_for("2,0", FOUR)
    assert sel.ids == [2, 0]
    assert [g.index for g in sel.gpus] == [2, 0]
    assert sel.env == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "2,0"}


def test_auto_n_picks_most_free_memory_ties_by_id():
    assert choose_gpu_ids("auto:1", FOUR) == [1]
    assert choose_gpu_ids("auto:3", FOUR) == [1, 3, 2]


def test_auto_uses_all_gpus_or_the_cpu():
    assert choose_gpu_ids("auto", FOUR) == [0, 1, 2, 3]
    sel = selection_for("auto", [])
    assert sel.ids == [] and sel.device_type == "cpu"
    assert sel.env["CUDA_VISIBLE_DEVICES"] == ""  # hides every GPU from a CPU run's children


def test_cpu_spec_ignores_gpus():
    assert choose_gpu_ids("cpu", FOUR) == []


def test_too_many_or_missing_gpus_are_named():
    with pytest.raises(EnvironmentMismatch, match=r"auto:5 asks for 5 GPU\(s\) but this machine has 4"):
        choose_gpu_ids("auto:5", FOUR)
    with pytest.raises(EnvironmentMismatch, match="no GPU with id 7, 9"):
        choose_gpu_ids("1,7,9", FOUR)
    with pytest.raises(EnvironmentMismatch, match="no GPUs"):
        choose_gpu_ids("0", [])


def test_worker_env_never_touches_our_own_environment():
    before = dict(os.environ)
    env = worker_env(selection_for("1,0", FOUR).env)
    assert env["CUDA_VISIBLE_DEVICES"] == "1,0"
    assert env["FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED"] == "1"  # FA4 compiles once per host, not per worker
    assert dict(os.environ) == before


def plan_for(overrides, gpus, **kw):
    cfg = load_config(None, overrides)
    return resolve_plan(cfg, report(gpus, **kw), selection_for(cfg.hardware.gpus, gpus))


def test_precision_auto_follows_the_gpu():
    assert plan_for(["hardware.gpus=0"], [gpu(0, 1, cc=(8, 0), name="A100")]).precision == "bf16"
    t4 = plan_for(["hardware.gpus=0"], [gpu(0, 1, cc=(7, 5), name="Tesla T4")])
    assert (t4.precision, t4.compute_dtype) == ("fp16", "float16")
    cpu = plan_for(["hardware.gpus=cpu"], [])
    assert (cpu.device, cpu.precision, cpu.compute_dtype, cpu.nproc) == ("cpu", "fp32", "float32", 1)


def test_mixed_gpus_use_the_weakest():
    mixed = [gpu(0, 1, cc=(9, 0)), gpu(1, 1, cc=(7, 5), name="Tesla T4")]
    assert plan_for(["hardware.gpus=0,1"], mixed).precision == "fp16"


def test_attention_auto_assumes_nothing_without_a_measurement():
    # What `auto` picks from measurements is tested in tests/test_backends.py.
    plan = plan_for(["hardware.gpus=auto:1"], [gpu(0, 1)], fa4=True, fa2=True)
    assert plan.eval_attn == plan.train_attn == "sdpa"
    assert plan_for(["hardware.gpus=cpu"], [], fa4=True).eval_attn == "sdpa"


def test_every_mismatch_is_reported_together():
    t4 = [gpu(0, 1, cc=(7, 5), name="Tesla T4")]
    with pytest.raises(EnvironmentMismatch) as info:
        plan_for(["hardware.gpus=0", "train.precision=bf16", "hardware.attn_implementation=flash_attention_4"], t4,
                 bnb="bitsandbytes cannot be imported: no module")
    text = str(info.value)
    assert "GPU 0 (Tesla T4, compute capability 7.5) has no bf16" in text
    assert "flash_attention_4 cannot run here" in text
    assert "needs bitsandbytes" in text
    assert len(info.value.problems) == 3


def test_flash_attention_on_cpu_and_fp16_on_cpu_are_refused():
    with pytest.raises(EnvironmentMismatch) as info:
        plan_for(["hardware.gpus=cpu", "hardware.attn_implementation=flash_attention_2", "train.precision=fp16"], [])
    assert "flash_attention_2 cannot run here" in str(info.value) and "fp16 needs a GPU" in str(info.value)


def test_cpu_processes_set_the_rank_count_only_on_cpu():
    assert plan_for(["hardware.gpus=cpu", "hardware.cpu_processes=2"], []).nproc == 2
    assert plan_for(["hardware.gpus=0,1", "hardware.cpu_processes=4"], FOUR).nproc == 2


def uuid_gpu(i, free, **kw):
    return gpu(i, free).model_copy(update={"uuid": f"GPU-{i}{i}{i}a1b2-0000-1111-2222-33334444555{i}", **kw})


UUIDS = [uuid_gpu(i, free) for i, free in enumerate((1000, 90000, 50000, 90000))]


def test_inherited_cuda_visible_devices_restricts_the_selection_to_nvidia_smi_ids():
    pinned = restrict(UUIDS, "1,3")
    assert choose_gpu_ids("auto", pinned) == [1, 3]
    assert choose_gpu_ids("auto:1", restrict(UUIDS, "2,0")) == [2]  # most free memory among the visible ones
    with pytest.raises(EnvironmentMismatch, match="GPU 0 .* is hidden from this process by CUDA_VISIBLE_DEVICES"):
        choose_gpu_ids("0,1", pinned)
    with pytest.raises(EnvironmentMismatch, match=r"auto:3 asks for 3 GPU\(s\) but this machine has 2 usable"):
        choose_gpu_ids("auto:3", pinned)


def test_visible_devices_by_uuid_or_prefix_and_cuda_stops_at_the_first_unknown_entry():
    assert visible_ids(f"{UUIDS[2].uuid},GPU-111", UUIDS) == {2, 1}
    assert visible_ids("3,7,1", UUIDS) == {3}  # CUDA ignores everything after an entry that names no GPU
    assert visible_ids("", UUIDS) == set()  # every GPU hidden: a CPU run
    assert choose_gpu_ids("auto", restrict(UUIDS, "")) == []
    assert visible_ids(None, UUIDS) is None


def test_mig_devices_are_refused_by_name():
    mig = [UUIDS[0], UUIDS[1].model_copy(update={"mig": True})]
    assert choose_gpu_ids("auto", mig) == [0]
    with pytest.raises(EnvironmentMismatch, match=r"GPU 1 .* is in MIG mode.*nvidia-smi -i 1 -mig 0"):
        choose_gpu_ids("1", mig)
    with pytest.raises(EnvironmentMismatch, match="no usable GPU.*MIG mode"):
        choose_gpu_ids("auto", [mig[1]])
    with pytest.raises(EnvironmentMismatch, match="names MIG instance MIG-"):
        visible_ids("MIG-4b2f2d4c-7f6a-5d2e-9d6a-0123456789ab", UUIDS)


def test_select_gpus_uses_the_probes_reading_and_never_reads_nvml_again(monkeypatch):
    import finetune_flows.runtime.gpus

    # the inventory changed since the probe (another job took GPU 1's memory): the plan still stands
    monkeypatch.setattr(finetune_flows.runtime.gpus, "read_inventory",
                        lambda: [gpu(0, 99999), gpu(1, 10), gpu(2, 50000)])
    assert select_gpus.fn("auto:1", FOUR).ids == [1] and plan_for(["hardware.gpus=auto:1"], FOUR).nproc == 1


def test_the_environment_report_marks_what_may_not_be_selected():
    env = report([UUIDS[0], UUIDS[1].model_copy(update={"mig": True}), UUIDS[2].model_copy(update={"visible": False})])
    env.visible_devices = "0,1"
    md = report_markdown(env)
    assert "CUDA_VISIBLE_DEVICES=0,1 (inherited)" in md
    assert "| yes |" in md and "| no: MIG mode |" in md and "| no: not in CUDA_VISIBLE_DEVICES |" in md


# ---------------------------------------------------------------- hardware.memory_budget_gib


def budget_plan(source: str, budget: float, host=None, spec: str = "0", extra=()):
    host = host or [gpu(0, 140000)]
    cfg = load_config(None, [f"hardware.gpus={spec}", f"model.source=generated:{source}", "train.liger_kernel=false",
                             f"hardware.memory_budget_gib={budget}", *extra])
    return resolve_plan(cfg, report(host), selection_for(spec, host))


def test_a_budget_too_small_for_the_model_is_refused_with_the_numbers_before_anything_loads():
    """resolve_plan runs in verify-environment, the flow's first step: from the model's config, nothing loaded."""
    with pytest.raises(EnvironmentMismatch) as err:
        budget_plan("qwen3-8b", 8)
    assert len(err.value.problems) == 1
    assert err.value.problems[0] == (
        "hardware.memory_budget_gib=8 is too small for generated:qwen3-8b: training it needs at least 8.7 GiB per GPU "
        "(5.6 GiB for the base weights (linear layers in 4 bits), 0.7 GiB for the LoRA adapter with its gradients "
        "and optimizer state, 0.9 GiB for one 512-token row (data.max_length) with activation checkpointing, 1.5 GiB "
        "for the allocator's slack and workspaces), beside 1.5 GiB outside the allocator (the CUDA context): set at "
        "least 10.2, or null for the whole GPU")
    budget_plan("qwen3-8b", 10.2)  # what the message asks for is enough
    with pytest.raises(EnvironmentMismatch, match="set at least 10.2"):
        budget_plan("qwen3-8b", 10.1)
    budget_plan("qwen3-8b", 24)
    budget_plan("qwen3-0.6b", 12)
    with pytest.raises(EnvironmentMismatch, match=r"one 8192-token row \(data.max_length\)"):
        budget_plan("qwen3-0.6b", 12, extra=["data.max_length=8192"])  # its logits alone: 11.6 GiB unfused
    with pytest.raises(EnvironmentMismatch, match="set at least"):
        budget_plan("qwen3-0.6b", 3)


def test_a_budget_beyond_a_selected_gpu_is_refused_and_the_cpu_ignores_it():
    host = [gpu(0, 140000), gpu(1, 80000, name="NVIDIA H100 80GB HBM3", total=81559)]
    with pytest.raises(EnvironmentMismatch) as err:
        budget_plan("qwen3-0.6b", 100, host, "0,1")
    assert err.value.problems == ["hardware.memory_budget_gib=100 is more than GPU 1 (NVIDIA H100 80GB HBM3) has: "
                                  "79.6 GiB; set at most that, or null for the whole GPU"]
    assert budget_plan("qwen3-0.6b", 100, host, "0").device == "cuda"
    cpu = resolve_plan(load_config(None, ["hardware.gpus=cpu", "hardware.memory_budget_gib=1"]), report([]),
                       selection_for("cpu", []))
    assert cpu.device == "cpu"
    with pytest.raises(Exception, match="memory_budget_gib"):
        load_config(None, ["hardware.memory_budget_gib=0"])


def test_strategy_auto_shards_a_model_that_fits_the_gpus_but_not_the_budget():
    host = [gpu(0, 140000), gpu(1, 140000)]
    auto = ["hardware.strategy=auto"]
    assert budget_plan("qwen3-8b", 100, host, "0,1", auto).strategy == "ddp"
    assert budget_plan("qwen3-8b", 12, host, "0,1", auto).strategy == "ddp"  # 8.7 GiB whole <= 12 - 1.5
    sharded = budget_plan("qwen3-8b", 9, host, "0,1", auto)  # 8.7 GiB whole > 9 - 1.5; half of it fits
    assert sharded.strategy == "fsdp" and "budget 7.5 GiB" in sharded.strategy_choice


def test_the_workers_cap_each_gpu_at_the_budget(monkeypatch):
    """set_per_process_memory_fraction((budget - 1.5 GiB outside the allocator) / total) on the training rank's GPU
    and on every GPU evaluation may spread over, and the evaluation's sizing sees the cap (CUDA mocked: no GPU
    here)."""
    from types import SimpleNamespace

    import torch

    import finetune_flows.runtime.gpus
    from finetune_flows.config.plan import Plan
    from finetune_flows.evaluation.worker import eval_device
    from finetune_flows.training.worker import use_device

    total = 143771 * 2**20
    calls = []
    monkeypatch.setattr(finetune_flows.runtime.gpus, "_CAPS", {})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: calls.append(("device", i)))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(total_memory=total))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, i: calls.append(("cap", f, i)))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda i: (130 * 2**30, total))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda i: 4 * 2**30)
    plan = Plan(device="cuda", nproc=2, precision="bf16", compute_dtype="bfloat16",
                train_attn="sdpa", eval_attn="sdpa")
    tf32 = torch.backends.cuda.matmul.allow_tf32
    try:
        assert use_device(plan, None, 1) and calls == [("device", 1)]  # no budget: no cap
        calls.clear()
        assert use_device(plan, 24, 1)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    cap = 22.5 * 2**30 / total
    assert calls == [("device", 1), ("cap", cap, 1)]
    assert isinstance(calls[1][1], float)  # torch refuses anything else
    calls.clear()
    assert eval_device(plan, 24) == torch.device("cuda:0")
    assert calls == [("cap", cap, 0), ("cap", cap, 1)]
    # the cap less what the allocator holds, not the device's 130 GiB
    assert finetune_flows.runtime.gpus.free_bytes(0) == 18.5 * 2**30
    assert eval_device(plan.model_copy(update={"device": "cpu"}), 24) == torch.device("cpu")


def test_the_exports_check_fits_within_the_budget_as_on_a_gpu_that_small(monkeypatch):
    """The export's check loads the merged model on the GPU in the compute dtype: under hardware.memory_budget_gib it
    must fit in the budget's allocator share, not in the device's free memory, else the step is skipped (or refused)
    naming the budget (CUDA mocked: no GPU here)."""
    from types import SimpleNamespace

    import torch

    import finetune_flows.runtime.gpus
    from finetune_flows.export.merge import memory_shortfalls

    total = 143771 * 2**20
    monkeypatch.setattr(finetune_flows.runtime.gpus, "_CAPS", {})
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(total_memory=total))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, i: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda i: (130 * 2**30, total))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda i: 0)  # the check comes before anything loads
    qwen3_8b, qwen3_14b, host = 8_190_735_360, 14_768_307_200, 120 * 2**30
    assert memory_shortfalls(qwen3_14b, 2, 2, host, "NVIDIA H200", None) == []  # 34.4 GiB of 130 free
    finetune_flows.runtime.gpus.cap_process_memory(24, 0)
    assert memory_shortfalls(qwen3_8b, 2, 2, host, "NVIDIA H200", 24) == []  # 19.1 GiB of the cap's 22.5
    assert memory_shortfalls(qwen3_14b, 2, 2, host, "NVIDIA H200", 24) == [
        "NVIDIA H200 within hardware.memory_budget_gib=24: needs 34.4 GiB, 22.5 GiB free"]
    assert memory_shortfalls(qwen3_14b, 2, 2, 40 * 2**30, None, None) == ["host memory: needs 68.8 GiB, 40.0 GiB free"]


def test_a_run_whose_merge_will_not_fit_its_budget_hears_it_before_training():
    """From the model's shape, before anything loads: the Qwen3-8B shape's check (19.1 GiB in bf16) fits 24 GiB,
    not 16; nothing is said without a budget, on the CPU, or with export.merge off."""
    from finetune_flows.config.plan import Plan
    from finetune_flows.config.schema import FinetuneConfig
    from finetune_flows.export.merge import budget_skips_merge

    gpu = Plan(device="cuda", nproc=1, precision="bf16", compute_dtype="bfloat16", train_attn="sdpa",
               eval_attn="sdpa")

    def config(budget, merge=True):
        return FinetuneConfig.model_validate({"model": {"source": "generated:qwen3-8b"}, "export": {"merge": merge},
                                              "hardware": {"memory_budget_gib": budget}})

    assert budget_skips_merge(config(24), gpu) is None
    assert budget_skips_merge(config(16), gpu) == (
        "export.merge: checking the merged model needs about 19.1 GiB of GPU memory, more than "
        "hardware.memory_budget_gib=16 leaves the allocator (14.5 GiB), so this run will skip the merge; set "
        "export.merge=false to leave it out, or merge later with flows/export.py and a larger budget")
    assert budget_skips_merge(config(None), gpu) is None
    assert budget_skips_merge(config(16, merge=False), gpu) is None
    assert budget_skips_merge(config(16), gpu.model_copy(update={"device": "cpu"})) is None
