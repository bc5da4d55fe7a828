"""The structured-output schema suite: JSON schemas kept in the repo (server/bench/schemas/), a
hand-written core and a seeded, generated rest, that the structured workload sends and the tests
compile.

The generated schemas combine what clients ask for: nested objects with required and optional
properties, arrays with item bounds, enums, anyOf, string formats and patterns, integers and numbers
with (exclusive) bounds, const, $defs/$ref. Only keywords that xgrammar (0.2.8) enforces exactly are
drawn: it over-accepts `date-time`/`time` (second 60), `ipv4` (leading zeros), `date` (year 0000, which
RFC 3339 allows and jsonschema's checker refuses), strings bounded by
`minLength`/`maxLength` (raw control characters), and ignores `uniqueItems` and multi-branch `allOf`;
those stay out of the suite so that "valid" means what the schema says.

Strings are patterns or formats of bounded length, and arrays have maxItems, so a random-weight model
under the grammar finishes most outputs within a few hundred tokens.

    .venv/bin/python scripts/make_schema_suite.py      # rewrites server/bench/schemas/generated/
"""
from __future__ import annotations

import json
import random
from pathlib import Path

SUITE_DIR = Path(__file__).resolve().parent / "schemas"
GENERATED = "generated"
CORE = "core"
DEFAULT_COUNT = 220
DEFAULT_SEED = 24
# formats xgrammar enforces exactly (checked against jsonschema's FormatChecker by tests/server/bench/test_schema_suite.py)
FORMATS = ("email", "uuid", "ipv6", "uri", "hostname")
_WORDS = ("alpha", "beta", "gamma", "delta", "red", "green", "blue", "small", "large", "open", "closed",
          "pending", "north", "south", "cat", "dog", "yes", "no", "low", "high")
_PATTERNS = ("^[a-z]{1,8}$", "^[A-Z]{2}-[0-9]{3}$", "^[a-z]+( [a-z]+)?$", "^[0-9]{4}$", "^(ab|cd)[xy]?$",
             "^[a-f0-9]{6}$")


def load_suite(root: Path = SUITE_DIR) -> list[tuple[str, dict]]:
    """(name, schema) for every schema of the suite, core first, each in name order."""
    out = []
    for part in (CORE, GENERATED):
        for path in sorted((root / part).glob("*.json")):
            out.append((f"{part}/{path.stem}", json.loads(path.read_text())))
    return out


def generate_schemas(count: int = DEFAULT_COUNT, seed: int = DEFAULT_SEED) -> list[dict]:
    """`count` schemas, the same for the same (count, seed)."""
    rng = random.Random(seed)
    return [_SchemaMaker(rng, i).root() for i in range(count)]


def write_generated(root: Path = SUITE_DIR, count: int = DEFAULT_COUNT, seed: int = DEFAULT_SEED) -> int:
    """Rewrite root/generated/ with generate_schemas(count, seed); returns how many were written."""
    out = root / GENERATED
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.json"):
        old.unlink()
    for i, schema in enumerate(generate_schemas(count, seed)):
        (out / f"gen-{i:03d}.json").write_text(dump(schema))
    return count


def dump(schema: dict) -> str:
    return json.dumps(schema, indent=1, sort_keys=True) + "\n"


class _SchemaMaker:
    """One generated schema. Depth and width shrink as it nests, so each stays a few hundred tokens."""

    def __init__(self, rng: random.Random, index: int) -> None:
        self.rng = rng
        self.index = index
        self.defs: dict[str, dict] = {}

    def root(self) -> dict:
        # Mostly objects (what json_schema users send), some arrays and scalars at the top.
        kind = self.rng.choices(("object", "array", "anyOf", "scalar"), weights=(70, 15, 8, 7))[0]
        schema = {"object": lambda: self.obj(0), "array": lambda: self.array(0),
                  "anyOf": lambda: self.any_of(1), "scalar": self.scalar}[kind]()
        schema = {"title": f"gen-{self.index:03d}", **schema}
        if self.defs:
            schema["$defs"] = self.defs
        return schema

    def value(self, depth: int) -> dict:
        weights = (45, 15, 12, 8, 5) if depth < 2 else (80, 0, 10, 10, 0)
        kind = self.rng.choices(("scalar", "object", "array", "anyOf", "ref"), weights=weights)[0]
        if kind == "object":
            return self.obj(depth + 1)
        if kind == "array":
            return self.array(depth + 1)
        if kind == "anyOf":
            return self.any_of(depth + 1)
        if kind == "ref":
            name = f"d{len(self.defs)}"
            self.defs[name] = self.scalar()
            return {"$ref": f"#/$defs/{name}"}
        return self.scalar()

    def obj(self, depth: int) -> dict:
        n = self.rng.randint(1, 5 if depth == 0 else 3)
        names = self.rng.sample(_WORDS, n)
        props = {name: self.value(depth) for name in names}
        required = [name for name in names if self.rng.random() < 0.7]
        schema = {"type": "object", "properties": props, "additionalProperties": False}
        if required:
            schema["required"] = required
        return schema

    def array(self, depth: int) -> dict:
        lo = self.rng.randint(0, 2)
        return {"type": "array", "items": self.value(depth), "minItems": lo, "maxItems": lo + self.rng.randint(0, 3)}

    def any_of(self, depth: int) -> dict:
        # Branches of different JSON types, so `oneOf` would mean the same; anyOf is what is asked.
        kinds = self.rng.sample(("integer", "boolean", "null", "string", "object"), self.rng.randint(2, 3))
        branches = []
        for kind in kinds:
            if kind == "object":
                branches.append(self.obj(min(depth + 1, 2)))
            elif kind == "string":
                branches.append(self.string())
            elif kind == "integer":
                branches.append(self.integer())
            else:
                branches.append({"type": kind})
        return {"anyOf": branches}

    def scalar(self) -> dict:
        kind = self.rng.choices(("string", "integer", "number", "boolean", "enum", "const", "null", "nullable"),
                                weights=(30, 18, 14, 8, 16, 4, 2, 8))[0]
        if kind == "string":
            return self.string()
        if kind == "integer":
            return self.integer()
        if kind == "number":
            return self.number()
        if kind == "enum":
            return self.enum()
        if kind == "const":
            return {"const": self.rng.choice(_WORDS)}
        if kind == "nullable":
            return {"type": [self.rng.choice(("integer", "boolean")), "null"]}
        return {"type": kind}

    def string(self) -> dict:
        if self.rng.random() < 0.35:
            return {"type": "string", "format": self.rng.choice(FORMATS)}
        return {"type": "string", "pattern": self.rng.choice(_PATTERNS)}

    def integer(self) -> dict:
        lo = self.rng.randint(-1000, 1000)
        hi = lo + self.rng.randint(1, 5000)
        schema = {"type": "integer"}
        if self.rng.random() < 0.5:
            schema["minimum" if self.rng.random() < 0.7 else "exclusiveMinimum"] = lo
        if self.rng.random() < 0.5:
            schema["maximum" if self.rng.random() < 0.7 else "exclusiveMaximum"] = hi
        return schema

    def number(self) -> dict:
        lo = round(self.rng.uniform(-100, 100), 2)
        hi = round(lo + self.rng.uniform(0.5, 500), 2)
        return {"type": "number", "minimum": lo, "maximum": hi}

    def enum(self) -> dict:
        pool = list(_WORDS) + [1, 2, 3, 10, -1, 2.5, None, True]
        return {"enum": self.rng.sample(pool, self.rng.randint(2, 6))}
