//! Every algorithm in a real Envoy (`--concurrency 2`): bursts, steady rate, window edges,
//! token-bucket refill, and delay mode.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod common;

use common::{now_ms, Client, Envoy};
use std::time::{Duration, Instant};

fn rule(algorithm: &str, extra: &str, n: u32, unit: &str) -> String {
    format!(
        r#"{{"rules": [{{"name": "r", "algorithm": "{algorithm}", {extra}
            "rate_limit": {{"requests_per_unit": {n}, "unit": "{unit}"}}}}]}}"#
    )
}

/// Sleeps until `ms` past the start of a second (wall clock), so bursts do not straddle a
/// one-second window boundary unless a test wants them to.
fn sleep_until_ms_of_second(ms: u64) {
    let now = now_ms();
    let target = (now / 1000) * 1000 + ms;
    let target = if target <= now { target + 1000 } else { target };
    std::thread::sleep(Duration::from_millis(target - now));
}

fn admitted(c: &mut Client, n: usize) -> usize {
    (0..n)
        .filter(|_| match c.get("/").unwrap().status {
            200 => true,
            429 => false,
            s => panic!("status {s}"),
        })
        .count()
}

const ALGORITHMS: [(&str, &str); 5] = [
    ("sliding_window", ""),
    ("fixed_window", ""),
    ("token_bucket", ""),
    ("leaky_bucket", ""),
    ("sliding_log", ""),
];

#[test]
fn a_burst_admits_exactly_the_limit_for_every_algorithm() {
    for (algorithm, extra) in ALGORITHMS {
        let envoy = Envoy::start(&rule(algorithm, extra, 10, "minute"));
        let mut c = Client::connect(envoy.addr).unwrap();
        // Not across a minute's edge, where a fixed window would admit a second 10.
        let into_minute = now_ms() % 60_000;
        if into_minute > 57_000 {
            std::thread::sleep(Duration::from_millis(60_100 - into_minute));
        }
        assert_eq!(admitted(&mut c, 25), 10, "{algorithm}");
        let r = c.get("/").unwrap();
        assert_eq!(r.status, 429, "{algorithm}");
        assert!(r.header_u64("retry-after").unwrap() >= 1);
        assert_eq!(
            r.header("ratelimit-policy"),
            Some("\"r\";q=10;w=60"),
            "{algorithm}"
        );
    }
}

#[test]
fn a_steady_rate_is_held_to_the_limit_for_every_algorithm() {
    // 5 per second, offered at up to 20 per second for 3 s: about 15 admitted (the first
    // second's burst allowance, then the rate). Window algorithms may admit one window's worth
    // more depending on where the boundaries fall. Bounds follow the time measured, so a slow
    // machine widens them instead of failing them.
    for (algorithm, extra) in ALGORITHMS {
        let envoy = Envoy::start(&rule(algorithm, extra, 5, "second"));
        let mut c = Client::connect(envoy.addr).unwrap();
        sleep_until_ms_of_second(500);
        let start = Instant::now();
        let mut ok = 0;
        let mut sent = 0;
        while start.elapsed() < Duration::from_millis(3_000) {
            ok += usize::from(c.get("/").unwrap().status == 200);
            sent += 1;
            std::thread::sleep(Duration::from_millis(50));
        }
        let secs = start.elapsed().as_secs_f64();
        assert!(
            sent as f64 >= 10.0 * secs,
            "{algorithm}: only {sent} sent in {secs:.2} s, not twice the limit"
        );
        let most = 5 + (5.0 * secs).ceil() as usize + 5;
        assert!(
            (14..=most).contains(&ok),
            "{algorithm}: {ok} admitted of {sent} in {secs:.2} s (at most {most})"
        );
    }
}

#[test]
fn fixed_window_resets_at_the_edge_and_sliding_window_does_not() {
    // 5 per second, 5 requests just before a boundary and 5 just after. A slow machine may
    // spill a batch over the boundary it is meant to stay on one side of: then the run says
    // nothing and is tried again on a fresh Envoy (at most 5 times).
    let edge = |algorithm: &str| {
        for _ in 0..5 {
            let envoy = Envoy::start(&rule(algorithm, "", 5, "second"));
            let mut c = Client::connect(envoy.addr).unwrap();
            sleep_until_ms_of_second(850);
            let t0 = now_ms();
            let before = admitted(&mut c, 5);
            let t1 = now_ms();
            sleep_until_ms_of_second(30);
            let t2 = now_ms();
            let after = admitted(&mut c, 5);
            let t3 = now_ms();
            let second = t0 / 1000;
            if t1 / 1000 == second && t2 / 1000 == second + 1 && t3 % 1000 < 400 {
                return (before, after);
            }
            eprintln!(
                "{algorithm}: batches at {t0}..{t1} and {t2}..{t3}: off their seconds, again"
            );
        }
        panic!("{algorithm}: no run kept its batches on either side of a boundary");
    };
    assert_eq!(edge("fixed_window"), (5, 5), "the documented edge burst");
    // The sliding window still weighs the previous second at ~95 %: almost nothing passes.
    let (before, after) = edge("sliding_window");
    assert_eq!(before, 5);
    assert!(
        after <= 1,
        "sliding window admitted {after} right after the edge"
    );
}

#[test]
fn token_bucket_bursts_then_refills_at_the_rate() {
    let envoy = Envoy::start(&rule("token_bucket", r#""burst": 5,"#, 10, "second"));
    let mut c = Client::connect(envoy.addr).unwrap();
    // 10 tokens per second, one every 100 ms: what comes back is bounded by the time that
    // passed, measured here so that a slow machine widens the bound instead of failing it.
    let start = Instant::now();
    let burst = admitted(&mut c, 8);
    let burst_ms = start.elapsed().as_millis() as usize;
    assert!(
        burst >= 5 && burst <= 5 + burst_ms / 100,
        "the bucket holds 5; {burst} admitted in {burst_ms} ms"
    );
    std::thread::sleep(Duration::from_millis(350));
    let refilled = admitted(&mut c, 6);
    let total_ms = start.elapsed().as_millis() as usize;
    // At least 3 tokens came back in the 350 ms of quiet; never more than the clock allows.
    assert!(
        refilled >= 3 && burst - 5 + refilled <= total_ms / 100,
        "{refilled} admitted after 350 ms ({total_ms} ms since the burst began)"
    );
    let r = c.get("/").unwrap();
    assert_eq!(r.header("ratelimit-policy"), Some("\"r\";q=10;w=1"));
}

/// Sends `n` requests at once, each on its own connection opened beforehand; returns (status,
/// ms to answer from their common start), fastest first.
fn concurrent(envoy: &Envoy, n: usize) -> Vec<(u16, u64)> {
    let mut out = common::at_once(envoy.addr, n, |c| {
        let start = Instant::now();
        let r = c.get("/").unwrap();
        (r.status, start.elapsed().as_millis() as u64)
    });
    out.sort_by_key(|(_, ms)| *ms);
    out
}

#[test]
fn delay_mode_spaces_requests_at_the_drain_rate() {
    // 10 per second (one every 100 ms), room for 5, at most 450 ms of waiting.
    let envoy = Envoy::start(&rule(
        "leaky_bucket",
        r#""burst": 5, "on_limit": "delay", "max_delay_ms": 450,"#,
        10,
        "second",
    ));
    let results = concurrent(&envoy, 8);
    let ok: Vec<u64> = results
        .iter()
        .filter(|(s, _)| *s == 200)
        .map(|(_, ms)| *ms)
        .collect();
    let refused = results.iter().filter(|(s, _)| *s == 429).count();
    assert_eq!((ok.len(), refused), (5, 3), "{results:?}");
    // Released at the drain rate: the i-th at its turn, i × 100 ms, never earlier (20 ms for
    // the clocks' granularity), and not much later (a busy machine delays a release, which
    // does not push back the next turn; 250 ms is room for a loaded machine, while half the
    // rate would put the last at 800 ms).
    for (i, &at) in ok.iter().enumerate() {
        let turn = i as u64 * 100;
        assert!(
            at + 20 >= turn && at <= turn + 250,
            "request {i} at {at} ms, its turn {turn} ms: {results:?}"
        );
    }
    let delayed = common::metric(Some("r"), "delayed");
    assert_eq!(envoy.wait_stat(&delayed, 4), Some(4));
    assert_eq!(
        envoy.wait_stat(&common::metric(None, "delay_queue"), 0),
        Some(0)
    );
}

#[test]
fn a_client_that_leaves_while_held_is_counted_as_abandoned() {
    // One every 4 s, up to 10 s of waiting: the second request is held for about 4 s.
    let envoy = Envoy::start(&rule(
        "leaky_bucket",
        r#""burst": 10, "on_limit": "delay", "max_delay_ms": 10000,"#,
        15,
        "minute",
    ));
    let mut c = Client::connect(envoy.addr).unwrap();
    let first = Instant::now();
    assert_eq!(c.get("/").unwrap().status, 200);
    let queue = &common::metric(None, "delay_queue");
    {
        // Send a request and hang up while it is held.
        use std::io::Write;
        let mut raw = std::net::TcpStream::connect(envoy.addr).unwrap();
        raw.write_all(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n").unwrap();
        assert_eq!(envoy.wait_stat(queue, 1), Some(1), "the request is held");
    }
    // Dropped: Envoy ends the stream, the filter forgets it before its release time, 4 s after
    // the first request (the gauge is published once a second).
    assert_eq!(envoy.wait_stat(queue, 0), Some(0));
    assert!(
        first.elapsed() < Duration::from_millis(3900),
        "{:?}",
        first.elapsed()
    );
    // The filter still serves (its slot was used: the next one waits its turn, about 8 s).
    let r = c.get("/").unwrap();
    assert_eq!(r.status, 200);
    assert!(!envoy.log().contains("panic"));
    // Counted as what happened: two went on (the second after waiting), one was abandoned.
    let m = |name, n| envoy.wait_stat(&common::metric(Some("r"), name), n);
    assert_eq!(
        (m("abandoned", 1), m("allowed", 2), m("delayed", 1)),
        (Some(1), Some(2), Some(1))
    );
}
