"""The worker policy through real deployment runs: a Prefect server, `make deploy`, `make worker` under a policy,
and `prefect deployment run` with parameters that ask for more than the policy allows.

Every refused run must fail with one message naming the key and the policy, and write nothing (no run
directory, no cache entry, nothing outside); the allowed run completes, and the token the worker host holds
appears in none of its logs or artifacts.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from finetune_flows.data.demo import ticket_triage
from tests.deploy_support import PREFECT, WORKER_HEARTBEAT_SECONDS, PrefectStack, demo_config

pytestmark = pytest.mark.slow

SECRET = "hf_policy_test_token_5d1c"
SECRET_ROW = "hunter2-in-a-private-file"


@pytest.fixture(scope="module")
def host(tmp_path_factory) -> Path:
    """The worker host's directories: allowed data, runs and cache roots, and a private directory outside."""
    tmp = tmp_path_factory.mktemp("policy-host")
    for d in ("data", "runs", "cache", "outside"):
        (tmp / d).mkdir()
    rows = ticket_triage(120, seed=5)
    (tmp / "data" / "tickets.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (tmp / "outside" / "private.jsonl").write_text(json.dumps({"prompt": "password?", "response": SECRET_ROW}) + "\n")
    (tmp / "runs" / "link").symlink_to(tmp / "outside")
    (tmp / "cache" / "link").symlink_to(tmp / "outside")
    (tmp / "data" / "private.jsonl").symlink_to(tmp / "outside" / "private.jsonl")
    return tmp


@pytest.fixture(scope="module")
def stack(host, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("policy-stack")
    s = PrefectStack(home=tmp / "home", logs=tmp / "logs", allow={
        "data_roots": [host / "data"], "output_roots": [host / "runs"], "cache_roots": [host / "cache"]})
    s.env["HF_TOKEN"] = SECRET  # the worker host holds a Hub token; no run of an untrusted source may see it
    with s.deployed():
        yield s


def tiny(host: Path, **extra: str) -> list[str]:
    base = {"model.source": "generated:tiny-llama", "data.source": str(host / "data" / "tickets.jsonl"),
            "data.format": "instruction", "data.max_length": 128, "train.max_steps": 2, "train.save_steps": 1,
            "train.per_device_batch_size": 4, "eval.max_samples": 4, "eval.max_new_tokens": 4, "eval.batch_size": 4,
            "hardware.gpus": "cpu", "export.merge": False, "run.name": "policy", "run.output_dir": str(host / "runs"),
            "run.cache_dir": str(host / "cache")}
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


def refusals(host: Path) -> dict[str, tuple[dict[str, str], str]]:
    """name -> (overrides, what the message must say)."""
    runs, cache, data, outside = (host / d for d in ("runs", "cache", "data", "outside"))
    return {
        "remote-code": ({"model.trust_remote_code": "true"}, "model.trust_remote_code=true runs code"),
        "hub-kernel": ({"hardware.attn_implementation": "kernels-community/flash-attn"},
                       "hardware.attn_implementation=kernels-community/flash-attn loads a Hub kernel"),
        "output-outside": ({"run.output_dir": str(outside)}, f"run.output_dir={outside} resolves to {outside}"),
        "output-dotdot": ({"run.output_dir": f"{runs}/../outside"}, f"run.output_dir={runs}/../outside resolves to"),
        "output-symlink": ({"run.output_dir": str(runs / "link")}, f"run.output_dir={runs / 'link'} resolves to "
                                                                   f"{outside}"),
        "cache-dotdot": ({"run.cache_dir": f"{cache}/../outside"}, f"run.cache_dir={cache}/../outside resolves to"),
        "cache-symlink": ({"run.cache_dir": str(cache / "link")}, f"run.cache_dir={cache / 'link'} resolves to "
                                                                  f"{outside}"),
        "data-outside": ({"data.source": str(outside / "private.jsonl")}, "outside the policy's data_roots"),
        "data-symlink": ({"data.source": str(data / "private.jsonl")},
                         f"data.source={data / 'private.jsonl'} resolves to {outside / 'private.jsonl'}"),
    }


@pytest.fixture(scope="module")
def runs(stack, host):
    """Every refused run and the allowed one, triggered together with `prefect deployment run`."""
    ids = {name: stack.deployment_run("finetune/on-demand", config=demo_config(tiny(host, **overrides)))
           for name, (overrides, _) in refusals(host).items()}
    ids["allowed"] = stack.deployment_run("finetune/on-demand", config=demo_config(tiny(host)))
    # a caller's own policy (remote code allowed) through a job variable, for a run that needs remote code
    swapped = PrefectStack.write_policy(host / "callers-policy.yaml", {
        "remote_code": True, "data_roots": [host / "data"], "output_roots": [host / "runs"],
        "cache_roots": [host / "cache"]})
    # the pool's template takes no `env` or `command`, so a caller who gets past the server's check of job
    # variables (POST /flow_runs/ does not check them) reaches the worker with both: the worker must refuse the run
    # before any process starts (Prefect's own process worker would put the caller's PYTHONPATH, whose
    # sitecustomize.py runs at interpreter start, in the flow process's environment)
    ids["policy-swap"] = created_past_the_check(stack, "finetune/on-demand", config=demo_config(tiny(host, **{
        "model.trust_remote_code": "true"})), job_variables={
            "env": {"FINETUNE_FLOWS_POLICY": str(swapped), "PYTHONPATH": str(planted(host, "policy-swap"))},
            "command": f"touch {host / 'marker-api'}"})
    # the same through a dotted name, which Prefect's worker also merges into `env`
    ids["env-dotted"] = created_past_the_check(stack, "finetune/on-demand", config=demo_config(tiny(host)),
                                               job_variables={"env.PYTHONPATH": str(planted(host, "env-dotted"))})
    finished = stack.wait_for(list(ids.values()), timeout=900)
    return {name: (i, finished[i]) for name, i in ids.items()}


def planted(host: Path, name: str) -> Path:
    """A directory whose sitecustomize.py (run by any Python that has it on PYTHONPATH) writes marker-<name>."""
    directory = host / "planted" / name
    directory.mkdir(parents=True)
    marker = host / f"marker-{name}"
    (directory / "sitecustomize.py").write_text(f"open({str(marker)!r}, 'w').write('caller code ran')\n")
    return directory


def created_past_the_check(stack, name: str, job_variables: dict, **params) -> str:
    """A flow run of deployment `name` with these job variables, created through POST /flow_runs/ (which, unlike
    `prefect deployment run`, does not check job variables against the pool's template); returns its id."""
    with stack.client() as client:
        deployment = client.read_deployment_by_name(name)
    reply = stack.post("/flow_runs/", {
        "flow_id": str(deployment.flow_id), "deployment_id": str(deployment.id), "parameters": params,
        "work_pool_name": "finetune-gpu", "work_queue_name": "default", "job_variables": job_variables,
        "state": {"type": "SCHEDULED", "name": "Scheduled"}})
    assert reply.status_code == 201, reply.text
    return reply.json()["id"]


def messages(stack, flow_run_id: str) -> str:
    return "\n".join(log.message for log in stack.logs_of(flow_run_id))


@pytest.mark.parametrize("name", list(refusals(Path("/h"))))
def test_a_run_asking_for_more_than_the_policy_is_refused_and_writes_nothing(stack, host, runs, name):
    flow_run_id, run = runs[name]
    assert run.state.type.value == "FAILED", (name, run.state.message)
    text = messages(stack, flow_run_id)
    policy_file = stack.policy
    assert f"refused by the worker policy ({policy_file})" in text, text[-3000:]
    assert refusals(host)[name][1] in text, text[-3000:]
    assert "Traceback" not in text, text[-3000:]  # bad input: its message, not the engine's stack as well
    assert SECRET_ROW not in text and SECRET not in text
    assert sorted(p.name for p in (host / "outside").iterdir()) == ["private.jsonl"]  # nothing written outside


@pytest.mark.parametrize("variable, value", [
    ("command", "touch {marker}"),
    ("env", {"FINETUNE_FLOWS_POLICY": "{policy}"}),
    ("working_dir", "{host}"),
])
def test_the_pool_refuses_a_run_that_sets_command_env_or_working_dir(stack, host, variable, value):
    """The pool `make deploy` creates (deployments/process-pool-template.json) fixes what starts a run and its
    environment: `prefect deployment run --job-variable` for any of them is refused before a run exists."""
    marker = host / f"marker-{variable}"
    fill = {"marker": marker, "policy": host / "callers-policy.yaml", "host": host}
    value = ({k: v.format(**fill) for k, v in value.items()} if isinstance(value, dict) else value.format(**fill))
    with stack.client() as client:
        before = len(client.read_flow_runs())
    argv = [PREFECT, "deployment", "run", "finetune/on-demand", "--job-variable", f"{variable}={json.dumps(value)}"]
    result = subprocess.run(argv, env=stack.env, capture_output=True, text=True, timeout=120)
    out = " ".join((result.stdout + result.stderr).split())
    assert result.returncode != 0, out
    assert f"Error creating flow run: Validation failed. Failure reason: Additional properties are not allowed " \
           f"('{variable}' was unexpected)" in out, out
    with stack.client() as client:
        assert len(client.read_flow_runs()) == before  # no run was created
    time.sleep(3)  # a worker polls every 2 s here: nothing must start
    assert not marker.exists()


@pytest.mark.parametrize("name, refused", [
    ("policy-swap", ["the run's job variables set command, which the pool's template does not declare (a run may "
                     "set only labels, name, stream_output)",
                     "the run's job variables set env (FINETUNE_FLOWS_POLICY, PYTHONPATH), which the pool's template "
                     "does not declare"]),
    ("env-dotted", ["the run's job variables set env.PYTHONPATH, which the pool's template does not declare"]),
])
def test_a_job_variable_cannot_swap_the_worker_policy_or_run_a_command(stack, host, runs, name, refused):
    """A run created past the server's check (POST /flow_runs/) with `env` or `command`: `make worker`'s worker
    (deployments/worker.py) refuses it before the flow process starts, so no caller code runs, not even at
    interpreter start, and the run ends Crashed with the refusal."""
    flow_run_id, run = runs[name]
    assert not (host / f"marker-{name}").exists()  # the caller's sitecustomize.py never ran
    assert not (host / "marker-api").exists()  # nor the caller's command
    assert run.state.type.value == "CRASHED", run.state.message
    message = run.state.message
    assert "refused by the worker, before the flow process started: " in message, message
    for problem in refused:
        assert problem in message, message
    text = messages(stack, flow_run_id)
    assert refused[0] in text, text[-3000:]
    with stack.client() as client:
        states = [state.type.value for state in client.read_flow_run_states(run.id)]
    assert "RUNNING" not in states, states  # no flow process ever reported in
    assert "run allowed" not in text and "worker policy" not in text


def test_refused_runs_left_no_run_directory_and_no_cache_entry(host, runs):
    allowed_dirs = {p.name for p in (host / "runs").iterdir()} - {"link"}
    assert len(allowed_dirs) == 1 and next(iter(allowed_dirs)).startswith("policy-")  # only the allowed run's
    # (the machine probe is kept where FINETUNE_FLOWS_PROBE_DIR says, which the test session sets, and `compile/` holds
    # the compilers' own caches, made by the allowed run's workers when anything compiles: neither is a cache entry)
    kept = ("link", "environment-probes", "compile")
    assert sorted(p.name for p in (host / "cache").iterdir() if p.name not in kept) == [
        ".locks", ".verified", "adapters", "datasets", "dequantized", "evals", "models", "quantized", "tokenizers"]


def test_the_allowed_run_completes_and_never_shows_the_hosts_token(stack, host, runs):
    flow_run_id, run = runs["allowed"]
    assert run.state.type.value == "COMPLETED", (run.state.message, messages(stack, flow_run_id)[-3000:])
    text = messages(stack, flow_run_id)
    assert "worker policy" in text and "run allowed (remote code refused, secrets withheld)" in text
    assert SECRET not in text
    for artifact in stack.artifacts_of(flow_run_id).values():
        assert SECRET not in json.dumps(artifact.data if not isinstance(artifact.data, str) else artifact.data)
    (run_dir,) = [p for p in (host / "runs").iterdir() if p.name.startswith("policy-")]
    for f in run_dir.rglob("*"):
        if f.is_file():
            assert SECRET.encode() not in f.read_bytes(), f


def test_a_pool_template_changed_through_the_api_keeps_the_worker_from_starting_runs(stack, host, runs, tmp_path):
    """Whoever can update the work pool through the API could declare `env` again (Prefect's default process
    template does): the server then lets `prefect deployment run --job-variable env=...` through, but the worker
    checks against the host's deployments/process-pool-template.json and refuses every run while the server's
    copy differs. Last in the module: it changes the pool, and `make pool` sets it back."""
    from prefect.workers.process import ProcessWorker

    template = tmp_path / "prefect-default-template.json"
    template.write_text(json.dumps(ProcessWorker.get_default_base_job_template()))
    stack.run([PREFECT, "work-pool", "update", "finetune-gpu", "--base-job-template", str(template)])
    try:
        time.sleep(WORKER_HEARTBEAT_SECONDS + 3)  # the worker reads the pool again at its next heartbeat
        flow_run_id = stack.deployment_run("finetune/on-demand", config=demo_config(tiny(host)), job_variables={
            "env": {"PYTHONPATH": str(planted(host, "pool-changed"))}})
        run = stack.wait_for([flow_run_id], timeout=300)[flow_run_id]
    finally:
        stack.make("pool")
    assert not (host / "marker-pool-changed").exists()
    assert run.state.type.value == "CRASHED", run.state.message
    message = run.state.message
    assert "refused by the worker, before the flow process started: the base job template of work pool " \
           "'finetune-gpu' on the server differs from this worker's process-pool-template.json" in message, message
    assert "the run's job variables set env (PYTHONPATH), which the pool's template does not declare" in message
