//! Reading what a rule limits: `rate_limit` (the quota per unit, its calendar windows and UTC
//! offset) or `in_flight`, the algorithm with its `burst`, `on_limit` and `max_delay_ms`, the
//! numbers a request carries in place of the configured ones (`{"from": …}`), the `quota_unit`,
//! and `elastic`, the limit that follows the backend's health.
//!
//! Uses the reader's helpers and the configuration's types (`super`), and below the
//! configuration: the limiter's algorithms (their bounds, the calendar) and `elastic`'s
//! parameters.

use super::*;
use crate::elastic;
use crate::limiter::{calendar, sliding_log};

impl Validator {
    /// `rate_limit` with its algorithm, or `in_flight`: exactly one.
    /// With the numbers read from each request, where configured.
    pub(super) fn limit(
        &mut self,
        map: &Map<String, Value>,
        path: &str,
    ) -> Option<(Limit, PerRequest)> {
        match (map.get("rate_limit"), map.get("in_flight")) {
            (Some(q), None) => {
                let (quota, limit) = self.quota(q, &join(path, "rate_limit"))?;
                let (algorithm, burst, burst_is_limit) =
                    self.algorithm(map, path, quota, limit.as_ref())?;
                let per_request = PerRequest {
                    burst_is_limit: burst_is_limit && limit.is_some(),
                    limit,
                    burst,
                };
                Some((Limit::Rate { quota, algorithm }, per_request))
            }
            (None, Some(f)) => {
                let mut ok = true;
                for field in ["algorithm", "burst", "on_limit", "max_delay_ms", "cost"] {
                    if map.contains_key(field) {
                        self.error(
                            &join(path, field),
                            "not used by an \"in_flight\" rule (each request takes one slot)",
                        );
                        ok = false;
                    }
                }
                let limit = self.in_flight(f, &join(path, "in_flight"));
                limit.filter(|_| ok)
            }
            (Some(_), Some(_)) => {
                self.error(
                    path,
                    "a rule has either \"rate_limit\" or \"in_flight\", not both (make two rules)",
                );
                None
            }
            (None, None) => {
                self.error(
                    &join(path, "rate_limit"),
                    "required field is missing (or \"in_flight\" to limit requests in flight)",
                );
                None
            }
        }
    }

    fn in_flight(&mut self, v: &Value, path: &str) -> Option<(Limit, PerRequest)> {
        let map = self.object(v, path, &["max", "lease_s"])?;
        let max = match map.get("max") {
            Some(n) => self.amount(n, &join(path, "max")),
            None => {
                self.error(&join(path, "max"), "required field is missing");
                None
            }
        };
        let lease_s = match map.get("lease_s") {
            Some(n) => self.integer(n, &join(path, "lease_s"), 1, 86_400),
            None => Some(DEFAULT_LEASE_S),
        };
        let (max, max_from) = max?;
        let limit = Limit::InFlight {
            max,
            lease_ms: u32::try_from(lease_s? * 1000).ok()?,
        };
        let per_request = PerRequest {
            limit: max_from,
            ..PerRequest::default()
        };
        Some((limit, per_request))
    }

    /// A number of a limit: an integer, or `{"from", "default", "max"}`, read from each
    /// request.
    pub(super) fn amount(&mut self, v: &Value, path: &str) -> Option<(u32, Option<FromRequest>)> {
        if !v.is_object() {
            let n = self.integer(v, path, 1, u64::from(u32::MAX))?;
            return u32::try_from(n).ok().map(|n| (n, None));
        }
        let map = self.object(v, path, &["from", "default", "max"])?;
        let source = match map.get("from") {
            Some(f) => {
                let p = join(path, "from");
                self.string(f, &p).and_then(|s| self.source(s, &p))
            }
            None => {
                self.error(&join(path, "from"), "required field is missing");
                None
            }
        };
        let mut number = |field: &str, what: &str| match map.get(field) {
            Some(n) => self
                .integer(n, &join(path, field), 1, u64::from(u32::MAX))
                .and_then(|n| u32::try_from(n).ok()),
            None => {
                self.error(
                    &join(path, field),
                    format!("required field is missing ({what})"),
                );
                None
            }
        };
        let default = number("default", "what a request that carries no value gets");
        let max = number("max", "the most a request may get");
        let (default, max) = (default?, max?);
        if default > max {
            self.error(
                &join(path, "default"),
                format!("{default} is above \"max\" ({max})"),
            );
            return None;
        }
        Some((
            default,
            Some(FromRequest {
                source: source?,
                default,
                max,
            }),
        ))
    }

    /// Where a number of a request's limit is read.
    pub(super) fn source(&mut self, s: &str, path: &str) -> Option<Source> {
        if let Some(name) = s.strip_prefix("header:") {
            return self.header_name(name, path).map(Source::Header);
        }
        if let Some(rest) = s.strip_prefix("metadata:") {
            return match rest.split_once(':') {
                Some((namespace, key)) if !namespace.is_empty() && !key.is_empty() => {
                    Some(Source::Metadata {
                        namespace: namespace.to_string(),
                        key: key.to_string(),
                    })
                }
                _ => {
                    self.error(
                        path,
                        format!("invalid metadata source {s:?} (expected metadata:NAMESPACE:KEY)"),
                    );
                    None
                }
            };
        }
        if let Some(key) = s.strip_prefix("filter_state:") {
            if key.is_empty() {
                self.error(
                    path,
                    "invalid filter state source \"filter_state:\" (expected filter_state:KEY)",
                );
                return None;
            }
            return Some(Source::FilterState(key.to_string()));
        }
        self.error(
            path,
            format!("unknown source {s:?} (expected header:NAME, metadata:NAMESPACE:KEY or filter_state:KEY)"),
        );
        None
    }

    pub(super) fn quota_unit(
        &mut self,
        v: &Value,
        path: &str,
        limit: Option<Limit>,
    ) -> Option<String> {
        let s = self.string(v, path)?;
        let valid = !s.is_empty()
            && s.len() <= 32
            && s.bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
        if !valid {
            self.error(
                path,
                format!("invalid quota unit {s:?} (expected 1 to 32 of a-z 0-9 -)"),
            );
            return None;
        }
        let in_flight = matches!(limit, Some(Limit::InFlight { .. }));
        if in_flight != (s == CONCURRENT_REQUESTS) {
            self.error(
                path,
                format!(
                    "{CONCURRENT_REQUESTS:?} is the unit of \"in_flight\" rules, and theirs only"
                ),
            );
            return None;
        }
        Some(s.to_string())
    }

    /// The algorithm and the fields that belong to it.
    /// The algorithm, with its burst read from each request (if so configured) and whether
    /// the burst is the limit's (not configured).
    fn algorithm(
        &mut self,
        map: &Map<String, Value>,
        path: &str,
        q: Quota,
        limit: Option<&FromRequest>,
    ) -> Option<(Algorithm, Option<FromRequest>, bool)> {
        let name = match map.get("algorithm") {
            Some(a) => self.choice(
                a,
                &join(path, "algorithm"),
                "algorithm",
                &[
                    ("sliding_window", "sliding_window"),
                    ("fixed_window", "fixed_window"),
                    ("token_bucket", "token_bucket"),
                    ("leaky_bucket", "leaky_bucket"),
                    ("sliding_log", "sliding_log"),
                ],
            )?,
            None => "sliding_window",
        };
        let bucket = matches!(name, "token_bucket" | "leaky_bucket");
        let mut ok = true;
        // Fields that only some algorithms take.
        for (field, allowed) in [
            ("burst", bucket),
            ("on_limit", name == "leaky_bucket"),
            ("max_delay_ms", name == "leaky_bucket"),
        ] {
            if map.contains_key(field) && !allowed {
                self.error(
                    &join(path, field),
                    format!("not used by algorithm {name:?}"),
                );
                ok = false;
            }
        }
        let burst = match map.get("burst") {
            Some(b) => self.amount(b, &join(path, "burst")),
            None => Some((q.requests_per_unit, None)),
        };
        let burst_from = burst.as_ref().and_then(|(_, f)| f.clone());
        let burst = burst.map(|(n, _)| n);
        let delay = match map.get("on_limit") {
            None => Some(false),
            Some(_) if name != "leaky_bucket" => Some(false), // reported above
            Some(o) => self.choice(
                o,
                &join(path, "on_limit"),
                "on_limit",
                &[("reject", false), ("delay", true)],
            ),
        };
        let max_delay = match (delay, map.get("max_delay_ms")) {
            (Some(true), Some(m)) => self
                .integer(m, &join(path, "max_delay_ms"), 1, MAX_DELAY_MS)
                .and_then(|n| u32::try_from(n).ok())
                .map(Some),
            (Some(true), None) => {
                self.error(
                    &join(path, "max_delay_ms"),
                    "required with \"on_limit\": \"delay\"",
                );
                None
            }
            (Some(false), Some(_)) if name == "leaky_bucket" => {
                self.error(
                    &join(path, "max_delay_ms"),
                    "only used with \"on_limit\": \"delay\"",
                );
                None
            }
            (_, _) => Some(None),
        };
        let most = limit.map_or(q.requests_per_unit, |f| f.max);
        if name == "sliding_log" && most > sliding_log::MAX_LIMIT {
            let field = match limit {
                Some(_) => "rate_limit.requests_per_unit.max",
                None => "rate_limit.requests_per_unit",
            };
            self.error(
                &join(path, field),
                format!(
                    "{most} is too many for sliding_log, which stores every request's time (at most {}: use sliding_window for more)",
                    sliding_log::MAX_LIMIT
                ),
            );
            ok = false;
        }
        let algorithm = match name {
            "fixed_window" => Algorithm::FixedWindow,
            "token_bucket" => Algorithm::TokenBucket { burst: burst? },
            "leaky_bucket" => Algorithm::LeakyBucket {
                burst: burst?,
                max_delay_ms: max_delay?,
            },
            "sliding_log" => Algorithm::SlidingLog,
            _ => Algorithm::SlidingWindow,
        };
        ok.then_some((algorithm, burst_from, bucket && !map.contains_key("burst")))
    }

    /// With `requests_per_unit` read from each request, if so configured.
    fn quota(&mut self, v: &Value, path: &str) -> Option<(Quota, Option<FromRequest>)> {
        let map = self.object(v, path, &["requests_per_unit", "unit", "utc_offset"])?;
        let rpu = match map.get("requests_per_unit") {
            Some(n) => self.amount(n, &join(path, "requests_per_unit")),
            None => {
                self.error(
                    &join(path, "requests_per_unit"),
                    "required field is missing",
                );
                None
            }
        };
        let unit = match map.get("unit") {
            Some(u) => self.unit(u, &join(path, "unit"), &Unit::ALL),
            None => {
                self.error(&join(path, "unit"), "required field is missing");
                None
            }
        };
        let utc_offset_min = match map.get("utc_offset") {
            Some(o) => self.utc_offset(o, &join(path, "utc_offset")),
            None => Some(0),
        };
        let (requests_per_unit, from) = rpu?;
        Some((
            Quota {
                requests_per_unit,
                unit: unit?,
                utc_offset_min: utc_offset_min?,
            },
            from,
        ))
    }

    /// A UTC offset, `+HH:MM` or `-HH:MM`, in minutes.
    fn utc_offset(&mut self, v: &Value, path: &str) -> Option<i32> {
        let s = self.string(v, path)?;
        let b = s.as_bytes();
        let digits = |r: std::ops::Range<usize>| {
            let d = b.get(r)?;
            d.iter()
                .all(u8::is_ascii_digit)
                .then(|| d.iter().fold(0i32, |n, c| n * 10 + i32::from(c - b'0')))
        };
        let sign = match b.first() {
            Some(b'+') => Some(1),
            Some(b'-') => Some(-1),
            _ => None,
        };
        let minutes = match (sign, digits(1..3), b.get(3), digits(4..6), b.len()) {
            (Some(sign), Some(h), Some(b':'), Some(m), 6) if m < 60 => Some(sign * (h * 60 + m)),
            _ => None,
        }
        .filter(|m| m.abs() <= calendar::MAX_OFFSET_MIN);
        if minutes.is_none() {
            self.error(
                path,
                format!("expected an offset from UTC as \"+HH:MM\" or \"-HH:MM\", from -14:00 to +14:00 (\"+02:00\" for UTC+2), found {s:?}"),
            );
        }
        minutes
    }

    /// A rule's limit with the calendar's constraints: a month counts only in fixed windows
    /// (a sync global rule's service decides, and its local windows become calendar months),
    /// and only fixed windows begin at a time of day (`utc_offset`).
    pub(super) fn calendar(
        &mut self,
        limit: Option<Limit>,
        rate_limit: Option<&Value>,
        sync: bool,
        path: &str,
    ) -> Option<Limit> {
        let Some(Limit::Rate { quota, algorithm }) = limit else {
            return limit;
        };
        if sync {
            let calendar = matches!(quota.unit, Unit::Week | Unit::Month);
            let algorithm = match calendar || quota.utc_offset_min != 0 {
                true => Algorithm::FixedWindow,
                false => algorithm,
            };
            return Some(Limit::Rate { quota, algorithm });
        }
        let mut ok = true;
        if algorithm != Algorithm::FixedWindow {
            let name = algorithm.name();
            if quota.unit == Unit::Month {
                self.error(
                    &join(path, "rate_limit.unit"),
                    format!("\"month\" needs \"algorithm\": \"fixed_window\": a calendar month has 28 to 31 days, and {name} needs a window of one length (use \"week\", or fixed_window)"),
                );
                ok = false;
            }
            if rate_limit.and_then(|q| q.get("utc_offset")).is_some() {
                self.error(
                    &join(path, "rate_limit.utc_offset"),
                    format!("only fixed_window's windows begin at a time of day: {name} has none to move"),
                );
                ok = false;
            }
        }
        limit.filter(|_| ok)
    }

    /// `elastic`: the ceiling and floor of the limit, and how the backend's health is judged.
    pub(super) fn elastic(
        &mut self,
        v: &Value,
        path: &str,
        limit: Option<Limit>,
    ) -> Option<elastic::Params> {
        let map = self.object(
            v,
            path,
            &[
                "ceiling",
                "floor",
                "max_bad_share",
                "latency_ms",
                "window_s",
                "ramp_s",
            ],
        )?;
        let permille = |n: f64| (n * 1000.0).round() as u32;
        let ceiling = match map.get("ceiling") {
            Some(c) => self
                .number(c, &join(path, "ceiling"), (1.0, 100.0, "1 to 100"))
                .map(permille),
            None => {
                self.error(&join(path, "ceiling"), "required field is missing");
                None
            }
        };
        let floor = match map.get("floor") {
            Some(f) => self
                .number(f, &join(path, "floor"), (0.01, 1.0, "0.01 to 1"))
                .map(permille),
            None => Some(elastic::BASE),
        };
        let max_bad = match map.get("max_bad_share") {
            Some(b) => self
                .number(
                    b,
                    &join(path, "max_bad_share"),
                    (0.002, 0.999, "0.002 to 0.999"),
                )
                .map(permille),
            None => Some(DEFAULT_MAX_BAD),
        };
        let latency_ms = match map.get("latency_ms") {
            Some(l) => self
                .integer(l, &join(path, "latency_ms"), 1, 600_000)
                .and_then(|n| u32::try_from(n).ok())
                .map(Some),
            None => Some(None),
        };
        let mut seconds = |field: &str, min: u64, default: u64| match map.get(field) {
            Some(n) => self
                .integer(n, &join(path, field), min, 3_600)
                .and_then(|n| u32::try_from(n * 1000).ok()),
            None => u32::try_from(default * 1000).ok(),
        };
        let window_ms = seconds("window_s", 2, DEFAULT_HEALTH_WINDOW_S);
        let ramp_ms = seconds("ramp_s", 1, DEFAULT_RAMP_S);
        if let (
            Some(c),
            Some(Limit::Rate {
                quota,
                algorithm: Algorithm::SlidingLog,
            }),
        ) = (ceiling, limit)
        {
            let most = crate::limiter::scale(u64::from(quota.requests_per_unit), c);
            if most > u64::from(sliding_log::MAX_LIMIT) {
                self.error(
                    &join(path, "ceiling"),
                    format!(
                        "sliding_log holds at most {} requests: the ceiling would allow {most}",
                        sliding_log::MAX_LIMIT
                    ),
                );
                return None;
            }
        }
        Some(elastic::Params {
            ceiling: ceiling?,
            floor: floor?,
            max_bad: max_bad?,
            latency_ms: latency_ms?,
            window_ms: window_ms?,
            ramp_ms: ramp_ms?,
        })
    }
}
