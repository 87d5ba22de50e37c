//! The JSON Schema stays in step with the Rust config types: for every object of the
//! configuration, the fields the filter accepts are exactly the schema's properties, and every
//! enumerated value the filter accepts is exactly the schema's enum. (schema/test_schema.py
//! checks the other direction: fixtures, examples and snippets against the schema.)
#![allow(clippy::unwrap_used, clippy::panic, clippy::indexing_slicing)]

use ratelimit_core::config::Config;
use serde_json::Value;

fn schema() -> Value {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../schema/plugin-config.schema.json"
    );
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// The list in "(expected one of a, b)" / "(expected a, b)" of the error at `path`.
fn expected_list(config: &str, path: &str) -> Vec<String> {
    let errors = Config::parse(config.as_bytes()).unwrap_err();
    let e = errors
        .0
        .iter()
        .find(|e| e.path == path)
        .unwrap_or_else(|| panic!("no error at {path}: {errors}"));
    let list = e
        .reason
        .rsplit_once("(expected ")
        .unwrap()
        .1
        .trim_end_matches(')');
    let list = list.strip_prefix("one of ").unwrap_or(list);
    let mut v: Vec<String> = list.split(", ").map(str::to_string).collect();
    v.sort();
    v
}

fn keys(v: &Value) -> Vec<String> {
    let mut k: Vec<String> = v.as_object().unwrap().keys().cloned().collect();
    k.sort();
    k
}

fn strings(v: &Value) -> Vec<String> {
    let mut k: Vec<String> = v
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s.as_str().unwrap().to_string())
        .collect();
    k.sort();
    k
}

const RULE: &str = r#""name": "a", "rate_limit": {"requests_per_unit": 1, "unit": "second"}"#;

#[test]
fn every_object_has_the_same_fields_in_schema_and_filter() {
    let s = schema();
    let d = &s["$defs"];
    let cases = [
        (r#"{"zzz": 1, "rules": []}"#.to_string(), "zzz", &s["properties"]),
        (format!(r#"{{"rules": [{{{RULE}, "zzz": 1}}]}}"#), "rules[0].zzz", &d["rule"]["properties"]),
        (format!(r#"{{"rules": [{{{RULE}, "match": {{"zzz": 1}}}}]}}"#), "rules[0].match.zzz", &d["match"]["properties"]),
        (
            format!(r#"{{"rules": [{{{RULE}, "match": {{"headers": [{{"name": "x", "present": true, "zzz": 1}}]}}}}]}}"#),
            "rules[0].match.headers[0].zzz",
            &d["match"]["properties"]["headers"]["items"]["properties"],
        ),
        (
            r#"{"rules": [{"name": "a", "rate_limit": {"requests_per_unit": 1, "unit": "second", "zzz": 1}}]}"#.to_string(),
            "rules[0].rate_limit.zzz",
            &d["rule"]["properties"]["rate_limit"]["properties"],
        ),
        (format!(r#"{{"rules": [{{{RULE}}}], "response": {{"zzz": 1}}}}"#), "response.zzz", &d["response"]["properties"]),
        (
            format!(r#"{{"rules": [{{{RULE}}}], "operator": {{"zzz": 1}}}}"#),
            "operator.zzz",
            &s["properties"]["operator"]["properties"],
        ),
        (
            format!(r#"{{"rules": [{{{RULE}, "global": {{"cluster": "c", "domain": "d", "zzz": 1}}}}]}}"#),
            "rules[0].global.zzz",
            &d["global"]["properties"],
        ),
        (
            format!(r#"{{"rules": [{{{RULE}, "cost": {{"header": "x", "zzz": 1}}}}]}}"#),
            "rules[0].cost.zzz",
            &d["rule"]["properties"]["cost"]["oneOf"][1]["properties"],
        ),
        (
            format!(r#"{{"rules": [{{{RULE}, "cost": {{"response": "body_bytes", "zzz": 1}}}}]}}"#),
            "rules[0].cost.zzz",
            &d["rule"]["properties"]["cost"]["oneOf"][2]["properties"],
        ),
        (
            r#"{"rules": [{"name": "a", "in_flight": {"max": 1, "zzz": 1}}]}"#.to_string(),
            "rules[0].in_flight.zzz",
            &d["rule"]["properties"]["in_flight"]["properties"],
        ),
        (
            format!(r#"{{"rules": [{{{RULE}, "key": [{{"remote_address": {{"zzz": 1}}}}]}}]}}"#),
            "rules[0].key[0].remote_address.zzz",
            &d["keyPart"]["oneOf"][1]["properties"]["remote_address"]["properties"],
        ),
        (
            format!(r#"{{"rules": [{{{RULE}, "elastic": {{"ceiling": 2, "zzz": 1}}}}]}}"#),
            "rules[0].elastic.zzz",
            &d["elastic"]["properties"],
        ),
        (
            r#"{"rules": [{"name": "a", "rate_limit": {"requests_per_unit": {"from": "header:x", "default": 1, "max": 2, "zzz": 1}, "unit": "second"}}]}"#.to_string(),
            "rules[0].rate_limit.requests_per_unit.zzz",
            &d["limit_number"]["oneOf"][1]["properties"],
        ),
        (
            format!(r#"{{"rules": [{{{RULE}, "key": [{{"zzz": 1}}]}}]}}"#),
            "rules[0].key[0].zzz",
            &d["keyPart"]["oneOf"][1]["properties"],
        ),
        (
            format!(r#"{{"rules": [{{{RULE}, "key": [{{"first": ["bearer", "path"], "zzz": 1}}]}}]}}"#),
            "rules[0].key[0].zzz",
            &d["rule"]["properties"]["key"]["items"]["oneOf"][1]["properties"],
        ),
        (
            format!(r#"{{"rules": [{{{RULE}, "match": {{"body": [{{"field": "model", "equals": "x", "zzz": 1}}]}}}}]}}"#),
            "rules[0].match.body[0].zzz",
            &d["match"]["properties"]["body"]["items"]["properties"],
        ),
        (
            format!(r#"{{"rules": [{{{RULE}, "cost": {{"response": {{"price": {{"zzz": 1}}}}}}}}]}}"#),
            "rules[0].cost.response.price.zzz",
            &d["price"]["properties"]["price"]["properties"],
        ),
        (
            format!(r#"{{"rules": [{{{RULE}, "cost": {{"response": {{"price": {{}}, "zzz": 1}}}}}}]}}"#),
            "rules[0].cost.response.zzz",
            &d["price"]["properties"],
        ),
        (
            format!(r#"{{"rules": [{{{RULE}, "cost": {{"response": {{"price": {{"usage": "anthropic", "models": {{"m": {{"zzz": 1}}}}}}}}}}}}]}}"#),
            "rules[0].cost.response.price.models.m.zzz",
            &d["rates"]["properties"],
        ),
    ];
    for (config, path, properties) in cases {
        assert_eq!(expected_list(&config, path), keys(properties), "{path}");
    }
}

#[test]
fn every_enumeration_has_the_same_values_in_schema_and_filter() {
    let s = schema();
    let d = &s["$defs"];
    let bad = |field: &str| format!(r#"{{"rules": [{{{RULE}, {field}}}]}}"#);
    let cases = [
        (
            bad(r#""algorithm": "zzz""#),
            "rules[0].algorithm",
            &d["rule"]["properties"]["algorithm"]["enum"],
        ),
        (
            r#"{"rules": [{"name": "a", "rate_limit": {"requests_per_unit": 1, "unit": "zzz"}}]}"#
                .to_string(),
            "rules[0].rate_limit.unit",
            &d["rule"]["properties"]["rate_limit"]["properties"]["unit"]["enum"],
        ),
        (
            bad(r#""algorithm": "leaky_bucket", "on_limit": "zzz""#),
            "rules[0].on_limit",
            &d["rule"]["properties"]["on_limit"]["enum"],
        ),
        (
            format!(r#"{{"rules": [{{{RULE}}}], "failure_mode": "zzz"}}"#),
            "failure_mode",
            &s["properties"]["failure_mode"]["enum"],
        ),
        (
            format!(r#"{{"rules": [{{{RULE}}}], "log_limited": "zzz"}}"#),
            "log_limited",
            &s["properties"]["log_limited"]["enum"],
        ),
        (
            format!(r#"{{"rules": [{{{RULE}}}], "response": {{"headers": "zzz"}}}}"#),
            "response.headers",
            &d["response"]["properties"]["headers"]["enum"],
        ),
        (
            bad(r#""cost": {"response": {"price": {"usage": "zzz"}}}"#),
            "rules[0].cost.response.price.usage",
            &d["price"]["properties"]["price"]["properties"]["usage"]["enum"],
        ),
        (
            bad(r#""cost": {"response": {"price": {"per": "zzz"}}}"#),
            "rules[0].cost.response.price.per",
            &d["price"]["properties"]["price"]["properties"]["per"]["enum"],
        ),
    ];
    for (config, path, values) in cases {
        assert_eq!(expected_list(&config, path), strings(values), "{path}");
    }
}
