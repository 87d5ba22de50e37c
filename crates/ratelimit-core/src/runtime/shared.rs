//! A configuration of one shared rule (`share`, its capacity local or leased from a rate limit
//! service, shared on this proxy or fair across the fleet: [`shared_rule`]): its request decided
//! in one step when the shares admit it, without the pending request of the general path
//! ([`super::request::Pending`]) and, for a leased capacity, with one update of its lease (what is
//! held taken at once, where the general path looks at the lease before the shares decide, then
//! takes from it after). While the shares refuse the rule's requests (the last one here was
//! refused), or where the lease runs low or the service refuses the key, the lease is looked at and
//! taken from after, as on the general path: taken at once, a refused request would give it back
//! (two writes more than a look), and another worker meanwhile could find too little held. It owns
//! the test of what takes this path and the path itself; a request the shares refuse (or that must
//! wait, or whose store failed) is concluded by the general path's [`Runtime::finish_with`] from
//! the outcome already decided, and one whose lease holds too little for it (or whose fleet-fair
//! bands keep what is held for others) goes the general path whole, so that both decide, count,
//! wait and answer alike (the tests compare them).

use super::request::{asker, Applied, Decision, Left, Pending, Skip, Verdicts};
use super::{Compiled, Host, Runtime};
use crate::config::{Config, GlobalMode};
use crate::engine::{self, Check, Outcome, ShareCheck};
use crate::limiter::Policy;
use crate::metrics::Counter;
use crate::store::Store;
use crate::table;
use smallvec::SmallVec;

/// The index of the configuration's rule when it has one rule and that rule is a shared capacity,
/// local or leased from its service (shared here or fair across the fleet), charged by nothing but
/// its fixed or header cost, priced in nothing, with the limit of its configuration, not elastic,
/// reading no field of the body, and of a bucket's algorithm that holds no request (delay mode).
pub(super) fn shared_rule(config: &Config, compiled: &[Compiled]) -> Option<usize> {
    let ([rule], [c]) = (config.rules.as_slice(), compiled) else {
        return None;
    };
    let algorithm = match c.policy {
        Policy::SlidingWindow { .. } | Policy::FixedWindow { .. } => true,
        Policy::Gcra(p) => p.max_delay_ms.is_none(),
        Policy::SlidingLog { .. } | Policy::InFlight { .. } | Policy::Lease { .. } => false,
    };
    let capacity = match (&rule.global, c.lease, c.capacity_key) {
        (None, None, _) => true,
        (Some(g), Some(_), Some(_)) => g.mode == GlobalMode::Lease,
        _ => false,
    };
    let short = algorithm
        && capacity
        && rule.share.is_some()
        && rule.charge().is_none()
        && rule.price().is_none()
        && !rule.per_request.any()
        && c.watch.is_none()
        && !c.reads_body;
    short.then_some(0)
}

impl<S: Store> Runtime<S> {
    /// Decides a request of the shared rule `i` ([`shared_rule`]) as [`Runtime::start`] (and,
    /// for a leased capacity, [`Runtime::promote`] and [`Runtime::finish`]) would; `None` when
    /// the request lacks a part of the rule's key, or when the lease holds too little for it
    /// (nothing written: the general path claims).
    pub(super) fn start_shared(&self, i: usize, host: &mut impl Host) -> Option<Decision> {
        let (rule, compiled) = (self.config.rules.get(i)?, self.compiled.get(i)?);
        let sh = rule.share.as_ref()?;
        let a = match self.applying(rule, compiled, host) {
            Ok(a) if !a.keyless => a,
            Err(Skip::NoMatch) => return Some(Decision::Continue(None)),
            Ok(_) | Err(Skip::MissingPart) => return None,
        };
        let priced = a.priced?;
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
        // Fleet-fair: the tenant's name in the service's counters, from its key's parts.
        let fleet = sh
            .fleet_fair
            .then(|| compiled.fleet_id(rule, a.hash, host))
            .flatten()
            .map(|id| engine::FleetAsk {
                slot: compiled.fair_record(),
                id,
                counted: false,
            });
        let share = (
            0,
            ShareCheck {
                record: compiled.share_record(),
                share: sh.params,
                asker: asker(sh, host),
                fleet,
            },
        );
        let now = host.now_ms();
        // The lease first: what is held is taken in the same update that looks at it, unless
        // the shares refused the rule's last request here (then it is looked at, and taken
        // from once the shares admit the request: a refusal need not give it back).
        use std::sync::atomic::Ordering::Relaxed;
        let lease = match (compiled.lease, compiled.capacity_key) {
            (Some(policy), Some(key)) => {
                let (slot, alt) = table::slots_of(key, self.buckets);
                let check = Check {
                    slot,
                    alt,
                    fingerprint: table::fingerprint_of(key),
                    policy,
                    base: None,
                    ..check
                };
                let mut applied = Applied {
                    rule: i,
                    hash: key,
                    descriptor: None,
                    priced,
                    capacity: true,
                };
                let take = !compiled.share_refusing.load(Relaxed);
                let (took, expires_ms) =
                    self.take_leased((&check, &share), &mut applied, host, (now, take))?;
                Some((check, applied, (take, took, expires_ms)))
            }
            _ => None,
        };
        let fm = self.config.failure_mode;
        let (mut allowed, out, counted) =
            engine::decide_one_share(&self.store, &check, &share.1, now, fm);
        // The lease as the general path decides it after the shares: taken already, or taken
        // now if they admitted the request (given back to them if it cannot be).
        let mut lease_out = None;
        if let Some((lc, _, (take, took, _))) = &lease {
            if *take != allowed {
                compiled.share_refusing.store(!allowed, Relaxed);
            }
            if !took && allowed {
                let (ok, o) = engine::decide_single(&self.store, lc, now, fm);
                if !ok {
                    if counted {
                        engine::refund_one_share(&self.store, &check, &share.1, now);
                    }
                    allowed = false;
                }
                lease_out = Some(o);
            }
        }
        let admitted = allowed
            && out.failure.is_none()
            && lease_out.as_ref().is_none_or(|o| o.failure.is_none())
            && out.verdict.is_some_and(|v| v.allowed && v.delay_ms == 0);
        if admitted {
            for o in std::iter::once(&out).chain(&lease_out) {
                if let Some(failure) = self.store_work(i, o) {
                    self.failed(host, i, now, failure);
                }
            }
            self.metrics.add(i, Counter::Allowed, 1);
            let mut reported: Verdicts = SmallVec::new();
            if let Some(v) = out.verdict {
                reported.push((i, v));
            }
            // What the provider says of its limit (and its refusals) is read.
            let learns = sh.learn.is_some();
            let mut watched = SmallVec::new();
            if learns {
                watched.push(i);
            }
            let left = Left {
                watched,
                timed: learns,
                ..Left::default()
            };
            return Some(self.concluded(true, reported, left, now));
        }
        // Refused, shadowed, held or failed: the general path concludes from this outcome,
        // with the lease as it would have decided it (taken only if the shares admitted).
        let mut p = Pending::default();
        p.checks.push(check);
        p.applied.push(Applied {
            rule: i,
            hash: a.hash,
            descriptor: None,
            priced,
            capacity: false,
        });
        p.shares.push(share);
        let mut outcome = Outcome {
            allowed,
            rules: smallvec::smallvec![out],
        };
        if let Some((lc, applied, (_, took, expires_ms))) = lease {
            // Taken at once: given back if the shares refused the request; admitted, the
            // lease's check reports nothing (its store's work was counted as it was taken).
            if took && !outcome.allowed {
                self.give_back_leased(&lc, i, (now, expires_ms));
            }
            outcome.rules.push(lease_out.unwrap_or_default());
            p.checks.push(lc);
            p.applied.push(applied);
        }
        Some(self.finish_with(host, &p, now, Some(outcome)))
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
            r#"{{"rules": [{{"name": "r", "key": ["header:x-user"],
                "rate_limit": {{"requests_per_unit": 6, "unit": "second"}},
                "share": {{}}{rule}}}]}}"#
        )
    }

    #[test]
    fn only_a_lone_shared_rule_takes_the_shared_path() {
        let short = [
            "",
            r#", "algorithm": "token_bucket", "burst": 2"#,
            r#", "shadow": true"#,
            r#", "cost": {"header": "x-cost"}"#,
            r#", "match": {"path_prefix": "/api"}"#,
            r#", "global": {"cluster": "rls", "domain": "d", "mode": "lease"}"#,
        ];
        for rule in short {
            let rt = runtime(&one(rule));
            assert_eq!(rt.shared, Some(0), "{rule}");
            assert_eq!(rt.plain, None, "{rule}");
        }
        let fair = r#", "global": {"cluster": "rls", "domain": "d", "mode": "lease"},
                "share": {"fleet": "fair"}"#;
        assert_eq!(runtime(&one(fair)).shared, Some(0));
        let general =
            [r#", "cost": {"response": "header:x-usage", "reserve": 2, "true_up": true}"#];
        for rule in general {
            assert_eq!(runtime(&one(rule)).shared, None, "{rule}");
        }
        let plain = r#"{"rules": [{"name": "r", "key": ["remote_address"],
            "rate_limit": {"requests_per_unit": 3, "unit": "second"}}]}"#;
        assert_eq!(runtime(plain).shared, None);
        let two = r#"{"rules": [
            {"name": "a", "key": ["header:x-user"],
             "rate_limit": {"requests_per_unit": 3, "unit": "second"}, "share": {}},
            {"name": "b", "rate_limit": {"requests_per_unit": 3, "unit": "second"}}]}"#;
        assert_eq!(runtime(two).shared, None);
    }

    #[test]
    fn the_shared_path_decides_counts_logs_waits_and_answers_as_the_general_one() {
        let configs = [
            one(""),
            one(r#", "algorithm": "leaky_bucket", "burst": 2"#),
            one(r#", "algorithm": "token_bucket", "burst": 2"#),
            one(r#", "shadow": true"#),
            one(r#", "cost": {"header": "x-cost"}"#),
            one(r#", "match": {"path_prefix": "/api"}"#),
            one(r#", "on_missing_key": "refuse""#),
            one(r#", "on_missing_key": "shared""#),
            r#"{"rules": [{"name": "r", "key": ["header:x-user"],
                "rate_limit": {"requests_per_unit": 6, "unit": "second"},
                "share": {"max_wait_ms": 1000, "bands": [{"name": "hi"}, {"name": "lo"}],
                          "band": {"from": "header:x-band", "default": "lo"},
                          "weight": {"from": "header:x-weight", "default": 1, "max": 9}}}],
                "log_limited": "info"}"#
                .into(),
            r#"{"rules": [{"name": "r", "key": ["header:x-user"],
                "rate_limit": {"requests_per_unit": 6, "unit": "second"}, "share": {}}],
                "response": {"dialect": "openai", "on_allowed": false}}"#
                .into(),
        ];
        let mut kinds = [0u64; 4];
        for json in &configs {
            let short = runtime(json);
            let mut general = runtime(json);
            assert_eq!(short.shared, Some(0), "{json}");
            general.shared = None;
            for n in 0..60u64 {
                let path = if n % 9 == 0 { "/other" } else { "/api/x" };
                let user = (n % 4).to_string();
                let cost = (n % 3).to_string();
                let band = if n % 2 == 0 { "hi" } else { "lo" };
                let weight = (1 + n % 3).to_string();
                let request = || {
                    let mut h = FakeHost::new("10.0.0.1", path)
                        .header("x-cost", &cost)
                        .header("x-band", band)
                        .header("x-weight", &weight);
                    if n % 7 != 0 {
                        h = h.header("x-user", &user);
                    }
                    h.now = 600_000 + n * 61;
                    h
                };
                let (mut a, mut b) = (request(), request());
                let (sa, sb) = (short.start(&mut a), general.start(&mut b));
                assert_eq!(format!("{sa:?}"), format!("{sb:?}"), "{json}: request {n}");
                assert_eq!(a.logs, b.logs, "{json}: request {n}");
                if let Start::Decided(d) = sa {
                    kinds[match d {
                        Decision::Continue(_) => 0,
                        Decision::Reply(_) => 1,
                        Decision::Queue(_) => 2,
                        _ => 3,
                    }] += 1;
                }
            }
            assert_eq!(counts(&short), counts(&general), "{json}");
        }
        // Admitted, refused and queued requests all compared (none decided otherwise).
        assert!(kinds[0] > 100 && kinds[1] > 50 && kinds[2] > 8, "{kinds:?}");
        assert_eq!(kinds[3], 0);
    }

    fn leased(share: &str, rule: &str) -> String {
        format!(
            r#"{{"rules": [{{"name": "p", "key": ["header:x-user"],
                "rate_limit": {{"requests_per_unit": 100, "unit": "second"}},
                "global": {{"cluster": "rls", "domain": "edge", "mode": "lease", "flush_ms": 10,
                           "max_block": 8}},
                "share": {{{share}}}{rule}}}]}}"#
        )
    }

    /// One request through `rt`'s stream at `now`, each claim answered by `service` (a
    /// counter of 100 a second): what the stream did, step by step, and what it logged.
    fn leased_request(
        rt: &Runtime<MemoryStore>,
        service: &mut (u64, u64),
        (n, now): (u64, u64),
    ) -> (Vec<String>, Vec<(log::Level, String)>) {
        use crate::runtime::stream::{Next, StreamState};
        let mut steps = Vec::new();
        // Claims ahead of need, as the background sends them at its tick.
        for (_, claim) in rt.claims_ahead(now) {
            steps.push(format!("ahead {}", claim.block));
            let answer = crate::testkit::second_counter(service, claim.block, now);
            rt.ahead_answered(&claim, Ok(answer), now);
        }
        let user = (n % 4).to_string();
        let cost = (1 + n % 2).to_string();
        let mut h = FakeHost::new("10.0.0.1", "/")
            .header("x-user", &user)
            .header("x-cost", &cost)
            .header("x-band", if n % 3 == 0 { "hi" } else { "lo" });
        h.now = now;
        let mut st = StreamState::default();
        let mut next = st.request_headers(rt, &mut h);
        for id in 1..10 {
            match next {
                Next::Call { message, .. } => {
                    let hits = crate::rls::decode_request(&message).map_or(0, |r| r.hits);
                    steps.push(format!("claim {hits}"));
                    assert!(matches!(st.started(rt, &mut h, Ok(id)), Next::Wait));
                    let answer = crate::testkit::second_counter(service, hits, now);
                    next = st.call_answer(rt, &mut h, id, Ok(answer));
                }
                Next::Continue => {
                    // What the admitted request's response carries.
                    let mut fields = Vec::new();
                    st.response_headers(
                        rt,
                        &mut crate::testkit::FakeResponse::default(),
                        || now,
                        &mut String::new(),
                        |k, v, _| fields.push(format!("{k}: {v}")),
                        |_, _| {},
                    );
                    steps.push(format!("Continue {fields:?}"));
                    break;
                }
                other => {
                    steps.push(format!("{other:?}"));
                    break;
                }
            }
        }
        (steps, h.logs)
    }

    /// What a request the shares refused gives back goes to the quota it was taken from, not
    /// into a later window's (granted meanwhile).
    #[test]
    fn a_refused_request_gives_back_only_to_the_window_it_took_from() {
        let rt = runtime(&leased("", ""));
        let (Some(policy), Some(key)) = (rt.compiled[0].lease, rt.compiled[0].capacity_key) else {
            panic!("not leased");
        };
        let (slot, alt) = table::slots_of(key, rt.buckets);
        let check = Check {
            slot,
            alt,
            fingerprint: table::fingerprint_of(key),
            policy,
            cost: 1,
            shadow: false,
            charge_later: false,
            base: None,
        };
        let held = |held: i64, expires_ms: u64| {
            let s = crate::limiter::lease::State {
                held,
                expires_ms,
                ..Default::default()
            };
            engine::update_lease(&rt.store, (slot, alt), check.fingerprint, 1_000, |_| {
                ((), Some(s))
            });
        };
        let now_held = || {
            engine::update_lease(&rt.store, (slot, alt), check.fingerprint, 1_500, |s| {
                (s.map(|s| s.held), None)
            })
            .0
            .flatten()
        };
        // Taken from a window ending at 1,000; the next window's grant came meanwhile.
        held(9, 2_000);
        rt.give_back_leased(&check, 0, (1_001, 1_000));
        assert_eq!(now_held(), Some(9));
        rt.give_back_leased(&check, 0, (1_001, 2_000));
        assert_eq!(now_held(), Some(10));
    }

    #[test]
    fn a_leased_capacity_on_the_shared_path_claims_and_decides_as_the_general_one() {
        let configs = [
            leased("", ""),
            leased("", r#", "cost": {"header": "x-cost"}"#),
            leased(r#""max_wait_ms": 150"#, r#", "cost": {"header": "x-cost"}"#),
            leased(
                r#""bands": [{"name": "hi"}, {"name": "lo"}],
                   "band": {"from": "header:x-band", "default": "lo"}"#,
                "",
            ),
            leased("", r#", "shadow": true"#),
        ];
        let t0: u64 = 1_800_000_000_000;
        let mut seen = [0u64; 3];
        // Requests that found the lease to be taken at once, and to be looked at first.
        let mut looked = [0u64; 2];
        use std::sync::atomic::Ordering::Relaxed;
        for json in &configs {
            let short = runtime(json);
            let mut general = runtime(json);
            assert_eq!(short.shared, Some(0), "{json}");
            general.shared = None;
            let (mut s1, mut s2) = ((0, 0), (0, 0));
            // 4 tenants at 60 a second each (some costing 2) against 100 a second: the lease
            // claims, runs low, is refused at the window's end; the shares refuse and queue.
            for n in 0..600u64 {
                let now = t0 + n * 8 + (n % 5);
                looked[usize::from(short.compiled[0].share_refusing.load(Relaxed))] += 1;
                let a = leased_request(&short, &mut s1, (n, now));
                let b = leased_request(&general, &mut s2, (n, now));
                assert_eq!(a, b, "{json}: request {n}");
                let last = a.0.last().map_or("", String::as_str);
                seen[0] += a.0.iter().filter(|s| s.starts_with(['c', 'a'])).count() as u64;
                seen[1] += u64::from(last.starts_with("Reply"));
                seen[2] += u64::from(last.starts_with("Continue"));
            }
            assert_eq!(s1, s2, "{json}: the service's counts");
            assert_eq!(counts(&short), counts(&general), "{json}");
        }
        // Claims, refusals and admissions all compared, both orders of the lease's check.
        assert!(seen.iter().all(|&k| k > 50), "{seen:?}");
        assert!(looked.iter().all(|&k| k > 200), "{looked:?}");
    }
}
