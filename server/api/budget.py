"""What one generation request may cost, checked as a whole before any of it is admitted.

A request is its prompts x n choices x max_tokens: the tenant's max_tokens_per_request and
tokens_per_minute bound that total (a batch of 64 prompts with n 16 is 1,024 completions, not
one), and the response's size is bounded by --max-logprob-entries, counted as OpenAI's
response would carry them: per prompt, n x (max_tokens + the prompt's tokens when it is echoed
or scored) x (the top alternatives + 1). All are refusals that waiting cannot fix: 400s.
"""
from __future__ import annotations

from collections.abc import Sequence

from server.api.errors import APIError
from server.api.openai_requests import ChatCompletionRequest, CompletionRequest
from tenants import RequestTooLarge, Tenant, check_request_tokens


def _top(req: CompletionRequest | ChatCompletionRequest) -> int | None:
    """Alternatives per returned position; None when the response carries no logprobs."""
    if isinstance(req, CompletionRequest):
        asked = [v for v in (req.logprobs, req.prompt_logprobs) if v is not None]
    else:
        asked = [v for v in ((req.top_logprobs or 0) if req.logprobs else None, req.prompt_logprobs)
                 if v is not None]
    return max(asked) if asked else None


def logprob_entries(req: CompletionRequest | ChatCompletionRequest, prompt_lens: Sequence[int],
                    max_tokens: Sequence[int]) -> int:
    """Positions x (alternatives + 1) the response may carry; echoed prompts count as positions.
    0 for a response with neither logprobs nor an echo."""
    top = _top(req)
    echo = isinstance(req, CompletionRequest) and req.echo
    if top is None and not echo:
        return 0
    with_prompt = echo or req.prompt_logprobs is not None
    return sum(req.n * (m + (p if with_prompt else 0)) * ((top or 0) + 1) for p, m in zip(prompt_lens, max_tokens))


def _completion_tokens(prompts: int, n: int) -> str:
    return f"the request's completion tokens (prompts {prompts} x n {n} x max_tokens)"


def check_completion_cap(req: CompletionRequest | ChatCompletionRequest, tenant: Tenant, prompts: int) -> None:
    """The tenant's max_tokens_per_request before any prompt is tokenized, where the total does not
    depend on the prompts (a completion with max_tokens): a batch past the cap costs the server no
    tokenizing (64 prompts of text: 64 tokenizer calls, each a worker-thread hop). check_request_cost
    checks every request again once its prompts are known."""
    if isinstance(req, CompletionRequest) and req.max_tokens is not None:
        check_request_tokens(tenant, prompts * req.n * req.max_tokens, _completion_tokens(prompts, req.n))


def check_request_cost(req: CompletionRequest | ChatCompletionRequest, tenant: Tenant, prompt_lens: Sequence[int],
                       max_tokens: Sequence[int], max_logprob_entries: int) -> None:
    """400 for a request that can never be served within the tenant's per-request and per-minute
    token limits or the server's response budget."""
    completion = sum(req.n * m for m in max_tokens)
    check_request_tokens(tenant, completion, _completion_tokens(len(prompt_lens), req.n))
    tpm = tenant.quota.tokens_per_minute
    total = sum(prompt_lens) + completion
    if tpm is not None and total > tpm:
        raise RequestTooLarge(
            f"this request may use up to {total} tokens (its prompts' {sum(prompt_lens)} plus prompts x n x "
            f"max_tokens = {completion}), more than the tenant's tokens_per_minute of {tpm}; "
            f"send fewer prompts, a smaller n or max_tokens", "tokens_per_minute")
    entries = logprob_entries(req, prompt_lens, max_tokens)
    if entries > max_logprob_entries:
        raise APIError(400, f"this request may return up to {entries} logprob entries (prompts x n x (max_tokens "
                            f"+ prompt tokens when echoed or with prompt_logprobs) x (logprobs + 1)); the server's "
                            f"limit is {max_logprob_entries} (--max-logprob-entries): send fewer prompts, a smaller "
                            f"n, max_tokens or logprobs", "max_logprob_entries", param="logprobs")
