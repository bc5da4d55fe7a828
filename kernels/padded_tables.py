"""A step's block tables as one [B, width] int32 host array, each row padded with 0, kept from step to step.

Rebuilding it every step extends the array twice per row (its table, then its padding): at 256 decoding
rows the largest part of AttentionBatch.build. From one decode step to the next most rows' tables are
unchanged (a row gets a new block once per block_size tokens), so a row is compared with the copy kept of
it and rewritten only when it differs; a different row count or width rebuilds the whole array. Exact
whatever changed in between (appended blocks, a copy-on-write, blocks released behind a window, other
sequences): every row is compared.
"""
from __future__ import annotations

from array import array
from itertools import compress
from operator import ne


class PaddedTables:
    def __init__(self) -> None:
        self.rows: list[list[int]] = []  # a copy of each row's table as last written
        self.width = 0
        self.flat = array("i")  # [len(rows) * width]
        self.zeros = array("i")  # [width]

    def update(self, tables: list[list[int]]) -> tuple[array, int]:
        """The padded array of `tables` and its width (at least 1). Read the array before the next update:
        it is rewritten in place."""
        width = max(map(len, tables), default=1) or 1
        if width != self.width or len(tables) != len(self.rows):
            self.width, self.zeros = width, array("i", bytes(4 * width))
            self.rows = [t[:] for t in tables]
            flat = self.flat = array("i")
            for t in tables:
                flat.extend(t)
                flat.extend(self.zeros[: width - len(t)])
            return flat, width
        rows, flat = self.rows, self.flat
        for r in compress(range(len(rows)), map(ne, tables, rows)):  # the rows compared in C, a loop over the changed
            t = tables[r]
            at = r * width
            flat[at : at + len(t)] = array("i", t)
            flat[at + len(t) : at + width] = self.zeros[: width - len(t)]
            rows[r] = t[:]
        return flat, width
