//! A shared capacity whose refused requests wait for their turn (`share.max_wait_ms`), in a real
//! Envoy (two workers) in the build under test, in front of the stand-in provider (100 requests
//! a second, the rule's default algorithm, the sliding window). Four equal tenants ask twice
//! their share, 50 a second each, and a light one 8 a second, for WAIT_SECONDS (20 by default);
//! every request is its own connection, so a waiting request holds nobody else up. Asserted,
//! from the provider's side, the clients' and Envoy's access log: the provider refuses nothing,
//! the capacity is used whole, the equal tenants share it equally, the light one is served, no
//! request was held past `max_wait_ms` (Envoy's own durations), and no request was refused
//! after waiting less than its whole wait (a refusal comes at once, when the wait it would be
//! told is longer, or when its wait is over). Clients that hang up while waiting leave the
//! line. The seconds measured start once Envoy is up and its first seconds are past.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod common;

use common::provider::Provider;
use common::waits::{self, Seen};
use common::{bootstrap_with, metric, AccessLog, Envoy, Listener};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The provider's limit, requests a second: shares of some 20 requests a window (a share is
/// enforced on whole requests, so one of 11 a window can only be 10 or 11 a second: at 50 a
/// second, each equal tenant was held to 11, 96 % of the capacity used in all).
const RATE: f64 = 100.0;
// The rule hands out 99 % of the capacity by share (`target`; 97 % by default, the rest kept as
// headroom for tenants below their share). The wasm build used as little as 82 % here until
// two workers deciding one tenant at once counted it twice in the held weight (which lowered
// every tenant's level; `share::recount`), and the measured seconds began before Envoy was up
// on a loaded machine; and 94.8 % in one clean-clone CI run (wasm), 96 % in a lockstep the
// virtual clock reproduces: the light tenant's requests refused for the capacity and served
// from the line moments later counted as refused demand too, lowering the level to 22.5 every
// other step, each equal tenant held to 22 a second (fixed: a request that may wait counts as
// refused demand only if its wait ends refused). 99 % since, both builds.
const USED: f64 = 0.97;
const MAX_WAIT_MS: u64 = 1000;
const WARMUP_S: u64 = 4;
/// What a request may be held past `max_wait_ms` by, in Envoy: a look at the line every 10 ms,
/// the host's timer, and a loaded two-core machine's scheduling.
const SLACK_MS: u64 = 150;
/// The path every request of this file asks for (the rules' `/p1/`).
const PATH: &str = "/p1/x";

/// The tests of this file one at a time: each measures a capacity's use, which another Envoy
/// under load beside it would disturb.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// One request on its own connection: (status, milliseconds until the answer); status 0 when
/// `hang_up_ms` passed first and the client closed the connection.
fn request(addr: SocketAddr, tenant: &str, hang_up_ms: Option<u64>) -> (u16, u64) {
    request_in(addr, tenant, "", hang_up_ms)
}

/// [`request`] with more header lines (`extra`, each ending in CRLF).
fn request_in(addr: SocketAddr, tenant: &str, extra: &str, hang_up_ms: Option<u64>) -> (u16, u64) {
    waits::request_at(addr, PATH, tenant, extra, hang_up_ms)
}

/// A tenant sending `rate` requests a second, paced, each on its own thread, until `run_s`.
fn drive(
    addr: SocketAddr,
    provider: &Arc<Provider>,
    tenant: &str,
    rate: f64,
    run_s: u64,
    hang_up_ms: Option<u64>,
) -> std::thread::JoinHandle<Vec<Seen>> {
    drive_in(addr, provider, tenant, "", rate, run_s, hang_up_ms)
}

/// [`drive`] with more header lines on each request.
fn drive_in(
    addr: SocketAddr,
    provider: &Arc<Provider>,
    tenant: &str,
    extra: &str,
    rate: f64,
    run_s: u64,
    hang_up_ms: Option<u64>,
) -> std::thread::JoinHandle<Vec<Seen>> {
    waits::drive_over(
        &[addr],
        PATH,
        provider,
        tenant,
        extra,
        rate,
        run_s,
        hang_up_ms,
    )
}

/// What Envoy's access log says of the requests that waited (held over 20 ms): how many, and
/// the 99th percentile and the longest of their waits past `max_wait_ms`, ms: a refused
/// request's duration, an admitted one's time until Envoy sent it upstream (not the provider's
/// answer).
struct Waits {
    n: usize,
    p99_past: i64,
    max_past: i64,
}

impl std::fmt::Display for Waits {
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        write!(
            f,
            "envoy: {} waited, p99 {} ms and at most {} ms past max_wait_ms",
            self.n, self.p99_past, self.max_past
        )
    }
}

fn envoy_waits(log: &std::path::Path) -> Waits {
    envoys_waits(&[log])
}

/// [`envoy_waits`] over the access logs of several Envoys.
fn envoys_waits(logs: &[&std::path::Path]) -> Waits {
    // The log is flushed every 50 ms: wait until the last lines are in.
    std::thread::sleep(Duration::from_millis(500));
    let text: String = logs
        .iter()
        .map(|log| std::fs::read_to_string(log).unwrap_or_default())
        .collect();
    let mut ms: Vec<i64> = text
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter_map(|v| match v["code"].as_i64() {
            Some(429) => v["ms"].as_i64(),
            _ => v["held"].as_i64(),
        })
        .filter(|&ms| ms > 20)
        .map(|ms| ms - MAX_WAIT_MS as i64)
        .collect();
    ms.sort_unstable();
    let at = |q: f64| {
        let i = ((ms.len() as f64 - 1.0) * q).round() as usize;
        ms.get(i).copied().unwrap_or(i64::MIN)
    };
    Waits {
        n: ms.len(),
        p99_past: at(0.99),
        max_past: at(1.0),
    }
}

/// The answers to the requests sent within the whole seconds `warm..end`, those admitted after
/// waiting (held over 20 ms), and the refusals that came neither at once nor once the whole
/// wait was over (their ms).
struct Answers<'a> {
    measured: Vec<&'a Seen>,
    waited: usize,
    between: Vec<u64>,
}

fn answers(all: &[Seen], warm: u64, end: u64) -> Answers<'_> {
    let measured: Vec<&Seen> = all
        .iter()
        .filter(|s| s.at_s >= warm as f64 && s.at_s < end as f64)
        .collect();
    let waited = measured
        .iter()
        .filter(|s| s.status == 200 && s.ms > 20)
        .count();
    let between = measured
        .iter()
        .filter(|s| s.status == 429 && s.ms >= 100 && s.ms < MAX_WAIT_MS - 20)
        .map(|s| s.ms)
        .collect();
    Answers {
        measured,
        waited,
        between,
    }
}

fn jain(xs: &[f64]) -> f64 {
    let sum: f64 = xs.iter().sum();
    let squares: f64 = xs.iter().map(|x| x * x).sum();
    sum * sum / (xs.len() as f64 * squares)
}

#[test]
fn refused_requests_wait_their_turn_and_no_longer_than_max_wait() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let run_s = common::env_number("WAIT_SECONDS", 20);
    let provider = Arc::new(Provider::start(RATE));
    let config = format!(
        r#"{{"rules": [{{"name": "p1", "match": {{"path_prefix": "/p1/"}}, "key": ["header:x-tenant"],
            "rate_limit": {{"requests_per_unit": {RATE}, "unit": "second"}},
            "share": {{"max_wait_ms": {MAX_WAIT_MS}, "max_queued": 256, "max_queued_per_tenant": 64,
                       "target": 0.99}}}}]}}"#
    );
    // Envoy's own durations: what the filter adds to a wait, without the clients' scheduling.
    let log = common::scratch("share_wait").join("access.log");
    let listener = Listener {
        upstream: Some(provider.addr),
        access_log: Some(AccessLog {
            path: &log,
            json: &[
                ("code", "%RESPONSE_CODE%"),
                ("ms", "%DURATION%"),
                ("held", "%COMMON_DURATION(DS_RX_BEG:US_TX_BEG:ms)%"),
            ],
        }),
        ..Listener::default()
    };
    let envoy = Envoy::start_yaml_args(
        &bootstrap_with(&config, &listener),
        &["--file-flush-interval-msec", "50"],
    );
    let addr = envoy.addr;
    let cpu_start = envoy.cpu_ms();
    // The seconds are the provider's, which started before Envoy (a second or more on a loaded
    // machine): the run's start is the first whole second once Envoy is up.
    let start_s = provider.elapsed_s().ceil() as u64;
    std::thread::sleep(Duration::from_secs_f64(
        (start_s as f64 - provider.elapsed_s()).max(0.0),
    ));

    let heavy: Vec<_> = (0..4)
        .map(|i| {
            drive(
                addr,
                &provider,
                &format!("equal{i}"),
                0.5 * RATE,
                run_s,
                None,
            )
        })
        .collect();
    let light = drive(addr, &provider, "light", 0.08 * RATE, run_s, None);
    // Near the end (after the measured seconds), a tenant whose clients give up after 30 ms.
    std::thread::sleep(Duration::from_secs(run_s - 2));
    let leaver = drive(addr, &provider, "leaver", 0.4 * RATE, 1, Some(30));
    let heavy: Vec<Vec<Seen>> = heavy.into_iter().map(|h| h.join().unwrap()).collect();
    let light = light.join().unwrap();
    let leaver = leaver.join().unwrap();
    let cpu_run = envoy.cpu_ms() - cpu_start;
    let waits = envoy_waits(&log);
    // Whole seconds every tenant was sending in, after the warm-up and before the leaver came.
    let end = start_s + run_s - 2;
    let warm = start_s + WARMUP_S;
    let measured_s = (end - warm) as f64;

    // The provider refused nothing, and its capacity was used whole.
    assert_eq!(provider.refused(), 0, "provider 429s");
    let tally = provider.tally("p1", warm, end);
    let rate = |t: &str| tally.get(t).map_or(0.0, |(a, _)| *a as f64 / measured_s);
    let used: f64 = tally.values().map(|(a, _)| *a as f64).sum::<f64>() / measured_s;
    eprintln!("capacity used {:.3} ({used:.2}/s)", used / RATE);
    eprintln!("envoy cpu {cpu_run} ms over {run_s} s");
    eprintln!("{waits}");
    let per_s: Vec<u64> = (start_s..start_s + run_s)
        .map(|s| {
            provider
                .tally("p1", s, s + 1)
                .values()
                .map(|(a, _)| a)
                .sum()
        })
        .collect();
    eprintln!("admitted by the provider, by second: {per_s:?}");

    // The equal tenants share it equally; the light one gets what it asks.
    let equal: Vec<f64> = (0..4).map(|i| rate(&format!("equal{i}"))).collect();
    eprintln!("equal tenants {equal:.2?}/s, light {:.2}/s", rate("light"));
    let light_ok = light.iter().filter(|s| s.status == 200).count();
    eprintln!("light served {light_ok} of {}", light.len());
    for (s, i) in tally.iter() {
        eprintln!("{s}: {i:?}");
    }
    assert!(
        light_ok as f64 >= 0.99 * light.len() as f64,
        "light served {light_ok} of {}",
        light.len()
    );

    // Waits: no admitted request waited past max_wait_ms; a refusal came at once or once the
    // whole wait was over, never in between.
    let all: Vec<Seen> = heavy.iter().flatten().chain(&light).copied().collect();
    let Answers {
        measured,
        waited,
        between,
    } = answers(&all, warm, end);
    let longest_ok = measured
        .iter()
        .filter(|s| s.status == 200)
        .map(|s| s.ms)
        .max()
        .unwrap_or(0);
    let at_once = measured
        .iter()
        .filter(|s| s.status == 429 && s.ms < 100)
        .count();
    let timed_out = measured
        .iter()
        .filter(|s| s.status == 429 && s.ms >= MAX_WAIT_MS - 20)
        .count();
    let other: Vec<&&Seen> = measured
        .iter()
        .filter(|s| s.status != 200 && s.status != 429)
        .collect();
    eprintln!(
        "{} requests: {waited} admitted after waiting (longest {longest_ok} ms), {at_once} refused at once, {timed_out} at the end of their wait",
        measured.len()
    );
    assert!(other.is_empty(), "other answers: {other:?}");
    assert!(jain(&equal) >= 0.99, "Jain {:.4}: {equal:?}", jain(&equal));
    assert!(waited > 100, "requests admitted after waiting: {waited}");
    // Held no longer than max_wait_ms, by Envoy's own clock (the clients' includes the
    // provider's answer and their own scheduling).
    assert!(waits.max_past <= SLACK_MS as i64, "{waits}");
    assert!(
        between.is_empty(),
        "refused after waiting less than the whole wait: {between:?}"
    );

    // Operators see it.
    let stat = |name: &str| envoy.stat(&metric(Some("p1"), name)).unwrap_or(0);
    let queued = stat("share_queued");
    eprintln!(
        "share_queued {queued}, share_queue_timeouts {}, share_queue_full {}, share_waited_ms {}, abandoned {}",
        stat("share_queue_timeouts"),
        stat("share_queue_full"),
        stat("share_waited_ms"),
        stat("abandoned")
    );
    assert!(queued as usize >= waited, "share_queued {queued}");
    assert!(stat("share_waited_ms") > 0);
    // The clients that hung up while waiting left the line.
    let hung_up = leaver.iter().filter(|s| s.status == 0).count();
    eprintln!("leaver: {hung_up} of {} hung up", leaver.len());
    assert!(hung_up > 0, "no leaver waited long enough to hang up");
    let abandoned = envoy.wait_stat_until(&metric(Some("p1"), "abandoned"), |n| n > 0);
    assert!(abandoned.is_some_and(|n| n > 0), "abandoned {abandoned:?}");
    assert!(used >= USED * RATE, "used {used:.2}/s of {RATE}");
    // The rule's gauges: its capacity in force, and its one band's active weight (the four
    // equal tenants, the light one and the leaver, all asked within the active interval).
    let band_gauge = |name: &str| {
        let full = match common::build() {
            common::Build::Wasm => metric(Some("p1"), &format!("band=.=default;.;{name}")),
            common::Build::Native => format!("{}.band.default", metric(Some("p1"), name)),
        };
        envoy.wait_stat_until(&full, |n| n > 0)
    };
    let capacity = envoy.wait_stat_until(&metric(Some("p1"), "share_capacity"), |n| n > 0);
    assert_eq!(capacity, Some(RATE as u64), "share_capacity");
    // Six tenants of weight 1, each counted once in both builds (two workers deciding one
    // tenant at once included).
    let active = band_gauge("share_active_weight");
    assert_eq!(active, Some(6), "share_active_weight");
    let level = band_gauge("share_level_permille");
    assert!(
        level.is_some_and(|l| l <= 1000),
        "share_level_permille {level:?}"
    );
    // The waits by band (the rule's one band has them all): as many as the rule's. The two are
    // published apart, and the last waits end after the clients stop: read both until they
    // agree (at most 10 s).
    let agreed = |rule: &str, band: &str| {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let (of_rule, of_band) = (stat(rule), band_gauge(band));
            if of_band == Some(of_rule) || Instant::now() > deadline {
                return (of_band, Some(of_rule));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    };
    let (band_queued, queued) = agreed("share_queued", "share_band_queued");
    assert_eq!(band_queued, queued, "share_band_queued");
    let (band_waited, waited) = agreed("share_waited_ms", "share_band_waited_ms");
    assert_eq!(band_waited, waited, "share_band_waited_ms");
    // Still serving.
    let (status, _) = request(addr, "after", None);
    assert!(status == 200 || status == 429, "{status}");
}

/// The example's combination (examples/shared-provider: a sliding window, bands, waits), from
/// the first request: three interactive tenants asking 30 % of the capacity in all beside three
/// batch ones asking it all each, batch first. Interactive is refused or held only while the
/// capacity batch used before interactive first asked slides out of the window (the first
/// window and a tenth of the next, the docs say); after that never, and batch uses the rest.
#[test]
fn interactive_is_served_first_from_the_first_request() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let provider = Arc::new(Provider::start(RATE));
    let config = format!(
        r#"{{"rules": [{{"name": "p1", "match": {{"path_prefix": "/p1/"}}, "key": ["header:x-tenant"],
            "rate_limit": {{"requests_per_unit": {RATE}, "unit": "second"}},
            "share": {{"bands": [{{"name": "interactive", "min_share": 0.2}},
                                 {{"name": "batch", "min_share": 0.05}}],
                       "band": {{"from": "header:x-band", "default": "batch"}},
                       "max_wait_ms": 2000}}}}]}}"#
    );
    let listener = Listener::to(provider.addr);
    let envoy = Envoy::start_yaml(&bootstrap_with(&config, &listener));
    let run_s = 10;
    let batch: Vec<_> = (0..3)
        .map(|i| {
            let name = format!("batch{i}");
            drive_in(
                envoy.addr,
                &provider,
                &name,
                "x-band: batch\r\n",
                RATE,
                run_s,
                None,
            )
        })
        .collect();
    // Batch fills the first window before interactive asks.
    std::thread::sleep(Duration::from_millis(300));
    let interactive: Vec<_> = (0..3)
        .map(|i| {
            let name = format!("interactive{i}");
            let band = "x-band: interactive\r\n";
            drive_in(
                envoy.addr,
                &provider,
                &name,
                band,
                0.1 * RATE,
                run_s - 1,
                None,
            )
        })
        .collect();
    let interactive: Vec<Vec<Seen>> = interactive.into_iter().map(|t| t.join().unwrap()).collect();
    let batch: Vec<Vec<Seen>> = batch.into_iter().map(|t| t.join().unwrap()).collect();
    assert_eq!(provider.refused(), 0, "provider 429s");
    let first = interactive
        .iter()
        .flatten()
        .map(|s| s.at_s)
        .fold(f64::MAX, f64::min);
    // The first window, the next one's tenth, and a look at the line (10 ms) for the waits.
    let settled = first + 1.2;
    let late: Vec<&Seen> = interactive
        .iter()
        .flatten()
        .filter(|s| s.at_s >= settled && (s.status != 200 || s.ms > 100))
        .collect();
    let early = interactive
        .iter()
        .flatten()
        .filter(|s| s.at_s < settled && (s.status != 200 || s.ms > 100))
        .count();
    let sent: usize = interactive.iter().map(Vec::len).sum();
    let batch_ok = batch.iter().flatten().filter(|s| s.status == 200).count();
    eprintln!(
        "interactive: {sent} sent, {early} refused or held over 100 ms in the first 1.2 s, {} after; batch admitted {batch_ok}",
        late.len()
    );
    let queued = |band: &str| {
        let name = match common::build() {
            common::Build::Wasm => {
                metric(Some("p1"), &format!("band=.={band};.;share_band_queued"))
            }
            common::Build::Native => {
                format!("{}.band.{band}", metric(Some("p1"), "share_band_queued"))
            }
        };
        envoy.wait_stat_until(&name, |_| true).unwrap_or(0)
    };
    let (queued_interactive, queued_batch) = (queued("interactive"), queued("batch"));
    eprintln!("queued: interactive {queued_interactive}, batch {queued_batch}");
    assert!(
        late.is_empty(),
        "interactive refused or held after the first window: {late:?}"
    );
    // Interactive waits only for what batch had taken before it asked: fewer times than it
    // sent requests in those first 1.2 s (4 to 8 here; 73 to 75, and 18 requests refused or
    // held later, before higher bands' refused demand and use were kept from batch).
    let sent_early = interactive
        .iter()
        .flatten()
        .filter(|s| s.at_s < settled)
        .count();
    assert!(
        queued_interactive <= sent_early as u64,
        "interactive queued {queued_interactive} times ({sent_early} sent in the first 1.2 s)"
    );
    assert!(batch_ok > 0, "batch starved");
}

/// A shared capacity leased for two Envoys from the rate limit service (limitador over Redis,
/// one call at a time), whose refused requests wait their turn: each tenant's requests go to
/// the two Envoys in turn; four equal tenants at half the capacity each and a light one at 8 %,
/// for WAIT_SECONDS. Requests wait (their claims' grants back in the lease, their turns taking
/// from it), none past `max_wait_ms` by Envoy's clock, none refused between at once and the
/// end of its wait; the provider refuses nothing; the light tenant is served; the equal ones
/// alike.
#[test]
fn a_leased_capacity_lets_requests_wait_on_every_envoy() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let run_s = common::env_number("WAIT_SECONDS", 20);
    let (redis_port, rls_port) = (common::free_port(), common::free_port());
    let _redis = common::redis(redis_port);
    let limits = format!(
        r#"[{{"namespace": "provider", "name": "p1", "max_value": {RATE}, "seconds": 1,
             "conditions": ["descriptors[0].rule == 'p1'"], "variables": []}}]"#
    );
    let _rls = common::rls_server(rls_port, redis_port, &limits, 0, true);
    let provider = Arc::new(Provider::start(RATE));
    let config = format!(
        r#"{{"rules": [{{"name": "p1", "match": {{"path_prefix": "/p1/"}}, "key": ["header:x-tenant"],
            "rate_limit": {{"requests_per_unit": {RATE}, "unit": "second"}},
            "global": {{"cluster": "ratelimit", "domain": "provider", "mode": "lease",
                       "timeout_ms": 200, "flush_ms": 20, "max_block": 5}},
            "share": {{"max_wait_ms": {MAX_WAIT_MS}, "max_queued": 256, "max_queued_per_tenant": 64}}}}]}}"#
    );
    let logs: Vec<std::path::PathBuf> = (0..2)
        .map(|i| common::scratch("share_wait_leased").join(format!("access-{i}.log")))
        .collect();
    let envoys: Vec<Envoy> = logs
        .iter()
        .map(|log| {
            let listener = Listener {
                upstream: Some(provider.addr),
                access_log: Some(AccessLog {
                    path: log,
                    json: &[
                        ("code", "%RESPONSE_CODE%"),
                        ("ms", "%DURATION%"),
                        ("held", "%COMMON_DURATION(DS_RX_BEG:US_TX_BEG:ms)%"),
                    ],
                }),
                ..Listener::default()
            };
            let yaml = format!(
                "{}{}",
                bootstrap_with(&config, &listener),
                common::rls_cluster(rls_port, "1s")
            );
            Envoy::start_yaml_args(&yaml, &["--file-flush-interval-msec", "50"])
        })
        .collect();
    let addrs: Vec<SocketAddr> = envoys.iter().map(|e| e.addr).collect();
    let start_s = provider.elapsed_s().ceil() as u64;
    std::thread::sleep(Duration::from_secs_f64(
        (start_s as f64 - provider.elapsed_s()).max(0.0),
    ));
    let heavy: Vec<_> = (0..4)
        .map(|i| {
            let name = format!("equal{i}");
            waits::drive_over(&addrs, PATH, &provider, &name, "", 0.5 * RATE, run_s, None)
        })
        .collect();
    let light = waits::drive_over(
        &addrs,
        PATH,
        &provider,
        "light",
        "",
        0.08 * RATE,
        run_s,
        None,
    );
    let heavy: Vec<Vec<Seen>> = heavy.into_iter().map(|h| h.join().unwrap()).collect();
    let light = light.join().unwrap();
    let log_paths: Vec<&std::path::Path> = logs.iter().map(|l| l.as_path()).collect();
    let waits = envoys_waits(&log_paths);
    let (warm, end) = (start_s + WARMUP_S, start_s + run_s);
    let measured_s = (end - warm) as f64;

    assert_eq!(provider.refused(), 0, "provider 429s");
    let tally = provider.tally("p1", warm, end);
    let rate = |t: &str| tally.get(t).map_or(0.0, |(a, _)| *a as f64 / measured_s);
    let used: f64 = tally.values().map(|(a, _)| *a as f64).sum::<f64>() / measured_s;
    let equal: Vec<f64> = (0..4).map(|i| rate(&format!("equal{i}"))).collect();
    let all: Vec<Seen> = heavy.iter().flatten().chain(&light).copied().collect();
    let Answers {
        measured,
        waited,
        between,
    } = answers(&all, warm, end);
    let other = measured
        .iter()
        .filter(|s| s.status != 200 && s.status != 429)
        .count();
    let light_ok = light.iter().filter(|s| s.status == 200).count();
    let light_refused: Vec<(f64, u64)> = light
        .iter()
        .filter(|s| s.status != 200)
        .map(|s| (s.at_s - start_s as f64, s.ms))
        .collect();
    eprintln!("light refused (s into the run, ms): {light_refused:.2?}");
    let stat = |name: &str| -> u64 {
        envoys
            .iter()
            .map(|e| e.stat(&metric(Some("p1"), name)).unwrap_or(0))
            .sum()
    };
    eprintln!(
        "leased, two Envoys: capacity used {:.3} ({used:.2}/s); equal {equal:.2?}/s, light \
         served {light_ok} of {}; {} requests, {waited} admitted after waiting; {waits}; \
         share_queued {}, share_queue_timeouts {}, lease_claims {}, lease_refused {}",
        used / RATE,
        light.len(),
        measured.len(),
        stat("share_queued"),
        stat("share_queue_timeouts"),
        stat("lease_claims"),
        stat("lease_refused"),
    );
    assert_eq!(other, 0, "answers other than 200 and 429");
    assert!(waited > 100, "requests admitted after waiting: {waited}");
    assert!(waits.max_past <= SLACK_MS as i64, "{waits}");
    assert!(
        between.is_empty(),
        "refused after waiting less than the whole wait: {between:?}"
    );
    assert!(
        light_ok as f64 >= LEASED_LIGHT * light.len() as f64,
        "light served {light_ok} of {}",
        light.len()
    );
    assert!(jain(&equal) >= 0.99, "Jain {:.4}: {equal:?}", jain(&equal));
    assert!(used >= LEASED_USED * RATE, "used {used:.2}/s of {RATE}");
}

/// The part of its requests the light tenant gets on the leased Envoys, at least: 160 of 160 in
/// twenty runs (ten per build beside two CPU hogs; before a request the service's refusal reached
/// could wait for the next window, and a turn refused by the lease found the rule's share
/// check: 152 to 156 of 160).
const LEASED_LIGHT: f64 = 0.99;
/// The part of the capacity two leasing Envoys use, at least: 72.4 % to 82.6 % in the same
/// twenty runs (the Envoys' parts of the capacity follow the fleet's pace of grants; share_fleet.rs'
/// three, with no waits, 84.6 % to 94.0 %; on the virtual clock, 80.0 % with waits and 82.6 %
/// without).
const LEASED_USED: f64 = 0.65;
