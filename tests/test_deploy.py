"""deploy/: the compose files validate: always statically (`compose_problems`: what `docker
compose config` rejects, plus what only `up` would find: a mount of a missing file, a
depends_on or scrape target naming no service, a host port bound twice), and also with
`docker compose config` (else `docker-compose config`) where one is installed; the
Prometheus configs pass promtool where it exists, and every PromQL expression of the
Grafana dashboard names only metrics the server exports."""

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


# -- the static compose check ---------------------------------------------------------------
TOP_LEVEL_KEYS = {"version", "name", "include", "services", "networks", "volumes"}
TOP_LEVEL_KEYS |= {"configs", "secrets"}
SERVICE_KEYS = {
    *("annotations", "attach", "blkio_config", "build", "cap_add", "cap_drop", "cgroup"),
    *("cgroup_parent", "command", "configs", "container_name", "cpu_count", "cpu_percent"),
    *("cpu_period", "cpu_quota", "cpu_rt_period", "cpu_rt_runtime", "cpu_shares", "cpus"),
    *("cpuset", "depends_on", "deploy", "develop", "device_cgroup_rules", "devices", "dns"),
    *("dns_opt", "dns_search", "domainname", "entrypoint", "env_file", "environment"),
    *("expose", "extends", "external_links", "extra_hosts", "gpus", "group_add"),
    *("healthcheck", "hostname", "image", "init", "ipc", "isolation", "labels", "links"),
    *("logging", "mac_address", "mem_limit", "mem_reservation", "mem_swappiness"),
    *("memswap_limit", "network_mode", "networks", "oom_kill_disable", "oom_score_adj"),
    *("pid", "pids_limit", "platform", "ports", "post_start", "pre_stop", "privileged"),
    *("profiles", "pull_policy", "read_only", "restart", "runtime", "scale", "secrets"),
    *("security_opt", "shm_size", "stdin_open", "stop_grace_period", "stop_signal"),
    *("storage_opt", "sysctls", "tmpfs", "tty", "ulimits", "user", "userns_mode", "uts"),
    *("volumes", "volumes_from", "working_dir"),
}
BUILD_KEYS = {"context", "dockerfile", "args", "target", "labels", "cache_from", "network"}
HEALTHCHECK_KEYS = {"test", "interval", "timeout", "retries", "start_period", "disable"}
HEALTHCHECK_KEYS |= {"start_interval"}
RESTART_POLICIES = {"no", "always", "on-failure", "unless-stopped"}
DEPENDS_CONDITIONS = {"service_started", "service_healthy", "service_completed_successfully"}
VOLUME_MODES = {"ro", "rw", "z", "Z", "cached", "delegated", "consistent", "nocopy"}
SERVICE_NAME_RE = re.compile(r"^[a-zA-Z0-9][a-zA-Z0-9_.-]*$")
ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
DURATION_RE = re.compile(r"^(?:\d+(?:\.\d+)?(?:ns|us|ms|s|m|h))+$")
PORT_RE = re.compile(
    r"^(?:(?P<ip>\d{1,3}(?:\.\d{1,3}){3}|\[[0-9a-fA-F:]+\]):)?"
    r"(?:(?P<host>\d+)(?:-(?P<host_end>\d+))?:)?"
    r"(?P<container>\d+)(?:-(?P<container_end>\d+))?(?:/(?P<proto>tcp|udp|sctp))?$"
)
# Every `$` compose reads: `$$` (a literal `$`), `${NAME}`, `${NAME:-x}` (and `-`, `?`, `+`
# with or without the colon), `$NAME`. Anything else is "invalid interpolation format".
INTERPOLATION_RE = re.compile(
    r"\$\$|\$\{[A-Za-z_][A-Za-z0-9_]*(?::?[-?+][^}]*)?\}|\$[A-Za-z_][A-Za-z0-9_]*"
)
PINNED_IMAGE_RE = re.compile(r"^[a-z0-9][a-z0-9._/-]*:(?!latest$)[A-Za-z0-9_][A-Za-z0-9_.-]*$")


class _StrictLoader(yaml.SafeLoader):
    """PyYAML keeps the last of two equal keys; compose (Go yaml.v3) refuses the file."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<: *anchor`: keys written beside it override the anchor's
            key = self.construct_object(key_node, deep=True)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _strings(value):
    """Every string in a loaded YAML value, keys included."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _strings(key)
            yield from _strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from _strings(item)


def _flag(command: list[str], flag: str) -> str | None:
    return command[command.index(flag) + 1] if flag in command[:-1] else None


def _dockerfile_exposes(dockerfile: Path) -> set[int]:
    ports = set()
    for line in dockerfile.read_text().splitlines():
        if line.strip().upper().startswith("EXPOSE "):
            ports |= {int(p.split("/")[0]) for p in line.split()[1:]}
    return ports


def compose_problems(path: Path, text: str | None = None) -> list[str]:
    """What is wrong with the compose file at `path` (its contents `text`, default: the
    file's), relative paths resolved against its folder: [] when nothing is."""
    base = path.parent
    try:
        compose = yaml.load(path.read_text() if text is None else text, Loader=_StrictLoader)
    except yaml.YAMLError as exc:
        return [f"not valid YAML: {exc}"]
    if not isinstance(compose, dict) or not isinstance(compose.get("services"), dict):
        return ["no `services:` mapping"]
    problems = []
    for key in compose:
        if key not in TOP_LEVEL_KEYS and not str(key).startswith("x-"):
            problems.append(f"unknown top-level key {key!r}")
    for string in _strings(compose):
        leftover = INTERPOLATION_RE.sub("", string)
        if "$" in leftover:
            problems.append(f"invalid interpolation format in {string!r}")
    services: dict = compose["services"]
    declared_volumes = set(compose.get("volumes") or {})
    declared_networks = set(compose.get("networks") or {}) | {"default"}
    built_images = {
        s.get("image") for s in services.values() if isinstance(s, dict) and "build" in s
    }
    used_volumes: set[str] = set()
    host_ports: dict[tuple[str, int], str] = {}
    mounts: dict[str, dict[str, Path]] = {}  # service -> container path -> repository path
    for name, service in services.items():
        where = f"service {name}"
        if not SERVICE_NAME_RE.match(str(name)):
            problems.append(f"{where}: not a valid service name")
        if not isinstance(service, dict):
            problems.append(f"{where}: not a mapping")
            continue
        for key in service:
            if key not in SERVICE_KEYS and not str(key).startswith("x-"):
                problems.append(f"{where}: unknown key {key!r}")
        # build / image
        build = service.get("build")
        image = service.get("image")
        if build is None and image is None:
            problems.append(f"{where}: neither build nor image")
        if build is not None:
            build = {"context": build} if isinstance(build, str) else build
            for key in set(build) - BUILD_KEYS:
                problems.append(f"{where}: unknown build key {key!r}")
            context = base / build.get("context", ".")
            dockerfile = context / build.get("dockerfile", "Dockerfile")
            if not context.is_dir():
                problems.append(f"{where}: build context {context} is not a folder")
            elif not dockerfile.is_file():
                problems.append(f"{where}: {dockerfile} does not exist")
        elif (
            isinstance(image, str)
            and image not in built_images
            and not PINNED_IMAGE_RE.match(image)
        ):
            problems.append(f"{where}: image {image!r} is neither built here nor pinned")
        # command / entrypoint
        for key in ("command", "entrypoint"):
            value = service.get(key)
            if value is not None and not (
                isinstance(value, str)
                or (isinstance(value, list) and all(isinstance(v, str) for v in value))
            ):
                problems.append(f"{where}: {key} is neither a string nor a list of strings")
        # environment
        environment = service.get("environment") or {}
        if isinstance(environment, list):
            environment = dict(item.partition("=")[::2] for item in environment)
        for key, value in environment.items():
            if not ENV_NAME_RE.match(str(key)):
                problems.append(f"{where}: bad environment variable name {key!r}")
            if isinstance(value, bool) or not isinstance(value, str | int | float | None):
                problems.append(
                    f"{where}: environment {key} is {value!r}, not a string, number or null"
                )
        # ports
        for port in service.get("ports") or []:
            match = PORT_RE.match(str(port)) if isinstance(port, str | int) else None
            if match is None:
                problems.append(f"{where}: bad port {port!r}")
                continue
            numbers = [int(v) for v in match.group("host", "host_end", "container") if v]
            if not all(1 <= n <= 65535 for n in numbers):
                problems.append(f"{where}: port {port!r} out of range")
            if match["host"]:
                key = (match["ip"] or "0.0.0.0", int(match["host"]))
                if key in host_ports:
                    problems.append(
                        f"{where}: host port {key[0]}:{key[1]} is bound twice "
                        f"(also by service {host_ports[key]})"
                    )
                host_ports[key] = name
        # volumes
        for volume in service.get("volumes") or []:
            if isinstance(volume, dict):
                source, target, mode = volume.get("source"), volume.get("target"), None
                kind = volume.get("type", "volume")
            else:
                source, _, rest = str(volume).partition(":")
                target, _, mode = rest.partition(":")
                kind = "bind" if source.startswith((".", "/", "~")) else "volume"
            if not target or not str(target).startswith("/"):
                problems.append(f"{where}: volume {volume!r} has no absolute container path")
            if mode and not set(mode.split(",")) <= VOLUME_MODES:
                problems.append(f"{where}: volume {volume!r} has an unknown mode {mode!r}")
            if kind == "bind":
                if str(source).startswith("."):
                    host = (base / source).resolve()
                    if not host.exists():
                        problems.append(f"{where}: bind mount source {source} does not exist")
                    mounts.setdefault(name, {})[str(target)] = host
            elif source:
                used_volumes.add(source)
                if source not in declared_volumes:
                    problems.append(f"{where}: named volume {source} is not declared")
        # networks
        networks = service.get("networks") or []
        for network in networks if isinstance(networks, list) else list(networks):
            if network not in declared_networks:
                problems.append(f"{where}: network {network} is not declared")
        # healthcheck
        healthcheck = service.get("healthcheck")
        if healthcheck is not None:
            for key in set(healthcheck) - HEALTHCHECK_KEYS:
                problems.append(f"{where}: unknown healthcheck key {key!r}")
            test = healthcheck.get("test")
            if isinstance(test, list) and (not test or test[0] not in ("CMD", "CMD-SHELL", "NONE")):
                problems.append(f"{where}: healthcheck test must start CMD, CMD-SHELL or NONE")
            for key in ("interval", "timeout", "start_period", "start_interval"):
                if key in healthcheck and not DURATION_RE.match(str(healthcheck[key])):
                    problems.append(f"{where}: healthcheck {key} {healthcheck[key]!r}")
            retries = healthcheck.get("retries", 1)
            if not isinstance(retries, int) or isinstance(retries, bool) or retries < 0:
                problems.append(f"{where}: healthcheck retries {retries!r}")
        restart = service.get("restart")
        if restart is not None and str(restart).split(":")[0] not in RESTART_POLICIES:
            problems.append(f"{where}: restart policy {restart!r}")
        # depends_on
        depends = service.get("depends_on") or []
        if isinstance(depends, dict):
            for other, condition in depends.items():
                if (condition or {}).get("condition", "service_started") not in (
                    DEPENDS_CONDITIONS
                ):
                    problems.append(f"{where}: depends_on {other}: condition {condition!r}")
        for other in depends:
            if other == name:
                problems.append(f"{where}: depends on itself")
            elif other not in services:
                problems.append(f"{where}: depends on {other}, which is not a service")
    for volume in declared_volumes - used_volumes:
        problems.append(f"named volume {volume} is declared but no service mounts it")
    problems += _dependency_cycles(services)
    problems += _deployment_problems(base, services, mounts)
    return problems


def _dependency_cycles(services: dict) -> list[str]:
    """compose refuses a depends_on cycle ("dependency cycle detected")."""

    def needs(name):
        depends = (services.get(name) or {}).get("depends_on") or []
        return [other for other in depends if other in services]

    state: dict[str, str] = {}
    cycles = []

    def visit(name, path):
        state[name] = "visiting"
        for other in needs(name):
            if state.get(other) == "visiting":
                cycles.append(f"dependency cycle: {' -> '.join([*path, name, other])}")
            elif other not in state:
                visit(other, [*path, name])
        state[name] = "done"

    for name in services:
        if name not in state:
            visit(name, [])
    return cycles


def _deployment_problems(base: Path, services: dict, mounts: dict) -> list[str]:
    """What `config` cannot see but `up` would: every server listens on the container ports
    mapped to it (and the image exposes them), the router's workers and Prometheus's scrape
    targets name services on ports they listen on, Grafana's home dashboard is mounted."""
    problems = []
    listens: dict[str, set[int]] = {}
    for name, service in services.items():
        if not isinstance(service, dict):
            continue
        command = service.get("command")
        if not (isinstance(command, list) and command and command[0] in ("serve", "router")):
            continue
        ports = {int(p) for p in (_flag(command, "--port"), _flag(command, "--grpc-port")) if p}
        listens[name] = ports
        build = service.get("build")
        dockerfile = base / build["context"] / build["dockerfile"] if build else None
        if dockerfile is not None and dockerfile.is_file():  # (a missing one: reported above)
            exposed = _dockerfile_exposes(dockerfile)
            if not ports <= exposed:
                problems.append(f"service {name}: listens on {ports}, the image exposes {exposed}")
        for port in service.get("ports") or []:
            match = PORT_RE.match(str(port))
            if match and int(match["container"]) not in ports:
                problems.append(f"service {name}: maps {port} but listens on {sorted(ports)}")

    def check_target(where: str, host: str, port: int) -> None:
        if host not in services:
            problems.append(f"{where}: {host}:{port} names no service")
        elif host in listens and port not in listens[host]:
            problems.append(f"{where}: service {host} does not listen on {port}")

    for name, command in (
        (n, s.get("command")) for n, s in services.items() if isinstance(s, dict)
    ):
        if isinstance(command, list) and command[:1] == ["router"]:
            for i, arg in enumerate(command[:-1]):
                if arg == "--worker":
                    url = re.match(r"^https?://([^:/]+):(\d+)", command[i + 1])
                    if url is None:
                        problems.append(f"service {name}: bad --worker {command[i + 1]!r}")
                    else:
                        check_target(f"service {name} --worker", url[1], int(url[2]))
    for name, service_mounts in mounts.items():
        config = service_mounts.get("/etc/prometheus/prometheus.yml")
        if config is not None and config.is_file():
            for job in yaml.safe_load(config.read_text())["scrape_configs"]:
                for static in job.get("static_configs", []):
                    for target in static["targets"]:
                        host, _, port = target.rpartition(":")
                        check_target(f"{config.name} (mounted by {name})", host, int(port))
        home = (services[name].get("environment") or {}).get(
            "GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"
        )
        if home is not None:
            found = [
                source / Path(home).relative_to(target)
                for target, source in service_mounts.items()
                if Path(home).is_relative_to(target)
            ]
            if not any(path.is_file() for path in found):
                problems.append(f"service {name}: home dashboard {home} is not mounted")
    return problems


@pytest.mark.parametrize("name", COMPOSE_FILES)
def test_compose_file_validates(name):
    assert compose_problems(DEPLOY / name) == []
    command = compose_command()
    if command is not None:  # and docker compose's own check where one is installed
        result = subprocess.run(
            [*command, "-f", str(DEPLOY / name), "config", "-q"], capture_output=True, text=True
        )
        assert result.returncode == 0, result.stderr


# (file, text replaced, replacement, a part of the problem the static check must report)
PLANTED_MISTAKES = [
    ("docker-compose.yml", "    depends_on:\n      - server", "    depends_on:\n      - sever",
     "depends on sever, which is not a service"),
    ("docker-compose.yml", "./prometheus.yml:", "./prometheus.yaml:",
     "bind mount source ./prometheus.yaml does not exist"),
    ("docker-compose.yml", "- prometheus-data:/prometheus", "- prom-data:/prometheus",
     "named volume prom-data is not declared"),
    ("docker-compose.yml", '"127.0.0.1:9090:9090"', '"127.0.0.1:3000:9090"',
     "host port 127.0.0.1:3000 is bound twice"),
    ("docker-compose.yml", "restart: unless-stopped\n\n  prometheus:",
     "restart: unless-stopped\n    restart: always\n\n  prometheus:", "duplicate key 'restart'"),
    ("docker-compose.yml", "${NANOLLMSERVE_API_KEY:-}", "${NANOLLMSERVE_API_KEY:-",
     "invalid interpolation format"),
    ("docker-compose.yml", 'GF_AUTH_ANONYMOUS_ENABLED: "true"', "GF_AUTH_ANONYMOUS_ENABLED: true",
     "environment GF_AUTH_ANONYMOUS_ENABLED is True"),
    ("docker-compose.yml", "dockerfile: Dockerfile", "dockerfile: Dockerfile.gpu",
     "Dockerfile.gpu does not exist"),
    ("docker-compose.yml", "interval: 10s", "interval: 10 seconds", "healthcheck interval"),
    ("docker-compose.yml", "image: prom/prometheus:v2.53.0", "image: prom/prometheus",
     "image 'prom/prometheus' is neither built here nor pinned"),
    ("docker-compose.yml", '"--port", "8000"', '"--port", "8080"',
     "maps 127.0.0.1:8000:8000 but listens on"),
    ("docker-compose.yml", "  server:\n", "  api:\n", "prometheus.yml (mounted by prometheus): "
     "server:8000 names no service"),
    ("docker-compose.yml", "    restart: unless-stopped\n\n  grafana:",
     "    restart: unless-stopped\n    restrat: always\n\n  grafana:", "unknown key 'restrat'"),
    ("docker-compose.yml", "- ./grafana/dashboards:", "- ./grafana/provisioning/dashboards:",
     "home dashboard /var/lib/grafana/dashboards/nanollmserve.json is not mounted"),
    ("docker-compose.cluster.yml", "- worker-1\n", "- worker-2\n",
     "depends on worker-2, which is not a service"),
    ("docker-compose.cluster.yml", "http://worker-1:8000", "http://worker-2:8000",
     "worker-2:8000 names no service"),
    ("docker-compose.cluster.yml", "  worker-0:\n    <<: *worker\n",
     "  worker-0:\n    <<: *worker\n    depends_on: [router]\n", "dependency cycle"),
    ("docker-compose.cluster.yml", "image: nanollmserve:latest  # built",
     "image: nanollm:latest  #", "image 'nanollm:latest' is neither built here nor pinned"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("name", "old", "new", "expected"), PLANTED_MISTAKES, ids=range(len(PLANTED_MISTAKES))
)
def test_the_static_check_finds_a_planted_mistake(name, old, new, expected):
    text = (DEPLOY / name).read_text()
    assert old in text
    problems = compose_problems(DEPLOY / name, text.replace(old, new, 1))
    assert any(expected in problem for problem in problems), problems


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
