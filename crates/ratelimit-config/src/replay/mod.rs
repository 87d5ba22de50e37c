//! `ratelimit-config replay`: what a configuration would do to recorded traffic, decided
//! offline by the filter's own code. Native only, never compiled into the `.wasm`.
//!
//! Each Envoy access log ([`input`]) is read line by line, put back in start-time order
//! ([`reorder`], [`source`]), and every request runs through [`ratelimit_core::runtime`] exactly as
//! the filter runs it, once per configuration replayed ([`sim`]): the configuration as written
//! and each `--what-if`. Per-key statistics stay within fixed memory ([`sketch`]); [`report`]
//! prints the result as a table, JSON or HTML.

pub mod args;
pub mod input;
pub mod reorder;
pub mod report;
pub mod sim;
pub mod sketch;
pub mod source;

use args::{Options, WhatIf};
use input::Mapping;
use ratelimit_core::config::{Config, ConfigErrors, LogLevel};
use reorder::{Disorder, Merge, Reorder};
use serde_json::Value;
use sim::{Replay, Variant};
use source::LogSource;
use std::io::{BufRead, BufReader, Write};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Readies a copy of a configuration for replay: the limited line is always logged (replay
/// reads the limited keys from it), and a global rule is decided by its own `rate_limit`,
/// locally (its service cannot be asked offline).
pub fn prepare(config: &mut Config) {
    config.log_limited = LogLevel::Info;
    for rule in &mut config.rules {
        rule.global = None;
    }
}

/// The configuration JSON with a what-if applied: the rule's `rate_limit.requests_per_unit`
/// (and `unit`, if given) or its `in_flight.max` set to the what-if's. `Err` if the rule is
/// not in the configuration.
pub fn apply_what_if(json: &str, w: &WhatIf) -> Result<String, String> {
    let mut doc: Value = serde_json::from_str(json).map_err(|e| format!("invalid JSON: {e}"))?;
    let rule = doc
        .get_mut("rules")
        .and_then(Value::as_array_mut)
        .and_then(|rules| {
            rules
                .iter_mut()
                .find(|r| r.get("name").and_then(Value::as_str) == Some(w.rule.as_str()))
        })
        .ok_or_else(|| format!("--what-if {}: no rule named {:?}", w.text, w.rule))?;
    if let Some(flight) = rule.get_mut("in_flight").and_then(Value::as_object_mut) {
        if w.unit.is_some() {
            return Err(format!(
                "--what-if {}: rule {} limits requests in flight: it has no unit",
                w.text, w.rule
            ));
        }
        flight.insert("max".into(), w.limit.into());
    } else if let Some(rate) = rule.get_mut("rate_limit").and_then(Value::as_object_mut) {
        rate.insert("requests_per_unit".into(), w.limit.into());
        if let Some(u) = w.unit {
            rate.insert("unit".into(), u.name().into());
        }
    } else {
        return Err(format!(
            "--what-if {}: rule {} has no limit",
            w.text, w.rule
        ));
    }
    Ok(doc.to_string())
}

/// One configuration to replay, as the filter parses it.
#[derive(Debug)]
pub struct Configuration {
    /// [`CONFIGURED`], or the what-if as written.
    pub name: String,
    /// The rule the what-if changes.
    pub changes: Option<usize>,
    /// The filter's parse of it, errors included.
    pub parsed: Result<Config, ConfigErrors>,
}

/// The configurations to replay from the configuration's JSON: the configuration as written,
/// then one per what-if. `Err` for a what-if that names no rule.
pub fn configurations(json: &str, what_ifs: &[WhatIf]) -> Result<Vec<Configuration>, String> {
    let base = Config::parse(json.as_bytes());
    let mut out = Vec::new();
    for w in what_ifs {
        let changed = apply_what_if(json, w)?;
        let changes = base
            .as_ref()
            .ok()
            .and_then(|c| c.rules.iter().position(|r| r.name == w.rule));
        out.push(Configuration {
            name: w.text.clone(),
            changes,
            parsed: Config::parse(changed.as_bytes()),
        });
    }
    out.insert(
        0,
        Configuration {
            name: CONFIGURED.to_string(),
            changes: None,
            parsed: base,
        },
    );
    Ok(out)
}

/// The name of the configuration as written, among the variants.
pub const CONFIGURED: &str = "configured";

/// A finished replay and what reading the logs met.
pub struct Run {
    /// The replay's counts.
    pub replay: Replay,
    /// Each log: name, lines, requests, bad lines and the first of them.
    pub logs: Vec<LogSummary>,
    /// What reordering met, over every log.
    pub disorder: Disorder,
    /// The reorder window, ms.
    pub reorder_window_ms: u64,
    /// Each field read: its name, where it was looked up, and how many requests had it.
    pub fields: Vec<(String, String, u64)>,
    /// How long the replay took.
    pub elapsed: Duration,
    /// The most memory replay held (Linux's `VmHWM`), KiB.
    pub peak_memory_kib: Option<u64>,
    /// How many requests are listed as top limited keys.
    pub top: usize,
}

/// One log's reading.
#[derive(Clone, Debug)]
pub struct LogSummary {
    /// As given.
    pub name: String,
    /// Lines read.
    pub lines: u64,
    /// Requests read.
    pub requests: u64,
    /// Lines that were not requests.
    pub bad: u64,
    /// The first of them, `name:line: why`.
    pub first_bad: Vec<String>,
}

/// Opens the logs: `Err` names one that cannot be read.
fn open(name: &str) -> Result<(Box<dyn BufRead>, Option<u64>), String> {
    const BUFFER: usize = 256 * 1024;
    if name == "-" {
        return Ok((
            Box::new(BufReader::with_capacity(BUFFER, std::io::stdin())),
            None,
        ));
    }
    let file = std::fs::File::open(name).map_err(|e| format!("{name}: cannot read: {e}"))?;
    let size = file.metadata().ok().map(|m| m.len());
    Ok((Box::new(BufReader::with_capacity(BUFFER, file)), size))
}

/// Replays the logs of `options` through `variants` (the configuration as written first, all
/// prepared by [`prepare`]). Progress goes to `progress` every 2 s once a replay takes longer
/// than that. `Err`: a log cannot be read.
pub fn run(
    options: &Options,
    configured: Config,
    variants: Vec<Variant>,
    progress: &mut dyn Write,
) -> Result<Run, String> {
    let mut fields = input::needed(&configured);
    for v in &variants {
        for f in input::needed(v.config()) {
            if !fields.contains(&f) {
                fields.push(f);
            }
        }
    }
    let mapping = Arc::new(Mapping::new(fields, &options.format, &options.fields)?);
    let mut total = Some(0u64);
    let mut sources = Vec::new();
    for name in &options.logs {
        let (reader, size) = open(name)?;
        total = total.zip(size).map(|(a, b)| a + b);
        sources.push(LogSource::new(
            name.clone(),
            reader,
            Arc::clone(&mapping),
            Reorder::new(options.reorder_window_ms, options.reorder_max),
        ));
    }
    let started = Instant::now();
    let mut next_report = started + Duration::from_secs(2);
    let mut replay = Replay::new(configured, variants, options.raw_keys);
    let mut merged = Merge::new(sources);
    while let Some(entry) = merged.next() {
        replay.request(entry);
        if replay.requests % 4096 == 0 && Instant::now() >= next_report {
            next_report += Duration::from_secs(2);
            let read: u64 = merged.streams().map(|s| s.bytes).sum();
            let _ = writeln!(
                progress,
                "replay: {} read{}, {} requests, {}/s",
                report::bytes(read),
                total.map_or(String::new(), |t| format!(
                    " of {} ({}%)",
                    report::bytes(t),
                    read * 100 / t.max(1)
                )),
                report::thousands(replay.requests),
                report::thousands(rate(replay.requests, started.elapsed())),
            );
        }
    }
    replay.finish();
    let elapsed = started.elapsed();
    if elapsed >= Duration::from_secs(2) {
        let _ = writeln!(
            progress,
            "replay: done, {} requests in {:.1} s ({}/s)",
            report::thousands(replay.requests),
            elapsed.as_secs_f64(),
            report::thousands(rate(replay.requests, elapsed)),
        );
    }
    let mut disorder = Disorder::default();
    let mut logs = Vec::new();
    let mut found = vec![0u64; mapping.fields().len()];
    for s in merged.streams() {
        if let Some(e) = &s.error {
            return Err(e.clone());
        }
        disorder.add(&s.reorder().disorder);
        for (f, n) in found.iter_mut().zip(&s.found) {
            *f += n;
        }
        logs.push(LogSummary {
            name: s.name.clone(),
            lines: s.lines,
            requests: s.requests,
            bad: s.bad,
            first_bad: s.first_bad.clone(),
        });
    }
    let fields = mapping
        .fields()
        .iter()
        .zip(found)
        .enumerate()
        .map(|(i, (f, n))| (f.name(), mapping.source(i), n))
        .collect();
    Ok(Run {
        replay,
        logs,
        disorder,
        reorder_window_ms: options.reorder_window_ms,
        fields,
        elapsed,
        peak_memory_kib: peak_memory_kib(),
        top: options.top,
    })
}

/// Requests per second.
fn rate(n: u64, elapsed: Duration) -> u64 {
    (n as f64 / elapsed.as_secs_f64().max(1e-9)) as u64
}

/// The most resident memory this process held, KiB (Linux's `VmHWM`).
fn peak_memory_kib() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    const TWO: &str = r#"{"rules": [
        {"name": "per-ip", "key": ["remote_address"], "rate_limit": {"requests_per_unit": 100, "unit": "minute"}},
        {"name": "flight", "in_flight": {"max": 4}}]}"#;

    #[test]
    fn what_ifs_change_one_limit_and_are_checked_like_the_configuration() {
        let w = |t: &str| WhatIf::parse(t).unwrap();
        let configs = configurations(TWO, &[w("per-ip=50/second"), w("flight=9")]).unwrap();
        let names: Vec<&str> = configs.iter().map(|c| c.name.as_str()).collect();
        assert_eq!(names, ["configured", "per-ip=50/second", "flight=9"]);
        let c = configs[1].parsed.as_ref().unwrap();
        assert_eq!(
            crate::summary::limit(&c.rules[0]),
            "50 per second (sliding_window)"
        );
        assert_eq!(configs[1].changes, Some(0));
        let c = configs[2].parsed.as_ref().unwrap();
        assert_eq!(
            crate::summary::limit(&c.rules[1]),
            "9 in flight (lease 300 s)"
        );
        assert_eq!(configs[2].changes, Some(1));
        assert!(configurations(TWO, &[w("nope=5")])
            .unwrap_err()
            .contains("no rule named \"nope\""));
        assert!(configurations(TWO, &[w("flight=5/minute")])
            .unwrap_err()
            .contains("has no unit"));
        // A what-if the filter refuses is refused with the filter's own message.
        let costly = r#"{"rules": [{"name": "c", "cost": 10, "rate_limit": {"requests_per_unit": 100, "unit": "minute"}}]}"#;
        let configs = configurations(costly, &[w("c=5")]).unwrap();
        let errors = configs[1].parsed.as_ref().unwrap_err();
        assert!(errors.to_string().contains("rules[0].cost"), "{errors}");
        // So is a limit of 0, or one too large for the filter, in either kind of rule.
        let configs =
            configurations(TWO, &[w("per-ip=0"), w("flight=0"), w("per-ip=4294967296")]).unwrap();
        let error = |i: usize| configs[i].parsed.as_ref().unwrap_err().to_string();
        assert!(
            error(1).starts_with("rules[0].rate_limit.requests_per_unit: "),
            "{}",
            error(1)
        );
        assert!(
            error(2).starts_with("rules[1].in_flight.max: "),
            "{}",
            error(2)
        );
        assert!(
            error(3).starts_with("rules[0].rate_limit.requests_per_unit: "),
            "{}",
            error(3)
        );
    }

    #[test]
    fn replay_copies_log_every_limited_request_and_decide_global_rules_locally() {
        let mut c = Config::parse(
            br#"{"log_limited": "off", "rules": [{"name": "g", "rate_limit": {"requests_per_unit": 5, "unit": "minute"},
                "global": {"cluster": "rls", "domain": "d", "mode": "async"}}]}"#,
        )
        .unwrap();
        prepare(&mut c);
        assert_eq!(c.log_limited, LogLevel::Info);
        assert!(c.rules[0].global.is_none());
    }
}
