"""`make worker`'s worker (deployments/worker.py) refuses job variables the pool's template does not declare.

These check the rule on its own; tests/test_policy_deployments.py runs it in a real worker against a real server.
"""

from __future__ import annotations

import asyncio
import copy
import json
from uuid import uuid4

import pytest
from prefect.client.schemas.objects import FlowRun, WorkPool

from deployments.worker import (TEMPLATE, CheckedJobConfiguration, CheckedProcessWorker, JobVariablesRefused,
                                refused_job_variables)

HOST = json.loads(TEMPLATE.read_text())
RUN = "the run's"


@pytest.mark.parametrize("variables, problem", [
    ({"env": {"LD_PRELOAD": "/tmp/x.so", "PYTHONPATH": "/tmp"}},
     "the run's job variables set env (LD_PRELOAD, PYTHONPATH), which the pool's template does not declare "
     "(a run may set only labels, name, stream_output)"),
    ({"env": {}}, "the run's job variables set env, which"),
    ({"env.LD_PRELOAD": "/tmp/x.so"}, "the run's job variables set env.LD_PRELOAD, which"),
    ({"command": "touch /tmp/x"}, "the run's job variables set command, which"),
    ({"working_dir": "/tmp"}, "the run's job variables set working_dir, which"),
    ({"labels": {"team": 1}}, "the run's job variables: labels.team: 1 is not of type 'string'"),
    ({"stream_output": "yes"}, "the run's job variables: stream_output: 'yes' is not valid"),
])
def test_a_variable_the_template_does_not_declare_or_a_value_its_schema_refuses_is_named(variables, problem):
    (found,) = refused_job_variables(HOST, {RUN: variables})
    assert found.startswith(problem), found


def test_what_the_template_declares_is_allowed_and_both_sources_are_checked():
    allowed = {"name": "run-1", "labels": {"team": "nlp"}, "stream_output": False}
    assert refused_job_variables(HOST, {"the deployment's": {"stream_output": True}, RUN: allowed}) == []
    assert refused_job_variables(HOST, {"the deployment's": None, RUN: None}) == []
    found = refused_job_variables(HOST, {"the deployment's": {"env": {"PYTHONPATH": "/x"}}, RUN: allowed})
    assert [p.split(",")[0] for p in found] == ["the deployment's job variables set env (PYTHONPATH)"]


def test_a_template_without_a_variables_schema_allows_nothing():
    assert refused_job_variables({"job_configuration": {}}, {RUN: {"name": "x"}}) == [
        "the run's job variables set name, which the pool's template does not declare (it declares none)"]


def resolve(job_variables: dict, pool_template: dict, deployment_variables: dict | None = None):
    """CheckedJobConfiguration.resolve_for_flow_run as the worker calls it; no client, so a run that got past
    the check would fail on the first API call instead (an AttributeError on None)."""
    deployment = type("Deployment", (), {"job_variables": deployment_variables})()
    flow_run = FlowRun(flow_id=uuid4(), deployment_id=uuid4(), job_variables=job_variables)
    pool = WorkPool(name="finetune-gpu", type="process", base_job_template=pool_template)
    return asyncio.run(CheckedJobConfiguration.resolve_for_flow_run(
        flow_run, client=None, work_pool=pool, worker_name="w", deployment=deployment))


def test_the_worker_refuses_a_run_with_env_before_it_builds_anything():
    with pytest.raises(JobVariablesRefused) as refused:
        resolve({"env": {"LD_PRELOAD": "/tmp/x.so"}}, HOST)
    assert str(refused.value).startswith("refused by the worker, before the flow process started: the run's job "
                                         "variables set env (LD_PRELOAD), which the pool's template does not declare")
    with pytest.raises(JobVariablesRefused, match="the deployment's job variables set command"):
        resolve({}, HOST, deployment_variables={"command": "touch /tmp/x"})
    with pytest.raises(AttributeError):  # allowed: it goes on to read the flow, here from no client at all
        resolve({"name": "x"}, HOST)


def test_the_worker_refuses_every_run_while_the_servers_template_differs_from_the_hosts():
    from prefect.workers.process import ProcessWorker

    changed = copy.deepcopy(HOST)
    changed["job_configuration"]["command"] = "touch /tmp/x"
    for pool_template in (changed, ProcessWorker.get_default_base_job_template()):
        with pytest.raises(JobVariablesRefused, match="the base job template of work pool 'finetune-gpu' on the "
                                                      "server differs from this worker's process-pool-template.json"):
            resolve({}, pool_template)


def test_the_worker_is_prefects_process_worker_with_the_checked_configuration():
    assert CheckedProcessWorker.type == "process"
    assert CheckedProcessWorker.job_configuration is CheckedJobConfiguration
