"""Decode steps padded to a bucket and run from persistent buffers (issue 21), checked on the CPU:
the same tokens and logprobs as PEFT and as the unpadded path, no KV written by padding rows, the
same launches (grids and scalar arguments) for every batch of a bucket, no host sync in the forward,
and the launches per step pinned. On CUDA the same contexts are captured as graphs; here they run
eagerly (torch kernels, and the Triton kernels under TRITON_INTERPRET=1)."""
from __future__ import annotations

import os

import pytest
import torch

from kernels import attention_decode, attention_triton, lora_triton_jit, metadata
from server.engine import LLM, SamplingParams
from kernels.sorted_tiles import max_tiles
from server.engine.decode_buffers import bucket_for, decode_buckets
from server.engine.decode_graphs import PaddedOut
from tests.engine_helpers import random_prompts

VOCAB = 512
TOL = 1e-4
ADAPTERS = ("r4_qv", "r8_all", "r16_rslora")  # ranks 4, 8, 16
TRITON = os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available()
needs_triton = pytest.mark.skipif(not TRITON, reason="Triton needs a GPU or the interpreter")
KERNELS = {
    "write_kv": attention_triton._write_kv_kernel,
    "prefill_attention": attention_triton._paged_attention_kernel,
    "decode_attention": attention_decode._decode_kernel,
    "combine_splits": attention_decode._combine_splits_kernel,
    "lora_shrink_gathered": lora_triton_jit._bgmv_shrink_kernel,
    "lora_expand_gathered": lora_triton_jit._bgmv_expand_kernel,
    "lora_shrink_segmented": lora_triton_jit._sgmv_shrink_kernel,
    "lora_expand_segmented": lora_triton_jit._sgmv_expand_kernel,
}


def make_llm(model_dir, adapters, kernels: str = "torch", padded: bool = True, **kw) -> LLM:
    opts = dict(device="cpu", dtype="float32", max_loras=4, kv_cache_blocks=64, max_model_len=128,
                max_num_batched_tokens=128, max_num_seqs=8, block_size=16, max_lora_rank=16,
                kernels=kernels)
    llm = LLM(model_dir, **{**opts, **kw})
    for name in ADAPTERS:
        llm.add_adapter(name, adapters[name])
    if padded:
        cfg = llm.engine.config
        llm.engine.runner.use_padded_decode(cfg.lora.max_loras, cfg.scheduler.max_num_seqs, cfg.scheduler.max_model_len)
    return llm


def test_buckets_follow_vllm_sizes() -> None:
    assert decode_buckets(256) == (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
    assert decode_buckets(1) == (1,)
    assert decode_buckets(100)[-3:] == (64, 96, 100)  # the largest batch the scheduler forms is a bucket
    assert [bucket_for(n, decode_buckets(64)) for n in (1, 3, 5, 9, 17, 25, 33, 49, 64)] == \
        [1, 4, 8, 16, 24, 32, 48, 64, 64]


def _generate(llm: LLM, prompts, names, max_tokens: int = 4):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=2)
    return llm.generate(prompts, params, adapters=names)


def _lora_form(monkeypatch, form: str) -> None:
    """The padded decode steps' LoRA plan (kernels.metadata.PADDED_LORA_FORM): gathered or tiled."""
    monkeypatch.setattr(metadata, "PADDED_LORA_FORM", form)


LORA_FORMS = pytest.mark.parametrize("form", ["gathered", "tiled"])


@pytest.fixture(scope="module")
def unpadded_outputs() -> dict:
    """Kernels (split-K or not) -> the unpadded engine's outputs for the parity test's batch: the LoRA form
    is the padded steps' alone, so a tiled case's unpadded run is its gathered case's (under the
    interpreter, a quarter of the test's time)."""
    return {}


@pytest.mark.parametrize("kernels", ["torch", *(pytest.param(k, marks=needs_triton) for k in (
    "triton", "triton-split-k", "triton-tiled", "triton-split-k-tiled"))])
def test_padded_decode_matches_peft_and_the_unpadded_path(tiny_model_dir, tiny_adapters, hf_logprobs, kernels,
                                                         monkeypatch, unpadded_outputs):
    # 5 sequences pad to bucket 8, then fewer as none finish early: mixed ranks, a base row, a repeated
    # adapter, adapters in non-adjacent slots. -tiled: the padded steps' LoRA on the tiled plan.
    _lora_form(monkeypatch, "tiled" if kernels.endswith("-tiled") else "gathered")
    kernels = kernels.removesuffix("-tiled")
    _split_k(monkeypatch, kernels == "triton-split-k")
    unpadded = kernels
    kernels = kernels.removesuffix("-split-k")
    names = ["r8_all", None, "r4_qv", "r16_rslora", "r8_all"]
    prompts = random_prompts(len(names), (5, 19), VOCAB, seed=43)
    padded = make_llm(tiny_model_dir, tiny_adapters, kernels)
    outs = _generate(padded, prompts, names)
    assert padded.engine.runner.padded.eager_steps == 3  # every decode step ran padded (the first is prefill)
    if unpadded not in unpadded_outputs:
        unpadded_outputs[unpadded] = _generate(make_llm(tiny_model_dir, tiny_adapters, kernels, padded=False),
                                               prompts, names)
    plain = unpadded_outputs[unpadded]
    for prompt, name, out, ref_out in zip(prompts, names, outs, plain):
        ref = hf_logprobs(name, prompt + out.token_ids)
        assert out.token_ids == ref_out.token_ids == [int(ref[len(prompt) - 1 + i].argmax()) for i in range(4)]
        for i, (entry, other) in enumerate(zip(out.logprobs, ref_out.logprobs)):
            assert abs(entry.logprob - float(ref[len(prompt) - 1 + i][entry.token_id])) <= TOL
            assert abs(entry.logprob - other.logprob) <= TOL


def test_padded_decode_of_base_only_and_single_rows(tiny_model_dir, tiny_adapters, hf_logprobs):
    llm = make_llm(tiny_model_dir, tiny_adapters)
    for names in ([None], [None, None, None], ["r4_qv"]):
        prompts = random_prompts(len(names), (4, 12), VOCAB, seed=len(names))
        for prompt, name, out in zip(prompts, names, _generate(llm, prompts, names, 3)):
            ref = hf_logprobs(name, prompt + out.token_ids)
            assert out.token_ids == [int(ref[len(prompt) - 1 + i].argmax()) for i in range(3)]


def _decode_ready(llm: LLM, names, seed: int = 5) -> None:
    """Only these requests, added and prefilled: the next step decodes every one of them."""
    engine = llm.engine
    for rid in list(engine.seqs):
        engine.abort_request(rid)
    prompts = random_prompts(len(names), (4, 30), VOCAB, seed=seed)
    versions = llm._versions
    for i, (prompt, name) in enumerate(zip(prompts, names)):
        engine.add_request(f"r{seed}-{i}", prompt, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
                           versions[name] if name else None)
    engine.step()  # the prefill
    running = engine.scheduler.running
    assert len(running) == len(names) and all(s.num_computed_tokens == len(s.token_ids) - 1 for s in running)


def test_padding_rows_write_no_kv(tiny_model_dir, tiny_adapters):
    llm = make_llm(tiny_model_dir, tiny_adapters)
    _decode_ready(llm, ["r8_all", None, "r4_qv"])  # 3 rows padded to 4
    caches = llm.engine.runner.kv_caches
    before = [(k.clone(), v.clone()) for k, v in caches]
    bs = llm.engine.config.cache.block_size
    written = {s.block_table[s.num_computed_tokens // bs] * bs + s.num_computed_tokens % bs
               for s in llm.engine.scheduler.running}
    llm.engine.step()
    assert llm.engine.runner.padded.eager_steps == 1
    for (k0, v0), (k1, v1) in zip(before, caches):
        for old, new in ((k0, k1), (v0, v1)):
            changed = (old != new).flatten(2).any(-1).flatten().nonzero().flatten().tolist()  # pool slots
            assert set(changed) == written


class _CountingGraph:
    """Stands for a captured CUDA graph on the CPU: counts its replays."""

    def __init__(self) -> None:
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1


def test_graphs_off_runs_the_padded_contexts_eagerly_and_keeps_the_graphs(tiny_model_dir, tiny_adapters):
    llm = make_llm(tiny_model_dir, tiny_adapters)
    padded = llm.engine.runner.padded
    graph = _CountingGraph()
    key = (4, True, False)  # 3 rows with an adapter pad to bucket 4
    padded.graphs[key] = (graph, PaddedOut(torch.zeros(4, VOCAB), None))  # what a replay leaves in its output
    _decode_ready(llm, ["r8_all", None, "r4_qv"])
    with padded.graphs_off():
        assert padded.graphs == {}
        llm.engine.step()
    assert (graph.replays, padded.replays, padded.eager_steps) == (0, 0, 1)
    assert padded.graphs[key][0] is graph
    llm.engine.step()  # the graph is back: replayed
    assert (graph.replays, padded.replays, padded.eager_steps) == (1, 1, 1)
    with pytest.raises(RuntimeError), padded.graphs_off():
        raise RuntimeError("a failed check inside")
    assert padded.graphs[key][0] is graph


class LaunchLog:
    """Every Triton launch: (kernel, grid, non-tensor arguments, tensor shapes and strides, and the
    addresses of integer tensors: the step's metadata, which a replayed graph reads where it was)."""

    def __init__(self, monkeypatch) -> None:
        self.launches: list[tuple] = []
        self.inside = False
        for name, kernel in KERNELS.items():
            monkeypatch.setattr(kernel, "run", self._wrap(name, kernel.run))

    def _wrap(self, name, run):
        def logged(*args, grid, warmup, **kwargs):
            described = tuple((tuple(a.shape), a.stride(), a.dtype, None if a.is_floating_point() else a.data_ptr())
                              if isinstance(a, torch.Tensor) else a for a in args)
            self.launches.append((name, tuple(grid), described, tuple(sorted(kwargs.items()))))
            self.inside = True
            try:
                return run(*args, grid=grid, warmup=warmup, **kwargs)
            finally:
                self.inside = False
        return logged

    def take(self) -> list[tuple]:
        out, self.launches = self.launches, []
        return out


def _padded_step(llm: LLM, log: LaunchLog) -> tuple[tuple[int, bool, bool], list[tuple]]:
    """One decode step; its (bucket, LoRA, DoRA) key and launches."""
    runner = llm.engine.runner
    keys = []
    stage = runner.padded.stage

    def spy(*a):
        keys.append(stage(*a))
        return keys[-1]

    runner.padded.stage = spy
    log.take()
    llm.engine.step()
    runner.padded.stage = stage
    assert len(keys) == 1
    return keys[0], log.take()


def _split_k(monkeypatch, split: bool) -> None:
    """The tiny model's in features (64, 128) are below the split-K minimum: lower it to split them
    (kernels.metadata.shrink_splits: 4 splits of 16 features for qkv, o and gate_up, 8 for down)."""
    if split:
        monkeypatch.setattr(metadata, "MIN_SPLIT_K", 16)


def _partials(llm: LLM, key) -> dict:
    """The split-K partial buffers of a padded context, by shape: their addresses."""
    scratch = llm.engine.runner.padded.contexts[key].lora.scratch
    return {k: v.data_ptr() for k, v in scratch.items() if k[0] == "lora-split-partials"}


@needs_triton
@LORA_FORMS
@pytest.mark.parametrize("split", [False, True], ids=["unsplit", "split-k"])
def test_two_batches_of_one_bucket_launch_the_same(tiny_model_dir, tiny_adapters, monkeypatch, split, form):
    """Different rows, adapters, ranks and context lengths padded to one bucket: the same grids and
    scalar arguments (what a captured graph replays), and work lists at the bucket's length (tiled: the
    bucket's table of tiles); split-K writes its partials into the same buffers on every step."""
    _split_k(monkeypatch, split)
    _lora_form(monkeypatch, form)
    llm = make_llm(tiny_model_dir, tiny_adapters, "triton", max_model_len=600, kv_cache_blocks=120)
    log = LaunchLog(monkeypatch)
    _decode_ready(llm, ["r4_qv", None, "r4_qv"], seed=1)
    key_a, a = _padded_step(llm, log)
    partials = _partials(llm, key_a)
    _decode_ready(llm, ["r16_rslora", "r8_all", None, "r8_all"], seed=2)
    key_b, b = _padded_step(llm, log)
    assert key_a == key_b == (4, True, False)
    assert a == b
    assert _partials(llm, key_b) == partials and len(partials) == (4 if split else 0)  # qkv, o, gate_up, down
    layers = llm.engine.model_config.num_layers
    names = [n for n, *_ in a]
    kind = "segmented" if form == "tiled" else "gathered"
    assert names.count(f"lora_shrink_{kind}") == names.count(f"lora_expand_{kind}") == 4 * layers
    assert len([n for n in names if n.startswith("lora")]) == 8 * layers
    entries = max_tiles(4, llm.engine.config.lora.max_loras) if form == "tiled" else 4  # 1 + 4 tiles
    assert all(grid[0] == entries for n, grid, *_ in a if n.startswith("lora"))
    assert all(grid[0] == 4 for n, grid, *_ in a if n == "decode_attention")
    shrinks = [(grid, dict(kw)) for n, grid, _, kw in a if n == f"lora_shrink_{kind}"]
    assert all(kw["SPLIT"] == split and kw.get("INDEXED", True) for _, kw in shrinks)
    assert sorted({grid[2] for grid, _ in shrinks}) == ([4, 8] if split else [1])  # splits x one rank tile


@needs_triton
@LORA_FORMS
@pytest.mark.parametrize("split", [False, True], ids=["unsplit", "split-k"])
def test_launches_per_decode_step_are_pinned(tiny_model_dir, tiny_adapters, monkeypatch, split, form):
    """Per layer: one KV write, one decode attention (plus its split combine when the bucket splits
    contexts), and per fused projection (qkv, o, gate_up, down) one shrink and one expand (gathered, or
    segmented on the tiled plan) for all its slices and all the step's adapters, split-K or not (the
    splits are programs of one launch); no LoRA launch in a base-model step."""
    _split_k(monkeypatch, split)
    _lora_form(monkeypatch, form)
    kind = "segmented" if form == "tiled" else "gathered"
    llm = make_llm(tiny_model_dir, tiny_adapters, "triton", max_model_len=600, kv_cache_blocks=120)
    layers = llm.engine.model_config.num_layers
    log = LaunchLog(monkeypatch)
    for names, lora in ((["r4_qv", "r8_all", "r16_rslora", None, "r4_qv"], True), ([None, None], False)):
        _decode_ready(llm, names, seed=len(names))
        key, launches = _padded_step(llm, log)
        assert key == (bucket_for(len(names), decode_buckets(8)), lora, False)
        counts: dict[str, int] = {}
        for n, *_ in launches:
            counts[n] = counts.get(n, 0) + 1
        split = counts.get("combine_splits", 0)
        assert split in (0, layers)
        fused = 4 if lora else 0
        assert counts == {"write_kv": layers, "decode_attention": layers,
                          **({"combine_splits": layers} if split else {}),
                          **({f"lora_shrink_{kind}": fused * layers, f"lora_expand_{kind}": fused * layers}
                             if lora else {})}


class HostSyncForbidden(AssertionError):
    pass


def _forbid_host_sync(monkeypatch, allowed=lambda: False) -> None:
    """Every way a forward could read a value back to the host raises (unless `allowed()`)."""
    def refuse(name, real):
        def guarded(*args, **kwargs):
            if not allowed():
                raise HostSyncForbidden(name)
            return real(*args, **kwargs)
        return guarded

    for name in ("item", "tolist", "nonzero", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, refuse(f"Tensor.{name}", getattr(torch.Tensor, name)))
    for name in ("nonzero", "unique", "unique_consecutive", "masked_select", "repeat_interleave"):
        monkeypatch.setattr(torch, name, refuse(f"torch.{name}", getattr(torch, name)))


@pytest.mark.parametrize("kernels", ["torch", pytest.param("triton", marks=needs_triton),
                                     pytest.param("triton-tiled", marks=needs_triton)])
@pytest.mark.parametrize("names", [["r8_all", None, "r4_qv"], [None, None]], ids=["adapters", "base"])
def test_padded_forward_reads_nothing_back_to_the_host(tiny_model_dir, tiny_adapters, monkeypatch, kernels, names):
    form = "tiled" if kernels == "triton-tiled" else "gathered"
    _lora_form(monkeypatch, form)
    kernels = kernels.removesuffix("-tiled")
    llm = make_llm(tiny_model_dir, tiny_adapters, kernels, max_model_len=600, kv_cache_blocks=120)
    assert llm.engine.runner.padded.lora_form == form
    _decode_ready(llm, names)
    runner = llm.engine.runner
    inputs = runner.prepare(llm.engine.scheduler.schedule())
    assert inputs.padded is not None and inputs.padded[1] == any(names)
    log = LaunchLog(monkeypatch) if kernels == "triton" else None
    # The interpreter runs a Triton kernel on numpy copies: only the kernels' own launches may read.
    _forbid_host_sync(monkeypatch, allowed=lambda: log is not None and log.inside)
    logits = runner.padded.run(inputs.padded).logits
    monkeypatch.undo()
    assert logits.shape == (bucket_for(len(names), decode_buckets(8)), VOCAB) and torch.isfinite(logits).all()
    with pytest.raises(HostSyncForbidden):  # the guard works: the unpadded path reads host values
        _forbid_host_sync(monkeypatch)
        torch.tensor([1, 0]).nonzero()


def test_enforce_eager_flag_reaches_the_engine(tiny_model_dir, tmp_path):
    from server.cli import build_parser
    from server.config import ServerConfig
    from server.engine.config import EngineConfig

    parser = build_parser()
    assert parser.parse_args(["serve"]).enforce_eager is False
    args = parser.parse_args(["serve", "--data-dir", str(tmp_path), "--admin-token", "x" * 16, "--enforce-eager"])
    assert ServerConfig.from_args(args, env={}).engine.device.enforce_eager is True
    with pytest.raises(ValueError, match="enforce_eager must be true or false"):
        EngineConfig.of(model="m", enforce_eager="yes")
    # A CPU device has no CUDA graphs: eager and unpadded whatever the flag says, and it says so.
    for eager in (True, False):
        llm = LLM(tiny_model_dir, device="cpu", kv_cache_blocks=16, max_model_len=64, enforce_eager=eager)
        assert llm.engine.runner.padded is None and llm.engine.stats().decode_graphs.graphs == 0
