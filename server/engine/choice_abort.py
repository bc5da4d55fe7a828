"""ChoiceAbort: the front end ended one choice of a request, which the engine still runs.

Stop strings are matched in the front end (server.engine.output_text): the choice's text ends at the token
that completed one, `kept` output tokens given to the client. The engine only sees token ids, so the
front end tells it; it stops that choice alone (the request's other choices run on), and the tokens it ran
past `kept` while the message was on its way are taken back from the tenant's fair share: a client is
charged, and its usage counted, for the tokens it was given (OpenAI's completion_tokens).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ChoiceAbort:
    request_id: str
    index: int  # the choice, 0..n-1
    kept: int  # its output tokens the client was given
