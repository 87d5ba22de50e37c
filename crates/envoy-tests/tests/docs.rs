//! The README's snippets work as written: every JSON configuration is valid, every YAML block
//! parses, the Envoy filter snippet runs in a real Envoy, and the quick-start session of the
//! demo (`envoy.yaml`) shows what the README shows, and so do its `explain` sessions.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod common;

use common::{wasm_path, Build, Client, Envoy};
use ratelimit_config::manifest::yaml_documents;
use ratelimit_core::config::Config;

fn readme() -> String {
    std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../README.md")).unwrap()
}

fn blocks(text: &str, lang: &str) -> Vec<String> {
    text.split(&format!("```{lang}\n"))
        .skip(1)
        .map(|b| b.split("```").next().unwrap().to_string())
        .collect()
}

#[test]
fn every_json_configuration_in_the_readme_is_valid() {
    let mut n = 0;
    for block in blocks(&readme(), "json") {
        if block.contains("\"rules\"") {
            if let Err(e) = Config::parse(block.as_bytes()) {
                panic!("{e}\n{block}");
            }
            n += 1;
        }
    }
    assert!(n >= 7, "{n} configurations");
}

#[test]
fn every_yaml_block_in_the_readme_parses() {
    let yaml = blocks(&readme(), "yaml");
    assert!(yaml.len() >= 2);
    for block in yaml {
        yaml_documents(&block).unwrap_or_else(|e| panic!("{e}\n{block}"));
    }
}

#[test]
fn the_envoy_snippet_runs_as_written() {
    // Deploy shows one snippet per build.
    let filter = match common::build() {
        Build::Wasm => "envoy.filters.http.wasm",
        Build::Native => "envoy.filters.http.dynamic_modules",
    };
    let snippet = blocks(&readme(), "yaml")
        .into_iter()
        .find(|b| b.contains(filter))
        .unwrap();
    // Put the snippet under an HTTP connection manager, pointing at the built module.
    let filters: String = snippet
        .replace(
            "/etc/envoy/wasm_ratelimit.wasm",
            &wasm_path().display().to_string(),
        )
        .lines()
        .map(|l| format!("          {l}\n"))
        .collect();
    let full = common::bootstrap("{}", &wasm_path());
    let start = full.find("          http_filters:").unwrap();
    let yaml = format!("{}{filters}", &full[..start]);
    let envoy = Envoy::start_yaml(&yaml);
    let mut c = Client::connect(envoy.addr).unwrap();
    let r = c.get("/").unwrap();
    assert_eq!(r.status, 200);
    assert_eq!(r.header("ratelimit-policy"), Some("\"per-ip\";q=100;w=60"));
    assert_eq!(r.header_u64("x-ratelimit-remaining"), Some(99));
    assert_eq!(
        envoy.wait_stat(&common::metric_of("edge", Some("per-ip"), "allowed"), 1),
        Some(1)
    );
}

/// Header lines whose values depend on the clock: checked for presence only.
const TIMED: [&str; 6] = [
    "date",
    "ratelimit",
    "x-ratelimit-reset",
    "retry-after",
    "x-ratelimit-retry-after",
    "content-length",
];

#[test]
fn the_quick_start_session_is_what_the_demo_shows() {
    let text = readme();
    let sessions: Vec<String> = blocks(&text, "console")
        .into_iter()
        .filter(|b| b.starts_with("$ curl -i localhost:10000/"))
        .collect();
    assert_eq!(sessions.len(), 2, "the first request and the sixth");
    // `make run` serves envoy.yaml, `make run-native` envoy-native.yaml: the same demo.
    let demo = match common::build() {
        common::Build::Wasm => "envoy.yaml",
        common::Build::Native => "envoy-native.yaml",
    };
    let yaml = std::fs::read_to_string(common::root().join(demo))
        .unwrap()
        .replace("port_value: 10000", "port_value: 0")
        .replace("port_value: 9901", "port_value: 0")
        .replace(
            "target/wasm32-wasip1/release/wasm_ratelimit.wasm",
            &wasm_path().display().to_string(),
        );
    let envoy = Envoy::start_yaml(&yaml);
    let mut c = Client::connect(envoy.addr).unwrap();
    let responses: Vec<_> = (0..6).map(|_| c.get("/").unwrap()).collect();
    for (session, r) in sessions.iter().zip([&responses[0], &responses[5]]) {
        let mut lines = session.lines().skip(1);
        let status: u16 = lines
            .next()
            .unwrap()
            .split(' ')
            .nth(1)
            .unwrap()
            .parse()
            .unwrap();
        assert_eq!(r.status, status);
        for line in lines.by_ref() {
            let Some((name, value)) = line.split_once(": ") else {
                break;
            };
            if TIMED.contains(&name) {
                assert!(r.header(name).is_some(), "{name} missing");
            } else {
                assert_eq!(r.header(name), Some(value), "{name}");
            }
        }
        let body: String = lines.collect::<Vec<_>>().join("\n");
        if status == 200 {
            assert_eq!(r.body_str().trim(), body.trim());
        } else {
            // The body's detail names the wait, which depends on the clock: compare its shape.
            let want: serde_json::Value = serde_json::from_str(body.trim()).unwrap();
            let got: serde_json::Value = serde_json::from_slice(&r.body).unwrap();
            for field in ["type", "title", "status", "violated-policies"] {
                assert_eq!(got[field], want[field], "{field}");
            }
        }
    }
}

/// The README's sessions of the CLI's `explain` and `check` print what the CLI prints.
#[test]
fn the_explain_sessions_print_what_explain_prints() {
    let mut n = 0;
    for (cmd, expected) in common::sessions(&readme()) {
        let cli =
            |sub: &str| cmd.starts_with(&format!("cargo run -q --bin ratelimit-config -- {sub} "));
        if !cli("explain") && !cli("check") {
            continue;
        }
        let got = common::cli_line(&cmd).unwrap();
        assert_eq!(got, expected, "$ {cmd}");
        n += 1;
    }
    assert!(n >= 4, "{n} explain and check sessions");
}
