"""deployments/kubernetes/ checked offline: the Prefect work-pool base job template against Prefect's server
validation and prefect-kubernetes' own template, the Job it renders and the other manifests against the Kubernetes
JSON schemas (`kubernetes-validate`, strict: unknown fields are errors), and the RayCluster against KubeRay's
CRD schema (vendored in tests/schemas/, see its README)."""

from __future__ import annotations

import asyncio
import copy
import json
import re
import tomllib
import uuid
from pathlib import Path

import jsonschema
import pytest

# installed by `make test` (pyproject's test extra); a GPU host given only the runtime wheels skips this file
kubernetes_validate = pytest.importorskip("kubernetes_validate")
import yaml

REPO = Path(__file__).resolve().parent.parent
K8S = REPO / "deployments" / "kubernetes"
RAYCLUSTER_SCHEMA = Path(__file__).parent / "schemas" / "raycluster-ray.io-v1-kuberay-1.7.0.json"
KUBERNETES_VERSION = "1.33"  # the oldest minor release the manifests claim to work on


def template() -> dict:
    return json.loads((K8S / "base-job-template.json").read_text())


def validate_k8s(resource: dict) -> None:
    kubernetes_validate.validate(resource, KUBERNETES_VERSION, strict=True)


def strict_openapi(schema: dict) -> dict:
    """Like `kubectl apply --validate=strict`: unknown fields are errors where the CRD does not allow them (the API
    server would silently drop them otherwise, so a typo would go unnoticed)."""
    schema = copy.deepcopy(schema)

    def walk(node):
        if isinstance(node, dict):
            if ("properties" in node and "additionalProperties" not in node
                    and not node.get("x-kubernetes-preserve-unknown-fields")):
                node["additionalProperties"] = False
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(schema)
    return schema


def validate_raycluster(resource: dict) -> None:
    schema = strict_openapi(json.loads(RAYCLUSTER_SCHEMA.read_text()))
    jsonschema.Draft7Validator(schema).validate(resource)
    spec = resource["spec"]
    # the pod templates, as Kubernetes sees them
    for group in [spec["headGroupSpec"], *spec.get("workerGroupSpecs", [])]:
        validate_k8s({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "check"},
                      "template": group["template"]})


def rendered_job(tpl: dict, values: dict) -> dict:
    """The Job manifest a Kubernetes worker would submit for a flow run, built by prefect-kubernetes' own code."""
    from prefect.client.schemas.objects import FlowRun
    from prefect.settings import PREFECT_API_URL, temporary_settings
    from prefect_kubernetes.worker import KubernetesWorkerJobConfiguration

    with temporary_settings({PREFECT_API_URL: "http://prefect-server.prefect.svc.cluster.local:4200/api"}):
        cfg = asyncio.run(KubernetesWorkerJobConfiguration.from_template_and_values(tpl, values))
        cfg.prepare_for_flow_run(FlowRun(id=uuid.uuid4(), name="tiny-otter", flow_id=uuid.uuid4()))
    return cfg.job_manifest


def without_prefect_pod_fields(job: dict) -> dict:
    """prefect-kubernetes insists on `parallelism: 1` and `completions: 1` inside the *pod* spec (its default
    template has them there and its validator rejects a template without them); Kubernetes ignores them there.
    They are the only fields the strict schema would not know."""
    job = copy.deepcopy(job)
    pod = job["spec"]["template"]["spec"]
    assert pod.pop("parallelism") == 1 and pod.pop("completions") == 1
    return job


def test_base_job_template_passes_prefect_server_validation():
    from prefect.server.schemas.actions import WorkPoolCreate

    pool = WorkPoolCreate(name="finetune-k8s", type="kubernetes", base_job_template=template())
    assert pool.base_job_template["variables"]["properties"]["gpus"]["default"] == 1


def test_base_job_template_keeps_the_shape_of_prefect_kubernetes_default():
    from prefect_kubernetes.worker import KubernetesWorker

    default, ours = KubernetesWorker.get_default_base_job_template(), template()
    assert set(ours["job_configuration"]) == set(default["job_configuration"])
    for key, value in default["job_configuration"].items():
        if key != "job_manifest":
            assert ours["job_configuration"][key] == value, key  # the worker reads these placeholders
    theirs_vars, our_vars = default["variables"]["properties"], ours["variables"]["properties"]
    assert set(theirs_vars) <= set(our_vars)  # every option of the worker (and its UI form) is still there
    for name, prop in theirs_vars.items():
        type_of = lambda p: (p.get("type"), json.dumps(p.get("anyOf"), sort_keys=True), p.get("$ref"))  # noqa: E731
        assert type_of(our_vars[name]) == type_of(prop), name
    # our defaults satisfy the variables schema (what the UI form and `prefect deployment run` check)
    defaults = {k: v["default"] for k, v in our_vars.items() if "default" in v}
    jsonschema.Draft202012Validator(ours["variables"]).validate(defaults)


def test_rendered_job_requests_gpus_shared_memory_and_gpu_nodes_and_is_a_valid_job():
    job = rendered_job(template(), {"gpus": 4, "image": "registry.example/finetune-flows:1.0",
                                    "node_selector": {"nvidia.com/gpu.product": "NVIDIA-H200"}})
    pod = job["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 4
    assert container["resources"]["requests"]["nvidia.com/gpu"] == 4
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
    assert volumes[mounts["/cache"]]["persistentVolumeClaim"]["claimName"] == "finetune-flows-cache"
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H200"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["FINETUNE_FLOWS_CACHE"] == "/cache" and env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert container["args"] == ["prefect", "flow-run", "execute"]
    validate_k8s(without_prefect_pod_fields(job))


def test_run_directories_outlive_the_pod():
    """A run writes `runs/<run>/` under FINETUNE_FLOWS_ROOT (the pull step's directory): that must be the claim, not
    the container's own disk, or the adapter, config.resolved.yaml and the nightly's previous runs vanish with it."""
    pod = rendered_job(template(), {})["spec"]["template"]["spec"]
    container = pod["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    runs = next(m for m in container["volumeMounts"] if m["mountPath"] == f"{env['FINETUNE_FLOWS_ROOT']}/runs")
    volume = next(v for v in pod["volumes"] if v["name"] == runs["name"])
    assert volume["persistentVolumeClaim"]["claimName"] == "finetune-flows-cache" and runs["subPath"] == "runs"


@pytest.mark.parametrize("ray_address", ["auto", "ray://finetune-ray-head-svc:10001"])
def test_a_deployment_run_in_the_rendered_pod_passes_the_pods_policy(tmp_path, monkeypatch, ray_address):
    """The pod's environment names the policy shipped in the image (worker-policy.yaml): a run there may use the
    claim at /cache, write its run directory and train on raycluster.yaml's cluster through its head service."""
    import finetune_flows.runtime.policy as policy_mod

    container = rendered_job(template(), {})["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    image_root = env["FINETUNE_FLOWS_ROOT"]
    for name in ("FINETUNE_FLOWS_CACHE", "FINETUNE_FLOWS_ROOT", "FINETUNE_FLOWS_POLICY"):
        monkeypatch.setenv(name, env[name].replace(image_root, str(REPO)))  # this checkout stands in for the image
    monkeypatch.chdir(REPO)  # FINETUNE_FLOWS_ROOT, where the pull step puts the run
    monkeypatch.setattr(policy_mod._Decision, "secrets_allowed", None)
    # a deployment run whose job variables set nothing of the host's (read from the server, which is not here)
    monkeypatch.setattr(policy_mod, "in_deployment_run", lambda: True)
    monkeypatch.setattr(policy_mod, "refuse_host_settings_in_job_variables", lambda: None)
    policy = policy_mod.current_policy()
    assert policy.source == str(K8S / "worker-policy.yaml")
    assert policy.cache_roots == [Path("/cache")] and policy.output_roots == [REPO / "runs"]
    cfg = policy_mod.checked_config(None, ["model.source=generated:tiny-llama", "hardware.launcher=ray",
                                           f"hardware.ray_address={ray_address}"])
    assert cfg.cache_root == Path("/cache")


def test_a_misspelled_field_in_the_job_template_is_caught():
    tpl = template()
    pod = tpl["job_configuration"]["job_manifest"]["spec"]["template"]["spec"]
    pod["nodeSelecter"] = pod.pop("nodeSelector")
    with pytest.raises(jsonschema.ValidationError, match="nodeSelecter"):
        validate_k8s(without_prefect_pod_fields(rendered_job(tpl, {})))


def test_raycluster_matches_the_kuberay_crd_and_requests_gpu_workers():
    cluster = yaml.safe_load((K8S / "raycluster.yaml").read_text())
    assert (cluster["apiVersion"], cluster["kind"]) == ("ray.io/v1", "RayCluster")
    validate_raycluster(cluster)
    head = cluster["spec"]["headGroupSpec"]
    assert head["rayStartParams"]["num-cpus"] == "0"  # no training worker lands on the head
    for group in cluster["spec"]["workerGroupSpecs"]:
        pod = group["template"]["spec"]
        container = pod["containers"][0]
        assert int(container["resources"]["limits"]["nvidia.com/gpu"]) >= 1
        volumes = {v["name"]: v for v in pod["volumes"]}
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
        assert "cache" in volumes and mounts["/cache"] == "cache"
        assert pod["nodeSelector"] and pod["tolerations"]
    # the cluster runs the Ray that the `ray` extra installs: Ray refuses clients of another version
    extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["ray"]
    pinned = next(re.search(r"==([\w.]+)", r).group(1) for r in extra if r.startswith("ray["))
    assert cluster["spec"]["rayVersion"] == pinned


def test_a_misspelled_field_in_the_raycluster_is_caught():
    cluster = yaml.safe_load((K8S / "raycluster.yaml").read_text())
    cluster["spec"]["workerGroupSpecs"][0]["replica"] = cluster["spec"]["workerGroupSpecs"][0].pop("replicas")
    with pytest.raises(jsonschema.ValidationError, match="replica"):
        validate_raycluster(cluster)
    cluster = yaml.safe_load((K8S / "raycluster.yaml").read_text())
    cluster["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["resource"] = {}
    with pytest.raises(jsonschema.ValidationError, match="resource"):
        validate_raycluster(cluster)


def test_cache_volume_claim_is_a_valid_shared_claim():
    claim = yaml.safe_load((K8S / "cache-pvc.yaml").read_text())
    validate_k8s(claim)
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]  # pods on different nodes write the cache
    assert claim["metadata"]["name"] == template()["variables"]["properties"]["cache_claim"]["default"]
