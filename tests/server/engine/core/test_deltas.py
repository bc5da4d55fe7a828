"""Outputs cross as deltas and are rebuilt cumulative: what the front end gets equals what the
engine made, tokens and logprobs (no text: the front end makes it, server.engine.output_text)."""
from __future__ import annotations

import msgspec

from server.engine.core.deltas import DeltaEncoder, OutputAssembler
from server.engine.core.messages import OutputDelta
from server.engine.sequence import RequestOutput, TokenLogprobs


def _lp(token: int) -> TokenLogprobs:
    return TokenLogprobs(token, -0.1 * token, ((token, -0.1 * token), (token + 1, -1.0 / 3)))


def test_deltas_rebuild_the_cumulative_outputs():
    prompt = [1, 2, 3]
    prompt_lp = [None, _lp(2), _lp(3)]
    made = []
    steps = 4
    for i in range(steps):
        for index in (0, 1):
            tokens = list(range(10, 11 + i))
            made.append(RequestOutput("r", prompt, tokens, "", finished=i == steps - 1,
                                      finish_reason="stop" if i == steps - 1 else None, index=index,
                                      logprobs=[_lp(t) for t in tokens], prompt_logprobs=prompt_lp,
                                      num_cached_tokens=1))
    encoder, assembler = DeltaEncoder(), OutputAssembler()
    encoder.track("r", b"front", 2)
    assembler.track("r", prompt)
    wire = msgspec.msgpack.Decoder(OutputDelta)
    for out in made:
        owner, delta = encoder.encode(out)
        assert owner == b"front"
        rebuilt = assembler.apply(wire.decode(msgspec.msgpack.encode(delta)))
        assert rebuilt == out
    assert encoder.encode(made[-1]) is None  # every choice finished: no longer tracked


def test_a_requests_own_error_stays_the_clients_fault():
    """A constraint too costly to enforce ends its request as the client's error (a 400), over the wire too."""
    out = RequestOutput("r", [1], [5], "", finished=True, finish_reason="error", error="too costly",
                        error_is_client=True)
    encoder, assembler = DeltaEncoder(), OutputAssembler()
    encoder.track("r", b"front", 1)
    assembler.track("r", [1])
    _, delta = encoder.encode(out)
    assert assembler.apply(msgspec.msgpack.Decoder(OutputDelta).decode(msgspec.msgpack.encode(delta))) == out


def test_no_text_crosses_the_wire():
    """The core sends token ids; the front end makes the text (server.engine.output_text), so the
    detokenizing and stop-string work stays off the core's step."""
    assert not any("text" in name for name in OutputDelta.__struct_fields__)
