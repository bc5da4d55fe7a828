"""Structured outputs' grammars: compiled once per tokenizer and constraint (xgrammar), cached by the
constraint's canonical hash (Grammars), and applied to a step's logits as one token bitmask (GrammarMask).

A StructuredOutputsParams becomes an xgrammar CompiledGrammar here, once per distinct
constraint: the cache is keyed by `StructuredOutputsParams.key` (sha256 of the canonical
constraint) and lives with the engine, whose tokenizer is fixed, so the key stands for
(tokenizer, constraint). Each constrained choice then gets a GrammarMatcher of its own,
advanced with every token it accepts, its masks filled ahead on the mask lane
(server.engine.mask_lane). Compiling runs in the caller's thread (xgrammar
releases the GIL while it works); server.engine.grammar_worker does it in another process
under a hard deadline for the server.

The structured-output token mask of a step (GrammarMask): one bitmask for the whole batch, gathered from the
rows its constrained choices had filled ahead (server.engine.mask_lane), applied to the logits on
their device. Nothing is filled here: the step never waits on a grammar.

A row without a constraint keeps every bit set, so applying the mask leaves its logits
exactly as they were: unconstrained requests sample the same tokens whether or not a
constrained one shares their batch.
"""
from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import xgrammar as xgr

from server.engine.json_string_safety import json_schema_grammar, structural_tag_grammar
from server.engine.mask_lane import DraftPosition, LaneMatcher, MaskBudget, MaskLane
from server.engine.repetition_depth import MAX_NESTED_REPETITION, grammar_depth, regex_depth
from server.engine.schema_keywords import unenforced_in_tag, unenforced_keyword
from server.engine.structured_outputs import StructuredOutputsParams


DEFAULT_CACHE_ENTRIES = 512


class GrammarError(ValueError):
    """The constraint cannot be compiled (an unsupported or malformed schema, regex or grammar)."""


@dataclass(frozen=True)
class GrammarStats:
    compiles: int  # grammars compiled (a cache miss that succeeded)
    cache_hits: int
    compile_seconds: float  # total time spent compiling
    failures: int  # constraints refused as malformed or past a limit
    cached: int  # grammars held now


def tokenizer_info(tokenizer, vocab_size: int, stop_token_ids) -> xgr.TokenizerInfo:
    """The tokenizer's vocabulary as xgrammar sees it, `vocab_size` wide: the model's lm_head may
    have more rows than the tokenizer has tokens (padding), and those rows are never allowed."""
    return xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=max(vocab_size, len(tokenizer)),
                                              stop_token_ids=sorted(stop_token_ids))


def _refuse_unenforced(spec: StructuredOutputsParams) -> None:
    if spec.kind == "json":
        problem = unenforced_keyword(json.loads(spec.json) if isinstance(spec.json, str) else spec.json)
    elif spec.kind == "structural_tag":
        problem = unenforced_in_tag(spec.structural_tag)
    else:
        return
    if problem is not None:
        raise GrammarError(f"invalid {spec.kind} constraint: {problem}")


def _refuse_nested_repetition(spec: StructuredOutputsParams) -> None:
    """GrammarError for a user grammar or regex nesting unbounded repetitions past MAX_NESTED_REPETITION:
    its token masks can grow costlier with every token (server.engine.repetition_depth). JSON schemas
    are xgrammar's own lowering and not checked."""
    if spec.kind == "grammar":
        depth = grammar_depth(spec.grammar)
    elif spec.kind == "regex":
        depth = regex_depth(spec.regex)
    else:
        return
    if depth > MAX_NESTED_REPETITION:
        raise GrammarError(f"invalid {spec.kind} constraint: unbounded repetitions (*, +, {{n,}}) nested {depth} "
                           f"deep, more than the {MAX_NESTED_REPETITION} allowed: its token masks grow costlier "
                           "with every token; bound or flatten the inner repetitions")


def _refuse_unsatisfiable(compiled: xgr.CompiledGrammar, kind: str) -> None:
    """GrammarError when no first token (end of output included) is allowed: `root ::= root`, a
    `$ref` cycle with no base case. Generation would otherwise stop at its first step, the server's
    fault as far as the client could tell. One mask fill, as the first step would do."""
    matcher = xgr.GrammarMatcher(compiled)
    mask = xgr.allocate_token_bitmask(1, compiled.tokenizer_info.vocab_size)
    matcher.fill_next_token_bitmask(mask)
    if not bool(mask.any()):
        raise GrammarError(f"invalid {kind} constraint: no output satisfies it (a rule or $ref that only "
                           "leads back to itself, with no way to end)")


def refuse_from_text(spec: StructuredOutputsParams) -> None:
    """GrammarError for what is refused from the constraint's text alone, before any compile (cheap:
    the server checks here before it hands the constraint to a compile process)."""
    _refuse_unenforced(spec)
    _refuse_nested_repetition(spec)


def compile_constraint(compiler: xgr.GrammarCompiler, spec: StructuredOutputsParams) -> xgr.CompiledGrammar:
    """Compile one constraint; GrammarError says what is wrong with it. JSON schemas (alone or in a
    structural tag) go through server.engine.json_string_safety, whose strings are always valid JSON."""
    kind = spec.kind
    refuse_from_text(spec)
    compiled = _compiled(compiler, spec)
    _refuse_unsatisfiable(compiled, kind)
    return compiled


def _compiled(compiler: xgr.GrammarCompiler, spec: StructuredOutputsParams) -> xgr.CompiledGrammar:
    kind = spec.kind
    try:
        if kind == "json":
            return compiler.compile_grammar(json_schema_grammar(spec.json))
        if kind == "json_object":
            # Any JSON object (OpenAI's json_object), not xgrammar's built-in any-JSON-value grammar.
            return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
        if kind == "regex":
            return compiler.compile_regex(spec.regex)
        if kind == "choice":
            # Each choice verbatim: a JSON string literal is a valid EBNF literal (same escapes).
            return compiler.compile_grammar("root ::= " + " | ".join(json.dumps(c) for c in spec.choice))
        if kind == "structural_tag":
            return compiler.compile_grammar(structural_tag_grammar(spec.structural_tag))
        return compiler.compile_grammar(spec.grammar)
    except (RuntimeError, ValueError, TypeError) as e:
        raise GrammarError(f"invalid {kind} constraint: {_first_line(e)}") from None


class Grammars:
    """The engine's compiled-grammar cache. Thread-safe: the server compiles off the engine
    thread and hands the result in; the engine thread only looks up and makes matchers."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids, max_entries: int = DEFAULT_CACHE_ENTRIES,
                 mask_budget: MaskBudget | None = None) -> None:
        assert max_entries > 0
        self.info = tokenizer_info(tokenizer, vocab_size, stop_token_ids)
        self.lane = MaskLane(self.info.vocab_size, mask_budget or MaskBudget())
        self.vocab_size = vocab_size
        # xgrammar's own cache stays off: ours is bounded in entries and counted.
        self._compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        self._max_entries = max_entries
        self._cache: OrderedDict[str, xgr.CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()
        self._compiles = self._hits = self._failures = 0
        self._compile_seconds = 0.0

    def lookup(self, spec: StructuredOutputsParams) -> xgr.CompiledGrammar | None:
        with self._lock:
            compiled = self._cache.get(spec.key)
            if compiled is not None:
                self._cache.move_to_end(spec.key)
                self._hits += 1
            return compiled

    def store(self, spec: StructuredOutputsParams, compiled: xgr.CompiledGrammar, seconds: float) -> None:
        with self._lock:
            self._compiles += 1
            self._compile_seconds += seconds
            self._cache[spec.key] = compiled
            self._cache.move_to_end(spec.key)
            while len(self._cache) > self._max_entries:
                self._cache.popitem(last=False)

    def count_failure(self) -> None:
        with self._lock:
            self._failures += 1

    def compile(self, spec: StructuredOutputsParams) -> xgr.CompiledGrammar:
        """The cached grammar, or one compiled now in this thread (no deadline: the offline API's
        path; the server compiles with server.engine.grammar_worker instead)."""
        compiled = self.lookup(spec)
        if compiled is None:
            start = time.perf_counter()
            try:
                compiled = compile_constraint(self._compiler, spec)
            except GrammarError:
                self.count_failure()
                raise
            self.store(spec, compiled, time.perf_counter() - start)
        return compiled

    def deserialize(self, serialized: str) -> xgr.CompiledGrammar:
        """A grammar compiled in another process (grammar_worker), bound to this tokenizer."""
        return xgr.CompiledGrammar.deserialize_json(serialized, self.info)

    def choice_matcher(self, compiled: xgr.CompiledGrammar, kind: str, sibling: LaneMatcher | None,
                       tenant: str | None = None, max_drafts: int = 0) -> LaneMatcher:
        """A constrained choice's matcher, its first mask already being filled on the lane; `sibling`: an
        earlier choice of its request (None for the first), whose mask budget it shares; `tenant`: whose
        turn its fills take on the lane; `max_drafts`: the most drafts a step verifies."""
        return self.lane.matcher(compiled, kind, sibling, tenant, max_drafts)

    def stats(self) -> GrammarStats:
        with self._lock:
            return GrammarStats(self._compiles, self._hits, self._compile_seconds, self._failures, len(self._cache))


def _first_line(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0][:300]


class GrammarMask:
    """Owned by the model runner.

    `vocab_size` is the grammar tokenizer's width (server.engine.grammar.tokenizer_info), at
    least the logits' width; the mask is applied to the logits' width.
    """

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def gather(self, matchers: Sequence[LaneMatcher | DraftPosition | None]) -> torch.Tensor | None:
        """[N, ceil(V / 32)] int32 on the CPU, bit t of row i set when row i may take token t;
        None when no row is constrained (the batch pays nothing). Every matcher's mask is ready
        (the scheduler ran only those)."""
        indices = [i for i, m in enumerate(matchers) if m is not None]
        if not indices:
            return None
        bitmask = xgr.allocate_token_bitmask(len(matchers), self.vocab_size)  # every bit set
        for i in indices:
            bitmask[i] = matchers[i].row()[0]
        return bitmask

    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        """logits: [N, V] (any device), changed in place: disallowed tokens become -inf."""
        xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True),
                                        vocab_size=logits.shape[-1])

    def allows_only(self, bitmask: torch.Tensor, row: int, tokens: Sequence[int]) -> bool:
        """Whether row `row` of a filled bitmask allows no token outside `tokens` (its grammar can
        only end now, when `tokens` are the stop tokens)."""
        words = bitmask[row].to(torch.int64) & 0xFFFFFFFF  # [W] the row's 32-bit words, unsigned
        for t in tokens:
            if 0 <= t < self.vocab_size:
                words[t >> 5] &= ~(1 << (t & 31)) & 0xFFFFFFFF
        tail = self.vocab_size % 32
        if tail:  # bits past the vocabulary are no tokens
            words[-1] &= (1 << tail) - 1
        return not bool(words.any())
