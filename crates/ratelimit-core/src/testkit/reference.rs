//! Reference models, written from each definition and independent of the code they check: the
//! five algorithms' decisions on a trace of `(time ms, cost)` requests, and an event stream's
//! data. The core's property tests and the fuzz targets (`fuzz/`) compare the filter with them.
#![allow(clippy::indexing_slicing, clippy::unwrap_used)]

use std::collections::HashMap;

/// Reference: the sliding window counter from its definition, counts kept per window index.
pub fn sliding_window(limit: u64, w: u64, trace: &[(u64, u64)]) -> Vec<bool> {
    let mut counts: HashMap<u64, u64> = HashMap::new();
    trace
        .iter()
        .map(|&(t, c)| {
            let (i, e) = (t / w, t % w);
            let prev = i
                .checked_sub(1)
                .and_then(|p| counts.get(&p))
                .copied()
                .unwrap_or(0);
            let cur = counts.get(&i).copied().unwrap_or(0);
            // prev × (1 − e/w) + cur + c ≤ limit, multiplied through by w.
            let ok = prev * (w - e) + (cur + c) * w <= limit * w;
            if ok {
                *counts.entry(i).or_default() += c;
            }
            ok
        })
        .collect()
}

/// Reference: fixed windows.
pub fn fixed_window(limit: u64, w: u64, trace: &[(u64, u64)]) -> Vec<bool> {
    let mut counts: HashMap<u64, u64> = HashMap::new();
    trace
        .iter()
        .map(|&(t, c)| {
            let n = counts.entry(t / w).or_default();
            let ok = *n + c <= limit;
            if ok {
                *n += c;
            }
            ok
        })
        .collect()
}

/// Reference: a token bucket holding tokens, refilled continuously. Tokens are counted in
/// units of 1/w so that `limit` tokens per `w` ms is exactly `limit` units per ms.
pub fn token_bucket(limit: u64, w: u64, burst: u64, trace: &[(u64, u64)]) -> Vec<bool> {
    let full = burst * w;
    let (mut tokens, mut last) = (full, 0u64);
    trace
        .iter()
        .map(|&(t, c)| {
            if last > 0 {
                tokens = (tokens + (t - last) * limit).min(full);
            }
            last = t;
            let ok = tokens >= c * w;
            if ok {
                tokens -= c * w;
            }
            ok
        })
        .collect()
}

/// Reference: nginx-style delaying leaky bucket: requests leave one emission interval apart;
/// one is admitted if its departure is at most `max_delay` away and the queue fits `burst`.
pub fn leaky_delay(
    limit: u64,
    w: u64,
    burst: u64,
    max_delay: u64,
    trace: &[(u64, u64)],
) -> Vec<(bool, u64)> {
    // Times in units of 1/limit ms: one request occupies w units.
    let mut next_free = 0u128;
    trace
        .iter()
        .map(|&(t, c)| {
            let now = u128::from(t) * u128::from(limit);
            let depart = next_free.max(now);
            let wait = depart - now;
            let ok = wait <= u128::from(max_delay) * u128::from(limit)
                && depart + u128::from(c * w) - now <= u128::from(burst * w);
            if ok {
                next_free = depart + u128::from(c * w);
            }
            let wait_ms = wait.div_ceil(u128::from(limit)) as u64;
            (ok, if ok { wait_ms } else { 0 })
        })
        .collect()
}

/// Reference: every admitted request's time and cost, counted over the last window.
pub fn sliding_log(limit: u64, w: u64, trace: &[(u64, u64)]) -> Vec<bool> {
    let mut log: Vec<(u64, u64)> = Vec::new();
    trace
        .iter()
        .map(|&(t, c)| {
            let used: u64 = log
                .iter()
                .filter(|(at, _)| at + w > t)
                .map(|(_, c)| c)
                .sum();
            let ok = used + c <= limit;
            if ok {
                log.push((t, c));
            }
            ok
        })
        .collect()
}

/// The WHATWG event-stream parser, small: each dispatched event's data. The stream's last
/// event counts even if no blank line ends it (as the scanner counts it).
pub fn sse_events(text: &str) -> Vec<String> {
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    let (mut events, mut data, mut has_data) = (Vec::new(), String::new(), false);
    let mut lines = Vec::new();
    let mut rest = text;
    while !rest.is_empty() {
        let end = rest.find(['\r', '\n']).unwrap_or(rest.len());
        lines.push(&rest[..end]);
        rest = &rest[end..];
        rest = rest
            .strip_prefix("\r\n")
            .or_else(|| rest.strip_prefix(['\r', '\n']))
            .unwrap_or(rest);
    }
    for line in lines {
        if line.is_empty() {
            if has_data {
                events.push(std::mem::take(&mut data));
            }
            has_data = false;
            continue;
        }
        let (field, value) = match line.find(':') {
            Some(at) => {
                let value = &line[at + 1..];
                (&line[..at], value.strip_prefix(' ').unwrap_or(value))
            }
            None => (line, ""),
        };
        if field == "data" {
            if has_data {
                data.push('\n');
            }
            data.push_str(value);
            has_data = true;
        }
    }
    if has_data {
        events.push(data);
    }
    events
}
