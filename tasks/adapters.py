"""An existing adapter: checked before anything loads, and its evaluation-only run recorded (`flows/evaluate.py`).

A fine-tune run leaves `runs/<run>/adapter/` (PEFT weights plus the tokenizer) beside the run's
`config.resolved.yaml`; an evaluation of the adapter uses that config unless given another, so the held-out
split is the one the adapter was trained against.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from prefect.artifacts import create_link_artifact, create_markdown_artifact
from pydantic import BaseModel

from tasks.config import FinetuneConfig, load_config
from tasks.errors import UserInputError
from tasks.evaluate import EvalReport
from tasks.launcher import run_logger
from tasks.plots import publish_plots
from tasks.quantize import QuantizedModel
from tasks.runs import create_run_dir
from tasks.store import write_atomic

ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")
TRAINING_CONFIG = "config.resolved.yaml"


class AdapterError(UserInputError):
    """The adapter directory is missing or does not hold a PEFT adapter this pipeline can evaluate."""


class EvaluationResult(BaseModel):
    run_dir: Path
    adapter_path: Path
    eval: EvalReport


def check_adapter_dir(adapter: str | Path) -> Path:
    """The adapter directory, resolved; raise AdapterError naming what is missing (nothing is loaded)."""
    path = Path(adapter).expanduser()
    hint = "give the `adapter/` directory of a fine-tune run, e.g. runs/<run>/adapter"
    if not path.is_dir():
        raise AdapterError(f"adapter directory not found: {path} ({hint})")
    missing = []
    if not (path / "adapter_config.json").is_file():
        missing.append("adapter_config.json")
    if not any((path / name).is_file() for name in ADAPTER_WEIGHTS):
        missing.append(" or ".join(ADAPTER_WEIGHTS))
    if not (path / "tokenizer_config.json").is_file():
        missing.append("tokenizer_config.json (the evaluator reads the tokenizer saved with the adapter)")
    if missing:
        raise AdapterError(f"{path} is not a PEFT adapter directory: no {', no '.join(missing)} ({hint})")
    try:
        json.loads((path / "adapter_config.json").read_text())
    except ValueError as exc:
        raise AdapterError(f"{path / 'adapter_config.json'} is not valid JSON: {exc}") from None
    return path.resolve()


def training_config(adapter_dir: Path) -> Path:
    """The config the adapter was trained with (`<run>/config.resolved.yaml`), when it is there."""
    found = adapter_dir.parent / TRAINING_CONFIG
    if not found.is_file():
        raise AdapterError(f"no config given, and {found} does not exist: pass the config the adapter was "
                           "trained with (--config / parameter `config`)")
    return found


def warn_if_other_base(adapter_dir: Path, base: QuantizedModel) -> None:
    trained_on = json.loads((adapter_dir / "adapter_config.json").read_text()).get("base_model_name_or_path")
    if trained_on and Path(trained_on) != Path(base.path):
        run_logger().warning("the adapter was trained on %s, but this run's base model is %s: check that "
                             "model.source and quantization match the training run", trained_on, base.path)


def create_eval_run_dir(cfg: FinetuneConfig) -> Path:
    """`<output_dir>/<name>-eval-<time>-<id>`: evaluation-only runs are told apart from fine-tune runs."""
    return create_run_dir(cfg.model_copy(update={"run": cfg.run.model_copy(update={"name": f"{cfg.run.name}-eval"})}))


def finish_evaluation(run_dir: Path, adapter_dir: Path, report: EvalReport) -> EvaluationResult:
    """Write eval.json and evaluation.json into the run directory and publish where the adapter is."""
    shutil.copy(report.path, run_dir / "eval.json")
    publish_plots(run_dir, None, report)  # <run>/plots/eval.png and the `eval-comparison` artifact
    result = EvaluationResult(run_dir=run_dir, adapter_path=adapter_dir, eval=report)
    write_atomic(run_dir / "evaluation.json", result.model_dump_json(indent=2))  # the run's "done" marker
    create_link_artifact(adapter_dir.as_uri(), link_text=str(adapter_dir), key="adapter-location",
                         description="The evaluated LoRA adapter")
    create_markdown_artifact(render_evaluation(result), key="run-summary", description="Evaluation-only run summary")
    return result


def render_evaluation(r: EvaluationResult) -> str:
    rows = r.eval.table()
    table = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
    table += ["| " + " | ".join(str(v) for v in row.values()) + " |" for row in rows]
    return (f"# Evaluation of {r.adapter_path}\n\n" + "\n".join(table)
            + f"\n\n- {r.eval.eval_rows} held-out rows on {r.eval.device}\n- run directory: `{r.run_dir}`\n")


def eval_run_name() -> str:
    """`<run name>/<model> eval <adapter's run>`: the evaluation-only flow run's name in the Prefect UI."""
    from prefect.runtime import flow_run

    params = flow_run.parameters
    adapter = Path(str(params.get("adapter")))
    label = adapter.parent.name if adapter.name == "adapter" else adapter.name
    try:
        config = params.get("config") or training_config(check_adapter_dir(adapter))
        cfg = load_config(config, params.get("overrides"))
    except Exception:
        return f"eval {label}"
    return f"{cfg.run.name}/{cfg.model.source.split(':')[-1].split('/')[-1]} eval {label}"
