"""The Gateway API Inference Extension example points at the loraplex pods of deploy/kubernetes:
the pool selects the Deployment's pods on the port loraplex listens on, the route and the picker
name the pool, and the picker reads the metric names the server exports."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from tests.repo import ROOT_DIR as ROOT

pytestmark = pytest.mark.unit



def _docs(path: Path) -> dict:
    return {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(path.read_text()) if d}


def test_inference_pool_points_at_the_loraplex_pods():
    gie = _docs(ROOT / "deploy" / "gateway-api-inference-extension" / "inferencepool.yaml")
    k8s = _docs(ROOT / "deploy" / "kubernetes" / "loraplex.yaml")
    pool = gie[("InferencePool", "loraplex")]
    pods = k8s[("Deployment", "loraplex")]["spec"]["template"]
    assert pool["metadata"]["namespace"] == k8s[("Deployment", "loraplex")]["metadata"]["namespace"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= pods["metadata"]["labels"].items()
    container = pods["spec"]["containers"][0]
    port = int(container["args"][container["args"].index("--port") + 1])
    assert [p["number"] for p in pool["spec"]["targetPorts"]] == [port]
    epp = gie[("Deployment", "loraplex-epp")]["spec"]["template"]["spec"]["containers"][0]
    assert "--pool-name=loraplex" in epp["args"]
    assert pool["spec"]["endpointPickerRef"]["name"] == "loraplex-epp"
    exported = {"vllm:num_requests_waiting", "vllm:kv_cache_usage_perc", "vllm:lora_requests_info"}
    assert {a.split("=", 1)[1] for a in epp["args"] if a.endswith(tuple(exported))} == exported
    [rule] = gie[("HTTPRoute", "loraplex")]["spec"]["rules"]
    assert rule["backendRefs"][0]["kind"] == "InferencePool" and rule["backendRefs"][0]["name"] == "loraplex"
