"""Decode steps padded to a bucket, run from persistent buffers; on CUDA, one captured graph per bucket.

A decode-only step (every scheduled sequence computes one token) of n rows is
padded to the smallest bucket that holds it (server.engine.decode_buffers)
and its inputs are refilled in place. The forward then reads nothing that
depends on the step: each bucket has one StepContext, built once, whose
tensors are views of the persistent buffers and whose host values are bounds
(every adapter slot may occur, every sequence may be max_model_len long), so
each launch's grid and scalar arguments are fixed per bucket. A bucket has
three contexts: with LoRA launches (any row has an adapter), with LoRA
launches and DoRA scales (a row's adapter is a DoRA one, kernels.dora_scale),
and without (a base-model step launches none); which one runs is chosen on
the host from the schedule, outside the forward.

A speculative verify step (every row a decode row running its last token and up to k drafts, no
prompt logprobs) runs the same way: padded to a (row bucket, k + 1) shape, every row widened to k + 1
tokens with padding tokens, each token one row of the buffers with its own position and sequence
length and its row's block table: causal attention of a row's token j over keys up to its own position
is a one-token decode query, once the step's KV is written (vLLM's batch expansion). A (row bucket,
width) shape is a bucket of row bucket x width token rows, so it shares the contexts (and graphs) of
the token count, decode's included; shapes past the model's token workspace stay eager.

With Medusa heads the step also keeps the last layer's rows (before the final norm) in its output, which
the heads read after the step (server.engine.medusa_proposer): a captured graph's outputs are both.

On CUDA each (bucket, LoRA, DoRA) context is captured once as a CUDA graph during
warm-up, largest first into one memory pool, and a decode step replays it:
no kernel launch from the host at all. Prefill and mixed steps stay eager.
On CPU there is nothing to capture (CUDA graphs are a CUDA feature); the
padded path still runs eagerly there when asked (tests, profiling), through
the same contexts.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import NamedTuple

import torch

from kernels import metadata
from kernels.metadata import AttentionBatch, LoraBatch
from server.engine.decode_buffers import DecodeBuffers, bucket_for, decode_buckets
from server.engine.kernel_ops import KernelOps
from server.engine.model import CausalLM, StepContext

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CaptureStats:
    graphs: int
    seconds: float
    bytes: int  # device memory the graphs' pool took (mem_get_info before and after)


@dataclass(frozen=True)
class DecodeGraphStats:
    graphs: int = 0  # captured (none: enforce_eager, a CPU, or the torch kernels)
    replays: int = 0  # decode steps that replayed one
    capture_seconds: float = 0.0
    capture_bytes: int = 0


class PaddedOut(NamedTuple):
    """What a padded step leaves, every row of its bucket, padding included."""

    logits: torch.Tensor  # [bucket, V] float32
    hidden: torch.Tensor | None  # [bucket, H] the last layer's rows (keep_hidden), else None


class PaddedDecode:
    """Runs decode-only steps padded to a bucket; `capture()` turns each bucket into a CUDA graph."""

    def __init__(self, model: CausalLM, kv_caches: list, ops: KernelOps, lora_scratch: torch.Tensor,
                 num_slots: int, max_rows: int, max_model_len: int, block_size: int, device: torch.device,
                 rank_table: torch.Tensor | None = None, slot_dora: list[bool] | None = None,
                 page_table: torch.Tensor | None = None, verify_widths: tuple[int, ...] = (),
                 verify_rows: int = 0, lora_form: str | None = None, keep_hidden: bool = False) -> None:
        """rank_table: LoraSlots.rank_table, each slot's own rank [L] int32 (None: full rank);
        slot_dora: LoraSlots.slot_dora, whether each slot holds a DoRA adapter (a live view);
        page_table: LoraSlots.page_table when the adapter memory is paged (updated in place);
        verify_widths: the tokens per row of the verify steps to pad (k + 1 for each k a step may
        verify), of up to verify_rows rows; () for none; lora_form: the LoRA plan of the steps,
        "gathered" or "tiled" (kernels.sorted_tiles); None: kernels.metadata.PADDED_LORA_FORM;
        keep_hidden: the step's output keeps the last layer's rows too (Medusa heads read them)."""
        self.lora_form = metadata.PADDED_LORA_FORM if lora_form is None else lora_form
        if self.lora_form not in ("gathered", "tiled"):
            raise ValueError(f"lora_form must be gathered or tiled, got {self.lora_form!r}")
        tiled = self.lora_form == "tiled"
        self.model = model
        self.keep_hidden = keep_hidden
        self.kv_caches = kv_caches
        self.device = device
        self.buckets = decode_buckets(max_rows)
        max_tokens = lora_scratch.shape[1]  # the model's token workspace: no padded step is larger
        self.verify_buckets = decode_buckets(verify_rows) if verify_widths and verify_rows else ()
        self.verify_widths = tuple(w for w in verify_widths if w >= 2 and self.verify_buckets
                                   and self.verify_buckets[0] * w <= max_tokens)
        sizes = set(self.buckets) | {r * w for r in self.verify_buckets for w in self.verify_widths
                                     if r * w <= max_tokens}
        self.sizes = tuple(sorted(sizes))  # token rows of every context
        self.max_tokens = max_tokens
        self.buffers = DecodeBuffers(self.sizes[-1], -(-max_model_len // block_size), device,
                                     num_slots if tiled else None)
        buf = self.buffers
        self.slot_dora = slot_dora
        self.contexts: dict[tuple[int, bool, bool], StepContext] = {}
        for rows in self.sizes:
            attn = AttentionBatch.padded_decode(
                buf.rows("slot_mapping", rows), buf.rows("block_tables", rows), buf.query_start_loc[: rows + 1],
                buf.rows("seq_lens", rows), buf.rows("context_lens", rows), max_model_len)
            for lora, dora in ((False, False), (True, False), (True, True)):
                self.contexts[rows, lora, dora] = StepContext(
                    ops=ops, positions=buf.rows("positions", rows), attn=attn,
                    lora=LoraBatch.padded_decode(buf.rows("token_slots", rows), buf.rows("gather", rows),
                                                 num_slots if lora else 0, rank_table, dora, page_table,
                                                 buf.tiled_plan(rows) if tiled and lora else None),
                    lora_scratch=lora_scratch)
        self.graphs: dict[tuple[int, bool, bool], tuple[torch.cuda.CUDAGraph, PaddedOut]] = {}
        self.replays = 0
        self.eager_steps = 0
        self.verify_steps = 0  # verify steps staged padded
        self.capture_stats: CaptureStats | None = None

    def stats(self) -> DecodeGraphStats:
        captured = self.capture_stats
        if captured is None:
            return DecodeGraphStats(replays=self.replays)
        return DecodeGraphStats(captured.graphs, self.replays, captured.seconds, captured.bytes)

    @property
    def max_rows(self) -> int:
        return self.buckets[-1]

    def verify_bucket(self, rows: int, width: int) -> int | None:
        """The row bucket a verify step of `rows` rows of `width` tokens pads to; None: it runs eager."""
        if width not in self.verify_widths or rows > self.verify_buckets[-1]:
            return None
        bucket = bucket_for(rows, self.verify_buckets)
        return bucket if bucket * width <= self.max_tokens else None

    def stage(self, input_ids: list[int], positions: list[int], slot_mapping: list[int],
              block_tables: list[list[int]], token_slots: list[int]) -> tuple[int, bool, bool]:
        """Write a decode step's rows and their padding, copy them to the device; returns the (bucket,
        LoRA, DoRA) key the step runs with."""
        return self._stage(bucket_for(len(input_ids), self.buckets), input_ids, positions, slot_mapping,
                           block_tables, token_slots)

    def stage_verify(self, bucket: int, width: int, input_ids: list[int], positions: list[int],
                     slot_mapping: list[int], block_tables: list[list[int]],
                     token_slots: list[int]) -> tuple[int, bool, bool]:
        """A verify step's tokens, row-major at `width` per row (verify_bucket()'s `bucket` rows at most),
        a row's unused places given as padding tokens (token 0, position 0, slot -1, table [0], no
        adapter): staged as one token row each, then padding rows up to bucket x width."""
        self.verify_steps += 1
        return self._stage(bucket * width, input_ids, positions, slot_mapping, block_tables, token_slots)

    def _stage(self, rows: int, input_ids: list[int], positions: list[int], slot_mapping: list[int],
               block_tables: list[list[int]], token_slots: list[int]) -> tuple[int, bool, bool]:
        self.buffers.fill(rows, input_ids, positions, slot_mapping, block_tables, token_slots)
        self.buffers.copy_in(rows)
        dora = self.slot_dora is not None and any(s >= 0 and self.slot_dora[s] for s in token_slots)
        return rows, any(s >= 0 for s in token_slots), dora

    def run(self, key: tuple[int, bool, bool]) -> PaddedOut:
        """The staged step's output: every row of its bucket, padding included."""
        graph = self.graphs.get(key)
        if graph is not None:
            graph[0].replay()
            self.replays += 1
            return graph[1]
        self.eager_steps += 1
        return self._forward(key)

    @contextmanager
    def graphs_off(self) -> Iterator[None]:
        """Inside, every step runs the same padded contexts and kernels eagerly, the captured graphs kept
        for after: a replay checked against the launches it captured (benchmarks.profile.gpu_profile_step)."""
        kept, self.graphs = self.graphs, {}
        try:
            yield
        finally:
            self.graphs = kept

    def _forward(self, key: tuple[int, bool, bool]) -> PaddedOut:
        rows, ctx = key[0], self.contexts[key]
        input_ids, every = self.buffers.rows("input_ids", rows), self.buffers.logits_rows[:rows]
        if not self.keep_hidden:
            return PaddedOut(self.model.forward(input_ids, self.kv_caches, ctx, every), None)
        hidden = self.model.hidden_rows(input_ids, self.kv_caches, ctx, every)  # [bucket, H]
        return PaddedOut(self.model.logits(hidden, ctx.ops, ctx.lora, every), hidden)

    def capture(self) -> CaptureStats:
        """Capture every (bucket, LoRA, DoRA) context as a CUDA graph, largest bucket first into one pool
        (smaller graphs reuse its memory). Each is run eagerly first on a side stream, so that what is
        built once per context (attention plans, split partials) exists before capture and nothing is
        allocated or copied from the host inside it."""
        assert self.device.type == "cuda", "CUDA graphs need a CUDA device"
        torch.cuda.synchronize(self.device)
        free_before = torch.cuda.mem_get_info(self.device)[0]
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        self.buffers.fill(self.sizes[-1], [], [], [], [], [])  # every row padding: writes no KV
        self.buffers.copy_in(self.sizes[-1])
        side = torch.cuda.Stream(self.device)
        for key in sorted(self.contexts, reverse=True):
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for _ in range(2):
                    self._forward(key)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            # thread_local: an adapter loader thread's allocations or copies meanwhile do not abort it.
            with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                out = self._forward(key)
            self.graphs[key] = (graph, out)
        torch.cuda.synchronize(self.device)
        stats = CaptureStats(len(self.graphs), time.perf_counter() - start,
                             free_before - torch.cuda.mem_get_info(self.device)[0])
        log.info("captured %d decode and verify CUDA graphs (token rows %s) in %.1f s, %.0f MiB", stats.graphs,
                 ",".join(map(str, self.sizes)), stats.seconds, stats.bytes / (1 << 20))
        self.capture_stats = stats
        return stats
