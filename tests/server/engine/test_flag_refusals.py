"""Flag combinations the engine does not build (server.engine.flag_refusals): the same one line from the
engine's config and from the server's, and `serve` refuses them before it starts an engine core (the
core's refusal was a traceback, three restarts and the lifespan's traceback)."""
from __future__ import annotations

import json

import pytest

from server.config import ConfigError, ServerConfig
from server.engine.config import EngineConfig, ModelConfig
from server.engine.flag_refusals import combination_refusal

pytestmark = pytest.mark.unit

_GEMMA2 = {"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "num_hidden_layers": 4,
           "sliding_window": 20, "head_dim": 16, "hidden_activation": "gelu_pytorch_tanh",
           "layer_types": ["sliding_attention", "full_attention"] * 2}


def _serve_config(tmp_path, **kw) -> ServerConfig:
    return ServerConfig.of(data_dir=tmp_path, admin_token="x" * 16, **kw)


def _server(tmp_path, **kw) -> EngineConfig:
    """The engine config a server built from these settings holds."""
    return _serve_config(tmp_path, **kw).engine


def test_the_engine_and_the_server_config_give_the_same_line(tmp_path, tiny_model_dir):
    mcfg = ModelConfig.from_dir(tiny_model_dir)
    flags = {"tensor_parallel_size": 2, "lora_page_rows": 16, "fully_sharded_loras": True}
    engine = combination_refusal(EngineConfig.of(model=str(tiny_model_dir), **flags), mcfg, False, tiny_model_dir)
    assert engine == combination_refusal(_server(tmp_path, **flags), mcfg, False, tiny_model_dir)
    assert engine == "--fully-sharded-loras does not combine with --lora-page-rows yet"


@pytest.mark.parametrize("flags, line", [
    (dict(quantization="int4", int4_group_size=64),
     "--tensor-parallel-size 2: int4 groups of 64 input channels do not split o_proj's 64 inputs into 2 shards of 32"),
    (dict(quantization="int4"), None),  # groups of 32: o_proj's 32 and down_proj's 64 per rank
    (dict(quantization="int8"), None),
    (dict(quantization="fp8"), "--tensor-parallel-size 2: a quantized base (fp8) is not sharded"),
])
def test_quantized_bases_under_tensor_parallel(tmp_path, tiny_model_dir, flags, line):
    mcfg = ModelConfig.from_dir(tiny_model_dir)
    got = combination_refusal(_server(tmp_path, tensor_parallel_size=2, **flags), mcfg, False, tiny_model_dir)
    assert got == line if line is None else got.startswith(line)


@pytest.mark.parametrize("spec, line", [
    ('{"method": "ngram", "num_speculative_tokens": 3}', None),  # drafts on rank 0, a plain verify step
    ('{"method": "medusa", "model": "heads", "num_speculative_tokens": 3}',
     "--tensor-parallel-size 2 does not combine with --speculative-config method medusa yet (ngram does)"),
    ('{"method": "draft_model", "model": "draft", "num_speculative_tokens": 3}',
     "--tensor-parallel-size 2 does not combine with --speculative-config method draft_model yet (ngram does)"),
])
def test_speculative_methods_under_tensor_parallel(tmp_path, tiny_model_dir, spec, line):
    mcfg = ModelConfig.from_dir(tiny_model_dir)
    assert combination_refusal(_server(tmp_path, tensor_parallel_size=2, speculative_config=spec), mcfg,
                               False, tiny_model_dir) == line
    engine = EngineConfig.of(model=str(tiny_model_dir), tensor_parallel_size=2, speculative_config=spec)
    assert combination_refusal(engine, mcfg, False, tiny_model_dir) == line


def test_a_gptq_checkpoints_groups_decide(tmp_path, tiny_model_dir):
    """No --int4-group-size: the checkpoint's quantization_config groups are the ones that must split."""
    cfg = json.loads((tiny_model_dir / "config.json").read_text())
    gptq = tmp_path / "gptq"
    gptq.mkdir()
    for group_size, want in ((32, None), (64, "int4 groups of 64"), (-1, "group_size -1")):
        (gptq / "config.json").write_text(json.dumps({**cfg, "quantization_config": {
            "quant_method": "gptq", "bits": 4, "group_size": group_size}}))
        got = combination_refusal(_server(tmp_path, tensor_parallel_size=2, quantization="gptq"),
                                  ModelConfig.from_dir(gptq), False, gptq)
        assert got is None if want is None else want in got


def test_unified_memory_is_refused_for_kv_layer_groups_and_a_draft_model(tmp_path, tiny_model_dir):
    cfg = json.loads((tiny_model_dir / "config.json").read_text())
    unified = _server(tmp_path, unified_memory=True, lora_page_rows=16)
    assert combination_refusal(unified, ModelConfig.from_dict(cfg), False, tiny_model_dir) is None
    assert "a draft model" in combination_refusal(unified, ModelConfig.from_dict(cfg), True, tiny_model_dir)
    gemma = combination_refusal(unified, ModelConfig.from_dict({**cfg, **_GEMMA2}), False, tiny_model_dir)
    assert gemma.startswith("--unified-memory does not serve a model with KV layer groups")


def test_serve_refuses_before_the_engine_core_in_one_line(tmp_path, tiny_model_dir):
    from server.cli import _check_flag_combinations

    gemma = tmp_path / "gemma"
    gemma.mkdir()
    cfg = json.loads((tiny_model_dir / "config.json").read_text())
    (gemma / "config.json").write_text(json.dumps({**cfg, **_GEMMA2}))
    with pytest.raises(ConfigError, match="--unified-memory does not serve a model with KV layer groups") as raised:
        _check_flag_combinations(_serve_config(tmp_path, unified_memory=True, lora_page_rows=16), gemma)
    assert "\n" not in str(raised.value)
    _check_flag_combinations(_serve_config(tmp_path, unified_memory=True, lora_page_rows=16), tiny_model_dir)
    _check_flag_combinations(_serve_config(tmp_path, tensor_parallel_size=2), gemma)  # windows and KV groups shard
    with pytest.raises(ConfigError, match=r"--tensor-parallel-size 3 does not divide num_attention_heads") as raised:
        _check_flag_combinations(_serve_config(tmp_path, tensor_parallel_size=3), gemma)
    assert "\n" not in str(raised.value)
