"""Issue 43's costly constraints: unbounded repetitions nested `depth` deep, each level able to take
any letter, so every output token is ambiguous across the levels. The server refuses both forms at
compile past server.engine.repetition_depth.MAX_NESTED_REPETITION (the abuse bench's attacks, and the
tests' examples)."""
from __future__ import annotations


def nested_grammar(depth: int) -> str:
    """`root ::= a0` and `aN ::= (aN+1 | [a-z])*` (926 bytes at depth 40)."""
    return "root ::= a0\n" + "".join(f"a{i} ::= (a{i + 1} | [a-z])*\n" for i in range(depth)) + f"a{depth} ::= [a-z]\n"


def nested_regex(depth: int) -> str:
    """The same nesting as a regex (~370 bytes at depth 40)."""
    pattern = "[a-z]"
    for _ in range(depth):
        pattern = f"([a-z]|{pattern})*"
    return pattern
