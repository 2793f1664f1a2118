"""Issue 43, Kubernetes (m32): the manifests of deploy/kubernetes/ validate offline against
the Kubernetes schemas (kubernetes-validate, strict: an unknown field fails; its schemas ship
in the wheel, nothing is fetched), and say what the server does: every container's command
line parses as a `nanollmserve` one, the probes are /ready and /live, the grace period
covers the preStop sleep, --shutdown-timeout and the server's 10 s backstop, the memory
request covers --kv-cache-memory, the disruption budgets select the pods, and the autoscaling
example reads the gauge /metrics serves and scales no further than the router lists."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from nanollmserve.cli.main import build_parser
from nanollmserve.sizes import parse_size

pytestmark = pytest.mark.milestone("m32")

kubernetes_validate = pytest.importorskip("kubernetes_validate")  # the dev extra has it

ROOT = Path(__file__).resolve().parents[1]
MANIFESTS = ROOT / "deploy" / "kubernetes"
VERSIONS = ("1.29.0", kubernetes_validate.latest_version())
"""The oldest Kubernetes the manifests promise (docs/features/distributed.md) and the newest
the validator knows."""
UVICORN_BACKSTOP_S = 10  # cli/serve.py: timeout_graceful_shutdown = --shutdown-timeout + 10
QUANTITY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}


def documents() -> list[tuple[str, dict]]:
    found = []
    for path in sorted(MANIFESTS.rglob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is not None:
                found.append((f"{path.relative_to(ROOT)} {doc['kind']}", doc))
    return found


def by_kind(kind: str) -> list[dict]:
    return [doc for _, doc in documents() if doc["kind"] == kind]


def workloads() -> list[dict]:
    return by_kind("Deployment") + by_kind("StatefulSet")


def containers() -> list[tuple[dict, dict]]:
    return [(w, c) for w in workloads() for c in w["spec"]["template"]["spec"]["containers"]]


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def quantity(text: str) -> int:
    for suffix, factor in QUANTITY.items():
        if text.endswith(suffix):
            return int(text[: -len(suffix)]) * factor
    return int(text)


def test_there_are_manifests_for_the_router_and_the_workers():
    kinds = {name for name, _ in documents()}
    assert kinds >= {
        "deploy/kubernetes/router.yaml Deployment",
        "deploy/kubernetes/router.yaml Service",
        "deploy/kubernetes/router.yaml PodDisruptionBudget",
        "deploy/kubernetes/workers.yaml StatefulSet",
        "deploy/kubernetes/workers.yaml Service",
        "deploy/kubernetes/workers.yaml PodDisruptionBudget",
        "deploy/kubernetes/examples/hpa-num-requests-waiting.yaml HorizontalPodAutoscaler",
    }, kinds


@pytest.mark.parametrize("version", VERSIONS)
def test_every_manifest_validates_against_the_kubernetes_schemas(version):
    for name, doc in documents():
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{name} (Kubernetes {version}): {exc.message} at {list(exc.path)}")


def test_the_validator_refuses_a_wrong_manifest():
    """The check above can fail: an unknown field and a wrong type are refused."""
    doc = by_kind("StatefulSet")[0]
    bad = {**doc, "spec": {**doc["spec"], "replica": 2}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, VERSIONS[0], strict=True)
    bad = {**doc, "spec": {**doc["spec"], "replicas": "two"}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, VERSIONS[0], strict=True)


def test_each_container_runs_a_nanollmserve_command_that_parses():
    parser = build_parser()
    seen = set()
    for _, container in containers():
        args = parser.parse_args(container["args"])  # SystemExit on a bad flag
        seen.add(container["args"][0])
        assert args.host == "0.0.0.0" and args.port == 8000
    assert seen == {"serve", "router"}


def test_probes_and_the_drain_match_the_server():
    for workload, container in containers():
        name = workload["metadata"]["name"]
        assert container["readinessProbe"]["httpGet"]["path"] == "/ready", name
        assert container["livenessProbe"]["httpGet"]["path"] == "/live", name
        pre_stop = container["lifecycle"]["preStop"]["exec"]["command"]
        assert pre_stop[0] == "sleep", name
        shutdown = float(flag(container["args"], "--shutdown-timeout"))
        grace = workload["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        assert grace == int(pre_stop[1]) + shutdown + UVICORN_BACKSTOP_S, name


def test_the_workers_memory_request_covers_the_kv_cache():
    for _, container in containers():
        if container["args"][0] != "serve":
            continue
        kv = parse_size(flag(container["args"], "--kv-cache-memory"))
        request = quantity(container["resources"]["requests"]["memory"])
        limit = quantity(container["resources"]["limits"]["memory"])
        # the cache, plus at least 512 MiB for the weights of the bundled model and the runtime
        assert kv + 512 * 2**20 <= request <= limit


def test_disruption_budgets_select_the_pods():
    budgets = {b["metadata"]["name"]: b for b in by_kind("PodDisruptionBudget")}
    for workload in workloads():
        budget = budgets[workload["metadata"]["name"]]
        labels = workload["spec"]["template"]["metadata"]["labels"]
        assert budget["spec"]["selector"]["matchLabels"].items() <= labels.items()
        replicas = workload["spec"]["replicas"]
        assert budget["spec"].get("minAvailable", 0) < replicas  # a node can be drained


def test_the_autoscaling_example_reads_the_waiting_gauge():
    metrics = (ROOT / "docs" / "reference" / "metrics.md").read_text()
    assert "`nanollmserve:num_requests_waiting` | gauge" in metrics
    (rules,) = by_kind("ConfigMap")
    assert "nanollmserve:num_requests_waiting" in rules["data"]["config.yaml"]
    (hpa,) = by_kind("HorizontalPodAutoscaler")
    (metric,) = hpa["spec"]["metrics"]
    assert metric["pods"]["metric"]["name"] == "nanollmserve_num_requests_waiting"
    assert f'as: "{metric["pods"]["metric"]["name"]}"' in rules["data"]["config.yaml"]
    (workers,) = by_kind("StatefulSet")
    assert hpa["spec"]["scaleTargetRef"]["name"] == workers["metadata"]["name"]
    (router,) = [c for _, c in containers() if c["args"][0] == "router"]
    listed = [router["args"][i + 1] for i, a in enumerate(router["args"]) if a == "--worker"]
    name = workers["metadata"]["name"]
    service = workers["spec"]["serviceName"]
    expected = [f"http://{name}-{i}.{service}:8000" for i in range(hpa["spec"]["maxReplicas"])]
    assert listed == expected
