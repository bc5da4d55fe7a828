"""Imported at start-up by every process of the vLLM peer when `--peer-patch lora-device` puts this
directory on its PYTHONPATH (benchmarks.peers.peer_quantization). Nothing in loraplex imports it.

vLLM 0.32's CPU int8 kernel (CPUInt8ScaledMMLinearKernel) on a CPU without AMX hands the int8 weight
to oneDNN, which prepacks it, and sets the layer's `weight` to None. The LoRA wrapper then asks that
`weight` for the device to put the adapters on (vllm/lora/layers/utils.py, _get_lora_device) and the
server dies at start: "AttributeError: 'NoneType' object has no attribute 'device'". The weight scale
lives on the same device, so it answers instead; nothing else changes (the matmul is oneDNN's).
"""


def _patch() -> None:
    import vllm.lora.layers.base_linear as base_linear
    import vllm.lora.layers.utils as utils

    original = utils._get_lora_device

    def lora_device(base_layer):
        if getattr(base_layer, "weight", 0) is None:  # released by the oneDNN int8 kernel after prepacking
            return base_layer.weight_scale.device
        return original(base_layer)

    # base_linear imported the function by name, so both bindings are replaced.
    utils._get_lora_device = base_linear._get_lora_device = lora_device


_patch()
