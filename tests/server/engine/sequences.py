"""Requests as the engine queues them, for tests of the scheduler and its parts (no model, no tokenizer)."""
from server.engine.sequence import SamplingParams, Sequence, SequenceGroup


def request(prompt: list[int], arrival: int, *, tenant: str | None = None, version: str | None = None,
            priority: int = 0, salt: str | None = None, n: int = 1, max_tokens: int = 4,
            prompt_logprobs: int | None = None) -> Sequence:
    """Choice 0 of a request (the others wait in its group until it forks), as LLMEngine.add_request makes it;
    `version` is the adapter version id (None: the base model)."""
    params = SamplingParams(max_tokens=max_tokens, n=n, prompt_logprobs=prompt_logprobs)
    group = SequenceGroup(f"r{arrival}", prompt_logprobs is not None, ())
    seqs = [Sequence(f"r{arrival}", prompt, params, version, arrival, tenant, priority, i, group, salt)
            for i in range(n)]
    return seqs[0]
