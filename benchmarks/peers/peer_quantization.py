"""`--peer-quantization` and `--peer-patch`: the vLLM peer serves a quantized copy of the bench's model.

The copy (server.bench.quantized_peer_checkpoint) holds the int8 weights and scales loraplex's
`--quantization int8` computes from the same float checkpoint, so both sides serve the same quantized
model; that is why an int8 peer needs `--quantization int8` on loraplex's side. GPTQ 4-bit is not offered:
for it, give the GPTQ checkpoint as `--model` and both sides serve it as is.

`--peer-patch lora-device` puts benchmarks/peers/vllm_shims/lora_device on the peer's PYTHONPATH: its
sitecustomize.py mends vLLM 0.32's LoRA wrapper for a base layer whose int8 weight the oneDNN kernel
released after prepacking (the only int8 path on CPUs without AMX), which otherwise fails at start with
"AttributeError: 'NoneType' object has no attribute 'device'" (docs/benchmarks/cpu-vs-vllm.md,
"Both sides quantized"). The JSON records which patch the peer ran with.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

PEER_QUANTIZATIONS = ("none", "w8a8-int8", "w8a16-int8")
INT8_PEER_QUANTIZATIONS = PEER_QUANTIZATIONS[1:]
SHIMS = {"lora-device": Path(__file__).resolve().parent / "vllm_shims" / "lora_device"}
PEER_PATCHES = ("none", *SHIMS)


def add_peer_quantization_arguments(g) -> None:
    g.add_argument("--peer-quantization", choices=PEER_QUANTIZATIONS, default="none",
                   help="serve the peer a copy of the model quantized with loraplex's int8 scales, in compressed-"
                        "tensors' W8A8 (int8 activations too) or W8A16 (weight-only) layout; needs --quantization "
                        "int8 for loraplex (default none)")
    g.add_argument("--peer-patch", choices=PEER_PATCHES, default="none",
                   help="lora-device: a start-up shim (sitecustomize) mending vLLM 0.32's LoRA wrapper over "
                        "oneDNN int8 layers, without which W8A8 + LoRA fails to start on CPUs without AMX "
                        "(default none)")


def check_peer_quantization(args, error: type[Exception]) -> None:
    """Raises `error` (the caller's config error) for options that cannot work together, before anything runs."""
    kind, patch = args.peer_quantization, args.peer_patch
    if args.peer is None and (kind != "none" or patch != "none"):
        raise error("--peer-quantization and --peer-patch need --peer vllm")
    if kind in INT8_PEER_QUANTIZATIONS and tuple(args.quantization) != ("int8",):
        raise error(f"--peer-quantization {kind} serves the peer loraplex's int8 weights: run loraplex on the "
                    f"same ones with --quantization int8 (got --quantization {','.join(args.quantization)})")


def peer_model_dir(args, model_dir: Path, work_dir: str | Path, log: Callable[[str], None]) -> Path:
    """The directory the peer serves: model_dir itself, or its quantized copy (written once under work_dir)."""
    from server.bench.quantized_peer_checkpoint import write_quantized_checkpoint

    if args.peer_quantization == "none":
        return model_dir
    out = Path(work_dir) / "models" / f"{Path(model_dir).name}-{args.peer_quantization}"
    log(f"the peer's {args.peer_quantization} copy of {model_dir}: {out}")
    return write_quantized_checkpoint(model_dir, out, args.peer_quantization).resolve()


def peer_pythonpath(args) -> tuple[str, ...]:
    """The peer's PYTHONPATH entries for --peer-patch (none without one)."""
    return () if args.peer_patch == "none" else (str(SHIMS[args.peer_patch]),)
