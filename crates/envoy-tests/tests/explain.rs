//! `ratelimit-config explain` says what the filter does: for every example configuration, one
//! request is explained offline, then sent to a real Envoy running that example (with a
//! `key_seed`, so both hash alike) until a rule refuses it. The rules explain says apply are the
//! rules the answers' `RateLimit-Policy` names, with the limits it names, and the key explain
//! prints for a rule is the key the filter logs when that rule refuses (or would refuse, for a
//! shadow rule) the request.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod common;

use common::{Client, Envoy};
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;

const SEED: &str = "5eed0000000000000000000000c0ffee";

/// One request of an example, and how many times at most to send it.
struct Case {
    example: &'static str,
    method: &'static str,
    path: &'static str,
    headers: &'static [(&'static str, &'static str)],
    /// What explain is told besides the headers (what the example's auth step adds).
    extra: &'static [&'static str],
    times: usize,
    /// Its shadow rules would refuse within `times`.
    shadow: bool,
}

const CASES: &[Case] = &[
    Case {
        example: "per-ip",
        method: "GET",
        path: "/api/items?page=2",
        headers: &[],
        extra: &[],
        times: 7,
        shadow: false,
    },
    Case {
        example: "api-key-tiers",
        method: "GET",
        path: "/api/orders",
        headers: &[("x-tier", "free"), ("x-api-key", "abc")],
        extra: &[],
        times: 5,
        shadow: false,
    },
    Case {
        example: "login",
        method: "POST",
        path: "/login?user=alice",
        headers: &[],
        extra: &[],
        times: 7,
        shadow: false,
    },
    Case {
        example: "customer-plans",
        method: "GET",
        path: "/",
        headers: &[("x-api-key", "acme")],
        // The example's stand-in auth step leaves acme's plan in dynamic metadata.
        extra: &["--metadata", "plans:rpm=5"],
        times: 7,
        shadow: false,
    },
    Case {
        example: "replay",
        method: "GET",
        path: "/api/orders",
        headers: &[("x-api-key", "k1")],
        extra: &[],
        times: 24,
        shadow: true,
    },
    Case {
        example: "tenant-in-flight",
        method: "GET",
        path: "/jobs",
        headers: &[("x-tenant", "acme")],
        extra: &[],
        times: 1,
        shadow: false,
    },
    Case {
        example: "downloads",
        method: "GET",
        path: "/files/small",
        headers: &[],
        extra: &[],
        times: 2,
        shadow: false,
    },
    Case {
        example: "global-cap",
        method: "GET",
        path: "/reports/daily",
        headers: &[],
        extra: &[],
        times: 2,
        shadow: false,
    },
    Case {
        example: "fleet",
        method: "GET",
        path: "/api/orders",
        headers: &[("x-api-key", "alice")],
        extra: &[],
        times: 7,
        shadow: false,
    },
    Case {
        example: "llm-tokens",
        method: "GET",
        path: "/v1/complete",
        headers: &[("x-api-key", "team-a")],
        extra: &[],
        times: 2,
        shadow: false,
    },
    Case {
        example: "openai-tokens",
        method: "GET",
        path: "/v1/models",
        headers: &[("authorization", "Bearer sk-a")],
        extra: &[],
        times: 1,
        shadow: false,
    },
    Case {
        example: "llm-gateway",
        method: "GET",
        path: "/v1/chat/completions",
        headers: &[("authorization", "Bearer alice")],
        // The example's stand-in auth step sets alice's team. Five: her requests a minute (a
        // refusal by the lease rule would name that rule alone).
        extra: &["--header", "x-team: research"],
        times: 5,
        shadow: false,
    },
    Case {
        example: "shared-provider",
        method: "GET",
        path: "/v1/chat/completions",
        headers: &[("authorization", "Bearer dave")],
        // The example's stand-in auth step sets dave's team, weight and band. One request:
        // its answer teaches the rule the provider's lower limit, which the next would name.
        extra: &[
            "--header",
            "x-team: nightly-evals",
            "--header",
            "x-team-weight: 1",
            "--header",
            "x-band: batch",
        ],
        times: 1,
        shadow: false,
    },
    Case {
        example: "anthropic-tokens",
        method: "GET",
        path: "/v1/messages",
        headers: &[("x-api-key", "sk-ant")],
        extra: &[],
        times: 1,
        shadow: false,
    },
];

/// The example's Envoy configuration on free ports, with `key_seed` and limited lines at info;
/// the guards keep the example's rate limit service running, if it has one.
fn example_yaml(dir: &Path) -> (String, Vec<common::Proc>) {
    let (yaml, services) = common::example(dir);
    (seeded(&yaml), services)
}

/// The configuration with the test's `key_seed` and `"log_limited": "info"` in front of its
/// rules.
fn seeded(yaml: &str) -> String {
    let at = yaml.find("\"rules\"").expect("a configuration with rules");
    format!(
        "{}\"key_seed\": \"{SEED}\", \"log_limited\": \"info\", {}",
        &yaml[..at],
        &yaml[at..]
    )
}

/// explain's JSON lines for the case, by rule.
fn explain(config: &Path, case: &Case) -> BTreeMap<String, Value> {
    let mut args: Vec<String> = vec![
        "explain".into(),
        config.display().to_string(),
        "--json".into(),
        "--method".into(),
        case.method.into(),
        "--path".into(),
        case.path.into(),
    ];
    for (k, v) in case.headers {
        args.push("--header".into());
        args.push(format!("{k}: {v}"));
    }
    args.extend(case.extra.iter().map(|s| s.to_string()));
    let out = Command::new(common::cli()).args(&args).output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // A file with several configurations (the LLM gateway's, one per provider) may have rules
    // of one name in each: the one that applies is kept.
    let mut rules = BTreeMap::new();
    for l in String::from_utf8(out.stdout).unwrap().lines() {
        let v: Value = serde_json::from_str(l).unwrap();
        let rule = v["rule"].as_str().unwrap().to_string();
        if rules
            .get(&rule)
            .is_none_or(|kept: &Value| kept["applies"] != Value::Bool(true))
        {
            rules.insert(rule, v);
        }
    }
    rules
}

/// (rule, q) of each item of a `RateLimit-Policy` field.
fn policy(field: &str) -> BTreeMap<String, u64> {
    field
        .split(", ")
        .map(|item| {
            let mut params = item.split(';');
            let name = params.next().unwrap().trim_matches('"').to_string();
            let q = params
                .find_map(|p| p.strip_prefix("q="))
                .unwrap()
                .parse()
                .unwrap();
            (name, q)
        })
        .collect()
}

/// The limit explain says is in force: requests per window, or requests in flight.
fn limit(v: &Value) -> u64 {
    let l = &v["limit"];
    l["requests_per_unit"]
        .as_u64()
        .or_else(|| l["in_flight"].as_u64())
        .unwrap_or_else(|| panic!("no limit in {v}"))
}

/// (rule, key) of every `limited` line in the log.
fn limited_lines(log: &str) -> Vec<(String, String)> {
    log.lines()
        .filter_map(|l| {
            let rest = &l[l.find("limited rule=")? + "limited rule=".len()..];
            let rule = rest.split_whitespace().next()?.to_string();
            let key = rest
                .split("key=")
                .nth(1)?
                .split_whitespace()
                .next()?
                .to_string();
            Some((rule, key))
        })
        .collect()
}

#[test]
fn explain_says_what_the_filter_does_to_each_example() {
    let root = common::root();
    let scratch = common::scratch("explain");
    let mut keys_compared = 0;
    let mut examples = 0;
    for case in CASES {
        let dir = root.join("examples").join(case.example);
        let (yaml, _services) = example_yaml(&dir);
        let config = scratch.join(format!("{}.yaml", case.example));
        std::fs::write(&config, &yaml).unwrap();
        let explained = explain(&config, case);
        let applying: BTreeMap<&String, &Value> = explained
            .iter()
            .filter(|(_, v)| v["applies"] == Value::Bool(true))
            .collect();
        let envoy = Envoy::start_yaml(&common::for_build(&yaml));
        let mut client = Client::connect(envoy.addr).unwrap();
        let mut answered = 0;
        let mut refused = false;
        for _ in 0..case.times {
            let r = client.send(case.method, case.path, case.headers).unwrap();
            if let Some(field) = r.header("ratelimit-policy") {
                let named = policy(field);
                let said: BTreeMap<String, u64> = applying
                    .iter()
                    .map(|(rule, v)| ((*rule).clone(), limit(v)))
                    .collect();
                assert_eq!(named, said, "{}: {field}", case.example);
                answered += 1;
            }
            if r.status != 200 {
                refused = true;
                break;
            }
        }
        assert!(answered > 0, "{}: no RateLimit-Policy field", case.example);
        // Envoy writes its log file lazily: wait for the line of a refusal (a shadow rule's
        // would-be refusal is logged too, and answered 200).
        if refused || case.shadow {
            assert!(
                envoy.log_shows("limited rule="),
                "{}: no limited line",
                case.example
            );
        }
        for (rule, key) in limited_lines(&envoy.log()) {
            let v = applying
                .get(&rule)
                .unwrap_or_else(|| panic!("{}: {rule} limited but not applying", case.example));
            assert_eq!(
                v["key"].as_str(),
                Some(key.as_str()),
                "{}: {rule}",
                case.example
            );
            keys_compared += 1;
        }
        examples += 1;
    }
    assert_eq!(examples, CASES.len());
    // per-ip, api-key-tiers, login, customer-plans and replay's shadow rules refuse (or would).
    assert!(keys_compared >= 5, "only {keys_compared} keys compared");
    // Every example directory has a case.
    let dirs = std::fs::read_dir(root.join("examples"))
        .unwrap()
        .filter(|e| e.as_ref().unwrap().path().is_dir())
        .count();
    assert_eq!(dirs, CASES.len(), "an example without a case");
}
