"""The real-model evaluation's automatic checks: is a reply right (per item, server.bench.eval_items),
and does it carry each demo adapter's effect (French, terse JSON, a pirate's voice)?

The effect checks are heuristics sized to the demo adapters' styles, not language identification:
French is "more French function words than English ones, and at least one", counted over a fixed
list of each; JSON is "the whole reply parses as a JSON object"; pirate is "a pirate's word
(arr, matey, ahoy, ye)". The tests pin each on examples of both sides.
"""
from __future__ import annotations

import json
import re

from server.bench.eval_items import EvalItem

_WORD = re.compile(r"[^\W\d_]+", re.UNICODE)
FRENCH_WORDS = frozenset("""le la les l de du des d est et un une font sont capitale pattes moins il elle
    c qui que pour avec dans au aux ce cette ville couleur combien réponse voici""".split())
ENGLISH_WORDS = frozenset("""the is of and are it this that which with for has have legs capital city color
    colour what answer here its""".split())
PIRATE_WORDS = frozenset("arr arrr matey mateys ahoy ye".split())
EFFECTS = ("french", "json", "pirate")


def words(text: str) -> list[str]:
    """Lower-case words (letters only: an apostrophe or a digit splits), e.g. "l'Italie" -> l, italie."""
    return _WORD.findall(text.lower())


def is_french(text: str) -> bool:
    w = words(text)
    french = sum(x in FRENCH_WORDS for x in w)
    return french >= 1 and french > sum(x in ENGLISH_WORDS for x in w)


def json_object(text: str) -> dict | None:
    """The reply as a JSON object (a ```json fence around it allowed), or None."""
    body = text.strip()
    fenced = re.fullmatch(r"```(?:json)?\s*(.*?)\s*```", body, re.DOTALL)
    if fenced:
        body = fenced.group(1)
    try:
        value = json.loads(body)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def is_json(text: str) -> bool:
    return json_object(text) is not None


def is_pirate(text: str) -> bool:
    return any(x in PIRATE_WORDS for x in words(text))


def has_effect(effect: str, text: str) -> bool:
    return {"french": is_french, "json": is_json, "pirate": is_pirate}[effect](text)


def _has_word(text: str, expect: str) -> bool:
    return re.search(rf"(?<![\w]){re.escape(expect)}(?![\w])", text, re.IGNORECASE | re.UNICODE) is not None


def is_correct(item: EvalItem, text: str) -> bool:
    """Whether `text` answers `item` (its check and accepted answers)."""
    stripped = text.strip()
    if item.check == "contains":
        return any(_has_word(text, e) for e in item.expect)
    if item.check == "one_word":
        word = stripped.rstrip(".!")
        return len(word.split()) == 1 and any(_has_word(word, e) for e in item.expect)
    if item.check == "only_number":
        return stripped.rstrip(".") in item.expect
    if item.check == "upper":
        return any(e in text for e in item.expect)
    if item.check == "json_answer":
        value = json_object(text)
        return value is not None and any(_has_word(str(value.get("answer", "")), e) for e in item.expect)
    assert item.check == "comma_list", item.check
    first = stripped.splitlines()[0] if stripped else ""
    return len([p for p in first.split(",") if p.strip()]) >= int(item.expect[0])
