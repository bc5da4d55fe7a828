"""JSON Schema keywords xgrammar (0.2.8) accepts but does not enforce, refused by name: an output
that satisfies no schema the client wrote is worse than a 400. Measured against xgrammar's matcher:
`not`, `if`/`then`/`else`, `contains`, the `dependent*` keywords and dynamic references are ignored, `uniqueItems: true` is ignored, an `allOf` of several
schemas keeps only one; and (issue 43's audit) `multipleOf` off an integer, `required` in an anyOf/oneOf/allOf branch
without its own properties, a `$ref` outside the
schema (a URL, another file, an `$anchor`: "any value"), `required` names missing from `properties`,
`enum`/`const` values of another `type` (the type is dropped), and a `oneOf` whose branches can
overlap (enforced as `anyOf`) pass values the schema refuses. The walk knows which keywords hold
schemas, so a property that happens to be named `not` is not mistaken for the keyword. Iterative:
nothing here relies on the body's depth bound."""
from __future__ import annotations

import json

UNENFORCED = ("not", "if", "then", "else", "contains", "dependentRequired", "dependencies", "dependentSchemas",
              "$dynamicRef", "$recursiveRef")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_VALUES = ("items", "additionalProperties", "additionalItems", "contains", "propertyNames",
                  "unevaluatedItems", "unevaluatedProperties", "contentSchema", *UNENFORCED)
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_SCHEMAS_IN_TAGS = ("schema", "json_schema", "parameters")


def unenforced_keyword(schema) -> str | None:
    """The first keyword in `schema` that would not be enforced, as a message (None: none)."""
    stack = [schema]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict):
            continue  # `true`/`false` schemas, or a value the compiler will refuse itself
        for keyword in UNENFORCED:
            if keyword in node:
                return f"the JSON Schema keyword '{keyword}' is not supported (it would not be enforced)"
        if node.get("uniqueItems") is True:
            return "uniqueItems is not supported"
        if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
            return "allOf with more than one schema is not supported"
        problem = _unenforced_constraint(node, schema)
        if problem is not None:
            return problem
        for key, value in node.items():
            if key in _SCHEMA_MAPS and isinstance(value, dict):
                stack.extend(value.values())
            elif key in _SCHEMA_LISTS and isinstance(value, list):
                stack.extend(value)
            elif key in _SCHEMA_VALUES:
                stack.append(value)
    return None


def _unenforced_constraint(node: dict, root) -> str | None:
    ref = node.get("$ref")
    if isinstance(ref, str) and ref != "#" and not ref.startswith("#/"):
        return (f"$ref {ref[:100]!r} is not supported: only references inside the schema (#/...) are "
                "resolved (it would accept any value)")
    if "multipleOf" in node and not (node.get("type") == "integer" and _whole(node["multipleOf"])):
        return "multipleOf is supported on integers only (type 'integer', a whole divisor)"
    required, properties = node.get("required"), node.get("properties")
    if isinstance(required, list) and ("properties" in node or node.get("type") == "object"):
        # (A bare {"required": [...]} beside its properties, as in dependentSchemas, is merged by xgrammar.)
        names = properties if isinstance(properties, dict) else {}
        missing = [r for r in required if r not in names]
        if missing:
            return f"required property {str(missing[0])[:100]!r} is not in 'properties' (it would not be enforced)"
    for key in ("anyOf", "oneOf", "allOf"):
        for branch in node.get(key) if isinstance(node.get(key), list) else ():
            if isinstance(branch, dict) and "required" in branch and "properties" not in branch \
                    and branch.get("type") != "object":
                return f"'required' in a {key} branch without its own 'properties' is not supported (it would not be enforced)"
    mismatch = _value_of_another_type(node)
    if mismatch is not None:
        return mismatch
    branches = node.get("oneOf")
    if isinstance(branches, list) and len(branches) > 1 and not _disjoint([_resolved(b, root) for b in branches]):
        return ("oneOf whose branches can overlap is not supported (it would be enforced as anyOf): use anyOf, "
                "or give each branch its own type or a required property with its own const")
    return None


def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


_TYPE_CHECKS = {"string": lambda v: isinstance(v, str), "boolean": lambda v: isinstance(v, bool),
                "null": lambda v: v is None, "object": lambda v: isinstance(v, dict),
                "array": lambda v: isinstance(v, list),
                "integer": lambda v: (isinstance(v, int) and not isinstance(v, bool))
                or (isinstance(v, float) and v.is_integer()),
                "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)}


def _value_of_another_type(node: dict) -> str | None:
    """xgrammar enforces `enum`/`const` and drops `type` beside them: a value of another type would pass."""
    types = node.get("type")
    types = [types] if isinstance(types, str) else types
    if not isinstance(types, list) or not all(t in _TYPE_CHECKS for t in types):
        return None
    values = node["enum"] if isinstance(node.get("enum"), list) else [node["const"]] if "const" in node else []
    for value in values:
        if not any(_TYPE_CHECKS[t](value) for t in types):
            return f"the enum/const value {json.dumps(value)[:100]} is not of the schema's type {node['type']!r}"
    return None


def _resolved(branch, root, hops: int = 8):
    """A oneOf branch with its local `$ref`s followed (pydantic's unions are refs to $defs)."""
    while hops and isinstance(branch, dict) and isinstance(branch.get("$ref"), str) and branch["$ref"].startswith("#/"):
        target = root
        for part in branch["$ref"][2:].split("/"):
            part = part.replace("~1", "/").replace("~0", "~")
            target = target.get(part) if isinstance(target, dict) else None
        branch, hops = target, hops - 1
    return branch


def _disjoint(branches: list) -> bool:
    """Whether no value can match two branches, as far as a simple reading shows: each branch has its
    own single type (integer and number overlap), or each requires one property with a const (or enum)
    of values no other branch has (a discriminated union)."""
    if not all(isinstance(b, dict) for b in branches):
        return False
    types = [b.get("type") for b in branches]
    if all(isinstance(t, str) for t in types) and len(set(types)) == len(types) \
            and not {"integer", "number"} <= set(types):
        return True
    common = set.intersection(*(set(b.get("required") or ()) & set(b.get("properties") or {}) for b in branches))
    for name in sorted(common, key=str):
        seen: set[str] = set()
        for b in branches:
            prop = b["properties"][name]
            values = prop.get("enum") if isinstance(prop, dict) and isinstance(prop.get("enum"), list) else \
                [prop["const"]] if isinstance(prop, dict) and "const" in prop else None
            if values is None:
                break
            keys = {json.dumps(v, sort_keys=True) for v in values}
            if keys & seen:
                break
            seen |= keys
        else:
            return True
    return False


def unenforced_in_tag(tag) -> str | None:
    """unenforced_keyword for each schema a structural tag holds, wherever it sits in the tag."""
    stack = [tag]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            for key, value in node.items():
                if key in _SCHEMAS_IN_TAGS and isinstance(value, dict):
                    problem = unenforced_keyword(value)
                    if problem is not None:
                        return problem
                else:
                    stack.append(value)
        elif isinstance(node, list):
            stack.extend(node)
    return None
