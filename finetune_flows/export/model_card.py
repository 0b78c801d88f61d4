"""The merged checkpoint in the run directory, with a model card (`README.md`) that says how it was made.

The card names the base model and revision, the exact 4-bit base it was merged into, the data and its
fingerprint, the evaluation table, the merge check, the versions of the stack, the full resolved config and
the commands that reproduce it. It is written beside the weights, so the checkpoint can be copied (or pushed
to a model hub) as it is.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import yaml

from finetune_flows.config.schema import FinetuneConfig, dotted, load_config
from finetune_flows.files import write_atomic
from finetune_flows.data.dataset import PreparedDataset
from finetune_flows.runtime.environment import EnvironmentReport
from finetune_flows.export.merge import ExportResult, link_tree, MergedModel
from finetune_flows.models.quantize import QuantizedModel
from finetune_flows.store.runs import create_run_dir
from finetune_flows.evaluation.evaluate import EvalReport


def _table(rows: list[dict]) -> list[str]:
    if not rows:
        return ["(not evaluated)"]
    lines = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
    return lines + ["| " + " | ".join(str(v) for v in row.values()) + " |" for row in rows]


NOT_IN_THE_CHECKPOINT = ("run.", "tracking.", "export.merge")  # where files and logs went; whether to merge


def export_overrides(cfg: FinetuneConfig, trained: FinetuneConfig | None) -> list[str]:
    """`KEY=VALUE` for each setting of an export's own config that differs from the config the adapter was trained
    with, as `--set` takes it (a string YAML would not read back as that string, quoted); none without `trained`."""
    if trained is None:
        return []
    ours, theirs = dotted(cfg.model_dump(mode="json")), dotted(trained.model_dump(mode="json"))
    return [f"{key}={value if isinstance(value, str) and yaml.safe_load(value) == value else json.dumps(value)}"
            for key, value in ours.items() if value != theirs.get(key) and not key.startswith(NOT_IN_THE_CHECKPOINT)]


def export_command(adapter: Path, overrides: list[str]) -> str:
    """`flows/export.py` as it made this checkpoint: the adapter (whose run's config it reads), and the overrides."""
    return " ".join(["python flows/export.py --adapter", shlex.quote(str(adapter)),
                     *(f"--set {shlex.quote(s)}" for s in overrides)])


def render_card(name: str, merged: MergedModel, cfg: FinetuneConfig, base: QuantizedModel, data: PreparedDataset,
                env: EnvironmentReport, eval_rows: list[dict], adapter: Path, config_file: Path,
                trained: FinetuneConfig | None = None) -> str:
    """`trained`: the config of the run that trained the adapter, where this card is an export's with another
    config (`flows/export.py --config`): the card's data and configuration are the training's, and the export's
    own settings are listed apart."""
    overrides = export_overrides(cfg, trained)  # none where the export only dropped the training's tracking
    trained = trained or cfg
    q = cfg.quantization
    quantized = (f"{q.quant_type} 4-bit{' with double quantization' if q.double_quant else ''}, compute dtype "
                 f"{base.compute_dtype}" if base.load_in_4bit else f"not quantized ({base.compute_dtype})")
    versions = [f"| {k} | {v} |" for k, v in env.versions.items() if v and k != "torch"]
    lines = [
        # quoted where YAML needs it: a path with " #" or ": " would otherwise be cut short or break the front matter
        "---", yaml.safe_dump({"base_model": cfg.model.source}, width=float("inf")).rstrip(),
        "library_name: transformers",
        "tags: [finetune-flows, qlora, lora, merged]",
        # flows/evaluate.py reads this to evaluate the checkpoint beside the adapter it was made from
        "finetune_flows:", f"  adapter: {json.dumps(str(adapter))}", "---", "",
        f"# {name}", "",
        f"`{cfg.model.source}` fine-tuned with QLoRA by finetune-flows, the LoRA adapter merged into the weights. "
        "A standalone checkpoint: no peft, no bitsandbytes needed to load it.", "",
        "```python", "from transformers import AutoModelForCausalLM, AutoTokenizer",
        f'model = AutoModelForCausalLM.from_pretrained("{merged.path}")',
        f'tokenizer = AutoTokenizer.from_pretrained("{merged.path}")', "```", "",
        "## Base model", "",
        f"- source: `{cfg.model.source}`, revision: `{cfg.model.revision or 'n/a'}`",
        f"- merged into the base it was trained on: `{base.path}` ({quantized}), dequantized, then the adapter "
        f"merged and the result saved in {merged.dtype}",
        f"- base fingerprint `{base.fingerprint}`; adapter: `{adapter}`", "",
        "## Data", "",
        *([f"- `{cfg.data.source}` ({data.format} format): {data.train_rows} training rows, {data.eval_rows} held "
           f"out, {data.train_tokens} training tokens", f"- data fingerprint `{data.fingerprint}`"]
          if trained.data.source == cfg.data.source else
          [f"- trained on `{trained.data.source}` (the training run's `{config_file}`)",
           f"- the merge below was checked on held-out rows of `{cfg.data.source}` (this export's config), data "
           f"fingerprint `{data.fingerprint}`"]), "",
        "## Evaluation (held-out split, base vs base + adapter)", "", *_table(eval_rows), "",
        "## Merge check", "",
        f"The saved checkpoint, reloaded with plain `from_pretrained`, against base + adapter (4-bit) on "
        f"{merged.check_prompts} held-out prompts ({merged.check_tokens} positions, {merged.device}): largest logit "
        f"difference {merged.logit_error:.3g} of the logits' standard deviation (limit "
        f"{cfg.export.max_logit_error}), same top-1 token at {merged.top1_agreement:.2%} of positions.", "",
        f"{merged.parameters / 1e6:.1f}M parameters, {merged.size_mb:.1f} MiB.", "",
        "## Reproduce", "",
        "```bash", f"python flows/finetune.py --config {shlex.quote(str(config_file))}   # train, evaluate"
        + (" and merge again" if trained.export.merge else " again (it does not merge: export.merge is off)"),
        f"{export_command(adapter, overrides)}   # merge this adapter again",
        f"python flows/evaluate.py --merged {shlex.quote(str(merged.path))}   # evaluate this checkpoint (beside "
        "base and the adapter)",
        "```", "",
        "## Versions", "", "| package | version |", "|---|---|", f"| python | {env.python} |",
        f"| torch | {env.torch} (CUDA {env.cuda_version}) |", *versions, "",
        "## Configuration", "", "```yaml", (trained if trained is not cfg else cfg.as_recorded()).to_yaml().rstrip(),
        "```", "",
    ]
    if overrides:
        lines += ["The export itself ran with another config; its `export` and `quantization` sections:", "",
                  "```yaml", yaml.safe_dump({k: cfg.model_dump(mode="json")[k] for k in ("export", "quantization")},
                                            sort_keys=False).rstrip(), "```", ""]
    return "\n".join(lines)


def place_merged(merged: MergedModel, run_dir: Path, cfg: FinetuneConfig, base: QuantizedModel,
                 data: PreparedDataset, env: EnvironmentReport, eval_rows: list[dict], adapter: Path) -> ExportResult:
    """`<run>/merged/`: the checkpoint (hard links to the cache entry) and its model card; published as the
    `merged-model` artifact."""
    # Prefect here, not at the top: the engine imports without it
    from prefect.artifacts import create_markdown_artifact

    target = run_dir / "merged"
    link_tree(merged.path, target)
    trained = None
    if (adapter.parent / "config.resolved.yaml").is_file():  # flows/export.py: the adapter of an earlier run
        shipped_adapter, config_file = adapter, adapter.parent / "config.resolved.yaml"
        trained = training_config_of(config_file, cfg)
    else:  # the fine-tune flow: its adapter is copied into the run directory at the end
        shipped_adapter, config_file = run_dir / "adapter", run_dir / "config.resolved.yaml"
    card = render_card(f"{run_dir.name}: merged model", merged.model_copy(update={"path": target}), cfg, base, data,
                       env, eval_rows, shipped_adapter, config_file, trained)
    write_atomic(target / "README.md", card)
    create_markdown_artifact(card, key="merged-model", description="The merged checkpoint and its model card")
    return ExportResult(**{**merged.model_dump(), "path": target, "cache_path": merged.path})


def training_config_of(config_file: Path, cfg: FinetuneConfig) -> FinetuneConfig | None:
    """The config an earlier run trained the adapter with, where it differs from this export's (None where it is
    the same, or unreadable: then the export's config is the card's)."""
    try:
        trained = load_config(config_file)
    except Exception:  # a run directory from another version of the config: the card names what it can
        return None
    return None if trained.fingerprint() == cfg.fingerprint() else trained


def create_export_run_dir(cfg: FinetuneConfig) -> Path:
    """`<output_dir>/<name>-export-<time>-<id>`: export-only runs are told apart from fine-tune runs."""
    return create_run_dir(cfg.model_copy(update={"run": cfg.run.model_copy(update={"name": f"{cfg.run.name}-export"})}))


def adapter_eval_table(adapter_dir: Path) -> list[dict]:
    """The eval table of the run that trained the adapter (`<run>/eval.json`), for the card; [] if absent."""
    found = adapter_dir.parent / "eval.json"
    try:
        return EvalReport.model_validate(json.loads(found.read_text())).table()
    except (OSError, ValueError):
        return []
