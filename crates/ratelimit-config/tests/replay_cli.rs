//! `ratelimit-config replay` as its users run it: exit codes, configurations refused exactly as
//! `check` refuses them, the JSON report, the HTML page, what-ifs, bad lines, and memory that
//! stays flat however long the log.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod run;

use ratelimit_core::testkit as common;
use run::{cli, root};

use serde_json::Value;
use std::io::Write;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Instant;

const EXAMPLE_CONFIG: &str = "examples/replay/config.json";
const EXAMPLE_LOG: &str = "examples/replay/access.log";

fn replay_json(args: &[&str]) -> Value {
    let mut all = vec!["replay", EXAMPLE_CONFIG, EXAMPLE_LOG, "--json"];
    all.extend_from_slice(args);
    let (code, out, err) = cli(&all);
    assert_eq!(code, 0, "{err}");
    serde_json::from_str(&out).unwrap()
}

// The documentation's replay sessions (`<!-- replay: cli -->`, their output cut short by a
// `…` line) are replayed by envoy-tests' docs.rs, with every other console session.

#[test]
fn usage_and_read_errors_exit_2() {
    for args in [
        &["replay"][..],
        &["replay", EXAMPLE_CONFIG],
        &["replay", EXAMPLE_CONFIG, EXAMPLE_LOG, "--bogus"],
        &["replay", EXAMPLE_CONFIG, EXAMPLE_LOG, "--what-if", "per-ip"],
        &["replay", EXAMPLE_CONFIG, EXAMPLE_LOG, "--what-if", "nope=5"],
        &[
            "replay",
            EXAMPLE_CONFIG,
            EXAMPLE_LOG,
            "--format",
            "%START_TIME%%DURATION%",
        ],
        &["replay", EXAMPLE_CONFIG, "/nonexistent/access.log"],
        &["replay", "/nonexistent/config.json", EXAMPLE_LOG],
        &[
            "replay",
            "crates/ratelimit-core/tests/fixtures/manifests/two-plugins.yaml",
            EXAMPLE_LOG,
        ],
        &[
            "replay",
            "crates/ratelimit-core/tests/fixtures/manifests/two-plugins.yaml",
            EXAMPLE_LOG,
            "--plugin",
            "nope",
        ],
    ] {
        let (code, out, err) = cli(args);
        assert_eq!(code, 2, "{args:?}: {out}{err}");
        assert!(out.is_empty(), "{args:?}: nothing on stdout: {out}");
        assert!(!err.is_empty(), "{args:?}: says why");
    }
    let (_, _, err) = cli(&["replay", EXAMPLE_CONFIG, "/nonexistent/access.log"]);
    assert!(
        err.starts_with("/nonexistent/access.log: cannot read"),
        "{err}"
    );
    let (_, _, err) = cli(&[
        "replay",
        "crates/ratelimit-core/tests/fixtures/manifests/two-plugins.yaml",
        EXAMPLE_LOG,
    ]);
    assert!(
        err.contains("pick one with --plugin NAME (good, typo)"),
        "{err}"
    );
}

#[test]
fn a_bad_configuration_fails_exactly_as_check_reports_it() {
    let mut files = common::fixture_files("bad");
    files.push(root(
        "crates/ratelimit-core/tests/fixtures/manifests/two-plugins.yaml",
    ));
    for file in files {
        let f = file.to_str().unwrap();
        let (check_code, check_out, _) = cli(&["check", f]);
        let mut args = vec!["replay", f, EXAMPLE_LOG];
        if f.ends_with(".yaml") {
            args.extend(["--plugin", "typo"]);
        }
        let (code, out, err) = cli(&args);
        assert_eq!((code, check_code), (1, 1), "{f}: {out}{err}");
        if f.ends_with(".yaml") {
            // check reports both plugins; replay only the one it was asked for.
            assert!(check_out.contains(&out), "{f}:\n{out}\nnot in\n{check_out}");
        } else {
            assert_eq!(out, check_out, "{f}");
        }
    }
    // A what-if the filter would refuse is refused with the filter's message.
    let dir = common::scratch("what-if");
    let config = dir.join("config.json");
    std::fs::write(
        &config,
        r#"{"rules": [{"name": "c", "cost": 10, "rate_limit": {"requests_per_unit": 100, "unit": "minute"}}]}"#,
    )
    .unwrap();
    let (code, out, _) = cli(&[
        "replay",
        config.to_str().unwrap(),
        EXAMPLE_LOG,
        "--what-if",
        "c=5",
    ]);
    assert_eq!(code, 1);
    assert!(
        out.contains("(what-if c=5): INVALID\n  rules[0].cost"),
        "{out}"
    );
    // A limit of 0 too: the configuration it makes is invalid (exit 1), not the command line.
    let (code, out, err) = cli(&[
        "replay",
        EXAMPLE_CONFIG,
        EXAMPLE_LOG,
        "--what-if",
        "per-ip=0",
    ]);
    assert_eq!((code, err.as_str()), (1, ""), "{out}");
    assert_eq!(
        out,
        format!(
            "{EXAMPLE_CONFIG} (what-if per-ip=0): INVALID\n  rules[0].rate_limit.requests_per_unit: \
             expected an integer from 1 to 4294967295, found number 0\n"
        )
    );
}

#[test]
fn the_json_report_counts_every_request_of_the_example() {
    let r = replay_json(&["--what-if", "per-ip=240", "--what-if", "per-ip=60"]);
    assert_eq!(r["requests"], 6736);
    let log = &r["logs"][0];
    assert_eq!(
        (log["lines"].as_u64(), log["bad_lines"].as_u64()),
        (Some(6739), Some(3))
    );
    assert_eq!(
        log["first_bad_lines"][0],
        "examples/replay/access.log:732: not a JSON object"
    );
    assert_eq!(
        r["configurations"],
        serde_json::json!(["configured", "per-ip=240", "per-ip=60"])
    );
    assert!(r["reorder"]["out_of_order"].as_u64().unwrap() > 1000);
    assert_eq!(r["reorder"]["late"], 0);
    for rule in r["rules"].as_array().unwrap() {
        let matched = rule["matched"].as_u64().unwrap();
        for result in rule["results"].as_array().unwrap() {
            // Shadow rules: every request they apply to is allowed or would be limited.
            let (a, l) = (
                result["allowed"].as_u64().unwrap(),
                result["limited"].as_u64().unwrap(),
            );
            assert_eq!(a + l, matched, "{}: {result}", rule["name"]);
        }
    }
    let per_ip = &r["rules"][0];
    assert_eq!(per_ip["name"], "per-ip");
    assert_eq!(per_ip["matched"], 6736);
    assert_eq!(per_ip["keys"], 64);
    let limited: Vec<u64> = per_ip["results"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x["limited"].as_u64().unwrap())
        .collect();
    // A higher limit limits less; a lower one more.
    assert!(
        limited[1] < limited[0] && limited[0] < limited[2],
        "{limited:?}"
    );
    assert_eq!(
        per_ip["results"][2]["limit"],
        "60 per minute (sliding_window)"
    );
    // Other rules are replayed under every configuration too (shadow rules: unchanged).
    assert_eq!(r["rules"][1]["results"][0], {
        let mut x = r["rules"][1]["results"][1].clone();
        x["configuration"] = "configured".into();
        x
    });
    // The top limited key is the filter's hash; with --raw-keys, its value too.
    let top = &per_ip["results"][0]["top_limited"][0];
    assert_eq!(top["key"].as_str().unwrap().len(), 16);
    assert!(top.get("raw").is_none());
    let raw = replay_json(&["--raw-keys", "--top", "3"]);
    let tops = raw["rules"][0]["results"][0]["top_limited"]
        .as_array()
        .unwrap();
    assert_eq!(tops.len(), 3);
    assert_eq!(tops[0]["key"], top["key"]);
    assert_eq!(tops[0]["raw"], "remote_address=10.9.0.4", "the batch job");
    assert_eq!(raw["rules"][2]["peak"]["raw"], "remote_address=192.0.2.55");
}

#[test]
fn the_table_says_what_the_json_says() {
    let (code, out, err) = cli(&[
        "replay",
        EXAMPLE_CONFIG,
        EXAMPLE_LOG,
        "--what-if",
        "login=10",
    ]);
    assert_eq!(code, 0, "{err}");
    let r = replay_json(&["--what-if", "login=10"]);
    assert!(
        out.starts_with("replayed 6,736 requests from examples/replay/access.log\n"),
        "{out}"
    );
    assert!(out.contains(
        "  3 bad lines, not replayed:\n    examples/replay/access.log:732: not a JSON object\n"
    ));
    let login = &r["rules"][2];
    let row = |i: usize| {
        let x = &login["results"][i];
        (
            x["allowed"].as_u64().unwrap(),
            x["limited"].as_u64().unwrap(),
        )
    };
    for (label, (allowed, limited)) in [
        ("5 per minute (configured)", row(0)),
        ("10 per minute (what-if login=10)", row(1)),
    ] {
        let line = out
            .lines()
            .find(|l| l.trim_start().starts_with(label))
            .unwrap();
        let words: Vec<&str> = line[label.len() + 2..].split_whitespace().collect();
        assert_eq!(words[0], allowed.to_string(), "{line}");
        assert_eq!(words[1], limited.to_string(), "{line}");
    }
    assert!(
        out.contains("rule login (shadow): 5 per minute (sliding_window)"),
        "{out}"
    );
}

#[test]
fn the_html_report_has_a_timeline_per_rule_and_needs_nothing_else() {
    let dir = common::scratch("html");
    let html = dir.join("report.html");
    let (code, _, err) = cli(&[
        "replay",
        EXAMPLE_CONFIG,
        EXAMPLE_LOG,
        "--what-if",
        "per-ip=240",
        "--html",
        html.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{err}");
    let page = std::fs::read_to_string(&html).unwrap();
    assert!(page.starts_with("<!DOCTYPE html>"));
    assert_eq!(page.matches("<svg ").count(), 3, "one per rule");
    assert_eq!(page.matches("</svg>").count(), 3);
    for forbidden in ["<script", "src=", "href=", "url(", "@import"] {
        assert!(!page.contains(forbidden), "{forbidden}");
    }
    // The per-ip timeline shows the configuration's areas and the what-if's line.
    let per_ip = page.split("<svg ").nth(1).unwrap();
    assert_eq!(
        per_ip.matches("<path ").count(),
        3,
        "allowed, limited, the what-if"
    );
    assert!(per_ip.contains("stroke-dasharray"));
    assert!(page.contains("would limit with per-ip=240"));
    // An unwritable path is a read/write error.
    let (code, _, err) = cli(&[
        "replay",
        EXAMPLE_CONFIG,
        EXAMPLE_LOG,
        "--html",
        "/nonexistent/x.html",
    ]);
    assert_eq!(code, 2, "{err}");
}

#[test]
fn bad_lines_are_counted_never_fatal() {
    let dir = common::scratch("bad");
    let log = dir.join("access.log");
    let good = std::fs::read_to_string(root(EXAMPLE_LOG)).unwrap();
    let mut text: String = good.lines().take(100).map(|l| format!("{l}\n")).collect();
    text.push_str("garbage\n\n{\"start_time\": \"never\"}\n");
    text.push_str(&"x".repeat(2 << 20));
    text.push('\n');
    for i in 0..10 {
        text.push_str(&format!("{{\"no_time\": {i}}}\n"));
    }
    std::fs::write(&log, text).unwrap();
    let (code, out, err) = cli(&["replay", EXAMPLE_CONFIG, log.to_str().unwrap(), "--json"]);
    assert_eq!(code, 0, "{err}");
    let r: Value = serde_json::from_str(&out).unwrap();
    let l = &r["logs"][0];
    assert_eq!(r["requests"], 100);
    assert_eq!(l["bad_lines"], 13, "the blank line is not bad");
    let first: Vec<String> = l["first_bad_lines"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| {
            x.as_str()
                .unwrap()
                .rsplit_once(".log:")
                .unwrap()
                .1
                .to_string()
        })
        .collect();
    assert_eq!(
        first,
        [
            "101: does not match the text format",
            "103: start time not understood",
            "104: longer than 1 MiB",
            "105: no start time",
            "106: no start time"
        ]
    );
}

#[test]
fn logs_merge_by_start_time_and_a_missing_field_is_a_note() {
    // The example split in two logs (two proxies) replays as the whole.
    let dir = common::scratch("merge");
    let text = std::fs::read_to_string(root(EXAMPLE_LOG)).unwrap();
    let (mut a, mut b) = (String::new(), String::new());
    for (i, line) in text.lines().enumerate() {
        let part = if i % 3 == 0 { &mut a } else { &mut b };
        part.push_str(line);
        part.push('\n');
    }
    std::fs::write(dir.join("a.log"), a).unwrap();
    std::fs::write(dir.join("b.log"), b).unwrap();
    let whole = replay_json(&[]);
    let (code, out, err) = cli(&[
        "replay",
        EXAMPLE_CONFIG,
        dir.join("a.log").to_str().unwrap(),
        dir.join("b.log").to_str().unwrap(),
        "--json",
    ]);
    assert_eq!(code, 0, "{err}");
    let split: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(split["rules"], whole["rules"]);
    // A client address under another key: unmapped, no rule keyed on it applies.
    let renamed = text.replace("downstream_remote_address", "client");
    std::fs::write(dir.join("renamed.log"), &renamed).unwrap();
    let log = dir.join("renamed.log");
    let (_, out, _) = cli(&["replay", EXAMPLE_CONFIG, log.to_str().unwrap(), "--json"]);
    let r: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(r["rules"][0]["matched"], 0);
    let notes = r["notes"].to_string();
    assert!(notes.contains("no request had remote_address"), "{notes}");
    // Mapped with --field, the same as the original.
    let (_, out, _) = cli(&[
        "replay",
        EXAMPLE_CONFIG,
        log.to_str().unwrap(),
        "--json",
        "--field",
        "remote_address=client",
    ]);
    let r: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(r["rules"], whole["rules"]);
}

#[test]
fn a_too_small_reorder_window_shows_and_changes_little() {
    let whole = replay_json(&[]);
    let tight = replay_json(&["--reorder-window", "0"]);
    assert!(tight["reorder"]["late"].as_u64().unwrap() > 1000);
    assert!(tight["notes"]
        .to_string()
        .contains("raise --reorder-window"));
    for (w, t) in whole["rules"]
        .as_array()
        .unwrap()
        .iter()
        .zip(tight["rules"].as_array().unwrap())
    {
        let (w, t) = (
            w["results"][0]["limited"].as_u64().unwrap(),
            t["results"][0]["limited"].as_u64().unwrap(),
        );
        eprintln!("limited in start order {w}, in log order {t}");
        // Each key's clock never goes back: out-of-order requests count at the key's latest
        // time, which moves few decisions.
        assert!(w.abs_diff(t) * 20 <= w, "{w} vs {t}");
    }
}

/// Writes about `bytes` of a JSON access log to `out`, as Envoy writes it (in end-time order),
/// at 1,000 requests a second: a million client addresses and 300,000 API keys seen once or a
/// few times, and 20 heavy clients sending a tenth of the traffic. Returns the lines written.
fn generate(out: &mut impl Write, bytes: u64) -> u64 {
    let mut rng = ratelimit_core::testkit::Rng(0x5eed_1e55);
    let mut end_ms = 1_795_000_000_000u64;
    let (mut written, mut lines) = (0u64, 0u64);
    let mut buf = String::new();
    while written < bytes {
        buf.clear();
        for _ in 0..1000 {
            end_ms += rng.below(3);
            let duration = if rng.below(100) == 0 {
                1000 + rng.below(5000)
            } else {
                rng.below(80)
            };
            let client = if rng.below(10) == 0 {
                rng.below(20)
            } else {
                rng.below(1_000_000)
            };
            let key = match rng.below(4) {
                0 => "null".to_string(),
                _ => format!("\"key-{:06}\"", rng.below(300_000)),
            };
            buf.push_str(&format!(
                "{{\"authority\":\"api.example.com\",\"bytes_sent\":{},\"downstream_remote_address\":\"10.{}.{}.{}:{}\",\"duration\":{duration},\"method\":\"GET\",\"path\":\"/api/items/{}\",\"response_code\":200,\"start_time\":\"{}\",\"x-api-key\":{key}}}\n",
                rng.below(5000),
                client >> 16,
                client >> 8 & 255,
                client & 255,
                20_000 + rng.below(40_000),
                rng.below(100_000),
                ratelimit_config::replay::input::format_time(end_ms - duration),
            ));
            lines += 1;
        }
        written += buf.len() as u64;
        if out.write_all(buf.as_bytes()).is_err() {
            break;
        }
    }
    lines
}

/// Replays `bytes` of generated log through standard input; returns the JSON report.
fn replay_generated(config: &Path, bytes: u64) -> (u64, Value) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_ratelimit-config"))
        .args(["replay", config.to_str().unwrap(), "-", "--json"])
        .args(["--what-if", "per-ip=50"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    let writer = std::thread::spawn(move || generate(&mut stdin, bytes));
    let out = child.wait_with_output().unwrap();
    let lines = writer.join().unwrap();
    assert!(out.status.success());
    (
        lines,
        serde_json::from_str(&String::from_utf8_lossy(&out.stdout)).unwrap(),
    )
}

/// Memory stays flat as the log grows: replay's peak resident memory (its own `VmHWM`, in the
/// report) for logs of 8, 32 and 128 MB (`REPLAY_MEMORY_MB=16,64,256,1024` for more; the
/// README has the curve to 1 GB). Every
/// structure that grows with the traffic is bounded: the table by `capacity`, key counts by
/// HyperLogLog, top keys by Space-Saving, the timeline by widening its buckets, the reorder
/// buffer by its window, the settle queue by the requests in flight.
#[test]
fn memory_stays_flat_as_the_log_grows() {
    let dir = common::scratch("memory");
    let config = dir.join("config.json");
    std::fs::write(
        &config,
        r#"{"rules": [
            {"name": "per-ip", "key": ["remote_address"], "rate_limit": {"requests_per_unit": 100, "unit": "minute"}},
            {"name": "api-key", "match": {"path_prefix": "/api/"}, "key": ["header:x-api-key"],
             "algorithm": "token_bucket", "burst": 20, "rate_limit": {"requests_per_unit": 5, "unit": "second"}},
            {"name": "flight", "key": ["remote_address"], "in_flight": {"max": 4}}]}"#,
    )
    .unwrap();
    let sizes: Vec<u64> = std::env::var("REPLAY_MEMORY_MB")
        .unwrap_or_else(|_| "8,32,128".into())
        .split(',')
        .map(|s| s.trim().parse().unwrap())
        .collect();
    let mut peaks = Vec::new();
    for mb in &sizes {
        let started = Instant::now();
        let (lines, r) = replay_generated(&config, mb << 20);
        assert_eq!(r["requests"], lines);
        assert_eq!(r["logs"][0]["bad_lines"], 0);
        let peak = r["peak_memory_kib"].as_u64().unwrap();
        eprintln!(
            "{mb} MB: {lines} requests, peak memory {} MiB, {} requests/s, {:.1} s",
            peak / 1024,
            r["requests_per_s"],
            started.elapsed().as_secs_f64()
        );
        // Keys beyond the exact count are estimated, within a few percent.
        let keys = r["rules"][0]["keys"].as_u64().unwrap();
        assert!(r["rules"][0]["keys_exact"] == false && keys > 16_384);
        peaks.push(peak);
    }
    let (first, last) = (peaks[0], *peaks.last().unwrap());
    assert!(
        last <= first + first / 4 + 4096,
        "peak memory grew from {first} KiB to {last} KiB over {sizes:?} MB"
    );
    assert!(last < 200 * 1024, "{last} KiB");
}

#[test]
fn a_shared_rule_replays_who_would_have_waited_and_who_was_refused() {
    // 5 requests a second shared by API key, waits up to 500 ms: a tenant sending 20 in a
    // second, another 2. The log's clock is the replay's: each waiter looks at its line as it
    // would live.
    let dir = common::scratch("share-replay");
    let config = dir.join("config.json");
    std::fs::write(
        &config,
        r#"{"rules": [{"name": "provider", "key": ["header:x-api-key"],
            "rate_limit": {"requests_per_unit": 5, "unit": "second"},
            "algorithm": "token_bucket", "burst": 5,
            "share": {"max_wait_ms": 500}}]}"#,
    )
    .unwrap();
    let mut log = String::new();
    let line = |ms: u64, key: &str| {
        format!(
            "{{\"downstream_remote_address\":\"10.0.0.1:1\",\"duration\":5,\"method\":\"POST\",\"path\":\"/v1/chat/completions\",\"response_code\":200,\"start_time\":\"{}\",\"x-api-key\":\"{key}\"}}\n",
            ratelimit_config::replay::input::format_time(1_795_000_000_000 + ms)
        )
    };
    for i in 0..20 {
        log.push_str(&line(i * 50, "heavy"));
    }
    log.push_str(&line(400, "light"));
    log.push_str(&line(900, "light"));
    let path = dir.join("access.log");
    std::fs::write(&path, log).unwrap();
    let (code, out, err) = cli(&[
        "replay",
        config.to_str().unwrap(),
        path.to_str().unwrap(),
        "--json",
    ]);
    assert_eq!(code, 0, "{err}");
    let r: Value = serde_json::from_str(&out).unwrap();
    let row = &r["rules"][0]["results"][0];
    let (allowed, limited, waited, timeouts) = (
        row["allowed"].as_u64().unwrap(),
        row["limited"].as_u64().unwrap(),
        row["waited"].as_u64().unwrap(),
        row["wait_timeouts"].as_u64().unwrap(),
    );
    assert_eq!(allowed + limited, 22, "{row}");
    assert!(waited > 0 && timeouts <= waited, "{row}");
    // The bucket of 5 and a token every 200 ms over about 1.4 s: at most 5 + 8 admitted.
    assert!((9..=13).contains(&allowed), "{row}");
    // The text report says it too.
    let (_, text, _) = cli(&["replay", config.to_str().unwrap(), path.to_str().unwrap()]);
    assert!(
        text.contains(&format!("waited in the shared line (configured): {waited} (refused when their wait ended: {timeouts})")),
        "{text}"
    );
}
