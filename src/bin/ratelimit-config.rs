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
    use std::io::Read;
    use wasm_ratelimit::config::{
        Algorithm, Config, Cost, FailureMode, GlobalMode, HeaderCondition, Limit, Match, Rule,
        Usage,
    };
    use wasm_ratelimit::manifest::plugin_configs;

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
            let configs = match plugin_configs(&text) {
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
                "  rule {}{}: {}, key [{}], match {}{}\n",
                r.name,
                if r.shadow { " (shadow)" } else { "" },
                limit(r),
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
                    Cost::Response(c) => format!(
                        ", charged after the response from {} (reserve {}{})",
                        match &c.usage {
                            Usage::Header(h) => format!("header or trailer {h}"),
                            Usage::BodyBytes => "its body bytes".into(),
                        },
                        c.reserve,
                        match c.usage {
                            Usage::Header(_) => format!(", default {}", c.default),
                            Usage::BodyBytes => String::new(),
                        }
                    ),
                },
            ));
            if let Some(e) = &r.elastic {
                out.push_str(&format!(
                    "    elastic: up to {}x while healthy, {}x when {}% of responses are bad{} over {} s, ramp {} s\n",
                    f64::from(e.ceiling) / 1000.0,
                    f64::from(e.floor) / 1000.0,
                    f64::from(e.max_bad) / 10.0,
                    e.latency_ms
                        .map_or(String::new(), |l| format!(" (5xx, 429 or over {l} ms)")),
                    e.window_ms / 1000,
                    e.ramp_ms / 1000,
                ));
            }
            if let Some(g) = &r.global {
                out.push_str(&format!(
                    "    global {}: cluster {}, domain {}, timeout {} ms{}\n",
                    match g.mode {
                        GlobalMode::Sync => "sync",
                        GlobalMode::Async => "async",
                    },
                    g.cluster,
                    g.domain,
                    g.timeout_ms,
                    match g.mode {
                        GlobalMode::Async => format!(", flush every {} ms", g.flush_ms),
                        GlobalMode::Sync => String::new(),
                    }
                ));
            }
        }
        out
    }

    fn limit(r: &Rule) -> String {
        let (quota, algorithm) = match r.limit {
            Limit::Rate { quota, algorithm } => (quota, algorithm),
            Limit::InFlight { max, lease_ms } => {
                return format!("{max} in flight (lease {} s)", lease_ms / 1000)
            }
        };
        let algorithm = match algorithm {
            Algorithm::TokenBucket { burst } => format!("token_bucket, burst {burst}"),
            Algorithm::LeakyBucket {
                burst,
                max_delay_ms: Some(d),
            } => format!("leaky_bucket, burst {burst}, delay up to {d} ms"),
            Algorithm::LeakyBucket { burst, .. } => format!("leaky_bucket, burst {burst}"),
            other => other.name().to_string(),
        };
        format!(
            "{} {}per {} ({algorithm})",
            quota.requests_per_unit,
            r.quota_unit
                .as_deref()
                .map_or(String::new(), |u| format!("{u} ")),
            quota.unit.name(),
        )
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
