//! The rate limit services' configurations that the examples ship count what the filter sends.
//!
//! For each example with global rules (`examples/fleet`, `examples/llm-gateway`), its Envoy
//! runs against the test service (the limitador engine, with the example's `limits.json`),
//! which logs every call (`RLS_LOG`, see the rls-server), and requests reach every global rule.
//! Then, for every call the filter made:
//!
//! - **Limitador** (`limits.json`): exactly one limit counted it, the one named as the rule the
//!   descriptor names, in the rule's domain, with the rule's limit and window (a `month` rule:
//!   31 days, the longest month);
//! - **envoyproxy/ratelimit** (`ratelimit.yaml`): the descriptor finds a rate limit the way
//!   envoyproxy/ratelimit looks one up (`GetLimit` in its `src/config/config_impl.go`: entry by
//!   entry, `key_value` before `key`, a limit only at the descriptor's last entry), in the
//!   rule's domain, with the rule's limit and unit; and the file holds only the keys that
//!   service accepts, with no duplicate descriptor at any level;
//!
//! and every global rule of the example was called. A service that finds no limit for a
//! descriptor admits it: a configuration out of step with the filter would not limit at all.
//!
//! Also the way every Envoy test starts such services (`common::ports`): the ports it gives,
//! and that a started service counts only once it listens on its port itself (tested here once
//! rather than in every test binary that compiles the module).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod common;

use common::{root, Envoy, Proc};
use ratelimit_config::manifest::{plugin_configs, yaml_documents};
use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Child;
use std::process::{Command, Stdio};
use std::time::Duration;

/// A global rule of an example's configuration.
#[derive(Debug, Clone, PartialEq)]
struct Rule {
    domain: String,
    limit: u64,
    unit: String,
}

/// The global rules of every filter configuration in the example's envoy.yaml, by name. Rules
/// of one name in several configurations must agree: they count against one limit.
fn global_rules(dir: &Path) -> BTreeMap<String, Rule> {
    let yaml = std::fs::read_to_string(dir.join("envoy.yaml")).unwrap();
    let mut rules: BTreeMap<String, Rule> = BTreeMap::new();
    for (label, json) in plugin_configs(&yaml).unwrap() {
        let config: Value = serde_json::from_str(&json).unwrap();
        for r in config["rules"].as_array().unwrap() {
            let Some(domain) = r["global"]["domain"].as_str() else {
                continue;
            };
            let rule = Rule {
                domain: domain.to_string(),
                limit: r["rate_limit"]["requests_per_unit"].as_u64().unwrap(),
                unit: r["rate_limit"]["unit"].as_str().unwrap().to_string(),
            };
            let name = r["name"].as_str().unwrap().to_string();
            if let Some(other) = rules.get(&name) {
                assert_eq!(
                    other, &rule,
                    "{label:?}: rule {name} differs from its namesake"
                );
            }
            rules.insert(name, rule);
        }
    }
    rules
}

/// Limitador's window for a rule's unit.
fn seconds(unit: &str) -> u64 {
    match unit {
        "second" => 1,
        "minute" => 60,
        "hour" => 3600,
        "day" => 86400,
        "week" => 604800,
        "month" => 2678400,
        other => panic!("unit {other}"),
    }
}

/// One call the test service logged.
struct Call {
    domain: String,
    entries: Vec<(String, String)>,
    limits: Vec<String>,
}

fn calls(log: &Path) -> Vec<Call> {
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .map(|l| {
            let v: Value = serde_json::from_str(l).unwrap();
            let descriptors = v["descriptors"].as_array().unwrap();
            assert_eq!(descriptors.len(), 1, "one descriptor per call: {l}");
            Call {
                domain: v["domain"].as_str().unwrap().to_string(),
                entries: descriptors[0]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|e| {
                        (
                            e[0].as_str().unwrap().to_string(),
                            e[1].as_str().unwrap().to_string(),
                        )
                    })
                    .collect(),
                limits: v["limits"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|n| n.as_str().unwrap().to_string())
                    .collect(),
            }
        })
        .collect()
}

/// The keys envoyproxy/ratelimit accepts in its configuration (`validKeys`).
const RATELIMIT_KEYS: &[&str] = &[
    "domain",
    "key",
    "value",
    "descriptors",
    "rate_limit",
    "unit",
    "requests_per_unit",
    "unlimited",
    "shadow_mode",
    "quota_mode",
    "name",
    "replaces",
    "detailed_metric",
    "value_to_metric",
    "share_threshold",
    "metadata",
];

/// What envoyproxy/ratelimit would refuse to load in a descriptor list.
fn check_ratelimit_descriptors(list: &Value, at: &str) {
    let mut seen = BTreeSet::new();
    for d in list.as_array().unwrap() {
        for k in d.as_object().unwrap().keys() {
            assert!(
                RATELIMIT_KEYS.contains(&k.as_str()),
                "{at}: unknown key {k}"
            );
        }
        let key = d["key"].as_str().unwrap();
        assert!(!key.is_empty(), "{at}: an empty key");
        let full = match d["value"].as_str() {
            Some(v) if !v.is_empty() => format!("{key}_{v}"),
            _ => key.to_string(),
        };
        assert!(
            seen.insert(full.clone()),
            "{at}: duplicate descriptor {full}"
        );
        if let Some(rl) = d.get("rate_limit") {
            let unit = rl["unit"].as_str().unwrap().to_ascii_uppercase();
            assert!(
                ["SECOND", "MINUTE", "HOUR", "DAY", "WEEK", "MONTH", "YEAR"]
                    .contains(&unit.as_str()),
                "{at}/{full}: unit {unit}"
            );
        }
        if let Some(inner) = d.get("descriptors") {
            check_ratelimit_descriptors(inner, &format!("{at}/{full}"));
        }
    }
}

/// The rate limit envoyproxy/ratelimit finds for a descriptor: (requests_per_unit, UNIT).
fn ratelimit_lookup(config: &Value, entries: &[(String, String)]) -> Option<(u64, String)> {
    let mut level = config["descriptors"].as_array()?;
    let mut found = None;
    for (i, (key, value)) in entries.iter().enumerate() {
        let with_value = level.iter().find(|d| {
            d["key"].as_str() == Some(key.as_str()) && d["value"].as_str() == Some(value.as_str())
        });
        let next = with_value.or_else(|| {
            level.iter().find(|d| {
                d["key"].as_str() == Some(key.as_str())
                    && d["value"].as_str().is_none_or(str::is_empty)
            })
        })?;
        if let Some(rl) = next.get("rate_limit") {
            if i == entries.len() - 1 {
                found = Some((
                    rl["requests_per_unit"].as_u64()?,
                    rl["unit"].as_str()?.to_ascii_uppercase(),
                ));
            }
        }
        match next.get("descriptors").and_then(Value::as_array) {
            Some(inner) if !inner.is_empty() => level = inner,
            _ => break,
        }
    }
    found
}

fn rls_server_bin() -> PathBuf {
    std::env::var("RLS_SERVER")
        .map(PathBuf::from)
        .unwrap_or_else(|_| root().join("crates/envoy-tests/rls-server/target/release/rls-server"))
}

/// A child process killed on drop.
struct Killed(Child);
impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The example's Envoy on free ports, against a Redis and the test service logging to `log`.
fn start(dir: &Path, log: &Path) -> (Envoy, Proc, Killed) {
    let limits = std::fs::read_to_string(dir.join("limits.json")).unwrap();
    let (redis_port, rls_port) = (common::free_port(), common::free_port());
    let store = common::redis(redis_port);
    let mut child = Command::new(rls_server_bin())
        .args([
            format!("127.0.0.1:{rls_port}"),
            format!("redis://127.0.0.1:{redis_port}"),
            limits,
            "0".into(),
            "serial".into(),
        ])
        .env("RLS_LOG", log)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("the test RLS server (make rls-server builds it)");
    common::ports::wait_listening(&mut child, rls_port, "the test RLS server");
    let yaml =
        common::example_yaml(dir).replace("port_value: 8081", &format!("port_value: {rls_port}"));
    let envoy = Envoy::start_yaml(&common::for_build(&yaml));
    (envoy, store, Killed(child))
}

/// `curl -s -o /dev/null -w '%{http_code}'` with `args`, against `envoy`.
fn curl(envoy: &Envoy, path: &str, args: &[&str]) -> String {
    let out = Command::new("curl")
        .args(["-s", "-o", "/dev/null", "-w", "%{http_code}"])
        .args(args)
        .arg(format!("http://{}{path}", envoy.addr))
        .output()
        .unwrap();
    String::from_utf8(out.stdout).unwrap()
}

fn check_example(name: &str, send: impl Fn(&Envoy)) {
    let dir = root().join("examples").join(name);
    let rules = global_rules(&dir);
    assert!(!rules.is_empty(), "{name}: no global rule");
    let scratch = common::scratch(&format!("services-{name}"));
    let log = scratch.join("rls.log");
    let _ = std::fs::remove_file(&log);
    let (envoy, _store, _service) = start(&dir, &log);
    send(&envoy);
    // Claims ahead of need and usage reports go out every flush_ms (100 ms).
    std::thread::sleep(Duration::from_millis(500));
    drop(envoy);
    let calls = calls(&log);
    assert!(!calls.is_empty(), "{name}: the service was never called");

    let limits: Vec<Value> =
        serde_json::from_str(&std::fs::read_to_string(dir.join("limits.json")).unwrap()).unwrap();
    let ratelimit = yaml_documents(&std::fs::read_to_string(dir.join("ratelimit.yaml")).unwrap())
        .unwrap()
        .remove(0);
    check_ratelimit_descriptors(&ratelimit["descriptors"], &format!("{name}/ratelimit.yaml"));

    let mut called = BTreeSet::new();
    for call in &calls {
        let what = format!("{name}: {} {:?}", call.domain, call.entries);
        let (first, value) = &call.entries[0];
        assert_eq!(first, "rule", "{what}");
        let rule = rules
            .get(value)
            .unwrap_or_else(|| panic!("{what}: no global rule {value}"));
        assert_eq!(call.domain, rule.domain, "{what}");
        called.insert(value.clone());

        // Limitador: one limit, the rule's.
        assert_eq!(
            call.limits,
            vec![value.clone()],
            "{what}: counted by these limits of limits.json"
        );
        let limit = limits
            .iter()
            .find(|l| l["name"].as_str() == Some(value.as_str()))
            .unwrap();
        assert_eq!(
            limit["namespace"].as_str(),
            Some(rule.domain.as_str()),
            "{what}"
        );
        assert_eq!(limit["max_value"].as_u64(), Some(rule.limit), "{what}");
        assert_eq!(
            limit["seconds"].as_u64(),
            Some(seconds(&rule.unit)),
            "{what}"
        );

        // envoyproxy/ratelimit: the rule's limit and unit.
        assert_eq!(
            ratelimit["domain"].as_str(),
            Some(rule.domain.as_str()),
            "{what}"
        );
        assert_eq!(
            ratelimit_lookup(&ratelimit, &call.entries),
            Some((rule.limit, rule.unit.to_ascii_uppercase())),
            "{what}: the rate limit ratelimit.yaml gives it"
        );
    }
    let all: BTreeSet<String> = rules.keys().cloned().collect();
    assert_eq!(called, all, "{name}: the global rules called");
    println!("{name}: {} calls, rules {called:?}", calls.len());
}

/// The LLM gateway's envoy.yaml runs openai.json and anthropic.json as they are: the pages show
/// the files.
#[test]
fn the_llm_gateways_filters_run_its_configuration_files() {
    let dir = root().join("examples/llm-gateway");
    let yaml = std::fs::read_to_string(dir.join("envoy.yaml")).unwrap();
    let configs: BTreeMap<String, Value> = plugin_configs(&yaml)
        .unwrap()
        .into_iter()
        .map(|(label, json)| (label.unwrap(), serde_json::from_str(&json).unwrap()))
        .collect();
    for name in ["openai", "anthropic"] {
        let file: Value = serde_json::from_str(
            &std::fs::read_to_string(dir.join(format!("{name}.json"))).unwrap(),
        )
        .unwrap();
        assert_eq!(
            configs.get(&format!("Wasm filter {name}")),
            Some(&file),
            "{name}.json"
        );
    }
    assert_eq!(configs.len(), 2, "{:?}", configs.keys());
}

#[test]
fn the_fleet_examples_service_configurations_count_what_the_filter_sends() {
    check_example("fleet", |envoy| {
        for _ in 0..3 {
            assert_eq!(curl(envoy, "/api/items", &["-H", "x-api-key: k1"]), "200");
        }
    });
}

#[test]
fn the_llm_gateways_service_configurations_count_what_the_filter_sends() {
    let chat = r#"{"model": "gpt-4o-mini", "max_tokens": 300, "messages": [{"role": "user", "content": "Hi"}]}"#;
    let message = r#"{"model": "claude-sonnet-4-5", "max_tokens": 300, "messages": [{"role": "user", "content": "Hi"}]}"#;
    check_example("llm-gateway", |envoy| {
        let json = ["-H", "content-type: application/json"];
        let openai = [
            &json[..],
            &["-H", "authorization: Bearer alice", "-d", chat],
        ]
        .concat();
        let anthropic = [&json[..], &["-H", "x-api-key: carol", "-d", message]].concat();
        assert_eq!(curl(envoy, "/v1/chat/completions", &openai), "200");
        assert_eq!(curl(envoy, "/v1/messages", &anthropic), "200");
    });
}

/// The harness's ports (`common::ports`): two are never one, both in their range and free.
#[test]
fn ports_are_distinct_bindable_and_in_their_range() {
    let (a, b) = (common::free_port(), common::free_port());
    assert_ne!(a, b);
    let (first, end) = common::ports::range();
    assert!(
        (first..end).contains(&a) && (first..end).contains(&b),
        "{a} {b} not in {first}..{end}"
    );
    drop(std::net::TcpListener::bind(("127.0.0.1", a)).unwrap());
}

/// A started service counts as started only when it listens on its port itself.
#[test]
fn only_the_child_itself_listening_will_do() {
    let port = common::free_port();
    // Somebody else holds the port: the child cannot bind it and exits, which is said.
    let squatter = std::net::TcpListener::bind(("127.0.0.1", port)).unwrap();
    let script = format!(
        "import socket,time; s=socket.socket(); s.bind(('127.0.0.1',{port})); s.listen(); \
         time.sleep(30)"
    );
    let mut child = Command::new("python3")
        .args(["-c", &script])
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let said = common::ports::listens(&mut child, port, "the child").unwrap_err();
    assert!(
        said.contains("exited") && said.contains("another process"),
        "{said}"
    );
    // Once it is free, the child's own listener is found.
    drop(squatter);
    let mut child = Command::new("python3")
        .args(["-c", &script])
        .spawn()
        .unwrap();
    common::ports::wait_listening(&mut child, port, "the child");
    let _ = child.kill();
    let _ = child.wait();
}
