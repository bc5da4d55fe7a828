"""The detokenizer's id -> bytes table (server.engine.output_processor) for byte-level vocabularies: each
entry is the bytes its piece's byte-level characters stand for, and a vocabulary with a piece that is
not byte-level (a raw space, a character outside the alphabet) gets no table (decode() is used)."""
from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

from server.engine.output_text import IncrementalDetokenizer
from server.engine.tokenizer_loader import bytes_to_unicode

pytestmark = pytest.mark.unit


def _byte_level(vocab: list[str]) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.WordLevel({piece: i for i, piece in enumerate(vocab)}, unk_token=vocab[0]))
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def test_each_entry_is_the_bytes_of_its_piece():
    alphabet = bytes_to_unicode()
    vocab = ["<unk>", alphabet[ord(" ")] + "hi", "".join(alphabet[b] for b in "é中😀".encode()), alphabet[0] + alphabet[255]]
    table = IncrementalDetokenizer(_byte_level(vocab), skip_special_tokens=False).token_bytes
    assert table == [b"<unk>", b" hi", "é中😀".encode(), b"\x00\xff"]


@pytest.mark.parametrize("piece", ["a b", "tab\there", "\x00", "\u00ad", "é\uffff", "中"])
def test_a_piece_that_is_not_byte_level_means_no_table(piece):
    assert IncrementalDetokenizer(_byte_level(["<unk>", "ok", piece])).token_bytes is None
