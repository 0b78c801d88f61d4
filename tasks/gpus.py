"""Step 2: choose GPUs by nvidia-smi id and build the environment a worker subprocess gets.

The orchestrating process never exports CUDA_VISIBLE_DEVICES; the selection is only an env dict for children.
"""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE
from pydantic import BaseModel

from tasks.errors import EnvironmentMismatch


class GpuInfo(BaseModel):
    index: int  # nvidia-smi id (PCI bus order)
    name: str
    uuid: str = ""
    memory_total_mib: int
    memory_free_mib: int
    capability: tuple[int, int]

    @property
    def supports_bf16(self) -> bool:
        return self.capability >= (8, 0)


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

    def describe(self) -> str:
        if not self.ids:
            return "CPU (no GPU selected)"
        return ", ".join(f"GPU {g.index} {g.name} ({g.memory_free_mib} MiB free)" for g in self.gpus)


def choose_gpu_ids(spec: str, inventory: list[GpuInfo]) -> list[int]:
    """Resolve `auto`, `auto:N`, `cpu`/`none` or `2,0` against an inventory; raise naming what is missing."""
    spec = spec.replace(" ", "")
    available = sorted(g.index for g in inventory)
    if spec in ("cpu", "none"):
        return []
    if spec == "auto":
        return available
    if spec.startswith("auto:"):
        n = int(spec.split(":", 1)[1])
        if n > len(inventory):
            raise EnvironmentMismatch(
                [f"hardware.gpus={spec} asks for {n} GPU(s) but this machine has {len(inventory)}"
                 + (f" (ids {available})" if available else "")]
            )
        by_free = sorted(inventory, key=lambda g: (-g.memory_free_mib, g.index))
        return [g.index for g in by_free[:n]]
    ids = [int(x) for x in spec.split(",")]
    missing = [i for i in ids if i not in available]
    if missing:
        raise EnvironmentMismatch(
            [f"hardware.gpus={spec}: no GPU with id {', '.join(map(str, missing))}; this machine has "
             + (f"ids {available}" if available else "no GPUs")]
        )
    return ids


def selection_for(spec: str, inventory: list[GpuInfo]) -> GpuSelection:
    ids = choose_gpu_ids(spec, inventory)
    by_id = {g.index: g for g in inventory}
    return GpuSelection(ids=ids, gpus=[by_id[i] for i in ids])


def read_inventory() -> list[GpuInfo]:
    """The GPUs NVML reports, with free memory; empty where there is no NVIDIA driver."""
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
            name = pynvml.nvmlDeviceGetName(h)
            uuid = pynvml.nvmlDeviceGetUUID(h)
            gpus.append(GpuInfo(
                index=i, name=name.decode() if isinstance(name, bytes) else name,
                uuid=uuid.decode() if isinstance(uuid, bytes) else uuid,
                memory_total_mib=mem.total // 2**20, memory_free_mib=mem.free // 2**20,
                capability=tuple(pynvml.nvmlDeviceGetCudaComputeCapability(h)),
            ))
        return gpus
    finally:
        pynvml.nvmlShutdown()


@task(name="select-gpus", task_run_name="select-gpus[{spec}]", tags=["setup"], persist_result=False,
      cache_policy=NO_CACHE)  # no result store: nothing pickled is ever read back
def select_gpus(spec: str, inventory: list[GpuInfo]) -> GpuSelection:
    """Pick GPUs (fresh free-memory readings for `auto:N`) and log the choice."""
    from tasks.launcher import run_logger

    live = read_inventory() or inventory
    selection = selection_for(spec, live)
    run_logger().info("selected %s; workers get %s", selection.describe(), selection.env)
    return selection
