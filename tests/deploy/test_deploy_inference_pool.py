"""The inference gateway examples, checked offline: the InferencePool (with the llm-d router's picker)
over deploy/kubernetes' pods as deploy/gateway-api-inference-extension's kustomization assembles them,
and KServe's LLMInferenceService. The custom resources validate against their CRDs' schemas vendored
in tests/deploy/schemas (README.md there); the pool selects the loraplex pods on the port they
listen on, the pods carry the engine-type label the router's metrics extractor reads, and the
picker's config names only plugins the router has, reading metric names the server exports."""
from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import yaml
from tests.repo import ROOT_DIR as ROOT

from server.api.metrics import Metrics

pytestmark = pytest.mark.unit

DEPLOY = ROOT / "deploy"
SCHEMAS = Path(__file__).parent / "schemas"
ENGINE_LABEL = "llm-d.ai/engine-type"
# The llm-d router's plugin types (llm-d/llm-d-router, pkg/epp/framework/plugins) the examples use.
ROUTER_PLUGINS = {"metrics-data-source", "core-metrics-extractor", "queue-scorer", "kv-cache-utilization-scorer",
                  "lora-affinity-scorer", "prefix-cache-scorer", "max-score-picker", "single-profile-handler"}
# What its core-metrics-extractor reads from an engine labelled `vllm` (its defaultEngineConfigs).
VLLM_ENGINE_METRICS = {"vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
                       "vllm:lora_requests_info", "vllm:cache_config_info"}


def _load(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _by_kind(docs: list[dict]) -> dict:
    return {(d["kind"], d["metadata"]["name"]): d for d in docs}


def _validate(doc: dict, schema: str) -> None:
    jsonschema.Draft7Validator(json.loads((SCHEMAS / schema).read_text())).validate(doc)


def _json_patch(doc: dict, ops: list[dict]) -> None:
    """The RFC 6902 `add` operations kustomize applies (the only ones the kustomization uses)."""
    for op in ops:
        assert op["op"] == "add", op
        *parents, last = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].split("/")[1:]]
        node = doc
        for p in parents:
            node = node[int(p)] if isinstance(node, list) else node[p]
        if isinstance(node, list):
            node.append(op["value"]) if last == "-" else node.insert(int(last), op["value"])
        else:
            node[last] = op["value"]


def _kustomize(directory: Path) -> dict:
    """The resources a kustomization makes (resources, JSON6902 patches by target, `$patch: delete`)."""
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    docs = []
    for resource in kustomization["resources"]:
        path = directory / resource
        docs += list(_kustomize(path).values()) if path.is_dir() else _load(path)
    objects = _by_kind(docs)
    for patch in kustomization.get("patches", []):
        body = yaml.safe_load(patch["patch"])
        if isinstance(body, dict) and body.get("$patch") == "delete":
            del objects[(body["kind"], body["metadata"]["name"])]
        else:
            target = patch["target"]
            _json_patch(objects[(target["kind"], target["name"])], body)
    return objects


def _args(container: dict) -> list[str]:
    return container["args"]


def _flag(container: dict, name: str) -> str:
    args = _args(container)
    return args[args.index(name) + 1]


def _check_picker_config(config: dict, pod_labels: dict) -> None:
    plugins = {p["type"]: p.get("parameters", {}) for p in config["plugins"]}
    assert set(plugins) <= ROUTER_PLUGINS
    assert {"lora-affinity-scorer", "queue-scorer", "kv-cache-utilization-scorer"} <= set(plugins)
    [profile] = config["schedulingProfiles"]
    assert {p["pluginRef"] for p in profile["plugins"]} <= set(plugins)
    extractor = plugins["core-metrics-extractor"]
    assert pod_labels[extractor["engineLabelKey"]] == extractor["defaultEngine"] == "vllm"
    assert plugins["metrics-data-source"] == {"scheme": "http", "path": "/metrics"}


def test_the_router_reads_names_the_server_exports():
    exported = {family.name for family in Metrics().registry.collect()}
    assert VLLM_ENGINE_METRICS <= exported


def test_inference_pool_fronts_the_loraplex_pods():
    objects = _kustomize(DEPLOY / "gateway-api-inference-extension")
    assert not [key for key in objects if "haproxy" in key[1]] and ("Service", "loraplex") not in objects
    pool = objects[("InferencePool", "loraplex")]
    _validate(pool, "inferencepool.v1.json")
    deployment = objects[("Deployment", "loraplex")]
    pods = deployment["spec"]["template"]
    assert pool["metadata"]["namespace"] == deployment["metadata"]["namespace"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= pods["metadata"]["labels"].items()
    assert pods["metadata"]["labels"][ENGINE_LABEL] == "vllm"
    container = pods["spec"]["containers"][0]
    assert "--metrics-public" in _args(container)  # the picker sends no token
    assert [p["number"] for p in pool["spec"]["targetPorts"]] == [int(_flag(container, "--port"))]
    # The picker: its Service is the pool's endpointPickerRef, it watches this pool, reads its config.
    ref = pool["spec"]["endpointPickerRef"]
    service = objects[("Service", ref["name"])]
    assert [p["port"] for p in service["spec"]["ports"]] == [ref["port"]["number"]]
    epp_pods = objects[("Deployment", "loraplex-epp")]["spec"]["template"]
    assert service["spec"]["selector"].items() <= epp_pods["metadata"]["labels"].items()
    epp = epp_pods["spec"]["containers"][0]
    assert {"--pool-name=loraplex", "--pool-namespace=loraplex", f"--grpc-port={ref['port']['number']}",
            "--config-file=/config/epp.yaml"} <= set(epp["args"])
    config_map = objects[("ConfigMap", epp_pods["spec"]["volumes"][0]["configMap"]["name"])]
    _check_picker_config(yaml.safe_load(config_map["data"]["epp.yaml"]), pods["metadata"]["labels"])
    # /metrics is public on the pods: only the picker and labelled namespaces reach their port.
    policy = objects[("NetworkPolicy", "loraplex-pods")]["spec"]
    assert policy["podSelector"]["matchLabels"].items() <= pods["metadata"]["labels"].items()
    [rule] = policy["ingress"]
    assert {"podSelector": {"matchLabels": epp_pods["metadata"]["labels"]}} in rule["from"]
    assert [p["port"] for p in rule["ports"]] == [int(_flag(container, "--port"))]
    [route] = objects[("HTTPRoute", "loraplex")]["spec"]["rules"]
    assert route["backendRefs"][0]["kind"] == "InferencePool" and route["backendRefs"][0]["name"] == "loraplex"
    assert route["matches"] == [{"path": {"type": "PathPrefix", "value": "/v1"}}]  # never /metrics, /admin


def test_kserve_llm_inference_service_runs_loraplex():
    [service] = _load(DEPLOY / "kserve" / "llminferenceservice.yaml")
    assert (service["apiVersion"], service["kind"]) == ("serving.kserve.io/v1alpha2", "LLMInferenceService")
    _validate(service, "llminferenceservice.v1alpha2.json")
    spec = service["spec"]
    assert spec["labels"][ENGINE_LABEL] == "vllm"
    assert spec["annotations"]["serving.kserve.io/model-based-routing-enabled"] == "false"
    [container] = spec["template"]["containers"]
    assert container["name"] == "main" and container["command"] == ["loraplex"] and _args(container)[0] == "serve"
    assert _flag(container, "--model") == "/mnt/models"  # where KServe mounts spec.model.uri
    assert _flag(container, "--served-model-name") == spec["model"]["name"]
    port = int(_flag(container, "--port"))
    assert [p["containerPort"] for p in container["ports"]] == [port] and "--metrics-public" in _args(container)
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["port"] == port and container[probe]["httpGet"]["scheme"] == "HTTP"
    assert container["livenessProbe"]["httpGet"]["path"] == "/version"  # /health is 503 while Redis is down
    _check_picker_config(spec["router"]["scheduler"]["config"]["inline"], spec["labels"])
