//! Rule reload in a real Envoy that reads its listeners from a file (LDS from the filesystem),
//! the way Istio or a control plane pushes a changed WasmPlugin: counters survive, new limits
//! apply at once, a bad update is refused while the old configuration keeps serving.
#![allow(clippy::unwrap_used, clippy::panic, clippy::indexing_slicing)]

mod common;

use common::{free_port, wasm_path, Client, Envoy};
use std::path::Path;
use std::time::{Duration, Instant};

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

/// An Envoy whose listeners come from `dir/lds.yaml`.
fn lds_bootstrap(dir: &Path) -> String {
    format!(
        "node: {{id: test, cluster: test}}\n\
         admin:\n  address:\n    socket_address: {{address: 127.0.0.1, port_value: 0}}\n\
         dynamic_resources:\n  lds_config:\n    resource_api_version: V3\n    path_config_source:\n      path: {}\n      watched_directory: {{path: {}}}\n",
        dir.join("lds.yaml").display(),
        dir.display()
    )
}

fn lds_dir(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("wasm-ratelimit-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn reload_keeps_counters_applies_new_limits_and_refuses_bad_updates() {
    let dir = lds_dir("lds");
    let port = free_port();
    common::publish_lds(
        &dir,
        &common::lds_listener(port, &config("r", 5, "hour"), &wasm_path()),
    );
    let envoy = Envoy::start_yaml(&lds_bootstrap(&dir));
    let mut c = Client::connect(envoy.addr).unwrap();
    for left in [4, 3, 2] {
        let r = c.get("/").unwrap();
        assert_eq!(
            (r.status, r.header_u64("x-ratelimit-remaining")),
            (200, Some(left))
        );
    }

    // A lower limit, same rule name and key: the 3 counted requests stay counted.
    common::publish_lds(
        &dir,
        &common::lds_listener(port, &config("r", 4, "hour"), &wasm_path()),
    );
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
    common::publish_lds(
        &dir,
        &common::lds_listener(port, &config("r", 4, "fortnight"), &wasm_path()),
    );
    wait_lds(&envoy, "update_rejected", 1);
    assert!(envoy.log_shows(r#"rules[0].rate_limit.unit: unknown unit "fortnight""#));
    let mut c = Client::connect(envoy.addr).unwrap();
    let r = c.get("/").unwrap();
    assert_eq!(r.status, 429);
    assert_eq!(r.header("ratelimit-policy"), Some("\"r\";q=4;w=3600"));

    // A renamed rule is a new rule: its counters start afresh.
    common::publish_lds(
        &dir,
        &common::lds_listener(port, &config("r2", 4, "hour"), &wasm_path()),
    );
    wait_lds(&envoy, "update_success", 3);
    let mut c = Client::connect(envoy.addr).unwrap();
    let r = c.get("/").unwrap();
    assert_eq!(
        (r.status, r.header_u64("x-ratelimit-remaining")),
        (200, Some(3))
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// A connection opened before an update keeps the configuration it was opened with until Envoy
/// drains it; new connections get the new one at once. Envoy's default drain strategy
/// (`gradual`) tells an HTTP/1.1 client to close its connection (`Connection: close`) at one of
/// its responses, with a chance that grows over the drain time (none in the first second), and
/// closes what is still open when `--drain-time-s` ends. Two keep-alive clients send 10
/// requests a second each: one reconnects when told to close (as HTTP clients do), one ignores
/// it. The README states what this measures.
#[test]
fn an_open_connection_gets_the_new_limit_within_the_drain_time() {
    const DRAIN_S: u64 = 2;
    const OLD: Option<&str> = Some("\"d\";q=1000;w=3600");
    const NEW: Option<&str> = Some("\"d\";q=2;w=3600");
    let dir = lds_dir("drain");
    let port = free_port();
    common::publish_lds(
        &dir,
        &common::lds_listener(port, &config("d", 1000, "hour"), &wasm_path()),
    );
    let drain = DRAIN_S.to_string();
    let envoy = Envoy::start_yaml_args(&lds_bootstrap(&dir), &["--drain-time-s", &drain]);
    // (client, reconnects when told to close, requests under the old limit, switched after)
    let mut clients: Vec<(Client, bool, u32, Option<Duration>)> = [true, false]
        .into_iter()
        .map(|polite| (Client::connect(envoy.addr).unwrap(), polite, 0, None))
        .collect();
    for (c, ..) in &mut clients {
        assert_eq!(c.get("/").unwrap().header("ratelimit-policy"), OLD);
    }
    common::publish_lds(
        &dir,
        &common::lds_listener(port, &config("d", 2, "hour"), &wasm_path()),
    );
    wait_lds(&envoy, "update_success", 2);
    let updated = Instant::now();
    // A new connection: the new limit at once.
    let mut new = Client::connect(envoy.addr).unwrap();
    assert_eq!(new.get("/").unwrap().header("ratelimit-policy"), NEW);
    // The open connections: the old limit until Envoy has them closed.
    while clients.iter().any(|c| c.3.is_none()) {
        assert!(
            updated.elapsed() < Duration::from_secs(DRAIN_S + 10),
            "still the old limit after {:?}",
            updated.elapsed()
        );
        for (c, polite, under_old, switched) in clients.iter_mut().filter(|c| c.3.is_none()) {
            let r = c.get("/").unwrap_or_else(|_| {
                *c = Client::connect(envoy.addr).unwrap(); // closed by Envoy: again at once
                c.get("/").unwrap()
            });
            if r.header("ratelimit-policy") == NEW {
                *switched = Some(updated.elapsed());
                continue;
            }
            assert_eq!(r.header("ratelimit-policy"), OLD);
            *under_old += 1;
            if *polite && r.header("connection") == Some("close") {
                *c = Client::connect(envoy.addr).unwrap();
            }
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let (polite, deaf) = (&clients[0], &clients[1]);
    let (polite_at, deaf_at) = (polite.3.unwrap_or_default(), deaf.3.unwrap_or_default());
    eprintln!(
        "drain {DRAIN_S} s, 10 requests a second: the client that reconnects when told to close \
         got the new limit after {polite_at:?} ({} requests under the old one); the one that \
         ignores it after {deaf_at:?} ({})",
        polite.2, deaf.2
    );
    // No response asks to close in the drain's first second (`updated` is up to 50 ms late,
    // and the client's next request comes 100 ms after the one told to close).
    assert!(polite_at >= Duration::from_millis(950), "{polite_at:?}");
    // A connection still open is closed when the drain time ends, not before.
    let end = Duration::from_secs(DRAIN_S);
    assert!(deaf_at >= end - Duration::from_millis(100), "{deaf_at:?}");
    // Both at the latest at the end of the drain time (with a loaded machine's margin).
    for at in [polite_at, deaf_at] {
        assert!(at <= end + Duration::from_millis(500), "{at:?}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// The filter's configuration delivered by ECDS (extension config discovery), the way Istio
/// delivers a WasmPlugin: an update reaches open connections at their next request, no drain.
fn ecds_resource(plugin_config: &str) -> String {
    let plugin = common::Plugin {
        name: "test",
        root_id: "test",
        vm_id: Some("test"),
        failure_policy: None,
    };
    let entry = common::http_filter(&plugin, plugin_config, &common::wasm_path());
    let entry = ratelimit_config::manifest::yaml_documents(&entry)
        .unwrap()
        .remove(0);
    let typed_config = entry[0]["typed_config"].clone();
    serde_json::json!({"resources": [{
        "@type": "type.googleapis.com/envoy.config.core.v3.TypedExtensionConfig",
        "name": "ratelimit",
        "typed_config": typed_config,
    }]})
    .to_string()
}

fn publish_ecds(dir: &Path, content: &str) {
    let tmp = dir.join("ecds.tmp");
    std::fs::write(&tmp, content).unwrap();
    std::fs::rename(&tmp, dir.join("ecds.yaml")).unwrap();
}

#[test]
fn with_ecds_an_update_reaches_open_connections_at_once() {
    let dir = lds_dir("ecds");
    publish_ecds(&dir, &ecds_resource(&config("e", 1000, "hour")));
    let type_url = match common::build() {
        common::Build::Wasm => "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm",
        common::Build::Native => "type.googleapis.com/envoy.extensions.filters.http.dynamic_modules.v3.DynamicModuleFilter",
    };
    let full = common::bootstrap("{}", &common::wasm_path());
    let start = full.find("          http_filters:").unwrap();
    let end = full
        .find("          - name: envoy.filters.http.router")
        .unwrap();
    let yaml = format!(
        "node: {{id: test, cluster: test}}\n{}          http_filters:
          - name: ratelimit
            config_discovery:
              config_source:
                resource_api_version: V3
                path_config_source:
                  path: {}
                  watched_directory: {{path: {}}}
              type_urls: [\"{type_url}\"]
{}",
        &full[..start],
        dir.join("ecds.yaml").display(),
        dir.display(),
        &full[end..]
    );
    let envoy = Envoy::start_yaml(&yaml);
    let mut open = Client::connect(envoy.addr).unwrap();
    let r = open.get("/").unwrap();
    assert_eq!(r.header("ratelimit-policy"), Some("\"e\";q=1000;w=3600"));
    publish_ecds(&dir, &ecds_resource(&config("e", 2, "hour")));
    let updated = Instant::now();
    loop {
        let r = open.get("/").unwrap();
        if r.header("ratelimit-policy") == Some("\"e\";q=2;w=3600") {
            // Counters kept: 1 + this one counted, the next is refused.
            assert_eq!(r.header_u64("x-ratelimit-remaining"), Some(0));
            assert_eq!(open.get("/").unwrap().status, 429);
            break;
        }
        assert!(updated.elapsed() < Duration::from_secs(10), "never updated");
        std::thread::sleep(Duration::from_millis(20));
    }
    eprintln!(
        "ECDS: the open connection got the new limit {:?} after the update",
        updated.elapsed()
    );
    // A bad update is refused (and counted); the last good configuration keeps serving.
    publish_ecds(&dir, &ecds_resource(&config("e", 2, "fortnight")));
    let rejected = "extension_config_discovery.http_filter.ratelimit.config_fail";
    assert_eq!(envoy.wait_stat(rejected, 1), Some(1), "{}", envoy.log());
    let r = open.get("/").unwrap();
    assert_eq!(r.status, 429);
    assert_eq!(r.header("ratelimit-policy"), Some("\"e\";q=2;w=3600"));
    let _ = std::fs::remove_dir_all(&dir);
}
