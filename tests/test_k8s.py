"""deploy/k8s, checked offline: every manifest against the Kubernetes API schemas (kubernetes-validate, strict:
an unknown field fails), and the deployment's promises: what kustomization.yaml lists exists, every secret key
a pod reads is generated, Redis and RabbitMQ are reachable only by srl pods and never from outside the
cluster, nothing runs as root, and no credential is ever on a command line."""

from __future__ import annotations

import copy
import os
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

try:
    import kubernetes_validate
except ImportError:  # a laptop without the dev extra skips; CI (which installs it) must validate
    if os.environ.get("CI"):
        raise
    pytest.skip("kubernetes-validate is not installed (pip install -e '.[dev]')", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "k8s"
KUBERNETES_VERSION = "1.30.0"
"""the oldest Kubernetes the manifests are checked against (a release still served by the big clouds)"""
OPTIONAL = {"rabbitmq.yaml", "redis-external.yaml"}
"""manifests kustomization.yaml lists commented out: a user turns them on"""
FORBIDDEN_FLAGS = ("--password", "--secret", "--url", "--queue-url")
GATEWAY = "srl-redis-gateway"
"""redis-external.yaml's TLS gateway: the one pod besides srl's that may reach Redis"""


def kustomization() -> dict[str, Any]:
    found: dict[str, Any] = yaml.safe_load((K8S / "kustomization.yaml").read_text(encoding="utf-8"))
    return found


def documents(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((K8S / name).read_text(encoding="utf-8")) if d]


def merged(base: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    """A strategic merge as kustomize does it for these patches: maps merge, containers merge by name."""
    out = copy.deepcopy(base)
    for key, value in patch.items():
        if key == "containers":
            by_name = {c["name"]: c for c in out[key]}
            for container in value:
                assert container["name"] in by_name, f"the patch names a container the base lacks: {container['name']}"
                by_name[container["name"]].update(merged(by_name[container["name"]], container))
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merged(out[key], value)
        else:
            out[key] = value
    return out


def applied() -> list[dict[str, Any]]:
    """Every object ``kubectl apply -k`` creates from the listed resources (generated ones aside), patched."""
    objects = [d for name in kustomization()["resources"] for d in documents(name)]
    for patch_entry in kustomization().get("patches", []):
        patch = documents(patch_entry["path"])[0]
        target = next(o for o in objects if o["kind"] == patch["kind"] and o["metadata"]["name"] ==
                      patch["metadata"]["name"])
        objects[objects.index(target)] = merged(target, patch)
    return objects


def every_object() -> list[dict[str, Any]]:
    return applied() + [d for name in sorted(OPTIONAL) for d in documents(name)]


def pod_specs(objects: list[dict[str, Any]]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(object, pod template) of every workload."""
    return [(o, o["spec"]["template"]) for o in objects if o["kind"] in ("Deployment", "Job", "StatefulSet")]


def generated_keys(include_commented: bool) -> set[str]:
    text = (K8S / "kustomization.yaml").read_text(encoding="utf-8")
    keys = {entry.split("=", 1)[0] for gen in kustomization()["secretGenerator"] for entry in gen["files"]}
    if include_commented:
        keys |= set(re.findall(r"^\s*#\s*-\s*([A-Z_]+)=secrets/", text, flags=re.MULTILINE))
    return keys


def test_every_listed_file_exists_and_every_manifest_is_listed() -> None:
    k = kustomization()
    listed = set(k["resources"]) | {p["path"] for p in k.get("patches", [])}
    on_disk = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed <= on_disk, f"kustomization.yaml lists missing files: {sorted(listed - on_disk)}"
    assert on_disk - listed == OPTIONAL, f"manifests neither listed nor optional: {sorted(on_disk - listed - OPTIONAL)}"
    assert all(f"# - {name}" in (K8S / "kustomization.yaml").read_text() for name in OPTIONAL)


@pytest.mark.parametrize("index", range(len(every_object())))
def test_each_manifest_validates_against_the_kubernetes_schema(index: int) -> None:
    obj = every_object()[index]
    try:
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        pytest.fail(f"{obj['kind']}/{obj['metadata']['name']}: {e.message} at {list(e.path)}")


def test_a_manifest_with_an_unknown_field_fails_validation() -> None:
    trainer = next(o for o in applied() if o["metadata"]["name"] == "srl-trainer")
    broken = copy.deepcopy(trainer)
    broken["spec"]["template"]["spec"]["containers"][0]["gpus"] = 1
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)


def test_the_trainer_asks_for_a_gpu_through_the_patch_and_for_none_without_it() -> None:
    trainer = next(o for o in applied() if o["metadata"]["name"] == "srl-trainer")
    assert trainer["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 1
    base = documents("trainer.yaml")[0]
    assert "nvidia.com/gpu" not in base["spec"]["template"]["spec"]["containers"][0]["resources"].get("limits", {})


def test_brokers_are_reachable_only_by_srl_pods_and_never_from_outside() -> None:
    objects = every_object()
    services = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Service"}
    external = {name for name, s in services.items() if s["spec"].get("type", "ClusterIP") != "ClusterIP"}
    assert external == {"srl-redis-external"}, external  # the optional TLS gateway, nothing else
    gateway = services["srl-redis-external"]["spec"]
    assert gateway["selector"] == {"app.kubernetes.io/name": GATEWAY}
    assert [p["port"] for p in gateway["ports"]] == [6380]
    assert not any(s["spec"].get("type", "ClusterIP") != "ClusterIP" for s in
                   (o for o in applied() if o["kind"] == "Service")), "by default nothing is reachable from outside"
    policies = {p["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/name"]: p
                for p in objects if p["kind"] == "NetworkPolicy"}
    for broker in ("srl-redis", "srl-rabbitmq"):
        policy = policies[broker]
        assert policy["spec"]["policyTypes"] == ["Ingress"]
        sources = [s for rule in policy["spec"]["ingress"] for s in rule["from"]]
        assert sources == [{"podSelector": {"matchLabels": {"srl.io/node": "true"}}}], sources
    srl_pods = [(o, t) for o, t in pod_specs(objects) if t["spec"]["containers"][0]["image"] == "srl"]
    assert {o["metadata"]["name"] for o, _ in srl_pods} == {"srl-trainer", "srl-actor", "srl-client"}
    for obj, template in pod_specs(objects):
        labelled = template["metadata"]["labels"].get("srl.io/node") == "true"
        name = obj["metadata"]["name"]
        assert labelled == (template["spec"]["containers"][0]["image"] == "srl" or name == GATEWAY), name
    gateway_args = next(t for o, t in pod_specs(objects) if o["metadata"]["name"] == GATEWAY)["spec"]["containers"][0]
    assert "--cert=/tls/tls.crt" in gateway_args["args"]  # the gateway speaks TLS, never plain Redis


def test_nothing_runs_as_root_or_keeps_a_capability() -> None:
    for obj, template in pod_specs(every_object()):
        spec = template["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True, obj["metadata"]["name"]
        assert spec["securityContext"]["runAsUser"] != 0
        assert spec.get("automountServiceAccountToken") is False, obj["metadata"]["name"]
        for container in spec["containers"]:
            assert container["securityContext"]["allowPrivilegeEscalation"] is False
            assert container["securityContext"]["capabilities"]["drop"] == ["ALL"]


def test_credentials_come_from_the_generated_secret_never_a_command_line() -> None:
    active = generated_keys(include_commented=False)
    assert {"SRL_REDIS_PASSWORD", "SRL_SECRET"} <= active
    for objects, keys in ((applied(), active), (every_object(), generated_keys(include_commented=True))):
        for obj, template in pod_specs(objects):
            for container in template["spec"]["containers"]:
                line = " ".join(container.get("command", []) + container.get("args", []))
                assert not any(flag in line for flag in FORBIDDEN_FLAGS), (obj["metadata"]["name"], line)
                assert not re.search(r"://[^\s/@:]*:[^\s/@]+@", line), line
                for env in container.get("env", []):
                    ref = env.get("valueFrom", {}).get("secretKeyRef")
                    if ref is not None:
                        assert ref["name"] == "srl-credentials" and ref["key"] in keys, (obj["metadata"]["name"], ref)
                    else:
                        assert not re.search(r"PASS|SECRET|TOKEN", env["name"]), (obj["metadata"]["name"], env)
    ignored = (ROOT / ".gitignore").read_text(encoding="utf-8").split()
    assert "deploy/k8s/secrets/" in ignored, "the secrets kustomize reads must never be committed"


def test_the_image_name_is_the_one_kustomize_rewrites() -> None:
    names = {entry["name"] for entry in kustomization()["images"]}
    for obj, template in pod_specs(every_object()):
        for container in template["spec"]["containers"]:
            image = container["image"]
            assert image in names or ":" in image, f"{obj['metadata']['name']}: image {image!r} has no tag"
