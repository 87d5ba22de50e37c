//! A finished replay as a person or a script reads it: a table for the terminal, JSON, and a
//! self-contained HTML page with a timeline per rule (inline SVG: no script, no network).

use super::input::format_time;
use super::sim::{Outcome, Replay, Traffic};
use super::sketch::{Counted, Distinct, EXACT_DISTINCT};
use super::{Run, CONFIGURED};
use crate::summary;
use ratelimit_core::config::{Cost, Limit, Rule, Usage};
use ratelimit_core::runtime::MAX_HELD;
use serde_json::{json, Value};
use std::fmt::Write as _;

/// `1234567` as `1,234,567`.
pub fn thousands(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// `1 request`, `2,000 requests`.
fn plural(n: u64, what: &str) -> String {
    if n == 1 {
        format!("1 {what}")
    } else {
        format!("{} {what}s", thousands(n))
    }
}

/// A byte count for people: `512 B`, `3.2 MB`, `1.0 GB`.
pub fn bytes(n: u64) -> String {
    match n {
        0..1_000 => format!("{n} B"),
        1_000..1_000_000 => format!("{:.1} kB", n as f64 / 1e3),
        1_000_000..1_000_000_000 => format!("{:.1} MB", n as f64 / 1e6),
        _ => format!("{:.1} GB", n as f64 / 1e9),
    }
}

/// A rule's limit, short: `100 per minute`, `20 in flight`.
fn short_limit(r: &Rule) -> String {
    match r.limit {
        Limit::Rate { quota, .. } => format!(
            "{} {}per {}",
            thousands(u64::from(quota.requests_per_unit)),
            r.quota_unit
                .as_deref()
                .map_or(String::new(), |u| format!("{u} ")),
            quota.unit.name()
        ),
        Limit::InFlight { max, .. } => format!("{} in flight", thousands(u64::from(max))),
    }
}

fn count(d: &Distinct) -> String {
    if d.is_exact() {
        thousands(d.count())
    } else {
        format!("~{}", thousands(d.count()))
    }
}

/// `1 key`, `~20,000 keys`.
fn counted_keys(d: &Distinct) -> String {
    let n = count(d);
    if n == "1" {
        "1 key".into()
    } else {
        format!("{n} keys")
    }
}

fn percent(part: u64, whole: u64) -> String {
    if whole == 0 {
        return "-".into();
    }
    format!("{:.1}%", part as f64 * 100.0 / whole as f64)
}

/// A monitored count: exact, or the range the true count lies in.
fn counted(c: &Counted) -> String {
    if c.error == 0 {
        thousands(c.count)
    } else {
        format!("{}-{}", thousands(c.guaranteed()), thousands(c.count))
    }
}

/// The variants reported for a rule: the configuration as written, and each what-if that
/// changes this rule (every variant is in the JSON).
fn rows(replay: &Replay, rule: usize) -> impl Iterator<Item = (usize, &super::sim::Variant)> {
    replay
        .variants
        .iter()
        .enumerate()
        .filter(move |(i, v)| *i == 0 || v.changes == Some(rule))
}

fn row_label(v: &super::sim::Variant, rule: usize) -> String {
    let limit = v
        .config()
        .rules
        .get(rule)
        .map(short_limit)
        .unwrap_or_default();
    if v.name == CONFIGURED {
        format!("{limit} ({CONFIGURED})")
    } else {
        format!("{limit} (what-if {})", v.name)
    }
}

fn key_label(c: &Counted, raw: bool) -> String {
    match (&c.raw, raw) {
        (Some(r), true) => format!("key={:016x} {r}", c.key),
        _ => format!("key={:016x}", c.key),
    }
}

fn busiest(t: &Traffic, raw: bool) -> Option<String> {
    let (c, second) = t.peak.busiest.as_ref()?;
    Some(format!(
        "{}{} in one second, {} at {}",
        if t.peak.exact { "" } else { "at least " },
        plural(c.guaranteed(), "request"),
        key_label(c, raw),
        format_time(second * 1000).replace(".000Z", "Z"),
    ))
}

fn rule_title(r: &Rule) -> String {
    format!(
        "rule {}{}: {}, key {}, match {}",
        r.name,
        if r.shadow { " (shadow)" } else { "" },
        summary::limit(r),
        summary::key(r),
        summary::matcher(&r.matcher)
    )
}

/// What replay approximated or could not see in this run, in words.
pub fn notes(run: &Run) -> Vec<String> {
    let r = &run.replay;
    let mut out = Vec::new();
    for rule in &r.config.rules {
        if let Some(g) = &rule.global {
            out.push(format!(
                "rule {} is global ({}): replay cannot ask its rate limit service, so its own \
                 rate_limit decides, over these logs alone (give replay every proxy's log to \
                 see the whole fleet's traffic)",
                rule.name,
                summary::global_mode(g.mode)
            ));
        }
        if let Limit::Rate {
            algorithm:
                ratelimit_core::config::Algorithm::LeakyBucket {
                    max_delay_ms: Some(_),
                    ..
                },
            ..
        } = rule.limit
        {
            out.push(format!(
                "rule {} delays requests: a held request counts as admitted at its turn; the \
                 filter's cap of {} held requests per worker is not modelled",
                rule.name,
                thousands(MAX_HELD as u64)
            ));
        }
    }
    let settles = r.config.rules.iter().any(|rule| {
        matches!(rule.limit, Limit::InFlight { .. }) || matches!(rule.cost, Cost::Response(_))
    });
    for (field, source, found) in &run.fields {
        if *found > 0 {
            // Headers are often absent; what every request has should be in every line.
            if *found < r.requests
                && matches!(
                    field.as_str(),
                    "remote_address" | "method" | "path" | "authority"
                )
            {
                out.push(format!(
                    "{} had no {field} ({source}): rules that match or key on it did not apply to them",
                    plural(r.requests - found, "request"),
                ));
            }
            continue;
        }
        let why = match field.as_str() {
            "duration" if !settles => continue,
            "duration" => "requests are taken to end when they start (in-flight slots given \
                           back and usage charged at once)"
                .to_string(),
            "bytes_sent" => "rules charged by body bytes were charged 0".into(),
            f if f.starts_with("response:") => {
                "every response was charged its rule's default, as one that never reported \
                 its usage"
                    .into()
            }
            f if super::input::only_an_alternative(&r.config, f) => {
                "it is one of the parts of \"first\" keys, which took their other parts".into()
            }
            f => format!("rules that match or key on {f} never applied"),
        };
        out.push(format!(
            "no request had {field} ({source}): {why}; map it with --field {field}=KEY"
        ));
    }
    let d = &run.disorder;
    if d.late > 0 {
        out.push(format!(
            "{} came more than the reorder window ({} ms) after requests that started later, \
             by up to {} ms: each was decided at its key's latest time; raise --reorder-window",
            plural(d.late, "request"),
            thousands(run.reorder_window_ms),
            thousands(d.max_late_ms)
        ));
    }
    for (rule, v) in r.config.rules.iter().zip(
        r.variants
            .first()
            .map(|v| v.outcomes.as_slice())
            .unwrap_or_default(),
    ) {
        if v.evictions > 0 {
            out.push(format!(
                "rule {}: {} live keys were forgotten to make room (capacity {}), as the filter \
                 would have: raise capacity",
                rule.name,
                thousands(v.evictions),
                thousands(u64::from(r.config.capacity))
            ));
        }
        if v.key_missing > 0 {
            out.push(format!(
                "rule {}: {} requests lacked a part of its key (on_missing_key: {})",
                rule.name,
                thousands(v.key_missing),
                rule.on_missing_key.name()
            ));
        }
        if v.failed_open + v.failed_closed > 0 {
            out.push(format!(
                "rule {}: the table could not decide {} requests (failure_mode applied)",
                rule.name,
                thousands(v.failed_open + v.failed_closed)
            ));
        }
    }
    let estimated = r.traffic.iter().any(|t| !t.keys.is_exact())
        || r.variants
            .iter()
            .any(|v| v.outcomes.iter().any(|o| !o.keys_limited.is_exact()));
    if estimated {
        out.push(format!(
            "key counts marked ~ are estimates (HyperLogLog, ±0.8 %): counted exactly up to {} keys",
            thousands(EXACT_DISTINCT as u64)
        ));
    }
    if r.traffic.iter().any(|t| !t.peak.exact) {
        out.push("over 1,024 keys in one second: the busiest key's rate is a lower bound".into());
    }
    out
}

/// The report as a table for the terminal.
pub fn text(run: &Run, raw_keys: bool) -> String {
    let r = &run.replay;
    let mut out = String::new();
    let names: Vec<&str> = run.logs.iter().map(|l| l.name.as_str()).collect();
    let _ = writeln!(
        out,
        "replayed {} from {}",
        plural(r.requests, "request"),
        names.join(", ")
    );
    if let Some((a, b)) = r.span_ms {
        let _ = writeln!(
            out,
            "  {} to {} ({} s)",
            format_time(a),
            format_time(b),
            thousands((b - a).div_ceil(1000))
        );
    }
    let bad: u64 = run.logs.iter().map(|l| l.bad).sum();
    if bad > 0 {
        let first: Vec<&str> = run
            .logs
            .iter()
            .flat_map(|l| l.first_bad.iter().map(String::as_str))
            .take(super::source::LISTED_BAD_LINES)
            .collect();
        let _ = writeln!(out, "  {}, not replayed:", plural(bad, "bad line"));
        for line in first {
            let _ = writeln!(out, "    {line}");
        }
        if bad > super::source::LISTED_BAD_LINES as u64 {
            let _ = writeln!(out, "    …");
        }
    }
    let d = &run.disorder;
    if d.out_of_order > 0 {
        // Envoy logs a request when it ends.
        let _ = writeln!(
            out,
            "  {} logged after a later one, by up to {} ms: replayed in start order",
            plural(d.out_of_order, "request"),
            thousands(d.max_disorder_ms),
        );
    }
    for (i, rule) in r.config.rules.iter().enumerate() {
        let Some(t) = r.traffic.get(i) else { continue };
        let _ = writeln!(out, "\n{}", rule_title(rule));
        let _ = writeln!(
            out,
            "  matched {} from {}",
            plural(t.matched, "request"),
            counted_keys(&t.keys)
        );
        if let Some(b) = busiest(t, raw_keys) {
            let _ = writeln!(out, "  busiest key: {b}");
        }
        let table: Vec<(String, &Outcome)> = rows(r, i)
            .filter_map(|(_, v)| Some((row_label(v, i), v.outcomes.get(i)?)))
            .collect();
        let width = table.iter().map(|(l, _)| l.len()).max().unwrap_or(0).max(5);
        let limited = if rule.shadow {
            "would limit"
        } else {
            "limited"
        };
        let _ = writeln!(
            out,
            "  {:<width$}  {:>10}  {:>10} {:>6}  {:>8}  {:>12}",
            "limit", "allowed", limited, "", "delayed", "keys limited"
        );
        for (label, o) in &table {
            let _ = writeln!(
                out,
                "  {label:<width$}  {:>10}  {:>10} {:>6}  {:>8}  {:>12}",
                thousands(o.allowed),
                thousands(o.limited),
                percent(o.limited, t.matched),
                thousands(o.delayed),
                count(&o.keys_limited),
            );
        }
        if let Some(base) = r.variants.first().and_then(|v| v.outcomes.get(i)) {
            let top = base.top.top(run.top);
            if !top.is_empty() {
                let _ = writeln!(out, "  top limited keys ({CONFIGURED}):");
                for c in &top {
                    let _ = writeln!(out, "    {:>10}  {}", counted(c), key_label(c, raw_keys));
                }
            }
            if base.waited > 0 {
                let _ = writeln!(
                    out,
                    "  waited in the shared line ({CONFIGURED}): {} (refused when their wait ended: {})",
                    thousands(base.waited),
                    thousands(base.wait_timeouts)
                );
            }
            if let Cost::Response(charge) = &rule.cost {
                let _ = writeln!(
                    out,
                    "  charged {} {} after responses ({} responses did not say: charged {} each)",
                    thousands(base.usage_charged),
                    match charge.usage {
                        Usage::BodyBytes => "bytes",
                        Usage::Header(_) | Usage::Body(_) | Usage::Price(_) => "units",
                    },
                    thousands(base.usage_unreported),
                    charge.unreported(charge.admission())
                );
            }
        }
    }
    let notes = notes(run);
    if !notes.is_empty() {
        out.push_str("\nnotes:\n");
        for n in notes {
            let _ = writeln!(out, "  - {n}");
        }
    }
    out
}

fn counted_json(c: &Counted, raw_keys: bool) -> serde_json::Map<String, Value> {
    let mut m = serde_json::Map::new();
    m.insert("key".into(), format!("{:016x}", c.key).into());
    m.insert("count".into(), c.count.into());
    m.insert("error".into(), c.error.into());
    if raw_keys {
        m.insert("raw".into(), json!(c.raw));
    }
    m
}

/// The report as JSON (every rule under every configuration).
pub fn json(run: &Run, raw_keys: bool) -> Value {
    let r = &run.replay;
    let rules: Vec<Value> = r
        .config
        .rules
        .iter()
        .enumerate()
        .map(|(i, rule)| {
            let t = r.traffic.get(i);
            let peak = t.and_then(|t| {
                let (c, s) = t.peak.busiest.as_ref()?;
                let mut v = counted_json(c, raw_keys);
                v.insert("requests_per_s".into(), c.guaranteed().into());
                v.insert("at".into(), format_time(s * 1000).into());
                v.insert("exact".into(), t.peak.exact.into());
                Some(Value::Object(v))
            });
            let results: Vec<Value> = r
                .variants
                .iter()
                .filter_map(|v| {
                    let o = v.outcomes.get(i)?;
                    Some(json!({
                        "configuration": v.name,
                        "limit": v.config().rules.get(i).map(summary::limit),
                        "allowed": o.allowed,
                        "limited": o.limited,
                        "delayed": o.delayed,
                        "waited": o.waited,
                        "wait_timeouts": o.wait_timeouts,
                        "keys_limited": o.keys_limited.count(),
                        "keys_limited_exact": o.keys_limited.is_exact(),
                        "top_limited": o.top.top(run.top).iter().map(|c| Value::Object(counted_json(c, raw_keys))).collect::<Vec<_>>(),
                        "usage_charged": o.usage_charged,
                        "usage_unreported": o.usage_unreported,
                        "usage_refunded": o.usage_refunded,
                        "usage_exceeded": o.usage_exceeded,
                        "evictions": o.evictions,
                        "failed_open": o.failed_open,
                        "failed_closed": o.failed_closed,
                        "key_missing": o.key_missing,
                    }))
                })
                .collect();
            json!({
                "name": rule.name,
                "shadow": rule.shadow,
                "global": rule.global.as_ref().map(|g| summary::global_mode(g.mode)),
                "limit": summary::limit(rule),
                "key": summary::key(rule),
                "match": summary::matcher(&rule.matcher),
                "matched": t.map_or(0, |t| t.matched),
                "keys": t.map_or(0, |t| t.keys.count()),
                "keys_exact": t.is_none_or(|t| t.keys.is_exact()),
                "peak": peak,
                "results": results,
            })
        })
        .collect();
    let d = &run.disorder;
    json!({
        "requests": r.requests,
        "first": r.span_ms.map(|(a, _)| format_time(a)),
        "last": r.span_ms.map(|(_, b)| format_time(b)),
        "logs": run.logs.iter().map(|l| json!({
            "name": l.name, "lines": l.lines, "requests": l.requests,
            "bad_lines": l.bad, "first_bad_lines": l.first_bad,
        })).collect::<Vec<_>>(),
        "reorder": {
            "window_ms": run.reorder_window_ms,
            "out_of_order": d.out_of_order,
            "max_disorder_ms": d.max_disorder_ms,
            "late": d.late,
            "max_late_ms": d.max_late_ms,
        },
        "configurations": r.variants.iter().map(|v| v.name.clone()).collect::<Vec<_>>(),
        "rules": rules,
        "notes": notes(run),
        "elapsed_ms": run.elapsed.as_millis() as u64,
        "requests_per_s": super::rate(r.requests, run.elapsed),
        "peak_memory_kib": run.peak_memory_kib,
    })
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

const ALLOWED: &str = "#43a047";
const LIMITED: &str = "#e53935";
const WHAT_IF: [&str; 5] = ["#1e88e5", "#8e24aa", "#fb8c00", "#00897b", "#6d4c41"];

/// A round top for an axis at least `v`, and its tick step: 1, 2 or 5 times a power of ten,
/// in steps of 0.2, 0.5 and 1 times that power.
fn axis(v: f64) -> (f64, f64) {
    let p = if v > 0.0 {
        10f64.powf(v.log10().floor())
    } else {
        1.0
    };
    for (m, step) in [(1.0, 0.2), (2.0, 0.5), (5.0, 1.0), (10.0, 2.0)] {
        if m * p >= v {
            return (m * p, step * p);
        }
    }
    (10.0 * p, 2.0 * p)
}

fn rate_label(v: f64) -> String {
    if v >= 10.0 || v == 0.0 {
        format!("{}/s", thousands(v.round() as u64))
    } else {
        format!("{v:.1}/s")
    }
}

/// The most steps a timeline draws: neighbouring buckets are averaged beyond it.
const MAX_STEPS: usize = 240;

/// Seconds per drawn step of the timeline.
fn step_s(r: &Replay) -> u64 {
    r.timeline.width_s() * r.timeline.len().div_ceil(MAX_STEPS).max(1) as u64
}

/// A step path (`M x,y L …`) through `values`, one flat segment per step.
fn steps(values: &[f64], x: &dyn Fn(usize) -> f64, y: &dyn Fn(f64) -> f64) -> String {
    let mut d = String::new();
    for (i, v) in values.iter().enumerate() {
        let _ = write!(
            d,
            "{}{:.1},{:.1} L{:.1},{:.1} ",
            if i == 0 { "M" } else { "L" },
            x(i),
            y(*v),
            x(i + 1),
            y(*v)
        );
    }
    d
}

/// The timeline of one rule: requests per second allowed and limited under the configuration
/// as written (stacked areas), and limited under each what-if that changes the rule (lines).
fn svg(r: &Replay, rule: usize) -> String {
    const W: f64 = 960.0;
    const H: f64 = 260.0;
    const LEFT: f64 = 64.0;
    const RIGHT: f64 = 40.0;
    const TOP: f64 = 14.0;
    const BOTTOM: f64 = 36.0;
    let tl = &r.timeline;
    let group = tl.len().div_ceil(MAX_STEPS).max(1);
    let step = step_s(r) as f64;
    // Requests per second in each drawn step.
    let per_s = |col: usize| -> Vec<f64> {
        tl.column(col)
            .chunks(group)
            .map(|c| c.iter().sum::<u64>() as f64 / step)
            .collect()
    };
    let allowed = per_s(r.column(rule, 0));
    let limited = per_s(r.column(rule, 0) + 1);
    let total: Vec<f64> = allowed.iter().zip(&limited).map(|(a, l)| a + l).collect();
    let what_ifs: Vec<(Vec<f64>, Vec<f64>)> = rows(r, rule)
        .skip(1)
        .map(|(v, _)| (per_s(r.column(rule, v)), per_s(r.column(rule, v) + 1)))
        .collect();
    let mut most = total.iter().copied().fold(0.0, f64::max);
    for (a, l) in &what_ifs {
        most = a.iter().zip(l).map(|(a, l)| a + l).fold(most, f64::max);
    }
    let (top, tick) = axis(most);
    let n = allowed.len();
    let pw = W - LEFT - RIGHT;
    let ph = H - TOP - BOTTOM;
    let x = |i: usize| LEFT + pw * i as f64 / n.max(1) as f64;
    let y = |v: f64| TOP + ph * (1.0 - v / top);
    let mut s = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" viewBox=\"0 0 {W} {H}\" width=\"{W}\" height=\"{H}\" role=\"img\">\n<title>rule {}: requests per second</title>\n",
        escape(r.config.rules.get(rule).map_or("", |x| x.name.as_str()))
    );
    let mut v = 0.0;
    while v <= top + tick / 2.0 {
        let _ = writeln!(
            s,
            "<line x1=\"{LEFT}\" x2=\"{right:.1}\" y1=\"{yy:.1}\" y2=\"{yy:.1}\" stroke=\"#ddd\"/><text x=\"{lx:.1}\" y=\"{ly:.1}\" text-anchor=\"end\" class=\"t\">{label}</text>",
            right = W - RIGHT,
            yy = y(v),
            lx = LEFT - 6.0,
            ly = y(v) + 4.0,
            label = rate_label(v)
        );
        v += tick;
    }
    if let Some(origin) = tl.origin_s() {
        // About six labels, at round times.
        let span = n as u64 * step_s(r);
        let every = [
            1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 21_600,
        ]
        .into_iter()
        .find(|e| span / e <= 6)
        .unwrap_or(86_400);
        let mut t = origin.div_ceil(every) * every;
        while t <= origin + span {
            let at = LEFT + pw * (t - origin) as f64 / span.max(1) as f64;
            let label = format_time(t * 1000);
            let label = label.get(11..19).unwrap_or(&label);
            let _ = writeln!(
                s,
                "<line x1=\"{at:.1}\" x2=\"{at:.1}\" y1=\"{y0:.1}\" y2=\"{y1:.1}\" stroke=\"#999\"/><text x=\"{at:.1}\" y=\"{ty:.1}\" text-anchor=\"middle\" class=\"t\">{label}</text>",
                y0 = TOP + ph,
                y1 = TOP + ph + 5.0,
                ty = TOP + ph + 18.0,
            );
            t += every;
        }
    }
    if n > 0 {
        // Allowed from 0, limited stacked on it: each area a step line there and back.
        let back = |lower: &[f64]| {
            let mut d = String::new();
            for i in (0..n).rev() {
                let v = lower.get(i).copied().unwrap_or(0.0);
                let _ = write!(d, "L{:.1},{:.1} L{:.1},{:.1} ", x(i + 1), y(v), x(i), y(v));
            }
            d + "Z"
        };
        let zero = vec![0.0; n];
        let _ = writeln!(
            s,
            "<path d=\"{}{}\" fill=\"{LIMITED}\" fill-opacity=\"0.85\" shape-rendering=\"crispEdges\"/>\n<path d=\"{}{}\" fill=\"{ALLOWED}\" fill-opacity=\"0.8\" shape-rendering=\"crispEdges\"/>",
            steps(&total, &x, &y),
            back(&allowed),
            steps(&allowed, &x, &y),
            back(&zero),
        );
    }
    for (k, (_, limited)) in what_ifs.iter().enumerate() {
        let _ = writeln!(
            s,
            "<path d=\"{}\" fill=\"none\" stroke=\"{}\" stroke-width=\"2\" stroke-dasharray=\"6 3\"/>",
            steps(limited, &x, &y),
            WHAT_IF.get(k % WHAT_IF.len()).unwrap_or(&"#000")
        );
    }
    let _ = writeln!(
        s,
        "<rect x=\"{LEFT}\" y=\"{TOP}\" width=\"{pw:.1}\" height=\"{ph:.1}\" fill=\"none\" stroke=\"#999\"/>\n</svg>"
    );
    s
}

/// The report as a self-contained HTML page: the summary, then per rule its table, its top
/// limited keys and its timeline.
pub fn html(run: &Run, raw_keys: bool) -> String {
    let r = &run.replay;
    let mut h = String::from(
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\n<title>wasm-ratelimit replay</title>\n<style>\n\
         body{font:14px/1.45 system-ui,sans-serif;margin:24px auto;max-width:1000px;color:#222}\n\
         h1{font-size:20px;margin:0 0 4px} h2{font-size:16px;margin:28px 0 4px}\n\
         table{border-collapse:collapse;margin:8px 0} td,th{padding:2px 10px;text-align:right}\n\
         td:first-child,th:first-child{text-align:left} th{border-bottom:1px solid #999;font-weight:600}\n\
         .meta{color:#555} .t{font-size:11px;fill:#444} code{font-size:12px}\n\
         .sw{display:inline-block;width:12px;height:12px;margin:0 4px 0 12px;vertical-align:-1px}\n\
         .dash{display:inline-block;width:18px;border-top:2px dashed;margin:0 4px 3px 12px}\n\
         </style></head><body>\n",
    );
    let names: Vec<String> = run.logs.iter().map(|l| escape(&l.name)).collect();
    let _ = write!(
        h,
        "<h1>Replay of {}</h1>\n<div class=\"meta\">from {}",
        plural(r.requests, "request"),
        names.join(", ")
    );
    if let Some((a, b)) = r.span_ms {
        let _ = write!(h, ", {} to {}", format_time(a), format_time(b));
    }
    let bad: u64 = run.logs.iter().map(|l| l.bad).sum();
    let _ = writeln!(
        h,
        "; {}; {} out of start order (up to {} ms)</div>",
        plural(bad, "bad line"),
        plural(run.disorder.out_of_order, "request"),
        thousands(run.disorder.max_disorder_ms)
    );
    for (i, rule) in r.config.rules.iter().enumerate() {
        let Some(t) = r.traffic.get(i) else { continue };
        let _ = writeln!(
            h,
            "<h2>{}</h2>\n<div class=\"meta\">matched {} from {}{}</div>",
            escape(&rule_title(rule)),
            plural(t.matched, "request"),
            counted_keys(&t.keys),
            busiest(t, raw_keys)
                .map(|b| format!("; busiest key: {}", escape(&b)))
                .unwrap_or_default()
        );
        let limited = if rule.shadow {
            "would limit"
        } else {
            "limited"
        };
        let _ = writeln!(
            h,
            "<table><tr><th>limit</th><th>allowed</th><th>{limited}</th><th></th><th>delayed</th><th>keys limited</th></tr>"
        );
        for (_, v) in rows(r, i) {
            let Some(o) = v.outcomes.get(i) else { continue };
            let _ = writeln!(
                h,
                "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
                escape(&row_label(v, i)),
                thousands(o.allowed),
                thousands(o.limited),
                percent(o.limited, t.matched),
                thousands(o.delayed),
                count(&o.keys_limited)
            );
        }
        h.push_str("</table>\n");
        let _ = write!(
            h,
            "<div class=\"meta\"><span class=\"sw\" style=\"background:{ALLOWED}\"></span>allowed\
             <span class=\"sw\" style=\"background:{LIMITED}\"></span>{limited}"
        );
        for (k, (_, v)) in rows(r, i).skip(1).enumerate() {
            let _ = write!(
                h,
                "<span class=\"dash\" style=\"border-color:{}\"></span>{limited} with {}",
                WHAT_IF.get(k % WHAT_IF.len()).unwrap_or(&"#000"),
                escape(&v.name)
            );
        }
        let _ = writeln!(
            h,
            " &nbsp;(requests per second, averaged over {} s steps)</div>",
            step_s(r)
        );
        h.push_str(&svg(r, i));
        if let Some(base) = r.variants.first().and_then(|v| v.outcomes.get(i)) {
            let top = base.top.top(run.top);
            if !top.is_empty() {
                h.push_str("<table><tr><th>top limited keys</th><th>requests</th></tr>\n");
                for c in &top {
                    let _ = writeln!(
                        h,
                        "<tr><td><code>{}</code></td><td>{}</td></tr>",
                        escape(&key_label(c, raw_keys)),
                        counted(c)
                    );
                }
                h.push_str("</table>\n");
            }
        }
    }
    let notes = notes(run);
    if !notes.is_empty() {
        h.push_str("<h2>Notes</h2>\n<ul>\n");
        for n in notes {
            let _ = writeln!(h, "<li>{}</li>", escape(&n));
        }
        h.push_str("</ul>\n");
    }
    h.push_str("</body></html>\n");
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_for_people() {
        assert_eq!(thousands(0), "0");
        assert_eq!(thousands(999), "999");
        assert_eq!(thousands(1000), "1,000");
        assert_eq!(thousands(1_234_567), "1,234,567");
        assert_eq!(bytes(512), "512 B");
        assert_eq!(bytes(1_073_741_824), "1.1 GB");
        assert_eq!(axis(0.0), (1.0, 0.2));
        assert_eq!(axis(3.2), (5.0, 1.0));
        assert_eq!(axis(101.0), (200.0, 50.0));
        assert_eq!(axis(1000.0), (1000.0, 200.0));
        assert_eq!(rate_label(2.5), "2.5/s");
        assert_eq!(rate_label(1250.0), "1,250/s");
        assert_eq!(escape("<a&\"b\">"), "&lt;a&amp;&quot;b&quot;&gt;");
    }
}
