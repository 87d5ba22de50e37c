#!/usr/bin/env python3
"""Writes docs/src/reference/configuration.md from schema/plugin-config.schema.json: one table
per object of the configuration (the top level, then each nested object, depth first), a row per
field: its path, type, whether it is required, its default, the values or range allowed, and
the schema's description (markdown, rendered as is). `$ref`s are followed; a field that is one
of several forms (`oneOf`/`anyOf`) lists each form's type, and the fields of its object forms
get their own table. Each field's row has an HTML anchor, its path without `[]`
(`configuration.md#rules.rate_limit.unit`). `--check`: exit 1 if the committed page differs
from what this would write. Python 3, standard library only."""

from page import write_or_check
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
SCHEMA_PATH = ROOT / "schema/plugin-config.schema.json"
PAGE = ROOT / "docs/src/reference/configuration.md"
LONG_PATTERN = 60


def cell(text):
    """Text for a table cell: one line, pipes escaped."""
    return " ".join(str(text).split()).replace("|", "\\|")


def code(value):
    return "`" + json.dumps(value, ensure_ascii=False) + "`"


class Doc:
    def __init__(self, schema):
        self.schema = schema
        self.tables = []  # (path, description, rows)

    def resolve(self, node):
        """The node with its $ref followed (the node's own keys win, as its description)."""
        seen = 0
        while isinstance(node, dict) and "$ref" in node:
            ref = node["$ref"]
            assert ref.startswith("#/"), ref
            target = self.schema
            for part in ref[2:].split("/"):
                target = target[part]
            merged = dict(target)
            merged.update({k: v for k, v in node.items() if k != "$ref"})
            node = merged
            seen += 1
            assert seen < 20, ref
        return node

    def variants(self, node):
        node = self.resolve(node)
        forms = node.get("oneOf") or node.get("anyOf")
        if forms and "type" not in node and "enum" not in node:
            out = []
            for f in forms:
                out.extend(self.variants(f))
            return out
        return [node]

    def type_of(self, node):
        node = self.resolve(node)
        if "const" in node:
            return code(node["const"])
        if "enum" in node:
            return "string" if all(isinstance(v, str) for v in node["enum"]) else "enum"
        t = node.get("type")
        if t == "array":
            items = node.get("items", {})
            return "array of " + " or ".join(dict.fromkeys(self.type_of(v) for v in self.variants(items)))
        if isinstance(t, list):
            return " or ".join(t)
        if t:
            return t
        if "properties" in node:
            return "object"
        return "any"

    def allowed(self, node):
        node = self.resolve(node)
        parts = []
        if "enum" in node:
            parts.append(", ".join(code(v) for v in node["enum"]))
        if "const" in node:
            parts.append(code(node["const"]))
        lo, hi = node.get("minimum"), node.get("maximum")
        if lo is not None and hi is not None:
            parts.append(f"{lo} to {hi}")
        elif lo is not None:
            parts.append(f"≥ {lo}")
        elif hi is not None:
            parts.append(f"≤ {hi}")
        if "exclusiveMinimum" in node:
            parts.append(f"> {node['exclusiveMinimum']}")
        if "exclusiveMaximum" in node:
            parts.append(f"< {node['exclusiveMaximum']}")
        if "minLength" in node and "maxLength" in node:
            parts.append(f"{node['minLength']} to {node['maxLength']} characters")
        elif "minLength" in node:
            parts.append(f"at least {node['minLength']} characters")
        elif "maxLength" in node:
            parts.append(f"at most {node['maxLength']} characters")
        if "minItems" in node and "maxItems" in node:
            parts.append(f"{node['minItems']} to {node['maxItems']} items")
        elif "minItems" in node:
            parts.append(f"at least {node['minItems']} item" + ("s" if node["minItems"] != 1 else ""))
        elif "maxItems" in node:
            parts.append(f"at most {node['maxItems']} items")
        if node.get("uniqueItems"):
            parts.append("no duplicates")
        if "pattern" in node:
            p = node["pattern"]
            parts.append(f"matches `{p}`" if len(p) <= LONG_PATTERN else "a pattern (see the description)")
        if node.get("type") == "array":
            for v in self.variants(node.get("items", {})):
                a = self.allowed(v)
                if a:
                    parts.append("each: " + a)
        return "; ".join(parts)

    def field(self, node):
        """(type, allowed, default, description) of a field that may take several forms."""
        node = self.resolve(node)
        forms = self.variants(node)
        if len(forms) == 1:
            f = forms[0]
            return self.type_of(f), self.allowed(f), f.get("default", node.get("default"))
        types, allowed = [], []
        for f in forms:
            t, a = self.type_of(f), self.allowed(f)
            types.append(t)
            if a:
                allowed.append(f"{t}: {a}")
        default = node.get("default")
        if default is None:
            defaults = [f["default"] for f in forms if "default" in f]
            default = defaults[0] if defaults else None
        return " or ".join(dict.fromkeys(types)), "; ".join(allowed), default

    def walk(self, path, node, description=None):
        """A table for the object `node` at `path`, then one for each nested object."""
        node = self.resolve(node)
        props = dict(node.get("properties", {}))
        for form in (node.get("oneOf") or node.get("anyOf") or []):
            form = self.resolve(form)
            if self.type_of(form) == "object":
                for k, v in form.get("properties", {}).items():
                    props.setdefault(k, v)
        if not props:
            return
        required = set(node.get("required", []))
        rows, nested = [], []
        for name, sub in props.items():
            sub_r = self.resolve(sub)
            child = f"{path}.{name}" if path else name
            t, allowed, default = self.field(sub_r)
            desc = sub.get("description") or sub_r.get("description") or ""
            rows.append((child, t, "yes" if name in required else "no",
                         "" if default is None else code(default), allowed, desc))
            for form in self.variants(sub_r):
                if self.type_of(form) == "object" and form.get("properties"):
                    nested.append((child, form))
                elif form.get("type") == "array":
                    for item in self.variants(form.get("items", {})):
                        if self.type_of(item) == "object" and item.get("properties"):
                            nested.append((child + "[]", item))
        self.tables.append((path, description if description is not None else node.get("description", ""), rows))
        done = set()
        for child, form in nested:
            key = (child, json.dumps(form, sort_keys=True))
            if key in done:
                continue
            done.add(key)
            self.walk(child, form, form.get("description", ""))


def anchor(path):
    return path.replace("[]", "")


def render():
    schema = json.loads(SCHEMA_PATH.read_text())
    doc = Doc(schema)
    doc.walk("", schema)
    # Merge tables of one path (an object reached through several forms).
    merged = {}
    order = []
    for path, desc, rows in doc.tables:
        if path not in merged:
            merged[path] = [desc, []]
            order.append(path)
        seen = {r[0] for r in merged[path][1]}
        merged[path][1].extend(r for r in rows if r[0] not in seen)
    out = [
        "<!-- Generated by docs/gen/configuration.py from schema/plugin-config.schema.json: "
        "do not edit; run `make docs-gen`. -->\n",
        "# Configuration\n",
        cell(schema.get("description", "")) + "\n",
        "Every field of the plugin configuration (the JSON the filter reads: the Wasm filter's "
        "`configuration`, the dynamic module's `filter_config`, an Istio `WasmPlugin`'s "
        "`pluginConfig`), one table per object, from "
        "[`schema/plugin-config.schema.json`](../../../schema/plugin-config.schema.json), "
        "the JSON Schema editors can validate against. A path's `[]` is any item of an "
        "array. Rules between fields that a schema cannot state are checked by "
        "`ratelimit-config check` ([error messages](errors.md)).\n",
    ]
    for path in order:
        desc, rows = merged[path]
        title = path or "Top level"
        out.append(f"## {title}\n")
        if desc and path:
            out.append(desc.strip() + "\n")
        out.append("| field | type | required | default | allowed | description |")
        out.append("|---|---|---|---|---|---|")
        for child, t, req, default, allowed, d in rows:
            out.append(f"| <a id=\"{anchor(child)}\"></a>`{child}` | {cell(t)} | {req} | {cell(default)} "
                       f"| {cell(allowed)} | {cell(d)} |")
        out.append("")
    return "\n".join(out)


def main():
    return write_or_check(PAGE, render(), ROOT, "docs/gen/configuration.py")


if __name__ == "__main__":
    sys.exit(main())
