"""deploy/: the compose files validate (`docker compose config`, else `docker-compose config`,
and always structurally), the Prometheus configs pass promtool where it exists, and every
PromQL expression of the Grafana dashboard names only metrics the server exports."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from nanollmserve.engine.engine_core import EngineStats
from nanollmserve.engine.kv_cache import KVCacheStats
from nanollmserve.metrics import ServerMetrics
from nanollmserve.router import WorkerPool
from nanollmserve.router.metrics import RouterMetrics

pytestmark = pytest.mark.milestone("m10")

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
COMPOSE_FILES = ["docker-compose.yml", "docker-compose.cluster.yml"]
DASHBOARD = DEPLOY / "grafana/dashboards/nanollmserve.json"
METRIC_RE = re.compile(r"\b(?:nanollmserve(?:_router)?:[a-z0-9_]+|inference_[a-z0-9_]+)\b")


def compose_command() -> list[str] | None:
    """`docker compose` (v2 plugin) or `docker-compose` (v1), whichever works here."""
    candidates = [["docker", "compose"], ["docker-compose"]]
    for command in candidates:
        if shutil.which(command[0]) is None:
            continue
        probe = subprocess.run([*command, "version"], capture_output=True, text=True)
        if probe.returncode == 0:
            return command
    return None


def exported_metric_names() -> set[str]:
    kv = KVCacheStats(10, 16, 0, 10, 0, 0, 0, 0)
    metrics = ServerMetrics("m", lambda: EngineStats(0, 0, kv, 0, 0, 0, 0, 0, 0))
    names = {sample.name for family in metrics.registry.collect() for sample in family.samples}
    router = RouterMetrics(WorkerPool(["http://worker:8000"]))  # the cluster's router
    for family in (router.requests, router.failures, router.retries, router.upstream_latency):
        family.labels("http://worker:8000")
    router.render()
    return names | {s.name for family in router.registry.collect() for s in family.samples}


@pytest.mark.parametrize("name", COMPOSE_FILES)
def test_compose_file_validates(name):
    command = compose_command()
    if command is None:
        pytest.skip("neither `docker compose` nor `docker-compose` is installed")
    result = subprocess.run(
        [*command, "-f", str(DEPLOY / name), "config", "-q"], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("name", COMPOSE_FILES)
def test_compose_file_structure(name):
    compose = yaml.safe_load((DEPLOY / name).read_text())
    services = compose["services"]
    assert {"prometheus", "grafana"} <= set(services)
    servers = [s for s in services.values() if "build" in s]
    assert servers, "no service builds the server image"
    for service in servers:
        assert (DEPLOY / service["build"]["context"] / service["build"]["dockerfile"]).is_file()
        assert service["command"][0] == "serve" and "--host" in service["command"]
    for service in services.values():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):  # bind mounts of this repository must exist
                assert (DEPLOY / source).exists(), f"{name}: {source} does not exist"
        for port in service.get("ports", []):
            assert port.startswith("127.0.0.1:"), f"{name}: {port} is not loopback-only"


@pytest.mark.parametrize("name", ["prometheus.yml", "prometheus.cluster.yml"])
def test_prometheus_config(name):
    config = yaml.safe_load((DEPLOY / name).read_text())
    [job] = config["scrape_configs"]
    assert job["metrics_path"] == "/metrics" and job["static_configs"][0]["targets"]
    if shutil.which("promtool"):
        result = subprocess.run(
            ["promtool", "check", "config", str(DEPLOY / name)], capture_output=True, text=True
        )
        assert result.returncode == 0, result.stdout + result.stderr


def test_dashboard_queries_name_only_exported_metrics():
    dashboard = json.loads(DASHBOARD.read_text())
    exported = exported_metric_names()
    datasource = yaml.safe_load(
        (DEPLOY / "grafana/provisioning/datasources/prometheus.yml").read_text()
    )["datasources"][0]
    used = set()
    for panel in dashboard["panels"]:
        assert panel["datasource"]["uid"] == datasource["uid"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            names = set(METRIC_RE.findall(target["expr"]))
            assert names, f"{panel['title']}: no metric in {target['expr']!r}"
            assert names <= exported, f"{panel['title']}: not exported: {names - exported}"
            used |= names
    query = dashboard["templating"]["list"][0]["query"]["query"]
    assert set(METRIC_RE.findall(query)) <= exported
    # What the issue asks the dashboard to show.
    for needed in [
        "nanollmserve:request_success_total",
        "nanollmserve:generation_tokens_total",
        "nanollmserve:time_to_first_token_seconds_bucket",
        "nanollmserve:inter_token_latency_seconds_bucket",
        "nanollmserve:e2e_request_latency_seconds_bucket",
        "nanollmserve:num_requests_running",
        "nanollmserve:num_requests_waiting",
        "nanollmserve:kv_cache_usage_perc",
        "nanollmserve:prefix_cache_hits_total",
        "nanollmserve:num_preemptions_total",
    ]:
        assert needed in used, needed
    titles = " ".join(p["title"] for p in dashboard["panels"])
    for quantile in ("0.5", "0.95", "0.99"):
        assert f"histogram_quantile({quantile}," in DASHBOARD.read_text()
    assert "Time to first token" in titles and "Inter-token latency" in titles
    assert "nanollmserve_router:worker_up" in used and "sum by (instance)" in DASHBOARD.read_text()


def test_dockerfile_serves_the_ports_compose_maps():
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "EXPOSE 8000 50051" in dockerfile
    assert 'ENTRYPOINT ["nanollmserve"]' in dockerfile
    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    assert compose["services"]["server"]["ports"] == [
        "127.0.0.1:8000:8000",
        "127.0.0.1:50051:50051",
    ]
