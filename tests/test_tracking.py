"""Experiment tracking on real tools: a local `mlflow server` (SQLite backend, free port) started by the test,
read back through MlflowClient; TensorBoard event files read back with TensorBoard's own reader."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import tiny_config
from deploy_support import free_port, stop, wait_healthy
from finetune_flows.config.schema import load_config
from finetune_flows.config.plan import Plan
from finetune_flows.errors import ConfigError, NotLogged
from finetune_flows.reporting import tracking
from finetune_flows.reporting.tracking import check_tracking

PLAN = Plan(device="cpu", nproc=1, precision="fp32", compute_dtype="float32", train_attn="sdpa", eval_attn="sdpa")

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    pytest.importorskip("mlflow", reason="MLflow is the optional `tracking` extra (make test installs it)")
    tmp = tmp_path_factory.mktemp("mlflow")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(tmp / "server.log", "w")
    proc = subprocess.Popen([str(Path(sys.executable).parent / "mlflow"), "server", "--host", "127.0.0.1",
                             "--port", str(port), "--workers", "1",
                             "--backend-store-uri", f"sqlite:///{tmp / 'mlflow.db'}",
                             "--artifacts-destination", str(tmp / "artifacts")],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_healthy(url, proc, tmp / "server.log", "mlflow server", timeout=180)
        yield url
    finally:
        stop(proc)


@pytest.fixture(scope="module")
def tracked_run(prefect_server, shared_cache, mlflow_server, tmp_path_factory):
    from flows.finetune import finetune

    runs = tmp_path_factory.mktemp("runs")
    return finetune(tiny_config(shared_cache / "pipeline", runs, **{
        "tracking.mlflow_uri": mlflow_server, "tracking.mlflow_experiment": "finetune-flows-tests"}))


def test_run_is_logged_to_a_real_mlflow_server(tracked_run, mlflow_server, tmp_path):
    from mlflow import MlflowClient

    result = tracked_run
    client = MlflowClient(tracking_uri=mlflow_server)
    experiment = client.get_experiment_by_name("finetune-flows-tests")
    (run,) = client.search_runs([experiment.experiment_id], f"attributes.run_name = '{result.run_dir.name}'")
    assert run.info.status == "FINISHED"
    params = run.data.params
    assert params["model.source"] == "generated:tiny-llama" and params["train.max_steps"] == "6"
    assert params["tracking.mlflow_uri"] == mlflow_server and params["plan.device"] == "cpu"
    history = sorted(client.get_metric_history(run.info.run_id, "train/loss"), key=lambda m: m.step)
    assert [(m.step, m.value) for m in history] == [(s, pytest.approx(v)) for s, v in result.train.loss_curve]
    metrics = run.data.metrics
    assert metrics["eval/adapter_loss"] == pytest.approx(result.eval.adapter.loss)
    assert metrics["eval/base_loss"] == pytest.approx(result.eval.base.loss)
    assert metrics["train/tokens_per_second"] == pytest.approx(result.train.tokens_per_second)

    listed = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"config.resolved.yaml", "eval.json", "eval_table.json", "plan.json", "plots", "adapter"} <= listed
    table = json.loads(Path(client.download_artifacts(run.info.run_id, "eval_table.json", str(tmp_path))).read_text())
    assert table["columns"][:2] == ["model", "eval loss"]
    assert [row[:2] for row in table["data"]] == [[r["model"], r["eval loss"]] for r in result.eval.table()]
    config = Path(client.download_artifacts(run.info.run_id, "config.resolved.yaml", str(tmp_path))).read_text()
    assert config == (result.run_dir / "config.resolved.yaml").read_text()
    plan = json.loads(Path(client.download_artifacts(run.info.run_id, "plan.json", str(tmp_path))).read_text())
    assert plan["device"] == "cpu" and plan["nproc"] == 1
    adapter = Path(client.download_artifacts(run.info.run_id, "adapter", str(tmp_path)))
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        assert (adapter / name).read_bytes() == (result.adapter_path / name).read_bytes()
    assert {a.path for a in client.list_artifacts(run.info.run_id, "plots")} == {"plots/loss.png", "plots/eval.png"}


def test_tensorboard_event_files_land_in_the_run_directory(tracked_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    result = tracked_run
    assert result.tensorboard_dir == result.run_dir / "tensorboard"
    (events,) = {p.parent for p in result.tensorboard_dir.rglob("events.out.tfevents.*")}
    accumulator = EventAccumulator(str(events))
    accumulator.Reload()
    losses = accumulator.Scalars("train/loss")
    assert [e.step for e in losses] == [s for s, _ in result.train.loss_curve]
    assert [e.value for e in losses] == [pytest.approx(v, rel=1e-4) for _, v in result.train.loss_curve]


def test_tracking_problems_are_config_errors_before_anything_loads():
    with pytest.raises(ConfigError, match="no MLflow server answers there"):
        check_tracking(load_config(None, [f"tracking.mlflow_uri=http://127.0.0.1:{free_port()}"]))
    with pytest.raises(ConfigError, match="tracking.report_to=no_such_tracker needs the `no_such_tracker` package"):
        check_tracking(load_config(None, ["tracking.report_to=no_such_tracker"]))
    with pytest.raises(ConfigError, match="`none` cannot be combined"):
        load_config(None, ["tracking.report_to=none,tensorboard"])
    assert load_config(None, ["tracking.report_to=none"]).tracking.report_to == []


def test_a_store_mlflow_refuses_is_a_config_error_and_sqlite_is_not(tmp_path):
    """MLflow 3 refuses file stores: found when the finished run was logged (three attempts, tracebacks, exit 1)."""
    pytest.importorskip("mlflow")
    with pytest.raises(ConfigError, match=r"tracking.mlflow_uri=file://.*: MLflow cannot use it \(The filesystem "):
        check_tracking(load_config(None, [f"tracking.mlflow_uri=file://{tmp_path}/mlruns"]))
    check_tracking(load_config(None, [f"tracking.mlflow_uri=sqlite:///{tmp_path}/mlflow.db"]))


def test_a_server_gone_after_the_checks_costs_a_bounded_wait_and_one_message(tracked_run, monkeypatch):
    """The run had waited about 13 minutes on MLflow's own retries, then printed 15 tracebacks."""
    monkeypatch.setattr(tracking, "PAUSE_SECONDS", 1.0)
    for key in tracking.CLIENT_LIMITS:
        monkeypatch.delenv(key, raising=False)  # the limits apply where the user set none
    uri = f"http://127.0.0.1:{free_port()}"
    start = time.monotonic()
    with pytest.raises(NotLogged, match=f"the run is complete in {tracked_run.run_dir}, but MLflow at {uri} did not "
                                        "take it .*run the same command again once the server answers"):
        tracking.log_to_mlflow(load_config(None, [f"tracking.mlflow_uri={uri}"]), PLAN, tracked_run)
    assert time.monotonic() - start < 60


def test_logging_again_replaces_a_half_logged_run_and_keeps_a_finished_one(tracked_run, mlflow_server, tmp_path):
    from mlflow import MlflowClient

    run_dir = tmp_path / tracked_run.run_dir.name
    shutil.copytree(tracked_run.run_dir, run_dir)
    result = tracked_run.model_copy(update={"run_dir": run_dir})
    client = MlflowClient(tracking_uri=mlflow_server)
    experiment = client.get_experiment_by_name("finetune-flows-tests").experiment_id
    half = client.create_run(experiment, run_name=run_dir.name, tags={"finetune-flows.run_dir": str(run_dir)})
    cfg = load_config(None, [f"tracking.mlflow_uri={mlflow_server}", "tracking.mlflow_experiment=finetune-flows-tests"])
    logged = tracking.log_to_mlflow(cfg, PLAN, result)
    assert client.get_run(half.info.run_id).info.lifecycle_stage == "deleted"
    assert tracking.log_to_mlflow(cfg, PLAN, result) == logged  # logged once: a further attempt finds it
    runs = client.search_runs([experiment], filter_string=f"tags.`finetune-flows.run_dir` = '{run_dir}'")
    assert [(r.info.run_id, r.info.status) for r in runs] == [(logged, "FINISHED")]


def test_tensorboard_logs_reach_the_run_directory_only_where_report_to_asks_for_them(tmp_path, caplog):
    """A cached adapter keeps the event files of the run that trained it; a rerun with report_to=none must not
    copy them into its run directory (nor print a TensorBoard line)."""
    trained = tmp_path / "adapter-entry"
    (trained / "tensorboard").mkdir(parents=True)
    (trained / "tensorboard" / "events.out.tfevents.1").write_bytes(b"x")
    off, on = tmp_path / "off", tmp_path / "on"
    off.mkdir(), on.mkdir()
    none = load_config(None, ["tracking.report_to=none"]).tracking.report_to
    assert tracking.copy_tensorboard_logs(trained, off, none) is None
    assert not (off / "tensorboard").exists()
    assert tracking.copy_tensorboard_logs(trained, on, ["tensorboard"]) == on / "tensorboard"
    assert (on / "tensorboard" / "events.out.tfevents.1").exists()
    untracked = tmp_path / "untracked-entry"  # trained with report_to=none: a rerun asking for TensorBoard is told
    untracked.mkdir()
    with caplog.at_level("INFO", logger="finetune_flows"):
        assert tracking.copy_tensorboard_logs(untracked, tmp_path / "on", ["tensorboard"]) is None
    assert "a cached adapter trained without tracking.report_to=tensorboard" in caplog.text


STOPPED_LOGGER = """
import sys
from pathlib import Path
from finetune_flows.cli import stop_on_signals
from finetune_flows.config.schema import load_config
from finetune_flows.reporting import tracking
from finetune_flows.config.plan import Plan
from finetune_flows.reporting.summary import FinetuneResult

PLAN = Plan(device="cpu", nproc=1, precision="fp32", compute_dtype="float32", train_attn="sdpa", eval_attn="sdpa")

result = FinetuneResult.model_validate_json(Path(sys.argv[2]).read_text())
with stop_on_signals():  # the CLI's: SIGTERM raises Stopped, as it does in a run
    tracking.log_to_mlflow(load_config(None, [f"tracking.mlflow_uri={sys.argv[1]}"]), PLAN, result)
"""


def test_a_stop_while_logging_to_mlflow_leaves_no_half_logged_run(tmp_path):
    """SIGTERM to a run while it logged to MLflow left its MLflow run RUNNING for good, half-logged (metrics, no
    artifacts): a rerun logs from a new run directory, so nothing ever replaced it."""
    pytest.importorskip("mlflow")
    from mlflow import MlflowClient

    from conftest import child_env
    from finetune_flows.evaluation.evaluate import EvalReport, ModelScores
    from finetune_flows.reporting.summary import FinetuneResult
    from finetune_flows.training.train import TrainResult

    run_dir, adapter = tmp_path / "runs" / "demo-stopped", tmp_path / "adapter"
    for directory in (run_dir, adapter):
        directory.mkdir(parents=True)
    (run_dir / "config.resolved.yaml").write_text("{}\n")
    (run_dir / "eval.json").write_text("{}\n")
    (adapter / "adapter_config.json").write_text("{}\n")
    steps = 200_000  # 200 batches of metrics: the logging lasts seconds, so the signal lands inside it
    train = TrainResult(adapter_path=adapter, output_dir=adapter, fingerprint="f", steps=steps, world_size=1,
                        device="cpu", loss_curve=[(s, 1.0) for s in range(1, steps + 1)], first_loss=1.0,
                        final_loss=1.0, tokens_per_second=1.0, train_tokens=1, train_seconds=1.0, peak_memory_mb=1.0,
                        resumed_from_step=None)
    scores = ModelScores(loss=1.0, perplexity=2.7, generation_score=0.0, generated=1, generate_seconds=1.0)
    report = EvalReport(base=scores, adapter=scores, metric="exact_match", attn_implementation="sdpa", device="cpu",
                        eval_rows=1, samples=[], path=run_dir / "eval.json")
    result = FinetuneResult(run_dir=run_dir, adapter_path=adapter, cached_steps=[], train=train, eval=report)
    (tmp_path / "result.json").write_text(result.model_dump_json())
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    client.create_experiment("finetune-flows", artifact_location=str(tmp_path / "artifacts"))
    proc = subprocess.Popen([sys.executable, "-c", STOPPED_LOGGER, uri, str(tmp_path / "result.json")],
                            env=child_env(), cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        experiment = client.get_experiment_by_name("finetune-flows").experiment_id
        deadline = time.monotonic() + 120
        while not client.search_runs([experiment]):  # the MLflow run exists: logging is under way
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()[-3000:]
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        output = proc.communicate(timeout=60)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0, f"the logging finished before the signal: {output[-2000:]}"
    left = [(r.info.run_name, r.info.status) for r in client.search_runs([experiment])]
    assert left == [], f"a stopped logging left MLflow runs behind: {left}\n{output[-2000:]}"
