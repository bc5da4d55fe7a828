"""From a validated OpenAI request to the engine's SamplingParams: defaults, caps and the
translations between the two vocabularies (OpenAI's top_k -1, logprobs as a count or a flag)."""
from __future__ import annotations

from server.api.errors import APIError
from server.api.openai_requests import ChatCompletionRequest, CompletionRequest, Unsupported
from server.engine import SamplingParams, StructuredOutputsParams
from tenants import Tenant

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


def max_tokens_for(req: CompletionRequest | ChatCompletionRequest, tenant: Tenant, prompt_len: int,
                   max_model_len: int) -> int:
    """The completion's token limit: as asked, else the endpoint's default (chat: the rest of the
    context, within the tenant's own caps, shared by the n choices of the token budget)."""
    if isinstance(req, CompletionRequest):
        return req.max_tokens if req.max_tokens is not None else COMPLETION_DEFAULT_MAX_TOKENS
    if req.completion_limit is not None:
        return req.completion_limit
    room = max_model_len - prompt_len
    q = tenant.quota
    if q.max_tokens_per_request is not None:
        room = min(room, q.max_tokens_per_request // req.n)  # the cap bounds all n choices together
    if q.tokens_per_minute is not None:
        room = min(room, (q.tokens_per_minute - prompt_len) // req.n)
    return max(1, room)


def sampling_params(req: CompletionRequest | ChatCompletionRequest, max_tokens: int, vocab_size: int,
                    structured_outputs: StructuredOutputsParams | None = None) -> SamplingParams:
    try:
        bias = req.token_bias()
    except Unsupported as e:
        raise APIError(400, str(e), "invalid_value", param=e.field) from None
    if bias and max(bias) >= vocab_size:
        raise APIError(400, f"'logit_bias' names token {max(bias)}, outside the vocabulary of {vocab_size}",
                       "invalid_value", param="logit_bias")
    if isinstance(req, CompletionRequest):
        logprobs = req.logprobs
        prompt_logprobs = req.prompt_logprobs
        if req.echo and req.logprobs is not None:
            prompt_logprobs = max(req.logprobs, prompt_logprobs or 0)
        if req.echo and max_tokens == 0 and prompt_logprobs is None:
            # vLLM's echo with max_tokens 0: the prompt comes back as the text. The engine runs such a
            # request only as scoring, so it scores the prompt (no alternatives); nothing of it is returned.
            prompt_logprobs = 0
    else:
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        prompt_logprobs = req.prompt_logprobs
    try:
        return SamplingParams(
            max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p,
            top_k=max(0, req.top_k), min_p=req.min_p, seed=req.seed, stop=req.stop_strings,
            stop_token_ids=tuple(req.stop_token_ids or ()), ignore_eos=req.ignore_eos, n=req.n,
            presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
            repetition_penalty=req.repetition_penalty, min_tokens=req.min_tokens, logit_bias=bias,
            logprobs=logprobs, prompt_logprobs=prompt_logprobs, structured_outputs=structured_outputs,
            speculative=req.speculative)
    except ValueError as e:
        # SamplingParams' messages begin with the field's name.
        raise APIError(400, str(e), "invalid_value", param=str(e).split(" ", 1)[0]) from None
