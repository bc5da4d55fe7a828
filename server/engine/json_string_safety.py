"""JSON-schema grammars whose strings are always valid JSON, whatever xgrammar 0.2.8 lowers.

xgrammar lowers three string constructs to grammars that admit invalid JSON (mlc-ai/xgrammar#800):
- a string with `minLength`/`maxLength` (and `propertyNames` with them): a character class that
  admits raw U+0000-U+001F and no escape at all;
- a `pattern`'s literal characters (`\\n`, `"`, `\\\\`, `\\x01`...) are written raw into the JSON text;
- `format: email`'s quoted local part writes `\\` + any printable character (`\\a` is no JSON escape).
Here each is repaired: patterns are rewritten before lowering (a literal becomes its JSON escape);
the lowered grammar's text has the length-bounded class replaced by a JSON string character
(any character but the C0 controls, `"` and `\\`, or an escape counted as one character) and the
email's quoted pair by a JSON-escaped one, then it is parsed back (xgrammar prints EBNF it reads).
Enums, consts and property names are escaped correctly by xgrammar and left alone.
"""
from __future__ import annotations

import json

import xgrammar as xgr

# The length-bounded string's character class as xgrammar prints it (wherever it sits: a rule of
# its own, or inlined as an optional one), and the email's quoted pair.
_RAW_CHAR_CLASS = r'[^\"\\\r\n]'
_JSON_CHAR = r'([^\0-\x1f\"\\] | "\\" lp_json_escape)'
_EMAIL_QUOTED_PAIR = r'(("\\" [ -~]) | ([ !#-[\]-~]))'
_JSON_QUOTED_PAIR = r'(("\\\\" ([ !#-[\]-~] | "\\\\" | "\\\"")) | ([ !#-[\]-~]))'
# One escape after the backslash; \u of a UTF-16 surrogate is left out, so that each escape is one
# code point and a length bound counts what a validator counts.
_ESCAPE_RULE = (r'lp_json_escape ::= [\"\\/bfnrt] | "u" ([0-9a-cA-CeEfF] [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F] '
                r'| [dD] [0-7] [0-9a-fA-F] [0-9a-fA-F])')
# Schema keywords whose values are data, not schemas: nothing under them is a pattern.
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples", "example"})
_SHORT_ESCAPES = {"\n": "n", "\r": "r", "\t": "t", "\f": "f", "\b": "b", '"': '"', "\\": "\\\\"}
_REGEX_CHAR_ESCAPES = {"n": "\n", "r": "\r", "t": "\t", "f": "\f", "v": "\v", "0": "\0"}


def _json_text_regex(char: str) -> str:
    """A regex for the JSON text of the one character `char` (a control, `"` or a backslash)."""
    short = _SHORT_ESCAPES.get(char)
    body = "\\\\" + short if short else f"\\\\u{ord(char):04x}"
    return f"(?:{body})"


def _needs_escape(char: str) -> bool:
    return char < " " or char in '"\\'


def json_string_pattern(pattern: str) -> str:
    """`pattern` rewritten so that xgrammar's JSON-string regex writes each literal control, quote
    or backslash as its JSON escape. Character classes are kept: xgrammar already leaves these
    characters out of them."""
    out: list[str] = []
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        if c == "[":  # a class, copied to its closing bracket (a leading `]` or `^]` is literal)
            j = i + 1
            j += pattern[j:j + 1] == "^"
            j += pattern[j:j + 1] == "]"
            while j < n and pattern[j] != "]":
                j += 2 if pattern[j] == "\\" else 1
            out.append(pattern[i:j + 1])
            i = j + 1
            continue
        if c == "\\" and i + 1 < n:
            literal, width = _escaped_literal(pattern, i + 1)
            if literal is not None and _needs_escape(literal):
                out.append(_json_text_regex(literal))
            else:
                out.append(pattern[i:i + 1 + width])
            i += 1 + width
            continue
        out.append(_json_text_regex(c) if _needs_escape(c) else c)
        i += 1
    return "".join(out)


def _escaped_literal(pattern: str, at: int) -> tuple[str | None, int]:
    """The literal character a regex escape starting at `at` (after its backslash) stands for, or
    None for a class or an assertion, and how many characters the escape takes after the backslash."""
    c = pattern[at]
    if c in _REGEX_CHAR_ESCAPES:
        return _REGEX_CHAR_ESCAPES[c], 1
    for letter, digits in (("x", 2), ("u", 4)):
        code = pattern[at + 1:at + 1 + digits]
        if c == letter and len(code) == digits and all(h in "0123456789abcdefABCDEF" for h in code):
            return chr(int(code, 16)), 1 + digits
    if c.isalnum():
        return None, 1
    return c, 1


def _rewrite_patterns(node):
    """A copy of a JSON schema with every `pattern` rewritten (json_string_pattern)."""
    if isinstance(node, list):
        return [_rewrite_patterns(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        if key in _DATA_KEYWORDS:
            out[key] = value
        elif key == "pattern" and isinstance(value, str):
            out[key] = json_string_pattern(value)
        elif key in ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas") \
                and isinstance(value, dict):
            out[key] = {name: _rewrite_patterns(sub) for name, sub in value.items()}
        else:
            out[key] = _rewrite_patterns(value)
    return out


def _rewrite_tag_schemas(node):
    """A copy of a structural tag with the JSON schemas in it rewritten (_rewrite_patterns)."""
    if isinstance(node, list):
        return [_rewrite_tag_schemas(v) for v in node]
    if not isinstance(node, dict):
        return node
    return {k: _rewrite_patterns(v) if k == "json_schema" else _rewrite_tag_schemas(v) for k, v in node.items()}


def repair_strings(grammar: xgr.Grammar) -> xgr.Grammar:
    """`grammar` with xgrammar's non-JSON string rules replaced; itself when it has none."""
    text = str(grammar)
    fixed = text.replace(_RAW_CHAR_CLASS, _JSON_CHAR).replace(_EMAIL_QUOTED_PAIR, _JSON_QUOTED_PAIR)
    if fixed == text:
        return grammar
    return xgr.Grammar.from_ebnf(fixed + "\n" + _ESCAPE_RULE + "\n")


def json_schema_grammar(schema: str | dict | bool) -> xgr.Grammar:
    """The grammar of a JSON schema's instances (compact separators), valid JSON in every string."""
    value = json.loads(schema) if isinstance(schema, str) else schema
    lowered = xgr.Grammar.from_json_schema(json.dumps(_rewrite_patterns(value)), any_whitespace=False)
    return repair_strings(lowered)


def structural_tag_grammar(tag: dict) -> xgr.Grammar:
    """The grammar of a structural tag (its JSON form), valid JSON in every string of its schemas."""
    return repair_strings(xgr.Grammar.from_structural_tag(json.dumps(_rewrite_tag_schemas(tag))))
