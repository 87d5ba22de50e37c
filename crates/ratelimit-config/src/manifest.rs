//! Reading configurations the way users hold them: plain JSON, YAML, Istio `WasmPlugin`
//! manifests (whose `spec.pluginConfig` Istio serializes to JSON for the filter), or an Envoy
//! configuration (each wasm or dynamic-module filter's StringValue configuration). Native only:
//! used by the `ratelimit-config` CLI and the tests, never compiled into the `.wasm`.

use serde_json::Value;
use yaml_rust2::{Yaml, YamlLoader};

/// Every YAML document in `text`, as JSON values.
pub fn yaml_documents(text: &str) -> Result<Vec<Value>, String> {
    let docs = YamlLoader::load_from_str(text).map_err(|e| format!("invalid YAML: {e}"))?;
    docs.iter().map(to_json).collect()
}

/// The configurations in a file, as the JSON the filter receives (Istio serializes
/// `pluginConfig` to JSON), each with a label when it comes from a manifest.
pub fn plugin_configs(text: &str) -> Result<Vec<(Option<String>, String)>, String> {
    // JSON first: the filter's own format. Text that looks like JSON goes to the filter as
    // it is, so a broken file gets the filter's own error.
    let trimmed = text.trim_start();
    if trimmed.starts_with('{') || trimmed.starts_with('[') {
        return Ok(vec![(None, text.to_string())]);
    }
    let mut out = Vec::new();
    for value in yaml_documents(text)? {
        if value.get("kind").and_then(Value::as_str) == Some("WasmPlugin") {
            let name = value
                .pointer("/metadata/name")
                .and_then(Value::as_str)
                .unwrap_or("unnamed");
            let config = value
                .pointer("/spec/pluginConfig")
                .cloned()
                .unwrap_or(Value::Null);
            let json = if config.is_null() {
                String::new() // no pluginConfig: the filter gets an empty configuration
            } else {
                config.to_string()
            };
            out.push((Some(format!("WasmPlugin {name}")), json));
        } else if value.get("kind").and_then(Value::as_str) == Some("EnvoyExtensionPolicy") {
            // Envoy Gateway passes each wasm and dynamic-module entry's `config` as JSON.
            let name = value
                .pointer("/metadata/name")
                .and_then(Value::as_str)
                .unwrap_or("unnamed");
            for list in ["wasm", "dynamicModule"] {
                let entries = value
                    .pointer(&format!("/spec/{list}"))
                    .and_then(Value::as_array);
                for (i, entry) in entries.into_iter().flatten().enumerate() {
                    let json = match entry.get("config") {
                        None | Some(Value::Null) => String::new(),
                        Some(config) => config.to_string(),
                    };
                    out.push((
                        Some(format!("EnvoyExtensionPolicy {name} {list}[{i}]")),
                        json,
                    ));
                }
            }
        } else if value
            .get("apiVersion")
            .and_then(Value::as_str)
            .is_some_and(|v| {
                v.starts_with("gateway.envoyproxy.io/")
                    || v.starts_with("gateway.networking.k8s.io/")
            })
        {
            // The other resources of an Envoy Gateway manifest (EnvoyProxy, Gateway, HTTPRoute)
            // hold no plugin configuration.
        } else if value.get("static_resources").is_some() {
            let before = out.len();
            envoy_filters(&value, &mut out);
            if out.len() == before {
                return Err(
                    "an Envoy configuration without a wasm or dynamic-module HTTP filter".into(),
                );
            }
        } else if !value.is_null() {
            out.push((None, value.to_string()));
        }
    }
    Ok(out)
}

/// The plugin configurations of the filters in an Envoy configuration, in order: a wasm
/// filter's `config.configuration`, a dynamic module's `filter_config` (the StringValue's
/// `value`), labelled with the filter's name.
fn envoy_filters(v: &Value, out: &mut Vec<(Option<String>, String)>) {
    match v {
        Value::Object(map) => {
            let kind = map.get("@type").and_then(Value::as_str).unwrap_or("");
            let found = if kind.ends_with(".filters.http.wasm.v3.Wasm") {
                Some((
                    "Wasm filter",
                    v.pointer("/config/name"),
                    v.pointer("/config/configuration/value"),
                ))
            } else if kind.ends_with(".dynamic_modules.v3.DynamicModuleFilter") {
                Some((
                    "dynamic module filter",
                    v.get("filter_name"),
                    v.pointer("/filter_config/value"),
                ))
            } else {
                None
            };
            match found {
                Some((what, name, config)) => {
                    let name = name.and_then(Value::as_str).unwrap_or("unnamed");
                    let json = config.and_then(Value::as_str).unwrap_or("").to_string();
                    out.push((Some(format!("{what} {name}")), json));
                }
                None => map.values().for_each(|v| envoy_filters(v, out)),
            }
        }
        Value::Array(items) => items.iter().for_each(|v| envoy_filters(v, out)),
        _ => {}
    }
}

/// YAML to the JSON value Istio's `protomarshal.ToJSON` would produce.
pub fn to_json(y: &Yaml) -> Result<Value, String> {
    Ok(match y {
        Yaml::Null | Yaml::BadValue => Value::Null,
        Yaml::Boolean(b) => Value::Bool(*b),
        Yaml::Integer(i) => Value::from(*i),
        Yaml::Real(r) => r
            .parse::<f64>()
            .ok()
            .and_then(serde_json::Number::from_f64)
            .map(Value::Number)
            .ok_or_else(|| format!("invalid number {r}"))?,
        Yaml::String(s) => Value::String(s.clone()),
        Yaml::Array(items) => Value::Array(items.iter().map(to_json).collect::<Result<_, _>>()?),
        Yaml::Hash(map) => {
            let mut obj = serde_json::Map::new();
            for (k, v) in map {
                let key = match k {
                    Yaml::String(s) => s.clone(),
                    Yaml::Integer(i) => i.to_string(),
                    Yaml::Boolean(b) => b.to_string(),
                    other => return Err(format!("unsupported YAML key {other:?}")),
                };
                obj.insert(key, to_json(v)?);
            }
            Value::Object(obj)
        }
        Yaml::Alias(_) => return Err("YAML aliases are not supported".into()),
    })
}
