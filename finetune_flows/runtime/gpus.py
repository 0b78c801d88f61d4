"""Step 2: choose GPUs by nvidia-smi id and build the environment a worker subprocess gets.

The GPUs are read once per flow run (NVML, `read_inventory`, as the flow starts); the preflight's check of
`hardware.gpus`, the environment probe and the selection the workers run on are computed from that same reading. An
inherited CUDA_VISIBLE_DEVICES (a Prefect worker pinned to some GPUs) restricts what may be selected; ids stay
nvidia-smi ids. GPUs in MIG mode are refused by name: MIG instances cannot train together over NCCL, and a whole GPU
in MIG mode is not usable by CUDA. The orchestrating process never exports CUDA_VISIBLE_DEVICES; the selection is only
an env dict for children. Inside the workers, `hardware.memory_budget_gib` caps PyTorch's allocator on each GPU
(cap_process_memory).
"""

from __future__ import annotations

import os

from pydantic import BaseModel

from finetune_flows.errors import EnvironmentMismatch
from finetune_flows.logs import run_logger
from finetune_flows.training.planner import allocator_bytes


class GpuInfo(BaseModel):
    index: int  # nvidia-smi id (PCI bus order)
    name: str
    uuid: str = ""
    memory_total_mib: int
    memory_free_mib: int
    capability: tuple[int, int]
    visible: bool = True  # allowed by an inherited CUDA_VISIBLE_DEVICES
    mig: bool = False  # MIG mode is on: CUDA sees its instances, not the GPU

    @property
    def supports_bf16(self) -> bool:
        return self.capability >= (8, 0)

    @property
    def usable(self) -> bool:
        return self.visible and not self.mig


class GpuSelection(BaseModel):
    ids: list[int]  # in the order the workers see them: ids[0] becomes cuda:0
    gpus: list[GpuInfo]

    @property
    def device_type(self) -> str:
        return "cuda" if self.ids else "cpu"

    @property
    def env(self) -> dict[str, str]:
        # PCI_BUS_ID makes CUDA number devices as nvidia-smi does; an empty list hides every GPU (CPU run).
        return {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": ",".join(map(str, self.ids))}

    def planning_mib(self) -> int | None:
        """The free memory the planner plans from per GPU (finetune_flows/training/planner.py planning_bytes): the
        least among the selected GPUs; None on the CPU."""
        return min((g.memory_free_mib for g in self.gpus), default=None)

    def describe(self) -> str:
        if not self.ids:
            return "CPU (no GPU selected)"
        return ", ".join(f"GPU {g.index} {g.name} ({g.memory_free_mib} MiB free)" for g in self.gpus)


def visible_ids(spec: str | None, inventory: list[GpuInfo]) -> set[int] | None:
    """nvidia-smi ids an inherited CUDA_VISIBLE_DEVICES allows (None: no restriction).

    Entries are ids (read as nvidia-smi ids: set CUDA_DEVICE_ORDER=PCI_BUS_ID where it matters), GPU UUIDs or
    their unique prefixes (`GPU-8932f937`); as CUDA does, the list ends at the first entry that names no GPU.
    MIG instance UUIDs are refused."""
    if spec is None:
        return None
    allowed: set[int] = set()
    for entry in (e.strip() for e in spec.split(",")):
        if entry.startswith("MIG-"):
            raise EnvironmentMismatch([f"CUDA_VISIBLE_DEVICES={spec} names MIG instance {entry}: MIG instances are "
                                       "not supported (use whole GPUs, by nvidia-smi id or GPU UUID)"])
        if entry.isdigit():
            match = [g for g in inventory if g.index == int(entry)]
        else:
            match = [g for g in inventory if entry and g.uuid.startswith(entry)]
        if len(match) != 1:
            break
        allowed.add(match[0].index)
    return allowed


def restrict(inventory: list[GpuInfo], spec: str | None) -> list[GpuInfo]:
    allowed = visible_ids(spec, inventory)
    return [g.model_copy(update={"visible": allowed is None or g.index in allowed}) for g in inventory]


def _unusable(gpu: GpuInfo) -> str:
    if gpu.mig:
        return (f"GPU {gpu.index} ({gpu.name}) is in MIG mode, which is not supported: turn MIG off "
                f"(`nvidia-smi -i {gpu.index} -mig 0`) or select another GPU")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return (f"GPU {gpu.index} ({gpu.name}) is hidden from this process by CUDA_VISIBLE_DEVICES"
            + (f"={visible}" if visible is not None else ""))


def choose_gpu_ids(spec: str, inventory: list[GpuInfo]) -> list[int]:
    """Resolve `auto`, `auto:N`, `cpu`/`none` or `2,0` against an inventory; raise naming what is missing."""
    spec = spec.replace(" ", "")
    usable = [g for g in inventory if g.usable]
    available = sorted(g.index for g in usable)
    if spec in ("cpu", "none"):
        return []
    held_back = [_unusable(g) for g in inventory if not g.usable]
    if spec == "auto":
        if inventory and not usable and any(g.mig for g in inventory):
            raise EnvironmentMismatch([f"hardware.gpus=auto: no usable GPU; {'; '.join(held_back)}"])
        return available
    if spec.startswith("auto:"):
        n = int(spec.split(":", 1)[1])
        if n > len(usable):
            raise EnvironmentMismatch(
                [f"hardware.gpus={spec} asks for {n} GPU(s) but this machine has {len(usable)}"
                 + (f" usable (ids {available})" if available else "") + "".join(f"; {h}" for h in held_back)]
            )
        by_free = sorted(usable, key=lambda g: (-g.memory_free_mib, g.index))
        return [g.index for g in by_free[:n]]
    ids = [int(x) for x in spec.split(",")]
    by_id = {g.index: g for g in inventory}
    problems = [_unusable(by_id[i]) for i in ids if i in by_id and not by_id[i].usable]
    missing = [i for i in ids if i not in by_id]
    if missing:
        problems.insert(0, f"hardware.gpus={spec}: no GPU with id {', '.join(map(str, missing))}; this machine has "
                        + (f"ids {sorted(by_id)}" if by_id else "no GPUs"))
    if problems:
        raise EnvironmentMismatch(problems)
    return ids


def selection_for(spec: str, inventory: list[GpuInfo]) -> GpuSelection:
    ids = choose_gpu_ids(spec, inventory)
    by_id = {g.index: g for g in inventory}
    return GpuSelection(ids=ids, gpus=[by_id[i] for i in ids])


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def read_inventory() -> list[GpuInfo]:
    """The GPUs NVML reports, with free memory, MIG mode, and what this process's CUDA_VISIBLE_DEVICES allows;
    empty where there is no NVIDIA driver. Cheap (no torch, no CUDA context)."""
    try:
        import pynvml
    except ImportError:
        return []
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return []
    try:
        gpus = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            try:
                mig = pynvml.nvmlDeviceGetMigMode(h)[0] == pynvml.NVML_DEVICE_MIG_ENABLE
            except pynvml.NVMLError:  # not MIG-capable
                mig = False
            gpus.append(GpuInfo(
                index=i, name=_text(pynvml.nvmlDeviceGetName(h)), uuid=_text(pynvml.nvmlDeviceGetUUID(h)),
                memory_total_mib=mem.total // 2**20, memory_free_mib=mem.free // 2**20,
                capability=tuple(pynvml.nvmlDeviceGetCudaComputeCapability(h)), mig=mig,
            ))
    finally:
        pynvml.nvmlShutdown()
    return restrict(gpus, os.environ.get("CUDA_VISIBLE_DEVICES"))


# ---------------------------------------------------------------- inside the workers

_CAPS: dict[int, int] = {}  # CUDA device index -> bytes PyTorch's allocator may hold there (cap_process_memory)


def cap_process_memory(budget_gib: float | None, device: int) -> float | None:
    """Cap PyTorch's allocator on CUDA device `device` at its share of `hardware.memory_budget_gib`, so that an
    allocation past it raises an out-of-memory error as on a GPU that small. Returns the fraction of the device set
    (None: no cap)."""
    import torch

    if budget_gib is None:
        return None
    total = torch.cuda.get_device_properties(device).total_memory
    # the allocator's share of the budget (the CUDA context takes the rest); the orchestrator refuses a budget over
    # the GPU's memory
    fraction = min(1.0, allocator_bytes(budget_gib) / total)
    torch.cuda.set_per_process_memory_fraction(fraction, device)
    _CAPS[device] = int(fraction * total)
    return fraction


def free_bytes(device: int) -> int:
    """What this process may still allocate on CUDA device `device`: the device's free memory, and under a cap
    (cap_process_memory) no more than the cap less what the allocator already holds there."""
    import torch

    free = torch.cuda.mem_get_info(device)[0]
    cap = _CAPS.get(device)
    return free if cap is None else max(0, min(free, cap - torch.cuda.memory_reserved(device)))


def select_gpus(spec: str, inventory: list[GpuInfo]) -> GpuSelection:
    """Pick GPUs from the environment probe's reading (the one `hardware.gpus` was checked against) and log it."""
    selection = selection_for(spec, inventory)
    run_logger().info("selected %s; workers get %s", selection.describe(), selection.env)
    return selection
