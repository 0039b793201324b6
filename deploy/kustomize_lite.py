"""A small, strict subset of `kustomize build`, for rendering deploy/k8s where kustomize is not installed.

It implements what deploy/k8s uses, and refuses (KustomizeError) any field it does not implement rather than
rendering something different from kustomize:

    resources (files and folders), components, namespace, images, replicas,
    patches (strategic merge patches, from a file, optionally with a target kind/name),
    configMapGenerator (files, literals; behavior create | replace | merge),
    generatorOptions (labels, annotations; disableNameSuffixHash must be true)

tests/test_deploy.py renders every overlay with it and, where `kubectl` is on the PATH, checks that the result
equals `kubectl kustomize`. Command line: `python deploy/kustomize_lite.py deploy/k8s/overlays/cpu-tiny`.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import yaml

KUSTOMIZATION_FILES = ("kustomization.yaml", "kustomization.yml", "Kustomization")
SUPPORTED_FIELDS = {
    "apiVersion", "kind", "resources", "components", "namespace", "images", "replicas", "patches",
    "configMapGenerator", "generatorOptions",
}
CLUSTER_SCOPED_KINDS = {
    "Namespace", "ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition", "PersistentVolume",
    "StorageClass", "PriorityClass", "IngressClass", "ValidatingWebhookConfiguration",
    "MutatingWebhookConfiguration", "APIService",
}
WORKLOAD_KINDS = {"Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"}
# Strategic-merge keys of the Kubernetes types deploy/k8s patches (lists not named here are replaced whole).
MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "ephemeralContainers": "name",
    "env": "name",
    "volumes": "name",
    "volumeMounts": "mountPath",
    "imagePullSecrets": "name",
}


class KustomizeError(ValueError):
    """A kustomization this subset does not implement, or one that is wrong."""


Resource = dict[str, Any]


def _load_yaml_documents(path: Path) -> list[Resource]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def _kustomization_file(folder: Path) -> Path:
    for name in KUSTOMIZATION_FILES:
        if (folder / name).is_file():
            return folder / name
    raise KustomizeError(f"{folder}: no kustomization.yaml")


def _key(resource: Resource) -> tuple[str, str]:
    return resource["kind"], resource["metadata"]["name"]


def _find(resources: list[Resource], kind: str, name: str, where: str) -> Resource:
    for resource in resources:
        if _key(resource) == (kind, name):
            return resource
    raise KustomizeError(f"{where}: no {kind} named {name!r} to apply to")


def strategic_merge(base: Any, patch: Any, field: str | None = None) -> Any:
    """Kubernetes strategic merge of `patch` into `base` (a copy): maps merge, null deletes a key, lists with a
    merge key merge item by item, other lists are replaced."""
    if isinstance(patch, dict) and isinstance(base, dict):
        if any(k.startswith("$") for k in patch):
            raise KustomizeError(f"patch directive {sorted(k for k in patch if k.startswith('$'))} not supported")
        merged = copy.deepcopy(base)
        for key, value in patch.items():
            if value is None:
                merged.pop(key, None)
            elif key in merged:
                merged[key] = strategic_merge(merged[key], value, key)
            else:
                merged[key] = copy.deepcopy(value)
        return merged
    if isinstance(patch, list) and isinstance(base, list):
        merge_key = MERGE_KEYS.get(field or "")
        if field == "ports":
            merge_key = "containerPort" if any("containerPort" in p for p in patch) else "port"
        if merge_key is None or not all(isinstance(p, dict) for p in patch):
            return copy.deepcopy(patch)
        # As kustomize orders them: the patch's items (merged with their namesakes) first, then the others.
        by_key = {item.get(merge_key): item for item in base if isinstance(item, dict)}
        patched = {item.get(merge_key) for item in patch}
        merged = [
            strategic_merge(by_key[item.get(merge_key)], item, field) if item.get(merge_key) in by_key
            else copy.deepcopy(item)
            for item in patch
        ]
        return merged + [copy.deepcopy(item) for item in base
                         if not (isinstance(item, dict) and item.get(merge_key) in patched)]
    return copy.deepcopy(patch)


def _pod_specs(resource: Resource) -> list[dict]:
    if resource["kind"] in WORKLOAD_KINDS:
        return [resource.get("spec", {}).get("template", {}).get("spec", {})]
    if resource["kind"] == "CronJob":
        return [resource["spec"]["jobTemplate"]["spec"]["template"]["spec"]]
    if resource["kind"] == "Pod":
        return [resource.get("spec", {})]
    return []


def _image_name(image: str) -> str:
    name = image.split("@", 1)[0]
    last = name.rsplit("/", 1)[-1]
    if ":" in last:
        name = name[: len(name) - len(last)] + last.split(":", 1)[0]
    return name


def _apply_images(resources: list[Resource], images: list[dict], where: str) -> None:
    for rule in images:
        unknown = set(rule) - {"name", "newName", "newTag", "digest"}
        if unknown:
            raise KustomizeError(f"{where}: images fields {sorted(unknown)} not supported")
        for resource in resources:
            for spec in _pod_specs(resource):
                for container in spec.get("initContainers", []) + spec.get("containers", []):
                    if _image_name(container["image"]) != rule["name"]:
                        continue
                    new = rule.get("newName", rule["name"])
                    if "digest" in rule:
                        new += "@" + rule["digest"]
                    elif "newTag" in rule:
                        new += ":" + str(rule["newTag"])
                    elif ":" in container["image"].rsplit("/", 1)[-1]:
                        new += ":" + container["image"].rsplit(":", 1)[1]
                    container["image"] = new


def _generate_configmap(spec: dict, folder: Path, options: dict) -> Resource:
    unknown = set(spec) - {"name", "files", "literals", "behavior", "options"}
    if unknown:
        raise KustomizeError(f"{folder}: configMapGenerator fields {sorted(unknown)} not supported")
    merged_options = {**options, **spec.get("options", {})}
    if not merged_options.get("disableNameSuffixHash", False):
        raise KustomizeError(f"{folder}: name suffix hashes are not implemented; set disableNameSuffixHash: true")
    data: dict[str, str] = {}
    for entry in spec.get("files", []):
        key, _, file = entry.partition("=") if "=" in entry else (Path(entry).name, "", entry)
        source = (folder / file).resolve()
        if folder.resolve() not in source.parents:
            raise KustomizeError(f"{folder}: file {file} is outside the kustomization folder")
        data[key] = source.read_text()
    for literal in spec.get("literals", []):
        key, _, value = literal.partition("=")
        data[key] = value
    metadata: dict[str, Any] = {"name": spec["name"]}
    if merged_options.get("labels"):
        metadata["labels"] = dict(merged_options["labels"])
    if merged_options.get("annotations"):
        metadata["annotations"] = dict(merged_options["annotations"])
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": metadata, "data": data}


def _run_generators(resources: list[Resource], kustomization: dict, folder: Path) -> None:
    options = kustomization.get("generatorOptions", {})
    unknown = set(options) - {"labels", "annotations", "disableNameSuffixHash"}
    if unknown:
        raise KustomizeError(f"{folder}: generatorOptions fields {sorted(unknown)} not supported")
    for spec in kustomization.get("configMapGenerator", []):
        generated = _generate_configmap(spec, folder, options)
        behavior = spec.get("behavior", "create")
        if behavior == "create":
            if any(_key(r) == _key(generated) for r in resources):
                raise KustomizeError(f"{folder}: ConfigMap {spec['name']!r} already exists (use behavior: replace)")
            resources.append(generated)
            continue
        existing = _find(resources, "ConfigMap", spec["name"], str(folder))
        if behavior == "replace":
            existing["data"] = generated["data"]
        elif behavior == "merge":
            existing["data"] = {**existing.get("data", {}), **generated["data"]}
        else:
            raise KustomizeError(f"{folder}: configMapGenerator behavior {behavior!r} unknown")
        for field in ("labels", "annotations"):
            if field in generated["metadata"]:
                existing["metadata"].setdefault(field, {}).update(generated["metadata"][field])


def _apply_patches(resources: list[Resource], patches: list[dict], folder: Path) -> None:
    for entry in patches:
        unknown = set(entry) - {"path", "target"}
        if unknown or "path" not in entry:
            raise KustomizeError(f"{folder}: patches need a `path` (inline patches and {sorted(unknown)} not supported)")
        target = entry.get("target", {})
        if set(target) - {"kind", "name"}:
            raise KustomizeError(f"{folder}: patch targets by {sorted(set(target) - {'kind', 'name'})} not supported")
        for patch in _load_yaml_documents(folder / entry["path"]):
            if "op" in patch or isinstance(patch, list):
                raise KustomizeError(f"{folder}/{entry['path']}: JSON 6902 patches are not supported")
            kind = target.get("kind", patch.get("kind"))
            name = target.get("name", patch.get("metadata", {}).get("name"))
            resource = _find(resources, kind, name, f"{folder}/{entry['path']}")
            body = {k: v for k, v in patch.items() if k not in ("apiVersion", "kind")}
            body["metadata"] = {k: v for k, v in body.get("metadata", {}).items() if k != "name"}
            if not body["metadata"]:
                del body["metadata"]
            merged = strategic_merge(resource, body)
            resource.clear()
            resource.update(merged)


def _accumulate(folder: Path, component: bool = False, into: list[Resource] | None = None) -> list[Resource]:
    file = _kustomization_file(folder)
    kustomization = yaml.safe_load(file.read_text()) or {}
    unknown = set(kustomization) - SUPPORTED_FIELDS
    if unknown:
        raise KustomizeError(f"{file}: fields {sorted(unknown)} are not implemented by kustomize_lite")
    expected_kind = "Component" if component else "Kustomization"
    if kustomization.get("kind", "Kustomization") != expected_kind:
        raise KustomizeError(f"{file}: kind {kustomization.get('kind')!r}, expected {expected_kind}")

    resources: list[Resource] = into if into is not None else []
    for entry in kustomization.get("resources", []):
        path = (folder / entry).resolve()
        loaded = build(path) if path.is_dir() else _load_yaml_documents(path)
        for resource in loaded:
            if any(_key(r) == _key(resource) for r in resources):
                raise KustomizeError(f"{file}: {resource['kind']} {resource['metadata']['name']!r} defined twice")
            resources.append(resource)
    for entry in kustomization.get("components", []):
        _accumulate((folder / entry).resolve(), component=True, into=resources)
    _run_generators(resources, kustomization, folder)
    _apply_patches(resources, kustomization.get("patches", []), folder)
    _apply_images(resources, kustomization.get("images", []), str(file))
    for rule in kustomization.get("replicas", []):
        workload = next((r for r in resources if r["kind"] in WORKLOAD_KINDS and r["metadata"]["name"] == rule["name"]), None)
        if workload is None:
            raise KustomizeError(f"{file}: replicas for unknown workload {rule['name']!r}")
        workload["spec"]["replicas"] = rule["count"]
    if "namespace" in kustomization:
        for resource in resources:
            if resource["kind"] not in CLUSTER_SCOPED_KINDS:
                resource["metadata"]["namespace"] = kustomization["namespace"]
    return resources


def build(path: str | Path) -> list[Resource]:
    """The resources `kustomize build path` would output (in no particular order)."""
    return _accumulate(Path(path).resolve())


def canonical(resources: list[Resource]) -> list[Resource]:
    """Resources sorted by kind, namespace and name: an order-independent form for comparisons."""
    return sorted(resources, key=lambda r: (r["kind"], r["metadata"].get("namespace", ""), r["metadata"]["name"]))


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python deploy/kustomize_lite.py <kustomization folder>")
    yaml.safe_dump_all(canonical(build(sys.argv[1])), sys.stdout, sort_keys=False)
