//! The config-check CLI: the filter's own validation, from JSON files and Istio manifests.
#![allow(clippy::unwrap_used, clippy::panic)]

use ratelimit_core::testkit as common;

use std::path::{Path, PathBuf};
use std::process::Command;

fn fixture_dir(dir: &str) -> PathBuf {
    common::fixtures().join(dir)
}

fn check(files: &[&Path]) -> (i32, String) {
    let bin = env!("CARGO_BIN_EXE_ratelimit-config");
    let (code, out, _) = common::output(Command::new(bin).arg("check").args(files));
    (code, out)
}

#[test]
fn every_bad_fixture_fails_with_every_error_listed() {
    for json in common::fixture_files("bad") {
        let (code, out) = check(&[&json]);
        assert_eq!(code, 1, "{}: {out}", json.display());
        assert!(out.contains(": INVALID"), "{out}");
        let expected = std::fs::read_to_string(json.with_extension("error")).unwrap();
        for error in expected.trim_end().split("; ") {
            assert!(
                out.contains(&format!("\n  {error}")),
                "{}:\n{out}",
                json.display()
            );
        }
    }
}

#[test]
fn good_fixtures_pass_with_a_summary() {
    let files = common::fixture_files("good");
    let refs: Vec<&Path> = files.iter().map(PathBuf::as_path).collect();
    let (code, out) = check(&refs);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains(
        "rule per-client: 100 per minute (sliding_window), key [remote_address, header:x-api-key], \
         match path_prefix /api/, methods GET|POST, x-tier=free, x-api-key present"
    ), "{out}");
    assert!(out.contains("rule tb: 10 per second (token_bucket, burst 20), key [], match every request, cost from header x-cost"), "{out}");
    assert!(
        out.contains("rule lb: 5 per second (leaky_bucket, burst 10, delay up to 500 ms)"),
        "{out}"
    );
    // A dialect beside the header style (fixtures/good/llm-dialect.json).
    assert!(
        out.contains(
            "headers none and anthropic's (also on allowed responses), limited status 429"
        ),
        "{out}"
    );
}

#[test]
fn istio_manifests_are_checked_document_by_document() {
    let file = fixture_dir("manifests").join("two-plugins.yaml");
    let (code, out) = check(&[&file]);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("(WasmPlugin good): OK\n"), "{out}");
    assert!(
        out.contains(
            "(WasmPlugin typo): INVALID\n  rules[0].rate_limit.unit: unknown unit \"minutes\""
        ),
        "{out}"
    );
}

/// Envoy Gateway's manifests: each EnvoyExtensionPolicy's wasm and dynamic-module entries are
/// checked; the other resources (EnvoyProxy, Gateway) are passed over, not refused.
#[test]
fn envoy_gateway_policies_are_checked_entry_by_entry() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/envoy-gateway");
    let (code, out) = check(&[&root.join("wasm.yaml"), &root.join("native.yaml")]);
    assert_eq!(code, 0, "{out}");
    for policy in [
        "(EnvoyExtensionPolicy ratelimit-gateway wasm[0]): OK\n",
        "(EnvoyExtensionPolicy ratelimit-search wasm[0]): OK\n",
        "(EnvoyExtensionPolicy ratelimit-native dynamicModule[0]): OK\n",
    ] {
        assert!(out.contains(policy), "{policy}: {out}");
    }
    // A policy whose configuration is wrong is refused with its field.
    let dir = std::env::temp_dir().join(format!("eg-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let bad = dir.join("bad.yaml");
    std::fs::write(
        &bad,
        "apiVersion: gateway.envoyproxy.io/v1alpha1\nkind: EnvoyExtensionPolicy\n\
         metadata: {name: typo}\nspec:\n  wasm:\n  - name: rl\n    config:\n      \
         rules: [{name: a, rate_limit: {requests_per_unit: 1, unit: minutes}}]\n",
    )
    .unwrap();
    let (code, out) = check(&[&bad]);
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains("(EnvoyExtensionPolicy typo wasm[0]): INVALID\n  rules[0].rate_limit.unit"),
        "{out}"
    );
}

#[test]
fn usage_errors_exit_2() {
    let out = Command::new(env!("CARGO_BIN_EXE_ratelimit-config"))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let (code, _) = check(&[Path::new("/nonexistent/config.json")]);
    assert_eq!(code, 2);
}

#[test]
fn envoy_configurations_are_checked_filter_by_filter() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let (code, out) = check(&[&root.join("examples/per-ip/envoy.yaml")]);
    assert_eq!(code, 0, "{out}");
    assert!(
        out.contains("examples/per-ip/envoy.yaml (Wasm filter per-ip): OK\n"),
        "{out}"
    );
    let dir = common::scratch("envoy-native");
    let yaml = dir.join("envoy.yaml");
    std::fs::write(
        &yaml,
        r#"static_resources:
  listeners:
  - filter_chains:
    - filters:
      - typed_config:
          http_filters:
          - name: envoy.filters.http.dynamic_modules
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.dynamic_modules.v3.DynamicModuleFilter
              filter_name: edge
              filter_config:
                "@type": type.googleapis.com/google.protobuf.StringValue
                value: '{"rules": [{"name": "r", "rate_limit": {"requests_per_unit": 1, "unit": "hour"}}]}'
"#,
    )
    .unwrap();
    let (code, out) = check(&[&yaml]);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("(dynamic module filter edge): OK\n"), "{out}");
    std::fs::write(&yaml, "static_resources: {listeners: []}\n").unwrap();
    let (code, out) = check(&[&yaml]);
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains("an Envoy configuration without a wasm or dynamic-module HTTP filter"),
        "{out}"
    );
}
