//! Rule reload in a real Envoy that reads its listeners from a file (LDS from the filesystem),
//! the way Istio or a control plane pushes a changed WasmPlugin: counters survive, new limits
//! apply at once, a bad update is refused while the old configuration keeps serving.
#![allow(clippy::unwrap_used, clippy::panic, clippy::indexing_slicing)]

mod common;

use common::{wasm_path, Client, Envoy};
use std::path::Path;
use std::time::{Duration, Instant};

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// The LDS file: one listener on `port` with the filter configured by `plugin_config`.
fn listeners(port: u16, plugin_config: &str) -> String {
    let full = common::bootstrap(plugin_config, &wasm_path());
    // Reuse the listener of the static bootstrap, re-indented as an LDS resource.
    let listener = full
        .split("  listeners:\n")
        .nth(1)
        .unwrap()
        .replace("port_value: 0", &format!("port_value: {port}"));
    let listener = listener.replacen(
        "  - name: test",
        "  - \"@type\": type.googleapis.com/envoy.config.listener.v3.Listener\n    name: test",
        1,
    );
    format!(
        "resources:\n{}",
        listener.replace("\n  ", "\n").trim_start_matches("  ")
    )
}

/// Replaces the LDS file atomically (Envoy watches for the rename).
fn publish(dir: &Path, content: &str) {
    let tmp = dir.join("lds.tmp");
    std::fs::write(&tmp, content).unwrap();
    std::fs::rename(&tmp, dir.join("lds.yaml")).unwrap();
}

fn config(name: &str, limit: u32, unit: &str) -> String {
    format!(
        r#"{{"rules": [{{"name": "{name}", "key": ["remote_address"],
            "rate_limit": {{"requests_per_unit": {limit}, "unit": "{unit}"}}}}]}}"#
    )
}

/// Waits (≤ 15 s) until a counter of the LDS stats reaches `n`.
fn wait_lds(envoy: &Envoy, stat: &str, n: u64) {
    let deadline = Instant::now() + Duration::from_secs(15);
    while envoy.stat(&format!("listener_manager.lds.{stat}")) < Some(n) {
        assert!(
            Instant::now() < deadline,
            "lds.{stat} never reached {n}:\n{}",
            envoy.log()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn reload_keeps_counters_applies_new_limits_and_refuses_bad_updates() {
    let dir = std::env::temp_dir().join(format!("wasm-ratelimit-lds-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let port = free_port();
    publish(&dir, &listeners(port, &config("r", 5, "hour")));
    let bootstrap = format!(
        "node: {{id: test, cluster: test}}\n\
         admin:\n  address:\n    socket_address: {{address: 127.0.0.1, port_value: 0}}\n\
         dynamic_resources:\n  lds_config:\n    resource_api_version: V3\n    path_config_source:\n      path: {}\n      watched_directory: {{path: {}}}\n",
        dir.join("lds.yaml").display(),
        dir.display()
    );
    let envoy = Envoy::start_yaml(&bootstrap);
    let mut c = Client::connect(envoy.addr).unwrap();
    for left in [4, 3, 2] {
        let r = c.get("/").unwrap();
        assert_eq!(
            (r.status, r.header_u64("x-ratelimit-remaining")),
            (200, Some(left))
        );
    }

    // A lower limit, same rule name and key: the 3 counted requests stay counted.
    publish(&dir, &listeners(port, &config("r", 4, "hour")));
    wait_lds(&envoy, "update_success", 2);
    let mut c = Client::connect(envoy.addr).unwrap();
    let r = c.get("/").unwrap();
    assert_eq!(r.header("ratelimit-policy"), Some("\"r\";q=4;w=3600"));
    assert_eq!(
        (r.status, r.header_u64("x-ratelimit-remaining")),
        (200, Some(0))
    );
    assert_eq!(c.get("/").unwrap().status, 429);

    // A bad update is refused; the old configuration keeps serving.
    publish(&dir, &listeners(port, &config("r", 4, "fortnight")));
    wait_lds(&envoy, "update_rejected", 1);
    assert!(envoy.log_shows(r#"rules[0].rate_limit.unit: unknown unit "fortnight""#));
    let mut c = Client::connect(envoy.addr).unwrap();
    let r = c.get("/").unwrap();
    assert_eq!(r.status, 429);
    assert_eq!(r.header("ratelimit-policy"), Some("\"r\";q=4;w=3600"));

    // A renamed rule is a new rule: its counters start afresh.
    publish(&dir, &listeners(port, &config("r2", 4, "hour")));
    wait_lds(&envoy, "update_success", 3);
    let mut c = Client::connect(envoy.addr).unwrap();
    let r = c.get("/").unwrap();
    assert_eq!(
        (r.status, r.header_u64("x-ratelimit-remaining")),
        (200, Some(3))
    );
    let _ = std::fs::remove_dir_all(&dir);
}
