"""Experiment tracking on the tools ML teams already run: TensorBoard (through the Trainer) and MLflow.

- `tracking.report_to` goes to the Trainer's `report_to`; TensorBoard's event files are written beside the
  adapter in the cache (so a cached rerun still has them) and copied into `<run>/tensorboard/`.
- `tracking.mlflow_uri` makes each run an MLflow run (experiment `tracking.mlflow_experiment`, run name = the
  run directory's name) holding the resolved config (params and `config.resolved.yaml`), the plan, the loss
  per step, the eval table and metrics, the plots and the adapter.

Both are checked before anything loads: a missing package or an MLflow server that does not answer is a
config error, not a failure after an hour of training. Only fine-tune runs are logged (evaluate and export runs
ignore these settings). A server that goes away later costs the log step a bounded wait, then one message: the
run is complete in its directory, and the same command logs it.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import time
import urllib.request
from pathlib import Path

from finetune_flows.config.schema import FinetuneConfig, dotted
from finetune_flows.config.plan import Plan
from finetune_flows.errors import ConfigError, NotLogged, first_line, redact_uri
from finetune_flows.logs import run_logger

PACKAGES = {"tensorboard": ("tensorboard", "tensorboardX"), "mlflow": ("mlflow",), "wandb": ("wandb",),
            "trackio": ("trackio",), "comet_ml": ("comet_ml",), "clearml": ("clearml",)}
EXTRA_HINT = "pip install 'finetune-flows[tracking]'"


def tracking_problems(cfg: FinetuneConfig, timeout: float = 5.0) -> list[str]:
    problems = []
    for name in cfg.tracking.report_to:
        modules = PACKAGES.get(name, (name,))
        if not any(importlib.util.find_spec(m) for m in modules):
            problems.append(f"tracking.report_to={name} needs the `{modules[0]}` package, which is not installed")
    uri = cfg.tracking.mlflow_uri
    shown = redact_uri(uri or "")
    if uri:
        if importlib.util.find_spec("mlflow") is None:
            problems.append(f"tracking.mlflow_uri={shown} needs MLflow: {EXTRA_HINT}")
        elif uri.startswith(("http://", "https://")):
            try:
                with urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=timeout) as response:
                    response.read()
            except OSError as exc:
                problems.append(f"tracking.mlflow_uri={shown}: no MLflow server answers there ({exc})")
        else:  # a store MLflow opens itself (sqlite:///runs.db); some it refuses (file stores, in MLflow 3)
            try:
                from mlflow import MlflowClient

                MlflowClient(tracking_uri=uri).search_experiments(max_results=1)
            except Exception as exc:
                problems.append(f"tracking.mlflow_uri={shown}: MLflow cannot use it ({first_line(exc)})")
    return problems


def check_tracking(cfg: FinetuneConfig) -> None:
    problems = tracking_problems(cfg)
    if problems:
        raise ConfigError(problems, "tracking")


def copy_tensorboard_logs(train_output: Path, run_dir: Path, report_to: list[str]) -> Path | None:
    """`<run>/tensorboard/`: the event files of the training that produced this run's adapter, where this run's
    `tracking.report_to` asks for TensorBoard (a cached adapter keeps the files of the run that trained it)."""
    source = Path(train_output) / "tensorboard"
    if "tensorboard" not in report_to:
        return None
    if not source.is_dir():  # reused: tracking.report_to is not in the adapter's cache key
        run_logger().info("no TensorBoard files for this run: its adapter's training wrote none (a cached adapter "
                          "trained without tracking.report_to=tensorboard)")
        return None
    shutil.copytree(source, run_dir / "tensorboard")
    return run_dir / "tensorboard"


def _experiment_id(client, name: str) -> str:
    found = client.get_experiment_by_name(name)
    if found is not None:
        return found.experiment_id
    try:
        return client.create_experiment(name)
    except Exception:  # another run created it meanwhile
        return client.get_experiment_by_name(name).experiment_id


# MLflow's defaults (7 retries backing off to minutes, 120 s requests) would hold a finished run for many minutes
# once its server is gone; these bound the wait (the user's own settings win)
CLIENT_LIMITS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
                 "MLFLOW_HTTP_REQUEST_TIMEOUT": "30"}
ATTEMPTS, PAUSE_SECONDS = 2, 5.0


def log_to_mlflow(cfg: FinetuneConfig, plan: Plan, result, attempts: int = ATTEMPTS) -> str:
    """Log a finished run (a FinetuneResult) to `tracking.mlflow_uri`; return the MLflow run id. A failure is
    tried again once; then NotLogged, one message (the run itself is complete)."""
    for key, value in CLIENT_LIMITS.items():
        os.environ.setdefault(key, value)
    for _ in range(attempts - 1):
        try:
            return _log(cfg, plan, result)
        except Exception as exc:
            run_logger().warning("logging to MLflow failed (%s); trying again in %.0f s", first_line(exc)[:300],
                                 PAUSE_SECONDS)
            time.sleep(PAUSE_SECONDS)
    try:
        return _log(cfg, plan, result)
    except Exception as exc:
        raise NotLogged(f"the run is complete in {result.run_dir}, but MLflow at "
                        f"{redact_uri(cfg.tracking.mlflow_uri)} did not take it ({first_line(exc)[:300]}); run the "
                        "same command again once the server answers: "
                        "every step is reused and the run is logged") from None


def _earlier_attempts(client, experiment_id: str, run_dir: Path) -> tuple[str | None, list[str]]:
    """(the id of a finished MLflow run of this run directory, the ids of unfinished ones an earlier attempt left)."""
    runs = client.search_runs([experiment_id], filter_string=f"tags.`finetune-flows.run_dir` = '{run_dir}'")
    finished = next((r.info.run_id for r in runs if r.info.status == "FINISHED"), None)
    return finished, [r.info.run_id for r in runs if r.info.status != "FINISHED"]


def _log(cfg: FinetuneConfig, plan: Plan, result) -> str:
    from mlflow import MlflowClient
    from mlflow.entities import Metric, Param

    client = MlflowClient(tracking_uri=cfg.tracking.mlflow_uri)
    run_dir, train, report = Path(result.run_dir), result.train, result.eval
    experiment_id = _experiment_id(client, cfg.tracking.mlflow_experiment)
    finished, partial = _earlier_attempts(client, experiment_id, run_dir)
    if finished:  # an earlier attempt got through before it failed
        return finished
    for run_id in partial:  # an earlier attempt's half-logged run: replaced, not duplicated
        client.delete_run(run_id)
    tags = {"finetune-flows.run_dir": str(run_dir), "finetune-flows.model": cfg.model.source,
            "finetune-flows.cached_steps": ",".join(result.cached_steps) or "none"}
    try:
        from prefect.runtime import deployment, flow_run

        tags.update({"prefect.flow_run_id": str(flow_run.id), "prefect.deployment": str(deployment.name)})
    except Exception:  # outside a flow run
        pass
    run = client.create_run(experiment_id, run_name=run_dir.name, tags=tags)
    run_id = run.info.run_id
    try:
        now = int(time.time() * 1000)
        settings = {**dotted(cfg.as_recorded().model_dump(mode="json")),  # run.cache_dir: the cache used
                    **dotted(plan.model_dump(mode="json"), "plan.")}
        params = [Param(k, str(v)[:6000]) for k, v in settings.items()]  # MLflow's limit on a param value
        metrics = [Metric("train/loss", loss, now, step) for step, loss in train.loss_curve]
        metrics += [Metric(f"train/{k}", float(getattr(train, k)), now, train.steps)
                    for k in ("tokens_per_second", "peak_memory_mb", "train_seconds", "final_loss")]
        for name, scores in (("base", report.base), ("adapter", report.adapter)):
            metrics += [Metric(f"eval/{name}_loss", scores.loss, now, train.steps),
                        Metric(f"eval/{name}_perplexity", scores.perplexity, now, train.steps)]
            if scores.generation_score is not None:
                metrics.append(Metric(f"eval/{name}_{report.metric}", scores.generation_score, now, train.steps))
        for start in range(0, len(params), 100):  # MLflow's batch limits: 100 params, 1000 metrics
            client.log_batch(run_id, params=params[start:start + 100])
        for start in range(0, len(metrics), 1000):
            client.log_batch(run_id, metrics=metrics[start:start + 1000])
        table = report.table()
        client.log_table(run_id, {key: [row[key] for row in table] for key in table[0]}, "eval_table.json")
        client.log_dict(run_id, plan.model_dump(mode="json"), "plan.json")
        client.log_artifact(run_id, str(run_dir / "config.resolved.yaml"))
        client.log_artifact(run_id, str(run_dir / "eval.json"))
        if (run_dir / "plots").is_dir():
            client.log_artifacts(run_id, str(run_dir / "plots"), "plots")
        client.log_artifacts(run_id, str(result.adapter_path), "adapter")
        client.set_terminated(run_id, "FINISHED")
    except BaseException:  # a stop (Ctrl-C, SIGTERM) or a failure: no half-logged run stays RUNNING for good (a
        # rerun logs from a new run directory, so nothing would ever replace it); the next attempt logs it whole
        try:
            client.delete_run(run_id)
        except Exception:  # the server is gone: the next attempt of this run directory replaces it
            pass
        raise
    run_logger().info("logged to MLflow %s: experiment %r, run %s (%s)", redact_uri(cfg.tracking.mlflow_uri),
                      cfg.tracking.mlflow_experiment, run_dir.name, run_id)
    return run_id
