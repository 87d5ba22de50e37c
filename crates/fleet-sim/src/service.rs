//! The rate limit service the fleet shares, as the limitador engine counts (Envoy's RLS
//! protocol), but atomic: each call is decided whole, at one instant.
//!
//! Per descriptor, a counter whose window starts at its first hit and lasts the limit's
//! length; the next hit after the window's end starts a new one. A call of `hits_addend` N is
//! granted if the count plus N stays within the limit (and then counted), else refused without
//! counting. Answers carry the limit, what remains and the time to the window's end.

use ratelimit_core::rls::{self, Code, DescriptorStatus, Response};
use std::collections::HashMap;

/// One descriptor's entries (key, value), as decoded.
pub type Descriptor = Vec<(String, Vec<u8>)>;

/// A descriptor's counter in its current window.
#[derive(Debug)]
struct Counter {
    /// When the window started, µs.
    start_us: u64,
    count: u64,
    /// Every window's start, µs, in order.
    starts: Vec<u64>,
}

/// The service: one limit for every descriptor, counters by descriptor.
#[derive(Debug)]
pub struct Service {
    limit: u64,
    window_us: u64,
    /// The protocol's unit of the limit (`RateLimit.Unit`: SECOND = 1, MINUTE = 2, HOUR = 3,
    /// DAY = 4), for `current_limit`.
    unit_seconds: u64,
    counters: HashMap<Descriptor, Counter>,
    /// Calls decided.
    pub calls: u64,
}

impl Service {
    /// A service whose every descriptor has `limit` per `window_s` seconds.
    pub fn new(limit: u64, window_s: u64) -> Service {
        Service {
            limit,
            window_us: window_s.saturating_mul(1_000_000),
            unit_seconds: window_s,
            counters: HashMap::new(),
            calls: 0,
        }
    }

    /// Decides the encoded `RateLimitRequest` `message` at `now_us`: every descriptor's hits
    /// are counted, or none (the answer is `OVER_LIMIT` if one descriptor has too little left).
    /// An undecodable message is answered `UNKNOWN`.
    pub fn decide(&mut self, message: &[u8], now_us: u64) -> Response {
        self.calls += 1;
        let Ok(request) = rls::decode_request(message) else {
            return Response::default();
        };
        let (limit, window_us) = (self.limit, self.window_us);
        let mut fits = true;
        for d in &request.descriptors {
            let c = self.counters.entry(d.clone()).or_insert(Counter {
                start_us: now_us,
                count: 0,
                starts: vec![now_us],
            });
            if now_us >= c.start_us.saturating_add(window_us) {
                c.start_us = now_us;
                c.count = 0;
                c.starts.push(now_us);
            }
            fits &= c.count.saturating_add(request.hits) <= limit;
        }
        let code = if fits { Code::Ok } else { Code::OverLimit };
        let unit_seconds = self.unit_seconds;
        let mut statuses = Vec::with_capacity(request.descriptors.len());
        for d in &request.descriptors {
            let Some(c) = self.counters.get_mut(d) else {
                continue;
            };
            if fits {
                c.count += request.hits;
            }
            let end = c.start_us.saturating_add(window_us);
            statuses.push(DescriptorStatus {
                code,
                requests_per_unit: u32::try_from(limit).ok(),
                unit_seconds: Some(unit_seconds),
                limit_remaining: u32::try_from(limit.saturating_sub(c.count)).unwrap_or(u32::MAX),
                reset_ms: Some(end.saturating_sub(now_us) / 1000),
            });
        }
        Response {
            overall_code: code,
            statuses,
            headers: Vec::new(),
        }
    }

    /// Each descriptor's window starts, µs.
    pub fn windows(&self) -> impl Iterator<Item = (&Descriptor, &[u64])> {
        self.counters.iter().map(|(d, c)| (d, c.starts.as_slice()))
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::indexing_slicing)]
mod tests {
    use super::*;

    fn message(hits: u32) -> Vec<u8> {
        rls::encode_request(
            "edge",
            &[("rule", b"g"), ("remote_address", b"10.0.0.1")],
            hits,
        )
    }

    #[test]
    fn grants_within_the_limit_refuses_without_counting_and_resets_at_the_window_end() {
        let mut s = Service::new(10, 60);
        let a = s.decide(&message(6), 1_000_000);
        assert_eq!(a.overall_code, Code::Ok);
        assert_eq!(a.statuses[0].limit_remaining, 4);
        assert_eq!(a.statuses[0].reset_ms, Some(60_000));
        // 6 more do not fit: refused, not counted; 4 do.
        let b = s.decide(&message(6), 31_000_000);
        assert_eq!(
            (b.overall_code, b.statuses[0].limit_remaining),
            (Code::OverLimit, 4)
        );
        assert_eq!(b.statuses[0].reset_ms, Some(30_000));
        assert_eq!(s.decide(&message(4), 31_000_000).overall_code, Code::Ok);
        assert_eq!(
            s.decide(&message(1), 60_999_999).overall_code,
            Code::OverLimit
        );
        // The window ends 60 s after its first hit: the next hit starts a new one.
        let c = s.decide(&message(1), 61_000_000);
        assert_eq!(
            (c.overall_code, c.statuses[0].limit_remaining),
            (Code::Ok, 9)
        );
        let windows: Vec<_> = s.windows().collect();
        assert_eq!(windows.len(), 1);
        assert_eq!(windows[0].1, [1_000_000, 61_000_000]);
        assert_eq!(s.calls, 5);
    }
}
