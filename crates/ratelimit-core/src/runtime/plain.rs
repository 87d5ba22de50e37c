//! A configuration of one rule that only counts: its request decided in one step, without the
//! pending request the other configurations build ([`super::request::Pending`]: checks,
//! questions, the body's fields, shared capacities), so that such a rule pays only for what it
//! uses. It owns the test of what makes a rule plain and its request's path; it uses the
//! general path's pieces ([`Runtime::applying`], the engine, [`Runtime::concluded`]), so that
//! both decide, count and answer alike (the tests compare them).

use super::request::{Decision, Left, Skip, Verdicts};
use super::{Compiled, Host, Runtime};
use crate::config::Config;
use crate::engine::{self, Check};
use crate::limiter::Policy;
use crate::metrics::Counter;
use crate::store::Store;
use crate::table;
use smallvec::SmallVec;

/// The index of the configuration's rule when it has one rule and that rule is plain: local
/// (no service), not shared, charged by nothing but its fixed or header cost, priced in
/// nothing, with the limit of its configuration (none carried by the request), not elastic,
/// reading no field of the body, and of a bucket's algorithm (a sliding log has slots of its
/// own) that holds no request (delay mode).
pub(super) fn plain_rule(config: &Config, compiled: &[Compiled]) -> Option<usize> {
    let ([rule], [c]) = (config.rules.as_slice(), compiled) else {
        return None;
    };
    let algorithm = match c.policy {
        Policy::SlidingWindow { .. } | Policy::FixedWindow { .. } => true,
        Policy::Gcra(p) => p.max_delay_ms.is_none(),
        Policy::SlidingLog { .. } | Policy::InFlight { .. } | Policy::Lease { .. } => false,
    };
    let plain = algorithm
        && rule.global.is_none()
        && rule.share.is_none()
        && rule.charge().is_none()
        && rule.price().is_none()
        && !rule.per_request.any()
        && c.watch.is_none()
        && c.lease.is_none()
        && !c.reads_body;
    plain.then_some(0)
}

impl<S: Store> Runtime<S> {
    /// Decides a request of the plain rule `i` ([`plain_rule`]) as [`Runtime::start`] would;
    /// `None` when the request lacks a part of the rule's key (the general path refuses it or
    /// keys it as the rule's shared value, and counts it).
    pub(super) fn start_plain(&self, i: usize, host: &mut impl Host) -> Option<Decision> {
        let (rule, compiled) = (self.config.rules.get(i)?, self.compiled.get(i)?);
        let a = match self.applying(rule, compiled, host) {
            Ok(a) if !a.keyless => a,
            Err(Skip::NoMatch) => return Some(Decision::Continue(None)),
            Ok(_) | Err(Skip::MissingPart) => return None,
        };
        let (slot, alt) = table::slots_of(a.hash, self.buckets);
        let check = Check {
            slot,
            alt,
            fingerprint: table::fingerprint_of(a.hash),
            policy: a.policy,
            cost: a.cost,
            shadow: rule.shadow,
            charge_later: false,
            base: None,
        };
        let now = host.now_ms();
        let (allowed, out) =
            engine::decide_single(&self.store, &check, now, self.config.failure_mode);
        let mut reported: Verdicts = SmallVec::new();
        if let Some(failure) = self.store_work(i, &out) {
            self.failed(host, i, now, failure);
        }
        if let Some(v) = out.verdict {
            // (No reservation to wait for: a plain rule reserves nothing.)
            if !v.allowed {
                self.refusal(host, i, a.hash, &v, check.cost, check.shadow);
            } else if allowed {
                self.metrics.add(i, Counter::Allowed, 1);
            }
            reported.push((i, v));
        }
        Some(self.concluded(allowed, reported, Left::default(), now))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::key::Seed;
    use crate::runtime::request::Start;
    use crate::store::MemoryStore;
    use crate::testkit::{counts, FakeHost};

    fn runtime(json: &str) -> Runtime<MemoryStore> {
        crate::testkit::runtime(json, Seed([1, 2]))
    }

    fn one(rule: &str) -> String {
        format!(
            r#"{{"rules": [{{"name": "r", "key": ["remote_address"],
                "rate_limit": {{"requests_per_unit": 3, "unit": "second"}}{rule}}}]}}"#
        )
    }

    #[test]
    fn only_a_lone_rule_that_only_counts_is_plain() {
        let plain = [
            "",
            r#", "algorithm": "fixed_window""#,
            r#", "algorithm": "token_bucket", "burst": 5"#,
            r#", "shadow": true"#,
            r#", "cost": {"header": "x-cost"}"#,
            r#", "match": {"path_prefix": "/api"}"#,
        ];
        for rule in plain {
            assert_eq!(runtime(&one(rule)).plain, Some(0), "{rule}");
        }
        let general = [
            r#", "algorithm": "sliding_log""#,
            r#", "algorithm": "leaky_bucket", "burst": 3, "on_limit": "delay", "max_delay_ms": 5000"#,
            r#", "global": {"cluster": "rls", "domain": "edge"}"#,
            r#", "cost": {"response": "header:x-usage", "reserve": 2}"#,
            r#", "share": {}"#,
            r#", "elastic": {"ceiling": 2.0, "floor": 0.5, "max_bad_share": 0.1}"#,
        ];
        for rule in general {
            assert_eq!(runtime(&one(rule)).plain, None, "{rule}");
        }
        let in_flight = r#"{"rules": [{"name": "r", "key": ["remote_address"],
            "in_flight": {"max": 2}}]}"#;
        assert_eq!(runtime(in_flight).plain, None);
        let carried = r#"{"rules": [{"name": "r", "key": ["remote_address"],
            "rate_limit": {"requests_per_unit": {"from": "header:x-plan", "default": 2, "max": 10},
                           "unit": "minute"}}]}"#;
        assert_eq!(runtime(carried).plain, None);
        let body = r#"{"rules": [{"name": "r", "key": ["body:user"],
            "rate_limit": {"requests_per_unit": 3, "unit": "second"}}]}"#;
        assert_eq!(runtime(body).plain, None);
        let two = r#"{"rules": [
            {"name": "a", "rate_limit": {"requests_per_unit": 3, "unit": "second"}},
            {"name": "b", "rate_limit": {"requests_per_unit": 3, "unit": "second"}}]}"#;
        assert_eq!(runtime(two).plain, None);
    }

    #[test]
    fn the_short_path_decides_counts_logs_and_answers_as_the_general_one() {
        let configs = [
            one(""),
            one(r#", "algorithm": "fixed_window""#),
            one(r#", "algorithm": "token_bucket", "burst": 2"#),
            one(r#", "shadow": true"#),
            one(r#", "cost": {"header": "x-cost"}"#),
            one(r#", "match": {"path_prefix": "/api"}"#),
            one(r#", "key": ["header:x-user"], "on_missing_key": "refuse""#),
            one(r#", "key": ["header:x-user"], "on_missing_key": "shared""#),
            one(r#", "key": ["header:x-user"], "on_missing_key": "skip""#),
            r#"{"rules": [{"name": "r", "key": ["remote_address"],
                "rate_limit": {"requests_per_unit": 3, "unit": "second"}}],
                "response": {"headers": "none"}, "log_limited": "info"}"#
                .into(),
            r#"{"rules": [{"name": "r", "key": ["remote_address"],
                "rate_limit": {"requests_per_unit": 3, "unit": "second"}}],
                "response": {"dialect": "openai", "on_allowed": false}}"#
                .into(),
        ];
        for json in &configs {
            let short = runtime(json);
            let mut general = runtime(json);
            assert_eq!(short.plain, Some(0), "{json}");
            general.plain = None;
            for n in 0..40u64 {
                let addr = format!("10.0.0.{}", n % 3);
                let path = if n % 5 == 0 { "/other" } else { "/api/x" };
                let user = (n % 4).to_string();
                let cost = (n % 3).to_string();
                let request = || {
                    let mut h = FakeHost::new(&addr, path).header("x-cost", &cost);
                    if n % 7 != 0 {
                        h = h.header("x-user", &user);
                    }
                    h.now = 600_000 + n * 97;
                    h
                };
                let (mut a, mut b) = (request(), request());
                let (sa, sb) = (short.start(&mut a), general.start(&mut b));
                let (Start::Decided(da), Start::Decided(db)) = (sa, sb) else {
                    panic!("{json}: request {n} was not decided at once");
                };
                assert_eq!(format!("{da:?}"), format!("{db:?}"), "{json}: request {n}");
                assert_eq!(a.logs, b.logs, "{json}: request {n}");
            }
            assert_eq!(counts(&short), counts(&general), "{json}");
        }
    }
}
