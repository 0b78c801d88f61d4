"""deployments/prefect.yaml for real: server, `make deploy`, `make worker`, `prefect deployment run`, the UI.

One Prefect stack serves the module (tests/deploy_support.py). First the typed `config` parameter: its schema,
bad values refused by the server and by the run form in headless Chromium. Then two on-demand runs start together
on one host whose device (the CPU here) has a one-slot limit, so their training and evaluation must take turns;
then the evaluation-only deployment scores the adapter one of them produced; then headless Chromium opens the UI.
Screenshots land in test-outputs/.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from finetune_flows.config.parameters import config_parameter
from tests.deploy_support import (PREFECT, ROOT, chromium, chromium_eval, demo_config, running_stack, table_rows,
                                  visible_text)

pytestmark = pytest.mark.slow

PREFECT_FILE = ROOT / "deployments" / "prefect.yaml"
OUTPUTS = ROOT / "test-outputs"
HOST_SLOT = f"device-{socket.gethostname().replace('.', '-')}-cpu"
ARTIFACT_KEYS = {"environment-report", "train-progress", "train-loss", "step-cache", "adapter-location",
                 "run-summary", "eval-metrics", "eval-samples"}


def tiny_overrides(tmp: Path, seed: int) -> list[str]:
    """The on-demand deployment's demo config, shrunk to the generated 2-layer model (no download)."""
    return ["model.source=generated:tiny-llama", "data.builtin_examples=120", "data.max_length=128",
            "train.max_steps=4", "train.save_steps=2", "train.logging_steps=1", "train.per_device_batch_size=4",
            f"train.seed={seed}", "eval.max_samples=8", "eval.max_new_tokens=6", "eval.batch_size=8",
            "hardware.gpus=cpu", "run.name=tiny", f"run.cache_dir={tmp / 'cache'}", f"run.output_dir={tmp / 'runs'}"]


def table_data(artifact) -> list[dict]:
    return json.loads(artifact.data) if isinstance(artifact.data, str) else artifact.data


def deployments() -> list[dict]:
    return yaml.safe_load(PREFECT_FILE.read_text())["deployments"]


# ---------------------------------------------------------------- the YAML itself (no server)


def config_file(deployment: dict) -> str | None:
    """The YAML file a deployment's build step loads into its typed `config` parameter (None: no such step)."""
    params = deployment.get("parameters", {})
    if "config" not in params:
        return None
    ((fqn, step),) = [item for step in deployment.get("build", []) for item in step.items()]
    assert fqn == "finetune_flows.config.parameters.deployment_config"
    assert params["config"] == "{{ " + step["id"] + ".config }}", "the parameter must be the step's output"
    return step["path"]


@pytest.mark.parametrize("deployment", deployments(), ids=lambda d: d["name"])
def test_deployment_parameters_are_the_typed_config_of_a_yaml_file(deployment):
    import inspect

    from prefect.flows import load_flow_from_entrypoint

    from finetune_flows.config.schema import FinetuneConfig, load_config

    flow = load_flow_from_entrypoint(str(ROOT / deployment["entrypoint"]))
    signature = inspect.signature(flow.fn, eval_str=True)
    params = deployment.get("parameters", {})
    assert set(params) <= set(signature.parameters), f"unknown parameters {set(params) - set(signature.parameters)}"
    assert signature.parameters["config"].annotation in (FinetuneConfig, FinetuneConfig | None)
    config = config_file(deployment)
    if config:
        data = load_config(ROOT / config).data.source
        assert data.startswith(("builtin:", "hub:")) or (ROOT / data).is_file(), f"{config} trains on missing {data}"
    assert deployment["work_pool"]["name"] == "finetune-gpu"
    required = {n for n, p in signature.parameters.items() if p.default is inspect.Parameter.empty}
    assert required <= set(params) | {"adapter"}, "only the adapter to evaluate may be left to the caller"


def test_nightly_deployment_is_scheduled_with_a_timezone_and_names_its_data():
    nightly = next(d for d in deployments() if d["name"] == "nightly")
    (schedule,) = nightly["schedules"]
    assert len(schedule["cron"].split()) == 5 and schedule["timezone"] and schedule["active"] is True
    from finetune_flows.config.schema import load_config

    assert load_config(ROOT / config_file(nightly)).data.source == "data/nightly-tickets.jsonl"


def test_evaluate_refuses_a_directory_that_is_not_an_adapter(tmp_path, capsys):
    from flows.evaluate import main
    from finetune_flows.evaluation.adapters import AdapterError, check_adapter_dir

    with pytest.raises(AdapterError, match="adapter directory not found"):
        check_adapter_dir(tmp_path / "nope")
    (tmp_path / "adapter.safetensors").write_text("")
    with pytest.raises(AdapterError, match="adapter.safetensors is a file, not an adapter directory"):
        check_adapter_dir(tmp_path / "adapter.safetensors")
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(AdapterError, match="no adapter_config.json, no adapter_model.safetensors"):
        check_adapter_dir(tmp_path)
    (tmp_path / "adapter_config.json").write_text("{}")
    assert main(["--adapter", str(tmp_path)]) == 2  # before any Prefect run or model load
    assert "not a PEFT adapter directory" in capsys.readouterr().err


def test_truncated_weights_are_named_before_anything_loads(tmp_path):
    """An interrupted copy of an adapter or a merged checkpoint: a SafetensorError traceback from the checks (adapter),
    or the base evaluated first and then a crash, a retry and 15 tracebacks (merged)."""
    from safetensors.torch import save_file
    import torch

    from finetune_flows.evaluation.adapters import AdapterError, check_adapter_dir, check_merged_dir

    for kind, name in (("adapter", "adapter_model.safetensors"), ("merged", "model.safetensors")):
        d = tmp_path / kind
        d.mkdir()
        for config in ("adapter_config.json", "config.json", "tokenizer_config.json"):
            (d / config).write_text("{}")
        save_file({"w": torch.ones(64, 64)}, str(d / name))
        check = check_adapter_dir if kind == "adapter" else check_merged_dir
        assert check(d) == d.resolve()
        whole = (d / name).read_bytes()
        (d / name).write_bytes(whole[:-100])
        with pytest.raises(AdapterError, match=f"{name}: truncated or not a safetensors file \\({len(whole) - 100:,} "
                                               "bytes\\); copy it again"):
            check(d)


def test_evaluate_refuses_a_directory_that_is_neither_adapter_nor_checkpoint(tmp_path):
    """One line, exit status 2, and neither torch nor transformers imported: nothing was loaded."""
    import subprocess

    from finetune_flows.evaluation.adapters import AdapterError, check_evaluation_dir

    neither = tmp_path / "neither"
    neither.mkdir()
    (neither / "tokenizer_config.json").write_text("{}")
    probe = ("import sys; from flows.evaluate import main; code = main(['--merged', sys.argv[1]]); "
             "print(code, 'torch' in sys.modules, 'transformers' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", probe, str(neither)], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.stdout.split() == ["2", "False", "False"], done
    assert done.stderr.splitlines() == [
        f"error: {neither} is neither a PEFT adapter (no adapter_config.json) nor a merged checkpoint (no "
        "config.json): give the `adapter/` or `merged/` directory of a fine-tune run, e.g. runs/<run>/adapter or "
        "runs/<run>/merged"]
    (neither / "config.json").write_text("{}")  # a config without weights is no checkpoint either
    with pytest.raises(AdapterError, match=rf"{neither} is not a merged checkpoint: no model weights"):
        check_evaluation_dir(neither)
    (neither / "model.safetensors").write_bytes(b"")
    with pytest.raises(AdapterError, match="model.safetensors: truncated or not a safetensors file \\(0 bytes\\)"):
        check_evaluation_dir(neither)
    (neither / "model.safetensors").write_bytes((2).to_bytes(8, "little") + b"{}")  # a whole file holding no tensor
    assert check_evaluation_dir(neither).kind == "merged"
    with pytest.raises(AdapterError, match=rf"no such directory: {tmp_path / 'merged'} \(give the `adapter/` or "
                       "`merged/` directory"):  # `--merged runs/nope/merged` said "adapter directory not found"
        check_evaluation_dir(tmp_path / "merged")
    with pytest.raises(AdapterError, match=rf"{neither / 'config.json'} is a file, not a directory \(give the "
                       "`adapter/` or `merged/` directory"):  # it said "not an adapter directory", also for --merged
        check_evaluation_dir(neither / "config.json")


def test_a_run_directory_or_a_merged_checkpoint_given_as_the_adapter_is_named_so(tmp_path):
    """`--adapter runs/<run>` said only that no adapter_config.json was there, and export's `--adapter
    runs/<run>/merged` listed missing adapter files: the message now says what the directory is and what to give.
    Exit status 2, nothing loaded."""
    import subprocess

    run = tmp_path / "run"
    for d in ("adapter", "merged"):
        (run / d).mkdir(parents=True)
    (run / "merged" / "config.json").write_text("{}")
    probe = ("import sys; import flows.evaluate, flows.export\n"
             "for flow, target in [(flows.evaluate, sys.argv[1]), (flows.export, sys.argv[1]), "
             "(flows.export, sys.argv[2])]:\n"
             "    print(flow.main(['--adapter', target]))\n"
             "print('torch' in sys.modules, 'transformers' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", probe, str(run), str(run / "merged")], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.stdout.split() == ["2", "2", "2", "False", "False"], done
    assert done.stderr.splitlines() == [
        f"error: {run} is a run directory: give its adapter, {run / 'adapter'}, or its merged checkpoint, "
        f"{run / 'merged'}",
        f"error: {run} is a run directory, not an adapter: give its adapter, {run / 'adapter'}",
        f"error: {run / 'merged'} is a model checkpoint (config.json, no adapter_config.json), not an adapter "
        "(give the `adapter/` directory of a fine-tune run, e.g. runs/<run>/adapter)"]


def test_an_evaluation_on_another_split_than_the_adapters_run_is_named(tmp_path):
    """`evaluate.py --adapter runs/<run>/adapter --set data.eval_fraction=0.9` scored 108 "held-out" rows, most of
    them rows the adapter was trained on, without a word."""
    from finetune_flows.config.schema import load_config
    from finetune_flows.evaluation.adapters import split_changes

    trained = load_config(None, ["data.builtin_examples=120"])
    (tmp_path / "adapter").mkdir()
    (tmp_path / "config.resolved.yaml").write_text(trained.to_yaml())
    assert split_changes(tmp_path / "adapter", trained) == []
    assert split_changes(tmp_path / "adapter", load_config(None, ["data.builtin_examples=120", "eval.max_samples=5",
                                                                  "data.max_length=64"])) == []  # same rows
    other = load_config(None, ["data.builtin_examples=120", "data.eval_fraction=0.9", "data.seed=7"])
    assert split_changes(tmp_path / "adapter", other) == ["data.eval_fraction: 0.1 -> 0.9", "data.seed: 42 -> 7"]
    assert split_changes(tmp_path / "elsewhere" / "adapter", other) == []  # no run config to compare with


# ---------------------------------------------------------------- the real stack


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    base = tmp_path_factory.getbasetemp()  # the runs below write caches and outputs in temporary directories
    roots = {"output_roots": [base], "cache_roots": [base], "config_roots": [base]}
    with running_stack(tmp_path_factory.mktemp("prefect-stack"), allow=roots) as s:
        yield s


@pytest.fixture(scope="module")
def two_runs(stack, tmp_path_factory):
    """Two on-demand runs triggered at once with `prefect deployment run`, each with its own cache."""
    tmps = [tmp_path_factory.mktemp(f"run{i}") for i in (1, 2)]
    ids = [stack.deployment_run("finetune/on-demand", config=demo_config(tiny_overrides(t, seed=i)))
           for i, t in enumerate(tmps, 1)]
    runs = stack.wait_for(ids, timeout=420)
    return [(i, runs[i], t) for i, t in zip(ids, tmps)]


def test_deploy_creates_pool_deployments_and_device_limits(stack):
    with stack.client() as client:
        pool = client.read_work_pool("finetune-gpu")
        assert pool.type == "process"
        deps = {f"{client.read_flow(d.flow_id).name}/{d.name}": d for d in client.read_deployments()}
        limit = client.read_global_concurrency_limit_by_name(HOST_SLOT)
    assert set(deps) == {"finetune/on-demand", "finetune/nightly", "evaluate/existing-adapter"}
    nightly = deps["finetune/nightly"]
    (schedule,) = nightly.schedules
    assert (schedule.schedule.cron, schedule.schedule.timezone, schedule.active) == ("30 1 * * *", "Europe/Berlin",
                                                                                     True)
    assert nightly.parameters == {"config": config_parameter(ROOT / "configs" / "nightly.yaml")}  # every key
    # the runs' environment is the pool's (its template fixes it: a run cannot set `env`)
    assert pool.base_job_template["job_configuration"]["env"]["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert "env" not in nightly.job_variables
    assert limit.limit == 1


def test_device_limits_are_created_idempotently(stack):
    from prefect.client.schemas.actions import GlobalConcurrencyLimitUpdate

    argv = [sys.executable, "-m", "finetune_flows.orchestration.concurrency", "--gpus", "0,1", "--host", "other.host"]
    stack.run(argv)
    with stack.client() as client:
        client.update_global_concurrency_limit("device-other-host-gpu1", GlobalConcurrencyLimitUpdate(limit=3))
    out = stack.run(argv).stdout
    with stack.client() as client:
        limits = {n: client.read_global_concurrency_limit_by_name(n).limit
                  for n in ("device-other-host-gpu0", "device-other-host-gpu1", "device-other-host-cpu")}
    assert limits == dict.fromkeys(limits, 1), out


# ---------------------------------------------------------------- the typed config in the API and the UI


def flow_runs_of(stack, name: str) -> tuple[str, set[str]]:
    """The deployment's id and the ids of every flow run it has, in any state."""
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId

    with stack.client() as client:
        deployment = client.read_deployment_by_name(name)
        runs = client.read_flow_runs(deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment.id])))
    return str(deployment.id), {str(r.id) for r in runs}


def leaf_fields(model, prefix: str = ""):
    """(key, description) of every non-section field of a config model."""
    for name, field in model.model_fields.items():
        if hasattr(field.annotation, "model_fields"):
            yield from leaf_fields(field.annotation, f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}", field.description


def test_the_deployment_schema_holds_every_section_and_key_with_its_description(stack):
    from finetune_flows.config.schema import FinetuneConfig

    with stack.client() as client:
        schema = client.read_deployment_by_name("finetune/on-demand").parameter_openapi_schema
    definitions = schema["definitions"]

    def walk(model, node: dict, prefix: str = "") -> int:
        assert node["additionalProperties"] is False, f"{prefix or 'config'} must refuse unknown keys"
        checked = 0
        for name, field in model.model_fields.items():
            prop = node["properties"][name]
            assert prop["title"] == name and prop["description"] == field.description, f"{prefix}{name}: {prop}"
            if hasattr(field.annotation, "model_fields"):  # a section: a nested object of its own
                checked += walk(field.annotation, definitions[prop["$ref"].rsplit("/", 1)[1]], f"{prefix}{name}.")
            else:
                checked += 1
        return checked

    config = schema["properties"]["config"]
    assert "config" in schema["required"] and config["description"].startswith("The run configuration")
    top = definitions[config["$ref"].rsplit("/", 1)[1]]
    assert list(top["properties"]) == ["model", "data", "quantization", "lora", "train", "hardware", "eval",
                                       "tracking", "export", "run"]
    assert walk(FinetuneConfig, top) == len(list(leaf_fields(FinetuneConfig)))
    train = definitions["TrainConfig"]["properties"]
    assert (train["learning_rate"]["type"], train["learning_rate"]["exclusiveMinimum"]) == ("number", 0)


def test_a_bad_config_value_is_refused_by_the_server_before_any_run_exists(stack):
    """`prefect deployment run` sends the parameters as they are; the server checks them against the deployment's
    schema (enforce_parameter_schema) and creates no flow run, so no worker ever sees one."""
    deployment_id, before = flow_runs_of(stack, "finetune/on-demand")
    wrong_type = demo_config([])
    wrong_type["train"]["learning_rate"] = "fast"
    cases = [
        (["--param", f"config={json.dumps(wrong_type)}"],
         "'config.train.learning_rate'. Failure reason: 'fast' is not of type 'number'"),
        (["--params", json.dumps({"config": {"train": {"max_steps": -7}}})],
         "'config.train.max_steps'. Failure reason: -7 is less than the minimum of -1"),
        (["--params", json.dumps({"config": {"train": {"learning_rat": 1e-4}}})],
         "Additional properties are not allowed ('learning_rat' was unexpected)"),
    ]
    for argv, message in cases:
        done = subprocess.run([PREFECT, "deployment", "run", "finetune/on-demand", *argv], cwd=ROOT, env=stack.env,
                              capture_output=True, text=True, timeout=120)
        said = " ".join((done.stdout + done.stderr).split())
        assert done.returncode == 1 and message in said, said
    reply = stack.post(f"/deployments/{deployment_id}/create_flow_run", {"parameters": {"config": {"lora": {"r": 0}}}})
    assert reply.status_code == 409 and "'config.lora.r'" in reply.json()["detail"], reply.text
    assert flow_runs_of(stack, "finetune/on-demand")[1] == before, "a refused run was created"


def test_a_run_that_skips_the_servers_check_fails_on_the_models_own_validation(stack):
    """A caller may create a run with `enforce_parameter_schema: false`; the flow process then validates the
    parameter with the same model before the flow starts, so the run fails naming the key."""
    deployment_id, _ = flow_runs_of(stack, "finetune/on-demand")
    reply = stack.post(f"/deployments/{deployment_id}/create_flow_run", {
        "parameters": {"config": {"train": {"learning_rate": "fast"}}}, "enforce_parameter_schema": False})
    assert reply.status_code == 201, reply.text
    flow_run_id = reply.json()["id"]
    run = stack.wait_for([flow_run_id], timeout=300)[flow_run_id]
    assert run.state.type.value == "FAILED", run.state.message
    assert "config.train.learning_rate" in run.state.message, run.state.message
    assert not any(log.message.startswith("worker policy") for log in stack.logs_of(flow_run_id)), "the flow ran"


SET_FIELD = """(() => {{
  const label = [...document.querySelectorAll('label')].find(l => l.textContent.trim().startsWith('{key} '));
  const input = document.getElementById(label.htmlFor);
  Object.getOwnPropertyDescriptor(HTMLInputElement.prototype, 'value').set.call(input, '{value}');
  input.dispatchEvent(new Event('input', {{bubbles: true}}));
  input.dispatchEvent(new Event('change', {{bubbles: true}}));
  label.scrollIntoView({{block: 'center'}});
  return input.value;
}})()"""


def test_the_run_form_shows_the_config_and_refuses_a_bad_value(stack, tmp_path):
    """The deployment's custom-run page in headless Chromium: every section and key with its description, the
    deployment's values filled in; a negative learning rate is refused on Submit, by the form and by the server,
    and no flow run is created. The screenshot is docs/images/prefect-ui-run-form.png."""
    from finetune_flows.config.schema import FinetuneConfig

    deployment_id, before = flow_runs_of(stack, "finetune/on-demand")
    OUTPUTS.mkdir(exist_ok=True)
    refused = "-0.001 is less than or equal to the minimum of 0"
    server = "Error creating flow run: Validation failed for field 'config.train.learning_rate'"

    def interact(page):
        assert page.evaluate(SET_FIELD.format(key="learning_rate", value="-0.001")) == "-0.001"
        page.evaluate("[...document.querySelectorAll('button')].find(b => b.textContent.trim() === 'Submit').click()")
        page.wait(f"document.body.innerText.includes({json.dumps(refused)})")  # the form's own check
        page.wait(f"document.body.innerText.includes({json.dumps(server)})")  # the server's answer
        page.evaluate(SET_FIELD.format(key="learning_rate", value="-0.001"))  # centred for the screenshot
        time.sleep(1)  # the message's fade-in
        (OUTPUTS / "prefect-ui-run-form-refuses.png").write_bytes(page.screenshot())
        time.sleep(3)  # a run, had one been created, would have navigated away by now

    text, path = chromium_eval(
        f"{stack.url}/v2/deployments/deployment/{deployment_id}/run", tmp_path / "form",
        "[document.body.innerText, location.pathname]",
        "document.body && document.body.innerText.includes('learning_rate')", window="1300,900", interact=interact)
    text = " ".join(text.split())
    for section, field in FinetuneConfig.model_fields.items():
        assert f"{section} (Optional) {field.description}" in text, section
    for key, description in leaf_fields(FinetuneConfig):
        assert f"{key.rsplit('.', 1)[1]} (Optional) {' '.join(description.split())}" in text, key
    assert refused in text and path.endswith(f"/deployments/deployment/{deployment_id}/run"), path
    assert flow_runs_of(stack, "finetune/on-demand")[1] == before, "the form created a run with a bad value"
    assert (OUTPUTS / "prefect-ui-run-form-refuses.png").stat().st_size > 20_000


def test_on_demand_runs_complete_with_their_artifacts(stack, two_runs):
    for flow_run_id, run, _ in two_runs:
        assert run.state.type.value == "COMPLETED", (run.state.message, stack.logs_of(flow_run_id)[-20:])
        assert re.fullmatch(r"tiny/tiny-llama/[0-9a-f]{8}", run.name), run.name  # <run name>/<model>/<run id>
        assert {"finetune", "on-demand"} <= set(run.tags)
        artifacts = stack.artifacts_of(flow_run_id)
        assert ARTIFACT_KEYS <= set(artifacts), sorted(artifacts)
        assert artifacts["train-progress"].data == 100
        assert [row["model"] for row in table_data(artifacts["eval-metrics"])] == ["base", "base + adapter"]
        assert {artifacts[k].type for k in ("environment-report", "run-summary", "eval-samples")} == {"markdown"}


def flushed_logs(stack, flow_run_id, timeout: float = 60):
    """A finished run's logs once they have all arrived: the API marks the run finished before the run's last
    log batch (sent every few seconds) is written, so wait for the flow's own last line."""
    deadline = time.monotonic() + timeout
    while True:
        logs = stack.logs_of(flow_run_id)
        if any(log.task_run_id is None and log.message.startswith("Finished in state") for log in logs) \
                or time.monotonic() > deadline:
            return logs
        time.sleep(1)


def _slot_events(stack, flow_run_id):
    """(time, task run, what) for each device-slot and device-job log line of a flow run."""
    events = []
    for log in flushed_logs(stack, flow_run_id):
        m = re.match(r"(waiting for|acquired|releasing) device slot\(s\) (\S+)"
                     r"|starting (quantize|train|evaluate|export) worker", log.message)
        if m:
            events.append((log.timestamp, log.task_run_id, m.group(1) or f"start {m.group(3)}", log.message))
    return events


def test_device_slot_makes_the_two_runs_take_turns(stack, two_runs):
    holds, starts, waited = [], [], []
    for flow_run_id, _, _ in two_runs:
        acquired = {}
        for when, task_run, what, message in _slot_events(stack, flow_run_id):
            if what == "acquired":
                assert HOST_SLOT in message
                acquired[task_run] = when
                waited.append(float(re.search(r"after waiting ([0-9.]+) s", message).group(1)))
            elif what == "releasing":
                holds.append((acquired.pop(task_run), when, flow_run_id))
            elif what.startswith("start"):
                starts.append((when, what.split()[1], flow_run_id))
    assert len(holds) == 8, "quantization, training, evaluation and the merge of both runs each hold the slot"
    assert sorted(job for _, job, _ in starts) == sorted(["quantize", "train", "evaluate", "export"] * 2), starts
    holds.sort()
    for (_, end, a), (start, _, b) in zip(holds, holds[1:]):
        assert end <= start, f"device held by {a} until {end} and by {b} from {start}: overlap"
    for when, _, flow_run_id in starts:  # every device job started while its run held the slot
        assert any(s <= when <= e and r == flow_run_id for s, e, r in holds)
    assert max(waited) > 1.0, f"the runs never queued for the device (waits {waited}): the test proved nothing"


def test_evaluation_only_deployment_scores_an_existing_adapter(stack, two_runs):
    _, _, tmp = two_runs[0]
    (adapter,) = (tmp / "runs").glob("tiny-2*/adapter")  # runs/<run>/adapter, beside config.resolved.yaml
    flow_run_id = stack.deployment_run("evaluate/existing-adapter", adapter=str(adapter),
                                       config=config_parameter(adapter.parent / "config.resolved.yaml",
                                                               ["eval.max_samples=4"]))
    run = stack.wait_for([flow_run_id], timeout=240)[flow_run_id]
    assert run.state.type.value == "COMPLETED", (run.state.message, stack.logs_of(flow_run_id)[-20:])
    assert run.name == f"tiny/tiny-llama eval {adapter.parent.name}"
    artifacts = stack.artifacts_of(flow_run_id)
    assert {"environment-report", "eval-metrics", "eval-samples", "adapter-location", "run-summary",
            "eval-comparison"} <= set(artifacts)
    assert "train-loss" not in artifacts
    messages = [log.message for log in stack.logs_of(flow_run_id)]
    assert any(m.startswith("starting evaluate worker") for m in messages), "the adapter was not evaluated anew"
    (eval_dir,) = (tmp / "runs").glob("tiny-eval-*")
    assert (eval_dir / "evaluation.json").is_file() and (eval_dir / "eval.json").is_file()
    assert (eval_dir / "plots" / "eval.png").is_file()


def test_ui_shows_the_run_and_its_eval_table(stack, two_runs, tmp_path):
    flow_run_id, run, _ = two_runs[0]
    eval_metrics = stack.artifacts_of(flow_run_id)["eval-metrics"]
    OUTPUTS.mkdir(exist_ok=True)

    run_page = f"{stack.url}/v2/runs/flow-run/{flow_run_id}?tab=Artifacts"
    text = visible_text(chromium(run_page, tmp_path / "p1", "--dump-dom"))
    assert run.name in text and "Completed" in text
    assert all(key in text for key in ARTIFACT_KEYS), text[:3000]
    chromium(run_page, tmp_path / "p2", f"--screenshot={OUTPUTS / 'prefect-ui-flow-run-artifacts.png'}",
             window="1400,1500")  # tall enough for every artifact card

    artifact_page = f"{stack.url}/v2/artifacts/artifact/{eval_metrics.id}"
    rows = table_rows(chromium(artifact_page, tmp_path / "p3", "--dump-dom"))
    assert rows[0][:2] == ["model", "eval loss"], rows
    for want in table_data(eval_metrics):  # the table as rendered: model name and eval loss of each row
        assert [want["model"], str(want["eval loss"])] in [r[:2] for r in rows[1:]], rows
    shot = OUTPUTS / "prefect-ui-eval-metrics.png"
    chromium(artifact_page, tmp_path / "p4", f"--screenshot={shot}")
    assert shot.stat().st_size > 20_000
