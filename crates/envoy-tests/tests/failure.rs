//! What happens to traffic when the filter panics, in each build, measured with a test build
//! that panics on an `x-test-panic` header. One worker, so every request meets the same VM.
//!
//! - wasm: the panic kills the VM; Envoy's `failure_policy` decides what later requests get;
//! - native: the hook catches the panic; the filter's `failure_mode` decides what that request
//!   gets, later requests are limited as before, and the panic is counted.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod common;

use common::{bootstrap_with_policy, build, Build, Client, Envoy};
use std::path::PathBuf;
use std::time::{Duration, Instant};

fn panic_build(var: &str) -> PathBuf {
    std::env::var(var)
        .map(PathBuf::from)
        .unwrap_or_else(|_| panic!("{var} (make integration builds it)"))
}

fn config(failure_mode: &str) -> String {
    format!(
        r#"{{"failure_mode": "{failure_mode}", "rules": [{{"name": "r", "key": ["remote_address"],
            "rate_limit": {{"requests_per_unit": 3, "unit": "hour"}}}}]}}"#
    )
}

/// Envoy with the panicking build, one worker.
fn start(failure_mode: &str, policy: Option<&str>) -> Envoy {
    let yaml = bootstrap_with_policy(&config(failure_mode), &panic_build("PANIC_WASM"), policy);
    match build() {
        Build::Wasm => Envoy::start_yaml_workers(&yaml, 1),
        Build::Native => Envoy::start_with_modules(&yaml, 1, &panic_build("PANIC_NATIVE_DIR")),
    }
}

/// Two requests, a panic, then what later requests get for `watch`: (status, has fields).
fn panic_and_watch(envoy: &Envoy, watch: Duration) -> (u16, Vec<(u16, bool)>) {
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
    (crashed, later)
}

fn wasm_only() -> bool {
    if build() != Build::Wasm {
        eprintln!("wasm only: the native build catches panics (see the native tests)");
    }
    build() == Build::Wasm
}

fn native_only() -> bool {
    if build() != Build::Native {
        eprintln!("native only: a panic kills the wasm VM (see the wasm tests)");
    }
    build() == Build::Native
}

#[test]
fn wasm_fail_closed_default_refuses_everything_after_a_crash() {
    if !wasm_only() {
        return;
    }
    let envoy = start("allow", None);
    let (crashed, later) = panic_and_watch(&envoy, Duration::from_millis(1500));
    assert_eq!(crashed, 503);
    assert!(later.iter().all(|&(s, _)| s == 503), "{later:?}");
    assert!(
        envoy.log_shows("panic: panicked at"),
        "the panic hook logs at critical"
    );
}

#[test]
fn wasm_fail_open_lets_traffic_through_unfiltered_after_a_crash() {
    if !wasm_only() {
        return;
    }
    let envoy = start("allow", Some("FAIL_OPEN"));
    let (crashed, later) = panic_and_watch(&envoy, Duration::from_millis(1500));
    assert_eq!(crashed, 503, "the crashing request itself fails");
    // No limiting any more: more than the limit of 3 passes, without rate-limit headers.
    assert!(later.len() >= 5);
    assert!(later.iter().all(|&(s, h)| s == 200 && !h), "{later:?}");
}

#[test]
fn wasm_fail_reload_recovers_with_counters_intact() {
    if !wasm_only() {
        return;
    }
    let envoy = start("allow", Some("FAIL_RELOAD"));
    let (crashed, later) = panic_and_watch(&envoy, Duration::from_millis(3000));
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

/// The native build: the panicking request gets what `failure_mode` says, nothing else changes.
fn native_panic(failure_mode: &str) -> (u16, Vec<(u16, bool)>, Envoy) {
    let envoy = start(failure_mode, None);
    let (crashed, later) = panic_and_watch(&envoy, Duration::from_millis(600));
    // Envoy is alive and limits exactly as before: 2 counted, 1 more, then 429.
    let statuses: Vec<u16> = later.iter().map(|&(s, _)| s).collect();
    assert_eq!(statuses[0], 200, "{later:?}");
    assert!(statuses[1..].iter().all(|&s| s == 429), "{later:?}");
    assert!(later.iter().all(|&(_, fields)| fields), "{later:?}");
    assert_eq!(
        envoy.wait_stat(&common::metric(None, "panics"), 1),
        Some(1),
        "the panic is counted"
    );
    assert!(envoy.log_shows("panic (caught): panicked at"));
    (crashed, later, envoy)
}

#[test]
fn native_panic_with_failure_mode_allow_lets_that_request_through() {
    if !native_only() {
        return;
    }
    let (crashed, _, envoy) = native_panic("allow");
    assert_eq!(crashed, 200);
    // The stream whose hook panicked is poisoned: its response gets no rate-limit fields (the
    // limit is reached by now: a stream that went on deciding would have been refused).
    let r = Client::connect(envoy.addr)
        .unwrap()
        .send("GET", "/", &[("x-test-panic", "1")])
        .unwrap();
    assert_eq!(r.status, 200);
    assert_eq!(r.header("ratelimit"), None);
    assert_eq!(r.header("x-ratelimit-limit"), None);
}

#[test]
fn native_panic_with_failure_mode_deny_refuses_that_request() {
    if !native_only() {
        return;
    }
    let (_, _, envoy) = native_panic("deny");
    let r = Client::connect(envoy.addr)
        .unwrap()
        .send("GET", "/", &[("x-test-panic", "1")])
        .unwrap();
    assert_eq!(r.status, 429);
    assert_eq!(r.header("content-type"), Some("application/problem+json"));
    assert!(
        r.body_str().contains("could not decide"),
        "{}",
        r.body_str()
    );
}

/// A slot of an in-flight rule whose give-back is lost (the filter panics as the stream ends:
/// in the wasm build the VM dies with it; the native build catches the panic) is freed by its
/// lease: between one and two leases after it was taken, never before.
#[test]
fn a_lost_in_flight_slot_is_freed_by_its_lease() {
    let config = r#"{"rules": [{"name": "flight", "in_flight": {"max": 1, "lease_s": 3}}]}"#;
    let yaml = bootstrap_with_policy(config, &panic_build("PANIC_WASM"), Some("FAIL_RELOAD"));
    let envoy = match build() {
        Build::Wasm => Envoy::start_yaml_workers(&yaml, 1),
        Build::Native => Envoy::start_with_modules(&yaml, 1, &panic_build("PANIC_NATIVE_DIR")),
    };
    let taken = Instant::now();
    let taken_ms = common::now_ms();
    let r = Client::connect(envoy.addr)
        .unwrap()
        .send("GET", "/", &[("x-test-panic", "end")])
        .unwrap();
    assert_eq!(r.status, 200, "answered before the stream ends");
    // Leases count in 3 s generations aligned to the epoch: the slot is free when the second
    // generation after the one it was taken in begins, 3 to 6 s after it was taken.
    let answered_ms = common::now_ms();
    let free_by = (answered_ms / 3000 + 2) * 3000 - taken_ms;
    // The slot stays taken (the wasm build answers 503 until its new VM serves).
    let mut seen = Vec::new();
    let freed = loop {
        let status = Client::connect(envoy.addr)
            .unwrap()
            .get("/")
            .unwrap()
            .status;
        if status == 200 {
            break taken.elapsed();
        }
        seen.push(status);
        assert!(taken.elapsed() < Duration::from_secs(10), "{seen:?}");
        std::thread::sleep(Duration::from_millis(100));
    };
    eprintln!("lease 3 s: the lost slot was freed after {freed:?} ({seen:?})");
    assert!(seen.contains(&429), "the slot was held: {seen:?}");
    // Never before the lease; after the generation ends, only as late as the polling (and, in
    // the wasm build, the new VM) makes it: 1.5 s of room on a loaded machine.
    assert!(
        freed >= Duration::from_secs(3) && freed < Duration::from_millis(free_by + 1_500),
        "freed after {freed:?}, free from {free_by} ms"
    );
    if build() == Build::Native {
        assert_eq!(envoy.wait_stat(&common::metric(None, "panics"), 1), Some(1));
    }
}
