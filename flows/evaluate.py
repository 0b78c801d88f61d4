"""evaluate: an existing QLoRA adapter, or the merged checkpoint made from one, scored against its base model.

    python flows/evaluate.py --adapter runs/<run>/adapter              # with the config it was trained with
    python flows/evaluate.py --merged runs/<run>/merged                # the merged checkpoint (and its adapter)
    python flows/evaluate.py --adapter DIR --config configs/X.yaml --set eval.max_samples=200

The directory's files say which it is (`--adapter` and `--merged` are the same option). A merged checkpoint is
scored beside the base and, when its model card names an adapter that is still there, beside base + adapter.
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
from finetune_flows.config.preflight import cli_preflight, preflight, without_tracking  # noqa: E402
from finetune_flows.config.schema import FinetuneConfig, load_config  # noqa: E402
from finetune_flows.evaluation.adapters import (  # noqa: E402
    EvaluationResult, check_evaluation_dir, check_fits, create_eval_run_dir, eval_run_name, finish_evaluation,
    named_adapter, render_evaluation, training_config, warn_if_other_base, warn_if_other_split,
)
from finetune_flows.evaluation.evaluate import beside_adapter, publish_eval  # noqa: E402
from finetune_flows.models.sources import materialize_tokenizer  # noqa: E402
from finetune_flows.orchestration.caching import run_step  # noqa: E402
from finetune_flows.runtime.gpus import read_inventory  # noqa: E402
from finetune_flows.runtime.policy import allowed_config_file, check_adapter_path  # noqa: E402
from finetune_flows.store.fingerprint import pin_hub_revisions  # noqa: E402
from tasks.evaluate_adapter import evaluate_adapter  # noqa: E402
from tasks.evaluate_checkpoint import evaluate_checkpoint  # noqa: E402
from tasks.prepare_dataset import prepare_dataset  # noqa: E402
from tasks.quantize_base_model import quantize_base_model  # noqa: E402
from tasks.select_gpus import select_gpus  # noqa: E402
from tasks.verify_environment import verify_environment  # noqa: E402


quiet_tracebacks()  # bad parameters fail before the flow's body runs, after this module is imported


@flow(name="evaluate", flow_run_name=eval_run_name, log_prints=True, persist_result=False)
def evaluate(adapter: str, config: FinetuneConfig | None = None) -> EvaluationResult:
    """An existing adapter, or a merged checkpoint made from one, scored against its base model.

    Args:
        adapter: An adapter directory or a merged checkpoint (runs/<run>/adapter or runs/<run>/merged).
        config: The run configuration; none: the one the adapter was trained with (its run's config.resolved.yaml).
    """
    quiet_tracebacks()  # bad input ends a deployment run with its message, not a traceback too
    check_adapter_path(adapter)  # the worker's policy first: nothing read or written
    target = check_evaluation_dir(adapter)  # adapter or merged checkpoint, before anything loads
    inventory = read_inventory()  # the run's one reading of the GPUs
    config = without_tracking(config or load_config(allowed_config_file(training_config(target.path))))
    cfg = pin_hub_revisions(preflight(config, inventory))
    check_fits(target, cfg)  # another model's config fails here, not after quantizing it
    warn_if_other_split(target.path, cfg)  # `--set data.eval_fraction=0.5`: training rows scored as held out
    run_dir = create_eval_run_dir(cfg)

    env, plan = verify_environment(cfg, run_dir, inventory)
    gpus = select_gpus(cfg.hardware.gpus, env.gpus)
    tokenizer = materialize_tokenizer(cfg.model.source, cfg.cache_root, cfg.model.revision,
                                      cfg.model.trust_remote_code)
    data, _ = run_step(prepare_dataset, cfg, tokenizer)
    base, _ = run_step(quantize_base_model, cfg, plan, gpus, run_dir)
    if target.kind == "adapter":
        adapter_dir = target.path
        warn_if_other_base(adapter_dir, base)
        report, _ = run_step(evaluate_adapter, cfg, data, base, adapter_dir, plan, gpus)
    else:
        report, _ = run_step(evaluate_checkpoint, cfg, data, base, target.path, plan, gpus)
        adapter_dir = named_adapter(target.path)  # the adapter it was merged from, if still there
        if adapter_dir is not None:
            warn_if_other_base(adapter_dir, base)
            with_adapter, _ = run_step(evaluate_adapter, cfg, data, base, adapter_dir, plan, gpus)
            report = beside_adapter(report, with_adapter, data)

    publish_eval(report)
    return finish_evaluation(run_dir, target, adapter_dir, report)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--adapter", "--merged", action=Once, dest="adapter", required=True, metavar="DIR",
                        help="adapter directory (runs/<run>/adapter) or merged checkpoint (runs/<run>/merged)")
    parser.add_argument("--config", action=Once,
                        help="run config YAML (default: the run's runs/<run>/config.resolved.yaml)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config key, e.g. eval.max_samples=200 (repeatable)")
    args = parser.parse_args(argv)
    def checked() -> FinetuneConfig:
        target = check_evaluation_dir(args.adapter)
        cfg = cli_preflight(without_tracking(load_config(args.config or training_config(target.path), args.overrides)))
        check_fits(target, cfg)
        return cfg

    return run_cli(checked,
        lambda cfg: evaluate(args.adapter, cfg), lambda result: print(render_evaluation(result)))


if __name__ == "__main__":
    if QUIET_WHILE_LOADING:
        signal.signal(signal.SIGINT, signal.default_int_handler)  # run_cli's own handling from here
    sys.exit(main())
