//! The native build against Envoys it was and was not built for: what each Envoy does with it
//! (docs-draft/SUPPORT.md). Needs the Envoy binaries `ENVOY_1_38`, `ENVOY_1_39`, `ENVOY_1_40`
//! and the module built for each supported ABI, `NATIVE_1_40_DIR` and `NATIVE_1_39_DIR`
//! (`make integration` installs and builds them all); a test without them fails.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod common;

use common::{Client, Envoy};
use std::path::PathBuf;
use std::process::Command;

/// An Envoy binary from `var`, checked to be release `version`.
fn envoy(var: &str, version: &str) -> String {
    let bin = std::env::var(var).unwrap_or_else(|_| {
        panic!("{var} is not set: the path of Envoy {version} (make integration sets it)")
    });
    let out = Command::new(&bin)
        .arg("--version")
        .output()
        .unwrap_or_else(|e| panic!("{var}={bin}: {e}"));
    let text = String::from_utf8_lossy(&out.stdout);
    // "<path>  version: <commit>/<release>/Clean/RELEASE/BoringSSL"
    let release = text
        .split_once("version: ")
        .and_then(|(_, v)| v.split('/').nth(1));
    assert_eq!(
        release,
        Some(version),
        "{var}={bin} is not Envoy {version}: {text}"
    );
    bin
}

/// The folder of `libwasm_ratelimit.so` built for an ABI, from `var`.
fn module(var: &str) -> PathBuf {
    let dir = PathBuf::from(
        std::env::var(var)
            .unwrap_or_else(|_| panic!("{var} is not set (make integration sets it)")),
    );
    assert!(
        dir.join("libwasm_ratelimit.so").is_file(),
        "{var}: no libwasm_ratelimit.so in {}",
        dir.display()
    );
    dir
}

/// A listener answering `ok` behind the module, with one rule of 2 requests an hour.
const BOOTSTRAP: &str = r#"admin:
  address: {socket_address: {address: 127.0.0.1, port_value: 0}}
static_resources:
  listeners:
  - name: test
    address: {socket_address: {address: 127.0.0.1, port_value: 0}}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: test
          route_config:
            virtual_hosts:
            - name: all
              domains: ["*"]
              routes:
              - match: {prefix: "/"}
                direct_response: {status: 200, body: {inline_string: "ok\n"}}
          http_filters:
          - name: envoy.filters.http.dynamic_modules
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.dynamic_modules.v3.DynamicModuleFilter
              dynamic_module_config: {name: wasm_ratelimit}
              filter_name: test
              filter_config:
                "@type": type.googleapis.com/google.protobuf.StringValue
                value: '{"rules": [{"name": "two", "rate_limit": {"requests_per_unit": 2, "unit": "hour"}}]}'
          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
"#;

/// The module limits: two requests pass with the rule's headers, the third gets 429.
fn limits(envoy: &Envoy) {
    let mut c = Client::connect(envoy.addr).unwrap();
    let statuses: Vec<u16> = (0..3).map(|_| c.get("/").unwrap().status).collect();
    assert_eq!(statuses, [200, 200, 429]);
    let r = c.get("/").unwrap();
    assert_eq!(r.header("ratelimit-policy"), Some("\"two\";q=2;w=3600"));
}

/// The module built for an ABI (its folder in `module_var`) runs in Envoy `version` (the
/// binary in `envoy_var`): its log shows `line`, and the module limits.
fn runs(envoy_var: &str, version: &str, module_var: &str, line: &str) {
    let envoy = Envoy::start_on(&envoy(envoy_var, version), BOOTSTRAP, &module(module_var));
    assert!(envoy.log_shows(line), "{}", envoy.log());
    limits(&envoy);
}

/// The module built for an ABI (its folder in `module_var`) in Envoy `version` (the binary in
/// `envoy_var`): Envoy exits with an error; what it logged.
fn refused(envoy_var: &str, version: &str, module_var: &str) -> String {
    let refused = Envoy::refused_on(&envoy(envoy_var, version), BOOTSTRAP, &module(module_var));
    assert!(!refused.exit_ok);
    refused.log
}

/// 1.38 lacks callbacks the module built for `module_var`'s ABI imports: the dynamic linker
/// refuses it before it runs.
fn refused_by_1_38_at_load(module_var: &str) {
    let log = refused("ENVOY_1_38", "1.38.3", module_var);
    assert!(
        log.contains("undefined symbol: envoy_dynamic_module_callback_http_filter_config_"),
        "{log}"
    );
}

#[test]
fn built_for_1_40_runs_on_1_40() {
    let line = "Dynamic module ABI version v0.2.0 matched.";
    runs("ENVOY_1_40", "1.40.0", "NATIVE_1_40_DIR", line);
}

/// Envoy 1.39 would load it (it exports every callback the module imports) and only warn about
/// the version string; the module refuses itself, saying why, and Envoy exits.
#[test]
fn built_for_1_40_refuses_to_load_in_1_39() {
    let log = refused("ENVOY_1_39", "1.39.3", "NATIVE_1_40_DIR");
    assert!(
        log.contains(
            "was built for the dynamic-module ABI of Envoy 1.40.0 (v0.2.0), but this Envoy does \
             not export envoy_dynamic_module_callback_log_v2, which Envoy 1.40.0 does: it is an \
             older Envoy. Refusing to load."
        ),
        "{log}"
    );
    assert!(log.contains("Failed to initialize dynamic module"), "{log}");
}

#[test]
fn built_for_1_40_is_refused_by_1_38_at_load() {
    refused_by_1_38_at_load("NATIVE_1_40_DIR");
}

#[test]
fn built_for_1_39_runs_on_1_39() {
    let line = "Dynamic module ABI version v0.1.0 matched.";
    runs("ENVOY_1_39", "1.39.3", "NATIVE_1_39_DIR", line);
}

/// Envoy's promise (a module built for 1.N runs on 1.N+1): 1.40 warns about the older ABI
/// string and runs it.
#[test]
fn built_for_1_39_runs_on_1_40_with_a_warning() {
    let line = "Dynamic module ABI version v0.1.0 is deprecated. Please recompile the module \
                against the SDK with the exact Envoy version used by the main program.";
    runs("ENVOY_1_40", "1.40.0", "NATIVE_1_39_DIR", line);
}

#[test]
fn built_for_1_39_is_refused_by_1_38_at_load() {
    refused_by_1_38_at_load("NATIVE_1_39_DIR");
}
