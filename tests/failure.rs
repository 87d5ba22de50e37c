//! What Envoy does to traffic when the filter's VM dies, for each `failure_policy`: measured by
//! killing the VM on purpose (a test build panics on an `x-test-panic` header). One worker, so
//! every request meets the same VM.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod common;

use common::{bootstrap_with_policy, Client, Envoy};
use std::path::PathBuf;
use std::time::{Duration, Instant};

fn panic_wasm() -> Option<PathBuf> {
    std::env::var("PANIC_WASM").ok().map(PathBuf::from)
}

const CONFIG: &str = r#"{"rules": [{"name": "r", "key": ["remote_address"],
    "rate_limit": {"requests_per_unit": 3, "unit": "hour"}}]}"#;

/// Two requests, a panic, then what later requests get for `watch`: (status, has headers).
fn kill_and_watch(policy: Option<&str>, watch: Duration) -> (u16, Vec<(u16, bool)>, Envoy) {
    let wasm = panic_wasm().expect("PANIC_WASM (make integration builds it)");
    let envoy = Envoy::start_yaml_workers(&bootstrap_with_policy(CONFIG, &wasm, policy), 1);
    let mut c = Client::connect(envoy.addr).unwrap();
    assert_eq!(c.get("/").unwrap().status, 200);
    assert_eq!(c.get("/").unwrap().status, 200);
    let crashed = Client::connect(envoy.addr)
        .unwrap()
        .send("GET", "/", &[("x-test-panic", "1")])
        .unwrap()
        .status;
    let mut later = Vec::new();
    let start = Instant::now();
    while start.elapsed() < watch {
        let r = Client::connect(envoy.addr).unwrap().get("/").unwrap();
        later.push((r.status, r.header("ratelimit").is_some()));
        std::thread::sleep(Duration::from_millis(100));
    }
    (crashed, later, envoy)
}

#[test]
fn fail_closed_default_refuses_everything_after_a_crash() {
    let (crashed, later, envoy) = kill_and_watch(None, Duration::from_millis(1500));
    assert_eq!(crashed, 503);
    assert!(later.iter().all(|&(s, _)| s == 503), "{later:?}");
    assert!(
        envoy.log_shows("panic: panicked at"),
        "the panic hook logs at critical"
    );
}

#[test]
fn fail_open_lets_traffic_through_unfiltered_after_a_crash() {
    let (crashed, later, _envoy) = kill_and_watch(Some("FAIL_OPEN"), Duration::from_millis(1500));
    assert_eq!(crashed, 503, "the crashing request itself fails");
    // No limiting any more: more than the limit of 3 passes, without rate-limit headers.
    assert!(later.len() >= 5);
    assert!(later.iter().all(|&(s, h)| s == 200 && !h), "{later:?}");
}

#[test]
fn fail_reload_recovers_with_counters_intact() {
    let (crashed, later, envoy) = kill_and_watch(Some("FAIL_RELOAD"), Duration::from_millis(3000));
    assert_eq!(crashed, 503);
    // 503 while the VM is reloaded (a backoff of about a second), then limiting resumes.
    let first_ok = later
        .iter()
        .position(|&(s, _)| s != 503)
        .expect("never recovered");
    eprintln!("FAIL_RELOAD: {first_ok} requests 100 ms apart got 503 before the new VM served");
    assert!(first_ok > 0, "{later:?}");
    // Shared data survived the VM: 2 counted before, so 1 more passes, then 429.
    let after: Vec<u16> = later[first_ok..].iter().map(|&(s, _)| s).collect();
    assert_eq!(after[0], 200, "{later:?}");
    assert!(after[1..].iter().all(|&s| s == 429), "{later:?}");
    assert!(envoy.stat("wasm.test.vm_reload_success").unwrap_or(0) >= 1);
}
