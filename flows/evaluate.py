"""evaluate: an existing QLoRA adapter scored against its base model, without training.

    python flows/evaluate.py --adapter runs/<run>/adapter              # with the config it was trained with
    python flows/evaluate.py --adapter DIR --config configs/X.yaml --set eval.max_samples=200
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")  # before prefect reads its settings

from prefect import flow  # noqa: E402

from tasks.adapters import (  # noqa: E402
    EvaluationResult, check_adapter_dir, create_eval_run_dir, eval_run_name, finish_evaluation, render_evaluation,
    training_config, warn_if_other_base,
)
from tasks.caching import run_step  # noqa: E402
from tasks.fingerprint import pin_hub_revisions  # noqa: E402
from tasks.policy import check_adapter_path  # noqa: E402
from tasks.dataset import prepare_dataset  # noqa: E402
from tasks.environment import verify_environment  # noqa: E402
from tasks.evaluate import evaluate_adapter, publish_eval  # noqa: E402
from tasks.gpus import select_gpus  # noqa: E402
from tasks.models import materialize_tokenizer  # noqa: E402
from tasks.preflight import preflight  # noqa: E402
from tasks.quantize import quantize_base_model  # noqa: E402


@flow(name="evaluate", flow_run_name=eval_run_name, log_prints=True, persist_result=False)
def evaluate(adapter: str, config: str | None = None, overrides: list[str] | None = None) -> EvaluationResult:
    check_adapter_path(adapter)  # the worker's policy first: nothing read or written
    adapter_dir = check_adapter_dir(adapter)  # before anything loads
    cfg = pin_hub_revisions(preflight(config or training_config(adapter_dir), overrides))
    run_dir = create_eval_run_dir(cfg)

    env, plan = verify_environment(cfg, run_dir)
    gpus = select_gpus(cfg.hardware.gpus, env.gpus)
    tokenizer = materialize_tokenizer(cfg.model.source, cfg.cache_root, cfg.model.revision,
                                      cfg.model.trust_remote_code)
    data, _ = run_step(prepare_dataset, cfg, tokenizer)
    base, _ = run_step(quantize_base_model, cfg, plan, gpus, run_dir)
    warn_if_other_base(adapter_dir, base)
    report, _ = run_step(evaluate_adapter, cfg, data, base, adapter_dir, plan, gpus)

    publish_eval(report)
    return finish_evaluation(run_dir, adapter_dir, report)


def main(argv: list[str] | None = None) -> int:
    from tasks.cli import run_cli

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--adapter", required=True, help="adapter directory (runs/<run>/adapter of a fine-tune run)")
    parser.add_argument("--config", help="run config YAML (default: the adapter's runs/<run>/config.resolved.yaml)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config key, e.g. eval.max_samples=200 (repeatable)")
    args = parser.parse_args(argv)
    return run_cli(lambda: preflight(args.config or training_config(check_adapter_dir(args.adapter)), args.overrides),
                   lambda: evaluate(args.adapter, args.config, args.overrides),
                   lambda result: print(render_evaluation(result)))


if __name__ == "__main__":
    sys.exit(main())
