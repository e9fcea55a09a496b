"""deploy/kubernetes: every manifest validates against the Kubernetes API schema (kubernetes-validate, strict: an
unknown or misspelt field fails), and the parts that no schema can check agree with each other and with
qasr-server: the flags exist, the probes hit the right endpoints on the container's port, the grace period
outlasts the preStop sleep plus the drain, the Service and the PodDisruptionBudget select the Deployment's pods.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml
from kubernetes_validate import utils as kubernetes_validate

from qasr.server import cli

MANIFESTS = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
# The oldest Kubernetes the manifests are for: the preStop `sleep` action is on by default from 1.30. Strict
# schemas reject fields a version does not know, so this also keeps newer-only fields out.
KUBERNETES_VERSION = "1.30.0"
STARTUP_BUDGET_S = 600  # the startup probe must wait at least this long for the model to load and warm up


def resources() -> list[dict]:
    documents = []
    for path in sorted(MANIFESTS.glob("*.yaml")):
        if path.name != "kustomization.yaml":
            documents += [document for document in yaml.safe_load_all(path.read_text()) if document]
    return documents


def the(kind: str) -> dict:
    [resource] = [resource for resource in resources() if resource["kind"] == kind]
    return resource


def server_container() -> dict:
    [container] = the("Deployment")["spec"]["template"]["spec"]["containers"]
    return container


@pytest.mark.parametrize("resource", resources(), ids=lambda resource: resource["kind"])
def test_manifest_validates_against_the_kubernetes_schema(resource):
    kubernetes_validate.validate(resource, KUBERNETES_VERSION, strict=True)


def test_a_misspelt_field_is_caught():
    deployment = copy.deepcopy(the("Deployment"))
    deployment["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {"httpGet": {"path": "/readyz"}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)


def test_kustomization_lists_every_manifest():
    kustomization = yaml.safe_load((MANIFESTS / "kustomization.yaml").read_text())
    files = {path.name for path in MANIFESTS.glob("*.yaml")} - {"kustomization.yaml"}
    assert sorted(kustomization["resources"]) == sorted(files)


def server_args() -> "cli.argparse.Namespace":
    container = server_container()
    assert container["command"] == ["qasr-server"]
    return cli.build_parser().parse_args(container["args"])  # an unknown or malformed flag exits here


def test_the_server_listens_on_the_container_port_on_every_interface():
    args = server_args()
    [port] = server_container()["ports"]
    assert args.host == "0.0.0.0" and args.port == port["containerPort"] and args.device == "cuda"


def test_one_gpu_per_replica():
    resources = server_container()["resources"]
    assert resources["limits"]["nvidia.com/gpu"] == 1 and resources["requests"]["nvidia.com/gpu"] == 1


def test_probes_use_readiness_for_traffic_and_health_for_restarts():
    container = server_container()
    [port] = container["ports"]
    probes = {name: container[name]["httpGet"] for name in ("startupProbe", "readinessProbe", "livenessProbe")}
    assert {name: probe["path"] for name, probe in probes.items()} == {
        "startupProbe": "/readyz", "readinessProbe": "/readyz", "livenessProbe": "/healthz"}
    assert all(probe["port"] in (port["name"], port["containerPort"]) for probe in probes.values())
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= STARTUP_BUDGET_S


def test_the_grace_period_outlasts_the_prestop_sleep_and_the_drain():
    pod = the("Deployment")["spec"]["template"]["spec"]
    pre_stop_s = server_container()["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert pod["terminationGracePeriodSeconds"] > pre_stop_s + server_args().drain_timeout_s


def test_service_and_disruption_budget_select_the_deployments_pods():
    deployment = the("Deployment")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    service = the("Service")
    assert service["spec"]["selector"].items() <= pod_labels.items()
    [service_port] = service["spec"]["ports"]
    assert service_port["targetPort"] in [port["name"] for port in server_container()["ports"]]
    budget = the("PodDisruptionBudget")
    assert budget["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert budget["spec"]["maxUnavailable"] < deployment["spec"]["replicas"]  # a disruption never takes them all
