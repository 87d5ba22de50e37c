//! `ratelimit-config check FILE...`: validates plugin configurations with the filter's own code.
//!
//! A FILE is the plugin configuration as JSON, or YAML holding either the configuration or Istio
//! `WasmPlugin` manifests (each document's `spec.pluginConfig` is checked). `-` reads standard
//! input. Prints a summary of the rules of each valid configuration, or every error with its
//! field path; exits 0 if all are valid, 1 if any is not, 2 on a usage or read error.

#[cfg(target_arch = "wasm32")]
fn main() {}

#[cfg(not(target_arch = "wasm32"))]
fn main() {
    std::process::exit(cli::run(std::env::args().skip(1).collect()));
}

#[cfg(not(target_arch = "wasm32"))]
mod cli {
    use serde_json::Value;
    use std::io::Read;
    use wasm_ratelimit::config::{
        Algorithm, Config, Cost, FailureMode, HeaderCondition, Match, Rule,
    };
    use yaml_rust2::{Yaml, YamlLoader};

    const USAGE: &str = "usage: ratelimit-config check FILE... (JSON, YAML, or Istio WasmPlugin manifests; - for stdin)";

    pub fn run(args: Vec<String>) -> i32 {
        let files = match args.split_first() {
            Some((cmd, files)) if cmd == "check" && !files.is_empty() => files,
            _ => {
                eprintln!("{USAGE}");
                return 2;
            }
        };
        let mut status = 0;
        for file in files {
            let text = match read(file) {
                Ok(t) => t,
                Err(e) => {
                    eprintln!("{file}: cannot read: {e}");
                    return 2;
                }
            };
            let configs = match documents(&text) {
                Ok(c) => c,
                Err(e) => {
                    println!("{file}: INVALID\n  config: {e}");
                    status = 1;
                    continue;
                }
            };
            // Nothing in the file: what the filter makes of an empty configuration.
            let configs = if configs.is_empty() {
                vec![(None, String::new())]
            } else {
                configs
            };
            for (label, json) in configs {
                let name = match label {
                    Some(l) => format!("{file} ({l})"),
                    None => file.clone(),
                };
                match Config::parse(json.as_bytes()) {
                    Ok(config) => print!("{name}: OK\n{}", summary(&config)),
                    Err(errors) => {
                        println!("{name}: INVALID");
                        for e in &errors.0 {
                            println!("  {e}");
                        }
                        status = 1;
                    }
                }
            }
        }
        status
    }

    fn read(file: &str) -> std::io::Result<String> {
        if file == "-" {
            let mut s = String::new();
            std::io::stdin().read_to_string(&mut s)?;
            Ok(s)
        } else {
            std::fs::read_to_string(file)
        }
    }

    /// The configurations in a file, as the JSON the filter receives (Istio serializes
    /// `pluginConfig` to JSON), each with a label when it comes from a manifest.
    fn documents(text: &str) -> Result<Vec<(Option<String>, String)>, String> {
        // JSON first: the filter's own format. Text that looks like JSON goes to the filter as
        // it is, so a broken file gets the filter's own error.
        let trimmed = text.trim_start();
        if trimmed.starts_with('{') || trimmed.starts_with('[') {
            return Ok(vec![(None, text.to_string())]);
        }
        let docs = YamlLoader::load_from_str(text).map_err(|e| format!("invalid YAML: {e}"))?;
        let mut out = Vec::new();
        for doc in docs {
            let value = to_json(&doc)?;
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
            } else if !value.is_null() {
                out.push((None, value.to_string()));
            }
        }
        Ok(out)
    }

    /// YAML to the JSON value Istio's `protomarshal.ToJSON` would produce.
    fn to_json(y: &Yaml) -> Result<Value, String> {
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
            Yaml::Array(items) => {
                Value::Array(items.iter().map(to_json).collect::<Result<_, _>>()?)
            }
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

    fn summary(c: &Config) -> String {
        let mut out = format!(
            "  capacity {} keys, failure_mode {}, headers {}{}, limited status {}\n",
            c.capacity,
            match c.failure_mode {
                FailureMode::Allow => "allow",
                FailureMode::Deny => "deny",
            },
            c.response.headers.name(),
            if c.response.on_allowed {
                " (also on allowed responses)"
            } else {
                ""
            },
            c.response.status,
        );
        for r in &c.rules {
            out.push_str(&format!(
                "  rule {}{}: {} per {} ({}), key [{}], match {}{}\n",
                r.name,
                if r.shadow { " (shadow)" } else { "" },
                r.quota.requests_per_unit,
                r.quota.unit.name(),
                algorithm(r),
                r.key
                    .iter()
                    .map(ToString::to_string)
                    .collect::<Vec<_>>()
                    .join(", "),
                matcher(&r.matcher),
                match &r.cost {
                    Cost::Fixed(1) => String::new(),
                    Cost::Fixed(n) => format!(", cost {n}"),
                    Cost::Header(h) => format!(", cost from header {h}"),
                },
            ));
        }
        out
    }

    fn algorithm(r: &Rule) -> String {
        match r.algorithm {
            Algorithm::TokenBucket { burst } => format!("token_bucket, burst {burst}"),
            Algorithm::LeakyBucket {
                burst,
                max_delay_ms: Some(d),
            } => format!("leaky_bucket, burst {burst}, delay up to {d} ms"),
            Algorithm::LeakyBucket { burst, .. } => format!("leaky_bucket, burst {burst}"),
            other => other.name().to_string(),
        }
    }

    fn matcher(m: &Match) -> String {
        let mut parts = Vec::new();
        if let Some(p) = &m.path_prefix {
            parts.push(format!("path_prefix {p}"));
        }
        if let Some(p) = &m.path {
            parts.push(format!("path {p}"));
        }
        if !m.methods.is_empty() {
            parts.push(format!("methods {}", m.methods.join("|")));
        }
        if let Some(a) = &m.authority {
            parts.push(format!("authority {a}"));
        }
        for h in &m.headers {
            parts.push(match &h.condition {
                HeaderCondition::Equals(v) => format!("{}={v}", h.name),
                HeaderCondition::Present(true) => format!("{} present", h.name),
                HeaderCondition::Present(false) => format!("{} absent", h.name),
            });
        }
        if parts.is_empty() {
            "every request".into()
        } else {
            parts.join(", ")
        }
    }
}
