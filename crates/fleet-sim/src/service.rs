//! The rate limit service the fleet shares, as the limitador engine counts (Envoy's RLS
//! protocol), but atomic: each call is decided whole, at one instant.
//!
//! Per descriptor, a counter whose window starts at its first hit and lasts the limit's
//! length; the next hit after the window's end starts a new one. A call of `hits_addend` N is
//! granted if the count plus N stays within the limit (and then counted), else refused without
//! counting. Answers carry the limit, what remains and the time to the window's end.
//!
//! A descriptor whose first entry is `fair` is a fleet-fair counter
//! ([`ratelimit_core::share::fair`]): counted by its own `hits_addend` where it has one, against
//! a limit of `u32::MAX` an hour, as the tests configure limitador for them.

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
    counters: HashMap<Descriptor, Counter>,
    /// Calls decided.
    pub calls: u64,
    /// Of them, calls whose first descriptor is a fleet-fair counter (reports).
    pub reports: u64,
}

/// A fleet-fair counter's limit and window, µs.
const FAIR_COUNTER: (u64, u64) = (u32::MAX as u64, 3_600_000_000);

/// Whether descriptor `d` is a fleet-fair counter.
fn is_fair(d: &[(String, Vec<u8>)]) -> bool {
    d.first().is_some_and(|(k, _)| k == "fair")
}

impl Service {
    /// A service whose every descriptor has `limit` per `window_s` seconds.
    pub fn new(limit: u64, window_s: u64) -> Service {
        Service {
            limit,
            window_us: window_s.saturating_mul(1_000_000),
            counters: HashMap::new(),
            calls: 0,
            reports: 0,
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
        if request.descriptors.first().is_some_and(|d| is_fair(d)) {
            self.reports += 1;
        }
        let limits = |d: &[(String, Vec<u8>)]| {
            if is_fair(d) {
                FAIR_COUNTER
            } else {
                (self.limit, self.window_us)
            }
        };
        let hits = |i: usize| {
            request
                .descriptor_hits
                .get(i)
                .copied()
                .flatten()
                .unwrap_or(request.hits)
        };
        let mut fits = true;
        for (i, d) in request.descriptors.iter().enumerate() {
            let (limit, window_us) = limits(d);
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
            fits &= c.count.saturating_add(hits(i)) <= limit;
        }
        let code = if fits { Code::Ok } else { Code::OverLimit };
        let mut statuses = Vec::with_capacity(request.descriptors.len());
        for (i, d) in request.descriptors.iter().enumerate() {
            let (limit, window_us) = limits(d);
            let Some(c) = self.counters.get_mut(d) else {
                continue;
            };
            if fits {
                c.count += hits(i);
            }
            let end = c.start_us.saturating_add(window_us);
            statuses.push(DescriptorStatus {
                code,
                requests_per_unit: u32::try_from(limit).ok(),
                unit_seconds: Some(window_us / 1_000_000),
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

    #[test]
    fn fair_counters_add_their_own_hits_without_a_limit_and_are_counted_as_reports() {
        let mut s = Service::new(10, 1);
        let entries = |kind: &'static [u8]| [("fair", &b"p"[..]), ("asked", kind), ("epoch", b"7")];
        let (a, b) = (entries(b"t1"), entries(b"t2"));
        let each = [
            rls::Each {
                entries: &a,
                hits: 25,
            },
            rls::Each {
                entries: &b,
                hits: 0,
            },
        ];
        let r = s.decide(&rls::encode_request_each("edge", &each), 1_000);
        assert_eq!(r.overall_code, Code::Ok);
        let left: Vec<u32> = r.statuses.iter().map(|x| x.limit_remaining).collect();
        assert_eq!(left, [u32::MAX - 25, u32::MAX]);
        assert_eq!(r.statuses[0].unit_seconds, Some(3_600));
        // The capacity's counter beside them is still 10 a second.
        assert_eq!(s.decide(&message(11), 2_000).overall_code, Code::OverLimit);
        assert_eq!((s.calls, s.reports), (2, 1));
    }
}
