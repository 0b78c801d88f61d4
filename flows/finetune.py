"""finetune: a base model and a dataset in, an evaluated QLoRA adapter (and the merged model) out.

    python flows/finetune.py                                   # the built-in demo (configs/demo.yaml)
    python flows/finetune.py --config configs/X.yaml --set train.learning_rate=1e-4
    python flows/finetune.py --help-config                     # every config key, documented
    python flows/finetune.py --config configs/X.yaml --print-params   # the same config as deployment run --params

The flow takes the config as one typed parameter (FinetuneConfig): this command line builds it from the YAML file and
the overrides once, checks it, and passes it on; a deployment carries it as JSON (deployments/README.md).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")  # before prefect reads its settings
QUIET_WHILE_LOADING = __name__ == "__main__" and signal.getsignal(signal.SIGINT) is signal.default_int_handler
if QUIET_WHILE_LOADING:  # Ctrl-C while the libraries below load: exit at once, no traceback (nothing is written yet)
    signal.signal(signal.SIGINT, lambda signum, frame: os._exit(128 + signum))

from prefect import flow  # noqa: E402
from prefect.tasks import exponential_backoff  # noqa: E402

from finetune_flows.cli import Once, print_to_pipe, quiet_tracebacks, run_cli  # noqa: E402
from finetune_flows.config.parameters import run_parameters  # noqa: E402
from finetune_flows.config.preflight import cli_preflight, preflight  # noqa: E402
from finetune_flows.config.schema import FinetuneConfig, config_reference, load_config  # noqa: E402
from finetune_flows.evaluation.evaluate import publish_eval  # noqa: E402
from finetune_flows.models.sources import materialize_tokenizer  # noqa: E402
from finetune_flows.orchestration.caching import run_step  # noqa: E402
from finetune_flows.reporting.summary import FinetuneResult, finish_run, print_table  # noqa: E402
from finetune_flows.runtime.gpus import read_inventory  # noqa: E402
from finetune_flows.store.fingerprint import pin_hub_revisions  # noqa: E402
from finetune_flows.store.runs import create_run_dir, flow_run_name  # noqa: E402
from tasks.evaluate_adapter import evaluate_adapter  # noqa: E402
from tasks.log_to_mlflow import log_to_mlflow  # noqa: E402
from tasks.merge_adapter import export_merged_model, warn_if_the_merge_will_be_skipped  # noqa: E402
from tasks.prepare_dataset import prepare_dataset  # noqa: E402
from tasks.quantize_base_model import quantize_base_model  # noqa: E402
from tasks.select_gpus import select_gpus  # noqa: E402
from tasks.train_adapter import train_adapter  # noqa: E402
from tasks.verify_environment import verify_environment  # noqa: E402

quiet_tracebacks()  # bad parameters fail before the flow's body runs, after this module is imported

DEFAULT_CONFIG = "configs/demo.yaml"  # in the working directory, else in this checkout (run from elsewhere)


@flow(name="finetune", flow_run_name=flow_run_name, log_prints=True, persist_result=False)
def finetune(config: FinetuneConfig) -> FinetuneResult:
    """A base model and a dataset in, an evaluated QLoRA adapter (and the merged model) out.

    Args:
        config: The run configuration, by section; each key as `python flows/finetune.py --help-config` lists it.
    """
    quiet_tracebacks()  # bad input ends a deployment run with its message, not a traceback too
    inventory = read_inventory()  # the run's one reading of the GPUs
    cfg = pin_hub_revisions(preflight(config, inventory))  # policy, then bad input, before anything is written
    run_dir = create_run_dir(cfg)

    env, plan = verify_environment(cfg, run_dir, inventory)
    warn_if_the_merge_will_be_skipped(cfg, plan)
    gpus = select_gpus(cfg.hardware.gpus, env.gpus)
    tokenizer = materialize_tokenizer(cfg.model.source, cfg.cache_root, cfg.model.revision,
                                      cfg.model.trust_remote_code)
    data, data_step = run_step(prepare_dataset, cfg, tokenizer)
    base, base_step = run_step(quantize_base_model, cfg, plan, gpus, run_dir)
    train, train_step = run_step(retrying_trainer(cfg), cfg, data, base, plan, gpus, run_dir)
    report, eval_step = run_step(evaluate_adapter, cfg, data, base, train.adapter_path, plan, gpus)
    merged, merge_step = export_merged_model(cfg, data, base, train.adapter_path, plan, gpus, env, run_dir,
                                             report.table())

    publish_eval(report)
    steps = {"prepare-dataset": data_step, "quantize-base-model": base_step, "train-adapter": train_step,
             "evaluate-adapter": eval_step} | ({"merge-adapter": merge_step} if merge_step else {})
    result = finish_run(run_dir, train, report, steps, merged, cfg.tracking.report_to)
    if cfg.tracking.mlflow_uri:
        log_to_mlflow(cfg, plan, result)
    return result


def retrying_trainer(cfg: FinetuneConfig):
    """The training task with the run's retries: the first after `train.retry_delay_seconds`, each next one after
    twice the delay before it (Prefect's exponential_backoff)."""
    return train_adapter.with_options(retries=cfg.train.retries,
                                      retry_delay_seconds=exponential_backoff(cfg.train.retry_delay_seconds))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", action=Once, default=DEFAULT_CONFIG, help="run config YAML (default: %(default)s)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config key, e.g. train.max_steps=50 (repeatable)")
    prints = parser.add_mutually_exclusive_group()  # one output, not the first of two without a word
    prints.add_argument("--help-config", action="store_true", help="print every config key with its doc and exit")
    prints.add_argument("--print-params", action="store_true",
                        help="print the config as `prefect deployment run --params` takes it, and exit")
    args = parser.parse_args(argv)
    if args.config == DEFAULT_CONFIG and not Path(DEFAULT_CONFIG).is_file():
        args.config = str(Path(__file__).resolve().parent.parent / DEFAULT_CONFIG)
    if args.help_config:
        print_to_pipe(config_reference())
        return 0
    if args.print_params:
        return run_cli(lambda: run_parameters(args.config, args.overrides), None, print)
    return run_cli(lambda: cli_preflight(load_config(args.config, args.overrides)), finetune, print_table)


if __name__ == "__main__":
    if QUIET_WHILE_LOADING:
        signal.signal(signal.SIGINT, signal.default_int_handler)  # run_cli's own handling from here
    sys.exit(main())
