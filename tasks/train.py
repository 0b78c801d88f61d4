"""Step 5: QLoRA training with peft and the transformers Trainer, launched as `torchrun --nproc_per_node=N`.

Each rank loads the 4-bit checkpoint onto its own device; DDP runs over NCCL on GPUs and gloo on the CPU. The
output directory is content-addressed (everything that determines the adapter), so a retry, or a rerun after a
crash, finds the last checkpoint there and resumes with its optimizer, scheduler and RNG state.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import task
from pydantic import BaseModel

from tasks.concurrency import produce_on_devices
from tasks.config import FinetuneConfig
from tasks.dataset import PreparedDataset
from tasks.environment import Plan
from tasks.errors import retry_unless_user_error
from tasks.fingerprint import code_version, combine
from tasks.gpus import GpuSelection
from tasks.launcher import run_logger, run_worker, torchrun_module, write_job
from tasks.quantize import QuantizedModel
from tasks.train_worker import last_checkpoint


class TrainResult(BaseModel):
    adapter_path: Path
    output_dir: Path
    fingerprint: str
    steps: int
    world_size: int
    device: str
    loss_curve: list[tuple[int, float]]  # (step, loss)
    first_loss: float
    final_loss: float
    tokens_per_second: float  # real (non-padding) tokens over all ranks / training wall time of this attempt
    train_tokens: int
    train_seconds: float
    peak_memory_mb: float  # max over ranks: CUDA max allocated, or process max RSS on CPU
    resumed_from_step: int | None
    backend: str | None = None  # torch.distributed backend (nccl on GPUs, gloo on the CPU)
    rank_steps: list[int] = []  # optimizer steps each rank finished (equal under DDP)
    devices: list[str] = []  # device name per rank

    def is_complete(self) -> bool:
        return (self.adapter_path / "adapter_config.json").is_file()


def train_fingerprint(cfg: FinetuneConfig, data: PreparedDataset, base: QuantizedModel, plan: Plan) -> str:
    return combine(data.fingerprint, base.fingerprint, cfg.lora.fingerprint(),
                   cfg.train.model_dump(mode="json", exclude={"retries", "retry_delay_seconds", "logging_steps"}),
                   plan.nproc, plan.device, plan.precision, plan.train_attn, code_version("train", "train_worker"))



class ProgressReporter:
    """Turns worker events into log lines and a live Prefect progress artifact (key `train-progress`)."""

    def __init__(self, max_steps: int):
        self.max_steps = max_steps
        self.artifact_id = None

    def __call__(self, event: dict[str, Any]) -> None:
        from prefect.artifacts import create_progress_artifact, update_progress_artifact

        logger = run_logger()
        if event["kind"] == "checkpoint":
            logger.info("checkpoint saved at step %s", event["step"])
            return
        if event["kind"] != "train_log":
            return
        total = event.get("max_steps") or self.max_steps
        percent = min(100.0, 100.0 * event["step"] / max(total, 1))
        logger.info("step %s/%s loss %.4f lr %s %.1f tokens/s", event["step"], total, event["loss"],
                    event.get("learning_rate"), event["tokens_per_second"])
        try:
            if self.artifact_id is None:
                self.artifact_id = create_progress_artifact(percent, key="train-progress",
                                                            description="QLoRA training progress (%)")
            else:
                update_progress_artifact(self.artifact_id, percent)
        except Exception as exc:  # outside a Prefect run there is nothing to update
            logger.debug("progress artifact not updated: %s", exc)


def _train_key(context, parameters) -> str:
    p = parameters
    return "adapter-" + train_fingerprint(p["cfg"], p["data"], p["base"], p["plan"])


@task(name="train-adapter", cache_key_fn=_train_key, persist_result=True, retry_condition_fn=retry_unless_user_error,
      task_run_name="train-adapter[{cfg.run.name}: {cfg.train.max_steps} steps]", tags=["training", "device"])
def train_adapter(cfg: FinetuneConfig, data: PreparedDataset, base: QuantizedModel, plan: Plan, gpus: GpuSelection,
                  run_dir: Path) -> TrainResult:
    """Launch torchrun with the selected GPUs; resume from the last checkpoint if an earlier attempt crashed."""
    fingerprint = train_fingerprint(cfg, data, base, plan)
    out = cfg.cache_root / "adapters" / fingerprint
    metrics = out / "train_metrics.json"

    def launch() -> None:
        out.mkdir(parents=True, exist_ok=True)
        resume = last_checkpoint(out / "checkpoints")
        if resume is not None:
            run_logger().warning("found %s from an interrupted attempt: resuming from it", resume)
        job = write_job(out, "train", config=cfg.model_dump(mode="json"), plan=plan.model_dump(), out=str(out),
                        base=str(base.path), data=str(data.path), load_in_4bit=base.load_in_4bit,
                        fingerprint=fingerprint)
        run_worker("train", torchrun_module("tasks.train_worker", job, plan.nproc), gpus.env, out,
                   on_event=ProgressReporter(cfg.train.max_steps))

    produce_on_devices(metrics, gpus.ids, launch)
    return TrainResult.model_validate_json(metrics.read_text())

