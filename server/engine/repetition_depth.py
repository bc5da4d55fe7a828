"""How deeply a user's grammar or regex nests unbounded repetitions: `(a | (b)*)*` is 2 deep. Deeply
nested repetitions of overlapping bodies (`aN ::= (aN+1 | [a-z])*`, 40 rules in under 1 KB) make
every output token ambiguous across the levels, so the grammar's token mask can grow costlier with
each token; such constraints are refused at compile, before any token is generated
(server.engine.grammar). JSON schemas are lowered by xgrammar itself and never pass through here.

The depth follows rule references: a repetition whose body reaches, through references, another
unbounded repetition nests it. A recursive reference (a rule reached again on its own path, as in
any JSON-like grammar) adds nothing: recursion is bounded by the text already written.
"""
from __future__ import annotations

import re
import re._constants as sre_constants
import re._parser as sre_parser

# Deeper than this is refused: ordinary grammars nest two or three (lines of words of letters).
MAX_NESTED_REPETITION = 4

_TOKEN = re.compile(r"""
    (?P<space>\s+|\#[^\n]*)
  | (?P<string>"(?:\\.|[^"\\])*")
  | (?P<cls>\[(?:\\.|[^\]\\])*\])
  | (?P<define>::=)
  | (?P<name>[A-Za-z_][A-Za-z0-9_.\-]*)
  | (?P<bound>\{\s*\d*\s*(?:,\s*\d*\s*)?\})
  | (?P<op>[()|*+?])
  | (?P<other>.)
""", re.VERBOSE | re.DOTALL)


def regex_depth(pattern: str) -> int:
    """Unbounded repetitions nested in `pattern` (0 when Python cannot read it: xgrammar says what
    is wrong then)."""
    try:
        parsed = sre_parser.parse(pattern)
    except (re.error, RecursionError, OverflowError, ValueError):
        return 0
    return _sre_depth(parsed)


def _sre_depth(items) -> int:
    deepest = 0
    for op, av in items:
        if op in (sre_constants.MAX_REPEAT, sre_constants.MIN_REPEAT, sre_constants.POSSESSIVE_REPEAT):
            low, high, sub = av
            depth = _sre_depth(sub) + (high == sre_constants.MAXREPEAT)
        elif op is sre_constants.SUBPATTERN:
            depth = _sre_depth(av[-1])
        elif op is sre_constants.BRANCH:
            depth = max((_sre_depth(b) for b in av[1]), default=0)
        elif op in (sre_constants.ASSERT, sre_constants.ASSERT_NOT, sre_constants.ATOMIC_GROUP):
            depth = _sre_depth(av[-1] if op is not sre_constants.ATOMIC_GROUP else av)
        else:
            depth = 0
        deepest = max(deepest, depth)
    return deepest


def grammar_depth(ebnf: str) -> int:
    """Unbounded repetitions nested from `ebnf`'s root rule (GBNF, as xgrammar reads it)."""
    return _Grammar(ebnf).depth()


class _Grammar:
    def __init__(self, ebnf: str) -> None:
        tokens = [(m.lastgroup, m.group()) for m in _TOKEN.finditer(ebnf) if m.lastgroup != "space"]
        self.rules: dict[str, list[tuple[str, str]]] = {}
        starts = [i for i in range(len(tokens) - 1) if tokens[i][0] == "name" and tokens[i + 1][0] == "define"]
        for a, b in zip(starts, starts[1:] + [len(tokens)]):
            self.rules.setdefault(tokens[a][1], tokens[a + 2 : b])
        self._memo: dict[str, int] = {}
        self._open: set[str] = set()

    def depth(self) -> int:
        if "root" in self.rules:
            return self._rule("root")
        return max((self._rule(name) for name in self.rules), default=0)

    def _rule(self, name: str) -> int:
        if name in self._memo:
            return self._memo[name]
        if name in self._open or name not in self.rules:
            return 0  # recursion (or a name xgrammar will refuse)
        self._open.add(name)
        depth = self._body(self.rules[name])
        self._open.discard(name)
        self._memo[name] = depth
        return depth

    def _body(self, tokens: list[tuple[str, str]]) -> int:
        """Max depth over a token run: each atom's own depth, plus one when an unbounded quantifier follows."""
        deepest, stack = 0, [0]  # stack: the depth so far inside each open group
        last = 0  # depth of the atom just closed, which a quantifier applies to
        for kind, text in tokens:
            if kind == "op" and text == "(":
                stack.append(0)
                last = 0
            elif kind == "op" and text == ")":
                last = stack.pop() if len(stack) > 1 else 0
                stack[-1] = max(stack[-1], last)
            elif kind in ("op", "bound") and text != "|":
                unbounded = text in ("*", "+") or (kind == "bound" and re.search(r",\s*\}", text))
                if unbounded and text != "?":
                    last += 1
                    stack[-1] = max(stack[-1], last)
            elif kind == "name":
                last = self._rule(text)
                stack[-1] = max(stack[-1], last)
            else:
                last = 0
            deepest = max(deepest, stack[-1])
        return max(deepest, *stack)
