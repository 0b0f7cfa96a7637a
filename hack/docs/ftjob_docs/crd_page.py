"""docs/reference/crd.md: every field of the FaultTolerantTrainingJob schema, from the CRD manifest itself.

A field's path is dotted from the object's root (``spec.failurePolicy.backoff.baseSeconds``); ``[]`` stands for the
items of a list (``spec.failurePolicy.rules[].action``) and ``*`` for the values of a map whose values have fields.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from ftjob_docs import CRD_FILE, GENERATED_NOTE, REPO_ROOT
from ftjob_docs.markdown import code, table, text

IMMUTABLE_RULE = "self == oldSelf"


@dataclass(frozen=True)
class Field:
    """One property of the schema, where it sits and whether its parent requires it."""

    path: str
    schema: dict[str, Any]
    required: bool


def load_crd(path: Path = CRD_FILE) -> dict[str, Any]:
    """The CRD manifest as a dict."""
    with open(path, encoding="utf-8") as f:
        return yaml.safe_load(f)


def storage_version(crd: dict[str, Any]) -> dict[str, Any]:
    """The version entry the API server stores (the one every reader of this page writes)."""
    return next(v for v in crd["spec"]["versions"] if v.get("storage"))


def walk(schema: dict[str, Any], prefix: str) -> Iterator[Field]:
    """Every property under ``schema`` (an object schema), depth first, in the manifest's order."""
    required = set(schema.get("required", ()))
    for name, sub in (schema.get("properties") or {}).items():
        path = f"{prefix}.{name}" if prefix else name
        yield Field(path, sub, name in required)
        yield from _below(sub, path)


def _below(schema: dict[str, Any], path: str) -> Iterator[Field]:
    if schema.get("properties"):
        yield from walk(schema, path)
    items = schema.get("items")
    if isinstance(items, dict):
        yield from _below(items, f"{path}[]")
    values = schema.get("additionalProperties")
    if isinstance(values, dict):
        yield from _below(values, f"{path}.*")


def type_of(schema: dict[str, Any]) -> str:
    """The field's type in words: ``integer (int32)``, ``list of object``, ``map of string``, ``int or string``."""
    if schema.get("x-kubernetes-int-or-string"):
        kind = "int or string"
    elif schema.get("type") == "array":
        kind = f"list of {type_of(schema.get('items') or {})}"
    elif schema.get("type") == "object" and isinstance(schema.get("additionalProperties"), dict):
        kind = f"map of {type_of(schema['additionalProperties'])}"
    else:
        kind = schema.get("type", "any")
        if "format" in schema:
            kind += f" ({schema['format']})"
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        kind += ", any further fields kept"
    return kind


def checks(schema: dict[str, Any], required: bool) -> list[str]:
    """The field's validation in words, each already escaped for a table cell."""
    out = ["required"] if required else []
    out += _bounds(schema)
    items = schema.get("items")
    if isinstance(items, dict):
        out += [f"each item: {c}" for c in _bounds(items)]
    if schema.get("x-kubernetes-list-type"):
        keys = schema.get("x-kubernetes-list-map-keys")
        out.append(
            f"list type {code(schema['x-kubernetes-list-type'])}" + (f", keyed by {_codes(keys)}" if keys else "")
        )
    for rule in schema.get("x-kubernetes-validations") or ():
        message = text(rule.get("message", ""))
        if rule["rule"].strip() == IMMUTABLE_RULE:
            out.append(f"**immutable**: {message}")
        else:
            out.append(f"rule {code(rule['rule'])}: {message}")
    return out


def _bounds(schema: dict[str, Any]) -> list[str]:
    out = []
    if "enum" in schema:
        out.append(f"one of {_codes(schema['enum'])}")
    for key, words in (("minimum", "minimum"), ("maximum", "maximum")):
        if key in schema:
            exclusive = schema.get(f"exclusive{key.capitalize()}")
            out.append(f"{'exclusive ' if exclusive else ''}{words} {code(_json(schema[key]))}")
    for key, words in (("minLength", "min length"), ("maxLength", "max length"), ("minItems", "min items"),
                       ("maxItems", "max items")):  # fmt: skip
        if key in schema:
            out.append(f"{words} {schema[key]}")
    if "pattern" in schema:
        out.append(f"matches {code(schema['pattern'])}")
    return out


def _codes(values: list[Any]) -> str:
    return ", ".join(code(v if isinstance(v, str) else _json(v)) for v in values)


def _json(value: Any) -> str:
    return json.dumps(value, separators=(", ", ": "))


def field_rows(fields: list[Field]) -> list[list[str]]:
    """The table rows of ``fields``: path, type, default, description, validation."""
    return [
        [
            code(f.path),
            text(type_of(f.schema)),
            code(_json(f.schema["default"])) if "default" in f.schema else "",
            text(f.schema.get("description", "")),
            "<br>".join(checks(f.schema, f.required)),
        ]
        for f in fields
    ]


def render(crd: dict[str, Any] | None = None) -> str:
    """The page's Markdown."""
    crd = load_crd() if crd is None else crd
    names, version = crd["spec"]["names"], storage_version(crd)
    root = version["schema"]["openAPIV3Schema"]
    header = ["Field", "Type", "Default", "Description", "Validation"]
    scale = (version.get("subresources") or {}).get("scale") or {}
    out = [
        f"# {names['kind']} (CRD reference)\n",
        GENERATED_NOTE.format(source=f"`{CRD_FILE.relative_to(REPO_ROOT)}`"),
        text(root.get("description", "")) + "\n",
        table(
            ["", ""],
            [
                ["API", code(f"{crd['spec']['group']}/{version['name']}")],
                ["Kind", code(names["kind"])],
                ["Resource", f"{code(names['plural'])} ({crd['spec']['scope']})"],
                ["Short names", _codes(names.get("shortNames", []))],
                ["Subresources", ", ".join(code(s) for s in (version.get("subresources") or {}))],
                ["Scale", ", ".join(f"{k.removesuffix('Path')} {code(v)}" for k, v in scale.items())],
            ],
        ),
        "Paths are dotted from the object's root; `[]` stands for the items of a list. Validation lists the "
        "OpenAPI checks and the CEL rules (`x-kubernetes-validations`) the API server enforces, with the message it "
        "answers when one fails.\n",
    ]
    root_rules = checks({"x-kubernetes-validations": root.get("x-kubernetes-validations")}, required=False)
    if root_rules:
        out += ["## Whole object\n", *(f"- {r}" for r in root_rules), ""]
    for top, title in (("spec", "Spec"), ("status", "Status")):
        sub = root["properties"][top]
        fields = [Field(top, sub, top in root.get("required", ())), *_below(sub, top)]
        out += [f"## {title}\n", table(header, field_rows(fields))]
    columns = version.get("additionalPrinterColumns") or []
    if columns:
        rows = [
            [code(c["name"]), code(c["jsonPath"]), text(c.get("description", "")), "wide" if c.get("priority") else ""]
            for c in columns
        ]
        out += ["## `kubectl get` columns\n", table(["Column", "From", "Meaning", "Shown"], rows)]
    return "\n".join(out)
