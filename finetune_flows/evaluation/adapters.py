"""An existing adapter or merged checkpoint: checked before anything loads, and its evaluation-only run recorded
(`flows/evaluate.py`).

A fine-tune run leaves `runs/<run>/adapter/` (PEFT weights plus the tokenizer) and, with `export.merge`,
`runs/<run>/merged/` (a plain transformers checkpoint with its model card) beside the run's `config.resolved.yaml`;
an evaluation uses that config unless given another, so the held-out split is the one the adapter was trained
against. Which of the two a directory is, its files say: `adapter_config.json` makes it an adapter, `config.json`
and weights without one a merged checkpoint. A merged checkpoint's card names the adapter it was made from (front
matter `finetune_flows.adapter`); when that adapter is still there, it is evaluated beside the checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

import yaml

from pydantic import BaseModel

from finetune_flows.config.preflight import check_adapter_fits, check_merged_fits
from finetune_flows.config.schema import FinetuneConfig
from finetune_flows.errors import UserInputError
from finetune_flows.evaluation.evaluate import EvalReport
from finetune_flows.logs import run_logger
from finetune_flows.runtime.policy import check_adapter_path
from finetune_flows.reporting.plots import publish_plots
from finetune_flows.models.quantize import QuantizedModel
from finetune_flows.store.runs import create_run_dir, run_label
from finetune_flows.files import write_atomic

ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")
TRAINING_CONFIG = "config.resolved.yaml"


class AdapterError(UserInputError):
    """The directory is missing or holds neither a PEFT adapter nor a merged checkpoint this pipeline can evaluate."""


class Evaluated(BaseModel):
    """What `flows/evaluate.py` was given, told apart by its files."""

    kind: Literal["adapter", "merged"]
    path: Path


class EvaluationResult(BaseModel):
    run_dir: Path
    adapter_path: Path | None  # the adapter evaluated (for a merged checkpoint: the one its card names, if evaluated)
    merged_path: Path | None = None  # the merged checkpoint evaluated
    eval: EvalReport


def check_safetensors(path: Path) -> None:
    """A .safetensors file whose header parses and whose tensors end where the file ends (an interrupted copy is
    shorter): read from the header alone, nothing loaded; AdapterError naming the file otherwise."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            length = int.from_bytes(f.read(8), "little")
            if not 0 < length <= size - 8:
                raise ValueError("header length")
            header = json.loads(f.read(length))
        end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
        if 8 + length + end != size:
            raise ValueError("size")
    except (ValueError, KeyError, TypeError, AttributeError, IndexError):
        raise AdapterError(f"{path}: truncated or not a safetensors file ({size:,} bytes); copy it again from the "
                           "run that made it") from None


def check_adapter_dir(adapter: str | Path) -> Path:
    """The adapter directory, resolved; raise AdapterError naming what is missing (nothing is loaded)."""
    path = Path(adapter).expanduser()
    hint = "give the `adapter/` directory of a fine-tune run, e.g. runs/<run>/adapter"
    if path.is_file():
        raise AdapterError(f"{path} is a file, not an adapter directory ({hint})")
    if not path.is_dir():
        raise AdapterError(f"adapter directory not found: {path} ({hint})")
    if not (path / "adapter_config.json").exists():
        if (path / "adapter").is_dir():
            raise AdapterError(f"{path} is a run directory, not an adapter: give its adapter, {path / 'adapter'}")
        if (path / "config.json").is_file():
            raise AdapterError(f"{path} is a model checkpoint (config.json, no adapter_config.json), not an adapter "
                               f"({hint})")
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
    for weights in path.glob("*.safetensors"):
        check_safetensors(weights)
    return path.resolve()


def check_merged_dir(path: Path) -> Path:
    """A merged (plain transformers) checkpoint, resolved; raise AdapterError naming what is missing."""
    hint = "give the `merged/` directory of a fine-tune or export run, e.g. runs/<run>/merged"
    missing = []
    if not any(path.glob("*.safetensors")) and not any(path.glob("pytorch_model*.bin")):
        missing.append("model weights (*.safetensors or pytorch_model*.bin)")
    if not (path / "tokenizer_config.json").is_file():
        missing.append("tokenizer_config.json (the evaluator reads the tokenizer saved with the checkpoint)")
    if missing:
        raise AdapterError(f"{path} is not a merged checkpoint: no {', no '.join(missing)} ({hint})")
    try:
        config = json.loads((path / "config.json").read_text())
    except ValueError as exc:
        raise AdapterError(f"{path / 'config.json'} is not valid JSON: {exc}") from None
    if isinstance(config, dict) and "quantization_config" in config:
        raise AdapterError(f"{path} is a quantized checkpoint (quantization_config in config.json), not a merged "
                           f"one ({hint})")
    for weights in path.glob("*.safetensors"):
        check_safetensors(weights)
    return path.resolve()


def check_evaluation_dir(target: str | Path) -> Evaluated:
    """An adapter directory or a merged checkpoint, checked (nothing is loaded); AdapterError naming the directory
    when it is neither."""
    path = Path(target).expanduser()
    hint = "give the `adapter/` or `merged/` directory of a fine-tune run, e.g. runs/<run>/adapter or runs/<run>/merged"
    if not path.exists():
        raise AdapterError(f"no such directory: {path} ({hint})")
    if path.is_file():  # `--merged runs/<run>/merged/model.safetensors`: not "an adapter directory"
        raise AdapterError(f"{path} is a file, not a directory ({hint})")
    if path.is_dir() and not (path / "adapter_config.json").exists():
        if (path / "config.json").is_file():
            return Evaluated(kind="merged", path=check_merged_dir(path))
        if (path / "adapter").is_dir():
            merged = f", or its merged checkpoint, {path / 'merged'}" if (path / "merged").is_dir() else ""
            raise AdapterError(f"{path} is a run directory: give its adapter, {path / 'adapter'}{merged}")
        raise AdapterError(f"{path} is neither a PEFT adapter (no adapter_config.json) nor a merged checkpoint (no "
                           f"config.json): {hint}")
    return Evaluated(kind="adapter", path=check_adapter_dir(path))


def named_adapter(merged_dir: Path, quiet: bool = False) -> Path | None:
    """The adapter a merged checkpoint was made from, as its model card names it, when that adapter is still there
    and the worker's policy lets this run read it; else None, with a log line saying why (none when quiet)."""
    card = merged_dir / "README.md"
    try:
        _, front, _ = card.read_text().split("---\n", 2)
        named = (yaml.safe_load(front) or {}).get("finetune_flows", {}).get("adapter")
    except (OSError, ValueError, AttributeError, yaml.YAMLError):
        named = None
    if not named:
        if quiet:
            return None
        run_logger().info("%s names no adapter (no finetune_flows.adapter in its front matter): base vs merged only",
                          card)
        return None
    try:
        check_adapter_path(named)  # read like the directory given: only where the policy allows
        return check_adapter_dir(named)
    except UserInputError as exc:
        if quiet:
            return None
        run_logger().warning("the model card names the adapter %s, which cannot be evaluated beside the merged "
                             "checkpoint: %s", named, str(exc).replace("\n", " "))
        return None


def training_config(evaluated: Path) -> Path:
    """The config the adapter (or merged checkpoint) was made with (`<run>/config.resolved.yaml`), when it is there."""
    found = evaluated.parent / TRAINING_CONFIG
    if not found.is_file():
        raise AdapterError(f"no config given, and {found} does not exist: pass the config the adapter was "
                           "trained with (--config / parameter `config`)")
    return found


SPLIT_KEYS = ("source", "eval_source", "hub_split", "hub_revision", "eval_fraction", "held_out_fold_digits",
              "max_samples", "builtin_examples", "seed")  # the data keys that decide which rows are held out


def split_changes(evaluated: Path, cfg: FinetuneConfig) -> list[str]:
    """The data keys deciding the held-out rows in which `cfg` differs from the config the adapter (or merged
    checkpoint) was made with, `data.KEY: before -> now`; none where that config is not there."""
    try:
        trained = yaml.safe_load((evaluated.parent / TRAINING_CONFIG).read_text())["data"]
    except (OSError, KeyError, TypeError, yaml.YAMLError):
        return []
    now = cfg.data.model_dump(mode="json")
    return [f"data.{key}: {trained.get(key)!r} -> {now.get(key)!r}" for key in SPLIT_KEYS
            if trained.get(key) != now.get(key)]


def check_fits(target: Evaluated, cfg: FinetuneConfig) -> None:
    """The adapter given, or the merged checkpoint and the adapter its card names (evaluated beside it), must fit
    the config's model: with another model's config the merged checkpoint was scored beside the wrong base, and the
    adapter then failed to load, after the model was quantized."""
    if target.kind == "adapter":
        check_adapter_fits(target.path, cfg)
        return
    if (adapter := named_adapter(target.path, quiet=True)) is not None:
        check_adapter_fits(adapter, cfg, f" (which {target.path / 'README.md'} names as the adapter the checkpoint "
                           "was merged from)")
    check_merged_fits(target.path, cfg)


def warn_if_other_split(evaluated: Path, cfg: FinetuneConfig) -> None:
    if changes := split_changes(evaluated, cfg):
        run_logger().warning("the held-out rows are not those of the run that made %s (%s, against its %s): rows it "
                             "was trained on may be scored as held out", evaluated, "; ".join(changes),
                             TRAINING_CONFIG)


def same_base(trained_on: Path, base: Path) -> bool:
    """The same path, or the same store entry (`quantized/<key>`, `models/<key>`: the key fingerprints the weights)
    in another cache root: a copied or moved cache, another host's."""
    return trained_on == base or (trained_on.name == base.name
                                  and trained_on.parent.name == base.parent.name in ("quantized", "models"))


def warn_if_other_base(adapter_dir: Path, base: QuantizedModel) -> None:
    trained_on = json.loads((adapter_dir / "adapter_config.json").read_text()).get("base_model_name_or_path")
    if trained_on and not same_base(Path(trained_on), Path(base.path)):
        run_logger().warning("the adapter was trained on %s, but this run's base model is %s: check that "
                             "model.source and quantization match the training run", trained_on, base.path)


def create_eval_run_dir(cfg: FinetuneConfig) -> Path:
    """`<output_dir>/<name>-eval-<time>-<id>`: evaluation-only runs are told apart from fine-tune runs."""
    return create_run_dir(cfg.model_copy(update={"run": cfg.run.model_copy(update={"name": f"{cfg.run.name}-eval"})}))


def finish_evaluation(run_dir: Path, evaluated: Evaluated, adapter_dir: Path | None,
                      report: EvalReport) -> EvaluationResult:
    """Write eval.json and evaluation.json into the run directory and publish where the evaluated model is."""
    # Prefect here, not at the top: the engine imports without it
    from prefect.artifacts import create_link_artifact, create_markdown_artifact

    write_atomic(run_dir / "eval.json", report.model_dump_json(indent=2))
    publish_plots(run_dir, None, report)  # <run>/plots/eval.png and the `eval-comparison` artifact
    result = EvaluationResult(run_dir=run_dir, adapter_path=adapter_dir, eval=report,
                              merged_path=evaluated.path if evaluated.kind == "merged" else None)
    write_atomic(run_dir / "evaluation.json", result.model_dump_json(indent=2))  # the run's "done" marker
    what = "LoRA adapter" if evaluated.kind == "adapter" else "merged checkpoint"
    create_link_artifact(evaluated.path.as_uri(), link_text=str(evaluated.path), key="adapter-location",
                         description=f"The evaluated {what}")
    create_markdown_artifact(render_evaluation(result), key="run-summary", description="Evaluation-only run summary")
    return result


def render_evaluation(r: EvaluationResult) -> str:
    rows = r.eval.table()
    table = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
    table += ["| " + " | ".join(str(v) for v in row.values()) + " |" for row in rows]
    beside = f"\n- beside the adapter it was made from: `{r.adapter_path}`" if r.merged_path and r.adapter_path else ""
    return (f"# Evaluation of {r.merged_path or r.adapter_path}\n\n" + "\n".join(table)
            + f"\n\n- {r.eval.eval_rows} held-out rows on {r.eval.device}{beside}\n- run directory: `{r.run_dir}`\n")


def eval_run_name() -> str:
    """`<run name>/<model> eval <run>`: the evaluation-only flow run's name in the Prefect UI."""
    from prefect.runtime import flow_run

    params = flow_run.parameters
    target = Path(str(params.get("adapter")))
    label = {"adapter": target.parent.name, "merged": f"{target.parent.name} merged"}.get(target.name, target.name)
    try:
        config = params.get("config") or yaml.safe_load(training_config(check_evaluation_dir(target).path).read_text())
        return f"{run_label(config)} eval {label}"
    except Exception:
        return f"eval {label}"
