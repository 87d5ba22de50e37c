//! Rule reload in a real Envoy that reads its listeners from a file (LDS from the filesystem),
//! the way Istio or a control plane pushes a changed WasmPlugin: counters survive, new limits
//! apply at once, a bad update is refused while the old configuration keeps serving.
#![allow(clippy::unwrap_used, clippy::panic, clippy::indexing_slicing)]

mod common;

use common::http::assert_remaining;
use common::{free_port, scratch, wasm_path, Client, Envoy};
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
    let name = format!("listener_manager.lds.{stat}");
    envoy.expect_stat(&name, Duration::from_secs(15), |v| v >= n);
}

#[test]
fn reload_keeps_counters_applies_new_limits_and_refuses_bad_updates() {
    let dir = scratch("lds");
    let port = free_port();
    common::publish_lds(
        &dir,
        &common::lds_listener(port, &config("r", 5, "hour"), &wasm_path()),
    );
    let envoy = Envoy::start_yaml(&common::lds_bootstrap(&dir));
    let mut c = Client::connect(envoy.addr).unwrap();
    assert_remaining(&mut c, &[4, 3, 2]);

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
    let dir = scratch("drain");
    let port = free_port();
    common::publish_lds(
        &dir,
        &common::lds_listener(port, &config("d", 1000, "hour"), &wasm_path()),
    );
    let drain = DRAIN_S.to_string();
    let envoy = Envoy::start_yaml_args(&common::lds_bootstrap(&dir), &["--drain-time-s", &drain]);
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

/// A bootstrap whose filter's configuration comes by ECDS from `dir/ecds.yaml`.
fn ecds_bootstrap(dir: &Path) -> String {
    let type_url = match common::build() {
        common::Build::Wasm => "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm",
        common::Build::Native => "type.googleapis.com/envoy.extensions.filters.http.dynamic_modules.v3.DynamicModuleFilter",
    };
    let full = common::bootstrap("{}", &common::wasm_path());
    let start = full.find("          http_filters:").unwrap();
    let end = full
        .find("          - name: envoy.filters.http.router")
        .unwrap();
    format!(
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
    )
}

#[test]
fn with_ecds_an_update_reaches_open_connections_at_once() {
    let dir = scratch("ecds");
    publish_ecds(&dir, &ecds_resource(&config("e", 1000, "hour")));
    let envoy = Envoy::start_yaml(&ecds_bootstrap(&dir));
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

/// Two equivalent configurations: the rule under test (`hot`, 50 an hour per `x-k`) the same,
/// an unrelated rule's limit alternating.
fn reload_config(generation: u32) -> String {
    format!(
        r#"{{"rules": [
  {{"name": "hot", "key": ["header:x-k"], "rate_limit": {{"requests_per_unit": 50, "unit": "hour"}}}},
  {{"name": "other", "key": ["header:x-other"],
    "rate_limit": {{"requests_per_unit": {}, "unit": "hour"}}}}]}}"#,
        1000 + 1000 * (generation % 2)
    )
}

/// The configuration republished by ECDS every second for ~20 s while 4 client threads send
/// as fast as Envoy answers. ECDS reaches open connections without a listener drain, so no
/// request may be lost: every one gets 200 or 429, none a 5xx or a reset (a client that met
/// one would reconnect and send the request again, and the test counts it). The rule under
/// test keeps its counters across every reload (same name, same key, same limit): each key
/// admits exactly its 50, however many reloads fall inside. Memory after 20 reloads stays
/// within 8 MiB of memory after 2 (each reload builds a new configuration; the old one must
/// go once its streams are done).
#[test]
fn configuration_reloads_every_second_under_full_load() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    const THREADS: usize = 4;
    const RELOADS: u32 = 20;
    const LIMIT: u64 = 50;
    const SLACK: u64 = 8 * 1024 * 1024;
    let dir = scratch("ecds-load");
    publish_ecds(&dir, &ecds_resource(&reload_config(0)));
    let envoy = Envoy::start_yaml(&ecds_bootstrap(&dir));
    let reloaded = "extension_config_discovery.http_filter.ratelimit.config_reload";
    let base = envoy.stat(reloaded).unwrap_or(0);
    let stop = Arc::new(AtomicBool::new(false));
    // Each thread: the key all threads share (`hot`) and its own, in turn; per key, the 200s;
    // the statuses other than 200 and 429; the requests sent again after a reset.
    let clients: Vec<_> = (0..THREADS)
        .map(|t| {
            let (addr, stop) = (envoy.addr, stop.clone());
            std::thread::spawn(move || {
                let own = format!("t{t}");
                let mut c = Client::connect(addr).unwrap();
                let (mut hot, mut mine, mut sent, mut resent) = (0u64, 0u64, 0u64, 0u64);
                let mut other = Vec::new();
                let mut hot_refused = false;
                while !stop.load(Ordering::SeqCst) {
                    for key in ["hot", own.as_str()] {
                        let headers = [("x-k", key), ("x-other", "o")];
                        let r = loop {
                            match c.send("GET", "/", &headers) {
                                Ok(r) => break r,
                                Err(_) => {
                                    resent += 1;
                                    c = Client::connect(addr).unwrap();
                                }
                            }
                        };
                        sent += 1;
                        match (r.status, key == "hot") {
                            (200, true) => {
                                assert!(!hot_refused, "hot admitted again after a 429");
                                hot += 1;
                            }
                            (200, false) => mine += 1,
                            (429, true) => hot_refused = true,
                            (429, false) => {}
                            (s, _) => other.push(s),
                        }
                        if r.header("connection") == Some("close") {
                            c = Client::connect(addr).unwrap();
                        }
                    }
                }
                (hot, mine, sent, resent, other)
            })
        })
        .collect();
    // Republish every second, alternating; memory once 2 and once RELOADS are applied.
    let (mut after_2, mut per_reload) = (0, Vec::new());
    let started = Instant::now();
    for generation in 1..=RELOADS {
        std::thread::sleep(Duration::from_secs(1));
        publish_ecds(&dir, &ecds_resource(&reload_config(generation)));
        let want = base + u64::from(generation);
        assert_eq!(
            envoy.wait_stat(reloaded, want),
            Some(want),
            "{}",
            envoy.log()
        );
        if generation == 2 {
            after_2 = envoy.memory_allocated();
        }
        per_reload.push(envoy.memory_allocated());
    }
    let after_all = envoy.memory_allocated();
    stop.store(true, Ordering::SeqCst);
    let results: Vec<_> = clients.into_iter().map(|t| t.join().unwrap()).collect();
    let elapsed = started.elapsed();
    let sent: u64 = results.iter().map(|r| r.2).sum();
    let resent: u64 = results.iter().map(|r| r.3).sum();
    let hot: u64 = results.iter().map(|r| r.0).sum();
    let failed: Vec<u16> = results.iter().flat_map(|r| r.4.clone()).collect();
    eprintln!(
        "{RELOADS} reloads in {elapsed:?} under {sent} requests ({:.0}/s) from {THREADS} \
         threads: {resent} resent after a reset, {} not 200/429; hot admitted {hot}, each own \
         key {:?}; memory after 2 reloads {:.1} MiB, after {RELOADS} {:.1} MiB ({:+.2} MiB); \
         per reload {:?} MiB",
        sent as f64 / elapsed.as_secs_f64(),
        failed.len(),
        results.iter().map(|r| r.1).collect::<Vec<_>>(),
        after_2 as f64 / 1048576.0,
        after_all as f64 / 1048576.0,
        (after_all as f64 - after_2 as f64) / 1048576.0,
        per_reload
            .iter()
            .map(|m| (*m as f64 / 104857.6).round() / 10.0)
            .collect::<Vec<_>>()
    );
    assert!(
        failed.is_empty(),
        "statuses other than 200 and 429: {failed:?}"
    );
    assert_eq!(resent, 0, "requests met a reset (ECDS drains nothing)");
    assert_eq!(envoy.stat("http.test.downstream_rq_5xx").unwrap_or(0), 0);
    // Counters kept: each key admitted exactly its limit across all the reloads.
    assert_eq!(hot, LIMIT, "the shared key");
    for r in &results {
        assert_eq!(r.1, LIMIT, "a thread's own key");
    }
    assert!(sent > u64::from(RELOADS) * 100, "too little load: {sent}");
    // No leak: 18 more reloads under the same load add at most the slack.
    assert!(
        after_all <= after_2 + SLACK,
        "{after_2} B after 2 reloads, {after_all} B after {RELOADS}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
