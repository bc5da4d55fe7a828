"""Adapters an attacker controls: poisoned values, malformed JSON, slow regexes. Each is refused
with an AdapterFormatError that says why, on inspect and on every load, within a bounded time.
(The canonical config that replaces user regexes is tested in test_canonical_config.py.)"""
from __future__ import annotations

import json
import re
import struct
import time

import pytest
import safetensors.torch
import torch

from adapters.bounded_json import MAX_DEPTH, MAX_INT_DIGITS, MAX_ITEMS, JsonLimitError, loads_bounded
from adapters.format import AdapterFormatError, inspect_adapter_bytes, load_adapter_bytes, load_adapter_dir
from tests.adapters.test_adapter_format import MAX_RANK, Q0_A, Q0_B, SHAPE, read, rebuild, save_adapter

Q0 = "model.layers.0.self_attn.q_proj"
SLOW = r"(.|.){0,24}\.q_proj"       # exponential backtracking in Python's re: ~40 s per upload unbounded
WALL_BOUND_S = 5.0


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    path = save_adapter(tmp_path_factory.mktemp("plain"))
    config, weights = read(path)
    return json.loads(config), safetensors.torch.load(weights)


def refused_everywhere(config_json: bytes, weights: bytes, match: str) -> None:
    with pytest.raises(AdapterFormatError, match=match):
        inspect_adapter_bytes(config_json, weights, SHAPE, MAX_RANK)
    with pytest.raises(AdapterFormatError, match=match):
        load_adapter_bytes(config_json, weights, SHAPE, MAX_RANK)


def with_config_field(config: dict, raw_value: str) -> bytes:
    """The config with a field whose JSON text is given verbatim (json.dumps cannot write these)."""
    return json.dumps(config)[:-1].encode() + b', "hostile": ' + raw_value.encode() + b"}"


def header_bytes(header_json: bytes, data: bytes = b"") -> bytes:
    return struct.pack("<Q", len(header_json)) + header_json + data


# ---- 1. values --------------------------------------------------------------------

@pytest.mark.parametrize("value, shown", [(float("nan"), "nan"), (float("inf"), "inf"), (-float("inf"), "-inf"),
                                          (1e38, "1e+38"), (65505.0, "65505")])
def test_poisoned_lora_b_is_refused_on_every_load(plain, tmp_path, value, shown):
    config, tensors = plain
    b = tensors[Q0_B].clone()
    b[3, 1] = value
    config_json, weights = rebuild(config, tensors | {Q0_B: b})
    with pytest.raises(AdapterFormatError, match=rf"{re.escape(Q0)}: lora_B holds .*{re.escape(shown)}"):
        load_adapter_bytes(config_json, weights, SHAPE, MAX_RANK)
    (tmp_path / "adapter_config.json").write_bytes(config_json)
    (tmp_path / "adapter_model.safetensors").write_bytes(weights)
    with pytest.raises(AdapterFormatError, match=rf"{re.escape(Q0)}: lora_B holds"):
        load_adapter_dir(tmp_path, SHAPE, MAX_RANK)


def test_f64_weight_beyond_float32_is_refused(plain):
    config, tensors = plain
    a = tensors[Q0_A].double()
    a[0, 0] = 1e300     # finite in F64, inf once cast to float32
    with pytest.raises(AdapterFormatError, match=rf"{re.escape(Q0)}: lora_A holds inf"):
        load_adapter_bytes(*rebuild(config, tensors | {Q0_A: a}), SHAPE, MAX_RANK)


@pytest.mark.parametrize("overrides, shown", [
    (dict(lora_alpha=1e30), "lora_alpha = 1e+30"),
    (dict(lora_alpha=1e308), "lora_alpha = 1e+308"),
    (dict(lora_alpha=-1e30), "lora_alpha = -1e+30"),
    (dict(alpha_pattern={"q_proj": 1e308}), "alpha_pattern['q_proj'] = 1e+308"),
    # under the config-wide bound (1e4 * max_lora_rank 16), but 1e5 / r=4 is a scaling of 25000
    (dict(lora_alpha=1e5), f"{Q0}: scaling 25000.0 (lora_alpha 100000.0 / 4)"),
    (dict(alpha_pattern={"layers.1.mlp.up_proj": 1e5}), "model.layers.1.mlp.up_proj: scaling 25000.0"),
])
def test_absurd_alpha_is_refused_from_the_config(plain, overrides, shown):
    config, tensors = plain
    refused_everywhere(*rebuild(config, tensors, **overrides), match=re.escape(shown))


def test_delta_weight_bound(plain):
    config, tensors = plain
    # scaling 2, r 4: |dW| <= 2 * 4 * 100 * 100 = 80000 > 65504, though each entry is a legal float16
    big = {Q0_A: torch.full((4, 32), 100.0), Q0_B: torch.full((32, 4), 100.0)}
    with pytest.raises(AdapterFormatError, match=rf"{re.escape(Q0)}: the delta weight .* can reach 80000"):
        load_adapter_bytes(*rebuild(config, tensors | big), SHAPE, MAX_RANK)
    # 10x smaller on one side: 8000, served
    ok = {Q0_A: torch.full((4, 32), 10.0), Q0_B: torch.full((32, 4), 100.0)}
    assert load_adapter_bytes(*rebuild(config, tensors | ok), SHAPE, MAX_RANK).weights[(0, "q_proj")].scaling == 2.0
    # The bound pairs maxima per rank component: B's huge column 0 meets A's small row 0 and A's
    # big row 1 meets B's small column 1, so |dW| <= 2 * (60000 * 0.1 + 0.01 * 100 + ...) ~ 12002,
    # although r * max|B| * max|A| * scaling would be 4.8e7.
    a, b = torch.full((4, 32), 1e-3), torch.full((32, 4), 1e-3)
    a[0], a[1], b[:, 0], b[:, 1] = 0.1, 100.0, 60000.0, 0.01
    served = load_adapter_bytes(*rebuild(config, tensors | {Q0_A: a, Q0_B: b}), SHAPE, MAX_RANK)
    w = served.weights[(0, "q_proj")]
    assert (w.scaling * (w.b @ w.a)).abs().max() <= 65504


# ---- 2. malformed JSON ------------------------------------------------------------

DEEP = "[" * 100_000 + "]" * 100_000


@pytest.mark.parametrize("raw, match", [
    (DEEP, f"nested deeper than {MAX_DEPTH} levels"),
    ('{"a": ' * 100_000 + "1" + "}" * 100_000, "nested deeper"),
    ("1" + "0" * 5000, "integer literal with 5001 digits"),
    ("NaN", "NaN is not valid JSON"),
    ("Infinity", "Infinity is not valid JSON"),
    ("-Infinity", "-Infinity is not valid JSON"),
    ("1e400", "out of the float64 range"),
    ("-1" + "0" * 400 + ".5", "out of the float64 range"),
    ('"\\ud800"', "lone surrogate U\\+D800"),
    ('{"\\udfff": 1}', "lone surrogate U\\+DFFF"),
])
def test_malformed_config_json(plain, raw, match):
    config, tensors = plain
    refused_everywhere(with_config_field(config, raw), safetensors.torch.save(tensors), match)


def test_huge_int_where_an_int_is_expected(plain):
    config, tensors = plain
    text = json.dumps(config).replace('"r": 4', '"r": 1' + "0" * 5000)
    assert "0" * 5000 in text
    refused_everywhere(text.encode(), safetensors.torch.save(tensors), "integer literal with 5001 digits")


@pytest.mark.parametrize("header, match", [
    (b'{"__metadata__": ' + DEEP.encode() + b"}", "nested deeper"),
    (b'{"x": {"dtype": "F32", "shape": [0], "data_offsets": [0, 1' + b"0" * 5000 + b"]}}", "5001 digits"),
    (b'{"x": {"dtype": "F32", "shape": [NaN], "data_offsets": [0, 0]}}', "NaN is not valid JSON"),
    (b'{"x": {"dtype": "F32", "shape": [1e999], "data_offsets": [0, 0]}}', "out of the float64 range"),
    (b'{"\\ud800": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]}}', "lone surrogate"),
    (b'{"__metadata__": {"format": "\\udc00pt"}}', "lone surrogate"),
    # 16 MiB of tiny values: seconds of GIL-holding parsing, refused before any of it
    (b'{"__metadata__": [' + b"[1]," * (4 * 1024 * 1024 - 10) + b"[1]]}", f"more than {MAX_ITEMS}"),
])
def test_malformed_safetensors_header(plain, tmp_path, header, match):
    config, _ = plain
    config_json, weights = json.dumps(config).encode(), header_bytes(header)
    with pytest.raises(AdapterFormatError, match="corrupt safetensors file: .*" + match):
        inspect_adapter_bytes(config_json, weights, SHAPE, MAX_RANK)
    with pytest.raises(AdapterFormatError, match=match):
        load_adapter_bytes(config_json, weights, SHAPE, MAX_RANK)
    (tmp_path / "adapter_config.json").write_bytes(config_json)
    (tmp_path / "adapter_model.safetensors").write_bytes(weights)
    with pytest.raises(AdapterFormatError, match=match):
        load_adapter_dir(tmp_path, SHAPE, MAX_RANK)


def test_bounded_json_limits_are_exact():
    assert loads_bounded("[" * (MAX_DEPTH - 1) + "{}" + "]" * (MAX_DEPTH - 1)) is not None
    with pytest.raises(JsonLimitError, match="nested deeper"):
        loads_bounded("[" * MAX_DEPTH + "{}" + "]" * MAX_DEPTH)
    assert loads_bounded("9" * MAX_INT_DIGITS) == int("9" * MAX_INT_DIGITS)
    assert loads_bounded("-" + "9" * MAX_INT_DIGITS) == -int("9" * MAX_INT_DIGITS)
    with pytest.raises(JsonLimitError, match="digits"):
        loads_bounded("9" * (MAX_INT_DIGITS + 1))
    assert loads_bounded('{"k": "\\u00e9\\ud83d\\ude00"}') == {"k": "\u00e9\U0001F600"}   # a valid pair is fine
    assert loads_bounded("1.7976931348623157e308") == 1.7976931348623157e308
    assert len(loads_bounded("[" + "0," * (MAX_ITEMS - 1) + "0]")) == MAX_ITEMS
    with pytest.raises(JsonLimitError, match=f"more than {MAX_ITEMS}"):
        loads_bounded("[" + "0," * MAX_ITEMS + "0]")


# ---- 3. user regexes ----------------------------------------------------------------

@pytest.mark.parametrize("overrides", [
    dict(target_modules=SLOW),
    dict(rank_pattern={"q_proj": 4, SLOW: 4}),
    dict(alpha_pattern={SLOW: 8}),
    dict(exclude_modules=SLOW),
    dict(layers_to_transform=[0, 1], layers_pattern=r"(.|.){0,24}\.nowhere"),
], ids=["target_modules", "rank_pattern", "alpha_pattern", "exclude_modules", "layers_pattern"])
def test_slow_regex_is_refused_within_the_bound(plain, overrides):
    config, tensors = plain
    config_json, weights = rebuild(config, tensors, **overrides)
    start = time.monotonic()
    with pytest.raises(AdapterFormatError, match="regular expression in .* took too long to match the model's "
                                                 "16 module names"):
        inspect_adapter_bytes(config_json, weights, SHAPE, MAX_RANK)
    assert time.monotonic() - start < WALL_BOUND_S


def test_slow_regex_is_refused_on_load_too(plain):
    config, tensors = plain
    start = time.monotonic()
    with pytest.raises(AdapterFormatError, match="took too long"):
        load_adapter_bytes(*rebuild(config, tensors, target_modules=SLOW), SHAPE, MAX_RANK)
    assert time.monotonic() - start < WALL_BOUND_S


@pytest.mark.parametrize("overrides, match", [
    (dict(target_modules="(" * 2000), "target_modules '\\(\\(\\(.*is 2000 characters long"),
    (dict(rank_pattern={"q" * 1025: 4}), "rank_pattern key 'qqq.*limited to 1024"),
    (dict(rank_pattern={"(q_proj": 4}), "rank_pattern key '\\(q_proj': invalid regular expression"),
    (dict(exclude_modules="[z-a]"), "exclude_modules '\\[z-a\\]': invalid regular expression"),
    (dict(layers_pattern="layers"), "layers_pattern needs layers_to_transform"),
])
def test_pattern_refusals(plain, overrides, match):
    config, tensors = plain
    refused_everywhere(*rebuild(config, tensors, **overrides), match=match)
