"""JSON Schema keywords xgrammar (0.2.8) accepts but does not enforce, refused by name: an output
that satisfies no schema the client wrote is worse than a 400. Measured against xgrammar's matcher:
`not` and `if`/`then`/`else` are ignored, `uniqueItems: true` is ignored, an `allOf` of several
schemas keeps only one. The walk knows which keywords hold schemas, so a property that happens to be
named `not` is not mistaken for the keyword. Iterative: nothing here relies on the body's depth bound."""
from __future__ import annotations

UNENFORCED = ("not", "if", "then", "else")
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
        for key, value in node.items():
            if key in _SCHEMA_MAPS and isinstance(value, dict):
                stack.extend(value.values())
            elif key in _SCHEMA_LISTS and isinstance(value, list):
                stack.extend(value)
            elif key in _SCHEMA_VALUES:
                stack.append(value)
    return None


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
