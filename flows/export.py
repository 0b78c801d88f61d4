"""export: an existing QLoRA adapter merged into the exact base it was trained on, as a standalone checkpoint.

    python flows/export.py --adapter runs/<run>/adapter                 # with the config it was trained with
    python flows/export.py --adapter DIR --set export.dtype=float16

Writes `runs/<name>-export-<time>-<id>/merged/` (weights, tokenizer, README.md model card) after checking that
the merged model's logits match base + adapter. The fine-tune flow does the same at its end (`export.merge`).
The other `export.*` keys apply here as there; `export.merge` does not: this command always merges (a config
with `export.merge: false`, e.g. the run's own, is fine; `--set export.merge=false` is refused).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")  # before prefect reads its settings
QUIET_WHILE_LOADING = __name__ == "__main__" and signal.getsignal(signal.SIGINT) is signal.default_int_handler
if QUIET_WHILE_LOADING:  # Ctrl-C while the libraries below load: exit at once, no traceback (nothing is written yet)
    signal.signal(signal.SIGINT, lambda signum, frame: os._exit(128 + signum))

from prefect import flow  # noqa: E402

from finetune_flows.cli import Once, quiet_tracebacks, run_cli  # noqa: E402
from finetune_flows.config.preflight import check_adapter_fits, cli_preflight, without_tracking  # noqa: E402
from finetune_flows.config.schema import FinetuneConfig, check_config, load_config  # noqa: E402
from finetune_flows.errors import UserInputError  # noqa: E402
from finetune_flows.evaluation.adapters import check_adapter_dir, training_config, warn_if_other_base  # noqa: E402
from finetune_flows.export.merge import ExportResult  # noqa: E402
from finetune_flows.export.model_card import adapter_eval_table, create_export_run_dir  # noqa: E402
from finetune_flows.models.sources import check_model_source, materialize_tokenizer  # noqa: E402
from finetune_flows.orchestration.caching import run_step  # noqa: E402
from finetune_flows.runtime.policy import allowed_config, check_adapter_path, checked_config  # noqa: E402
from finetune_flows.store.fingerprint import pin_hub_revisions  # noqa: E402
from tasks.merge_adapter import export_merged_model  # noqa: E402
from tasks.prepare_dataset import prepare_dataset  # noqa: E402
from tasks.quantize_base_model import quantize_base_model  # noqa: E402
from tasks.select_gpus import select_gpus  # noqa: E402
from tasks.verify_environment import verify_environment  # noqa: E402


quiet_tracebacks()  # bad parameters fail before the flow's body runs, after this module is imported


@flow(name="export", flow_run_name="export {adapter}", log_prints=True, persist_result=False)
def export(adapter: str, config: FinetuneConfig | None = None) -> ExportResult:
    """An existing adapter merged into the exact base it was trained on, as a standalone checkpoint.

    Args:
        adapter: An adapter directory (runs/<run>/adapter of a fine-tune run).
        config: The run configuration; none: the one the adapter was trained with (its run's config.resolved.yaml).
    """
    quiet_tracebacks()  # bad input ends a deployment run with its message, not a traceback too
    check_adapter_path(adapter)  # the worker's policy first: nothing read or written
    adapter_dir = check_adapter_dir(adapter)  # before anything loads
    cfg = allowed_config(check_config(config)) if config else checked_config(training_config(adapter_dir), None)
    cfg = pin_hub_revisions(cfg)
    check_model_source(cfg.model.source, cfg.model.trust_remote_code)
    check_adapter_fits(adapter_dir, cfg)  # another model's config fails here, not after quantizing it
    run_dir = create_export_run_dir(cfg)

    env, plan = verify_environment(cfg, run_dir)
    gpus = select_gpus(cfg.hardware.gpus, env.gpus)
    tokenizer = materialize_tokenizer(cfg.model.source, cfg.cache_root, cfg.model.revision,
                                      cfg.model.trust_remote_code)
    data, _ = run_step(prepare_dataset, cfg, tokenizer)
    base, _ = run_step(quantize_base_model, cfg, plan, gpus, run_dir)
    warn_if_other_base(adapter_dir, base)
    merged, _ = export_merged_model(cfg, data, base, adapter_dir, plan, gpus, env, run_dir,
                                    adapter_eval_table(adapter_dir), required=True)
    return merged


def show(result: ExportResult) -> None:
    print(f"merged checkpoint: {result.path} ({result.dtype}, {result.parameters / 1e6:.1f}M parameters); "
          f"model card: {result.path / 'README.md'}")


def check_merge_not_turned_off(cfg: FinetuneConfig, overrides: list[str]) -> None:
    """`--set export.merge=false` asks this command not to do the one thing it does: refused, not ignored. A config
    file's `export.merge: false` is a fine-tune run's choice to merge later, with this command: no matter here."""
    if not cfg.export.merge and any(o.partition("=")[0].strip() == "export.merge" for o in overrides):
        raise UserInputError("--set export.merge=false: flows/export.py always merges (export.merge turns off only "
                             "the fine-tune flow's merge at its end); leave it out")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--adapter", action=Once, required=True,
                        help="adapter directory (runs/<run>/adapter of a fine-tune run)")
    parser.add_argument("--config", action=Once,
                        help="run config YAML (default: the adapter's runs/<run>/config.resolved.yaml)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config key, e.g. export.dtype=float16 (repeatable)")
    args = parser.parse_args(argv)
    # checked before a Prefect server starts; the run's temporary server and workers stop with it (run_cli)
    def checked() -> FinetuneConfig:
        adapter_dir = check_adapter_dir(args.adapter)
        cfg = load_config(args.config or training_config(adapter_dir), args.overrides)
        check_merge_not_turned_off(cfg, args.overrides)
        cfg = cli_preflight(without_tracking(cfg))
        check_adapter_fits(adapter_dir, cfg)
        return cfg

    return run_cli(checked, lambda cfg: export(args.adapter, cfg), show)


if __name__ == "__main__":
    if QUIET_WHILE_LOADING:
        signal.signal(signal.SIGINT, signal.default_int_handler)  # run_cli's own handling from here
    sys.exit(main())
