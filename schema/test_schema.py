#!/usr/bin/env python3
"""Keeps schema/plugin-config.schema.json in step with the filter: every configuration the
filter accepts (fixtures, examples, the JSON configurations of the README, the book's pages
and the examples' READMEs, Istio manifests) validates against the
schema, and every bad fixture the filter refuses is refused by the schema too, except the few
rules a JSON Schema cannot express (listed below with the reason). Run by `make test` in the
project virtualenv (jsonschema, PyYAML)."""

import json
import re
import sys
from pathlib import Path

import jsonschema
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "docs/gen"))
from check_links import expand  # noqa: E402  (the docs' {{#include}} expansion)
SCHEMA = json.loads((ROOT / "schema/plugin-config.schema.json").read_text())
jsonschema.Draft202012Validator.check_schema(SCHEMA)
VALIDATOR = jsonschema.Draft202012Validator(SCHEMA)

# Bad fixtures whose mistake a schema cannot express.
NOT_EXPRESSIBLE = {
    "duplicate_name": "names must be unique across the items of an array",
    "cost_above_limit": "compares one field with another (cost against requests_per_unit/burst)",
    "response_cost_reserve_above_limit": "compares one field with another (reserve against requests_per_unit/burst)",
    "first_same_attribute": "two items of different forms (bearer and header:authorization) reading one header",
    "remote_address_twice": "two items of different forms (a string and an object) naming one key part",
    "usage_too_many_fields": "counts distinct fields across every rule's expressions (at most 16)",
    "elastic_sliding_log_ceiling": "compares one field with another (ceiling × requests_per_unit against sliding_log's 1,000)",
    "plan_default_above_max": "compares one field with another (default against max)",
    "plan_cost_above_cap": "compares one field with another (cost against burst.max)",
    "plan_sliding_log_cap": "compares one field with another (requests_per_unit.max against sliding_log's 1,000)",
    "plan_global": "a limit read from the request and \"global\" in one rule (two fields' forms)",
    "operator_host_bits": "an address whose bits beyond the prefix are set (arithmetic on the address)",
    "share_band_twice": "names must be unique across the items of an array",
    "share_reserved_above_all": "adds up a field across the items of an array (the bands' min_share)",
    "share_band_default_unknown": "compares one field with another (the default band against the bands' names)",
    "empty": "not a JSON document",
    "invalid_json": "not a JSON document",
}


def accepted_configs():
    """(label, config) for every configuration the filter accepts that the repo ships."""
    for path in sorted((ROOT / "crates/ratelimit-core/tests/fixtures/good").glob("*.json")):
        yield str(path.relative_to(ROOT)), json.loads(path.read_text())
    for path in sorted(ROOT.glob("examples/*/envoy.yaml")) + [ROOT / "envoy.yaml",
                                                              ROOT / "envoy-native.yaml"]:
        for doc in yaml.safe_load_all(path.read_text()):
            for cfg in find_plugin_configs(doc):
                yield str(path.relative_to(ROOT)), cfg
    for path in sorted(ROOT.glob("deploy/istio/*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") == "WasmPlugin":
                yield f"{path.relative_to(ROOT)} {doc['metadata']['name']}", doc["spec"]["pluginConfig"]
    pages = [ROOT / "README.md"] + sorted((ROOT / "docs/src").rglob("*.md")) + sorted(
        ROOT.glob("examples/*/README.md"))
    for path in pages:
        # The book's pages with their {{#include}}s expanded, as mdBook shows them.
        text = expand(path, path.read_text())
        for block in re.findall(r"^ *```json\n(.*?)```", text, re.S | re.M):
            cfg = json.loads(block)
            if "rules" in cfg:
                yield f"{path.relative_to(ROOT)} json block", cfg


def find_plugin_configs(node):
    """Plugin configurations inside an Envoy config: StringValue values holding JSON rules."""
    if isinstance(node, dict):
        if node.get("@type") == "type.googleapis.com/google.protobuf.StringValue":
            cfg = json.loads(node["value"])
            if "rules" in cfg:
                yield cfg
        for v in node.values():
            yield from find_plugin_configs(v)
    elif isinstance(node, list):
        for v in node:
            yield from find_plugin_configs(v)


def main():
    passed = failed = 0
    seen = 0
    for label, cfg in accepted_configs():
        seen += 1
        errors = list(VALIDATOR.iter_errors(cfg))
        if errors:
            failed += 1
            print(f"FAIL {label}: the filter accepts it, the schema does not: {errors[0].message}")
        else:
            passed += 1
    if seen < 10:
        failed += 1
        print(f"FAIL only {seen} accepted configurations found")
    for path in sorted((ROOT / "crates/ratelimit-core/tests/fixtures/bad").glob("*.json")):
        name = path.stem
        if name in NOT_EXPRESSIBLE:
            continue
        cfg = json.loads(path.read_text())
        if VALIDATOR.is_valid(cfg):
            failed += 1
            print(f"FAIL {path.relative_to(ROOT)}: the filter refuses it, the schema accepts it")
        else:
            passed += 1
    print(f"schema: {passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
