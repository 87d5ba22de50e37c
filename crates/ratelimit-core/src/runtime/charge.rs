//! What a request's rules are owed once its response is known, and the reservations sized from
//! its body: usage read from response headers, trailers and bodies (JSON and event streams,
//! scanned as they pass), charged afterwards or trued up against the reservation counted at
//! admission, and in-flight slots given back.
//!
//! A usage is known at the response header or trailer that reports it, or at the end of the
//! response body; a stream that ends before any of these (reset, cut short) is charged the
//! rule's default. Each usage settled is handed to the host's `report(rule, usage)` (the
//! access log's dynamic metadata or filter state).

use super::request::{Admitted, Debt, DebtKind, Pending, Response};
use super::Runtime;
use crate::config::{self, Cost, Usage};
use crate::engine::{self, Owed};
use crate::limiter::Verdict;
use crate::metrics::{Counter, Gauge};
use crate::store::Store;
use crate::usage::{Format, Scanner};

/// The scan of one response body for the usage it reports.
#[derive(Debug)]
pub struct BodyScan {
    /// `None`: the body cannot be read (compressed): its usage is not reported.
    scanner: Option<Scanner>,
}

impl BodyScan {
    /// Whether the body's bytes are read.
    pub(super) fn reads(&self) -> bool {
        self.scanner.is_some()
    }
}

/// Reads a request body for the fields that size its reservations.
#[derive(Debug)]
pub struct Reading {
    pub(super) pending: Pending,
    scanner: Scanner,
    /// Body bytes seen so far.
    bytes: u64,
}

impl Reading {
    /// Starts reading for `pending`'s sized checks.
    pub(super) fn new(pending: Pending) -> Reading {
        Reading {
            pending,
            scanner: Scanner::new(Format::Json),
            bytes: 0,
        }
    }
}

/// A usage settled: what the rule is charged for it in all, and what is still owed the store
/// (nothing when a reservation was exactly right).
struct TrueUp {
    used: u64,
    owed: Option<Owed>,
}

impl<S: Store> Runtime<S> {
    /// A piece of the request body (`end`: the last): scans it for the reservations' fields.
    /// True once every sized check has its cost (the request may be decided); a body that has
    /// not named them within the rules' `max_body` bytes, or that ended, reserves each rule's
    /// figure for those not found.
    pub(super) fn read_request(&self, r: &mut Reading, chunk: &[u8], end: bool) -> bool {
        let paths = &self.config.request_paths;
        r.scanner.feed(paths, chunk);
        r.bytes = r.bytes.saturating_add(chunk.len() as u64);
        if end {
            r.scanner.finish(paths);
        }
        let mut all_found = true;
        let mut by_bytes = false;
        let mut max_body = 0u64;
        for &i in &r.pending.sized {
            let Some(sized) = self.sized_of(&r.pending, i) else {
                continue;
            };
            all_found &= r.scanner.value(sized.slot).is_some();
            by_bytes |= matches!(sized.input, config::Input::PerBytes(_));
            max_body = max_body.max(u64::from(sized.max_body));
        }
        let known_length = r.pending.content_length.is_some() || !by_bytes;
        if !(end || r.bytes > max_body || all_found && known_length) {
            return false;
        }
        let length = r.pending.content_length.unwrap_or(r.bytes);
        for i in std::mem::take(&mut r.pending.sized) {
            let Some((charge, sized, rule)) = self.charge_at(&r.pending, i) else {
                continue;
            };
            let cost = match r.scanner.value(sized.slot) {
                Some(max) => max
                    .saturating_add(sized.input.estimate(length))
                    .clamp(1, u64::from(rule.limit.capacity().max(1))),
                None => charge.admission(),
            };
            if let Some(check) = r.pending.checks.get_mut(i) {
                check.cost = cost;
            }
        }
        true
    }

    fn charge_at(
        &self,
        p: &Pending,
        i: usize,
    ) -> Option<(&config::Charge, &config::Sized, &config::Rule)> {
        let rule = self.config.rules.get(p.applied.get(i)?.rule)?;
        let charge = rule.charge()?;
        Some((charge, charge.sized.as_ref()?, rule))
    }

    fn sized_of(&self, p: &Pending, i: usize) -> Option<&config::Sized> {
        self.charge_at(p, i).map(|(_, s, _)| s)
    }

    /// The response's headers say how to read its body: a `text/event-stream` is a stream of
    /// JSON events, anything else one JSON document; a compressed body is not guessed at (its
    /// usage is not reported).
    pub(super) fn start_scan(&self, a: &mut Admitted, response: &mut impl Response) {
        let reads_body = a.owed.iter().any(|d| {
            matches!(self.charge_of(d.rule), Some(Usage::Body(_)))
                && !matches!(d.kind, DebtKind::Slot(_))
        });
        if !reads_body || a.scan.is_some() {
            return;
        }
        let encoded = response
            .field("content-encoding")
            .is_some_and(|e| !e.trim_ascii().eq_ignore_ascii_case(b"identity"));
        let scanner = if encoded {
            None
        } else {
            let sse = response.field("content-type").is_some_and(|t| {
                t.trim_ascii_start()
                    .get(..17)
                    .is_some_and(|t| t.eq_ignore_ascii_case(b"text/event-stream"))
            });
            Some(Scanner::new(if sse { Format::Sse } else { Format::Json }))
        };
        a.scan = Some(Box::new(BodyScan { scanner }));
    }

    /// A piece of the response body passes: counted, and scanned when a rule reads it. At its
    /// `end`, the usage the body reported is charged.
    pub fn response_body(
        &self,
        a: &mut Admitted,
        len: u64,
        bytes: Option<&[u8]>,
        end: bool,
        now_ms: u64,
        report: &mut impl FnMut(&str, u64),
    ) {
        a.body_bytes = a.body_bytes.saturating_add(len);
        if let (Some(scan), Some(bytes)) = (a.scan.as_mut(), bytes) {
            if let Some(s) = scan.scanner.as_mut() {
                s.feed(&self.config.usage_paths, bytes);
            }
        }
        if end {
            self.body_ended(a, now_ms, report);
        }
    }

    /// The body is over (its last piece, or the trailers came): charges what the body reports.
    pub(super) fn body_ended(
        &self,
        a: &mut Admitted,
        now_ms: u64,
        report: &mut impl FnMut(&str, u64),
    ) {
        if let Some(s) = a.scan.as_mut().and_then(|s| s.scanner.as_mut()) {
            s.finish(&self.config.usage_paths);
        }
        let mut i = 0;
        while let Some(debt) = a.owed.get(i).copied() {
            let known = match (debt.kind, self.charge_of(debt.rule)) {
                (DebtKind::Slot(_), _) | (_, Some(Usage::Header(_)) | None) => None,
                (_, Some(Usage::BodyBytes)) => Some(Some(a.body_bytes)),
                (_, Some(Usage::Body(body))) => Some(
                    a.scan
                        .as_ref()
                        .and_then(|s| s.scanner.as_ref())
                        .and_then(|s| body.total(|slot| s.value(slot))),
                ),
            };
            let Some(usage) = known else {
                i += 1;
                continue;
            };
            a.owed.swap_remove(i);
            self.pay_usage(a, &debt, usage, now_ms, report);
        }
    }

    /// Charges the usage debts whose header `fields` carries, updating their verdicts.
    pub(super) fn charge_reported(
        &self,
        a: &mut Admitted,
        fields: &mut impl Response,
        now_ms: u64,
        report: &mut impl FnMut(&str, u64),
    ) {
        let mut i = 0;
        while let Some(debt) = a.owed.get(i).copied() {
            let reported = match (debt.kind, self.charge_of(debt.rule)) {
                (DebtKind::Slot(_), _) => None,
                (_, Some(Usage::Header(name))) => fields.field(name).and_then(config::parse_usage),
                _ => None,
            };
            let Some(usage) = reported else {
                i += 1;
                continue;
            };
            a.owed.swap_remove(i);
            self.pay_usage(a, &debt, Some(usage), now_ms, report);
        }
    }

    /// Charges the usages known from elsewhere, by rule name (replay reads them from an access
    /// log, where [`StreamState`](super::StreamState) reported them).
    pub fn charge_known(
        &self,
        a: &mut Admitted,
        usage: impl Fn(&str) -> Option<u64>,
        now_ms: u64,
        report: &mut impl FnMut(&str, u64),
    ) {
        let mut i = 0;
        while let Some(debt) = a.owed.get(i).copied() {
            let known = match debt.kind {
                DebtKind::Slot(_) => None,
                _ => self
                    .config
                    .rules
                    .get(debt.rule)
                    .and_then(|r| usage(&r.name)),
            };
            let Some(used) = known else {
                i += 1;
                continue;
            };
            a.owed.swap_remove(i);
            self.pay_usage(a, &debt, Some(used), now_ms, report);
        }
    }

    /// The response's trailers are in: charges the rules whose usage they report; the body is
    /// over.
    pub fn response_trailers(
        &self,
        a: &mut Admitted,
        trailers: &mut impl Response,
        now_ms: u64,
        report: &mut impl FnMut(&str, u64),
    ) {
        if !a.owed.is_empty() {
            self.charge_reported(a, trailers, now_ms, report);
            self.body_ended(a, now_ms, report);
        }
    }

    /// The stream is over, however it ended: charges what is still owed (the body's bytes that
    /// passed, or the default for a response that never reported its usage) and gives the
    /// in-flight slots back.
    pub fn settle(&self, a: Admitted, now_ms: u64, report: &mut impl FnMut(&str, u64)) {
        let mut a = a;
        for debt in std::mem::take(&mut a.owed) {
            match (debt.kind, self.charge_of(debt.rule)) {
                (DebtKind::Slot(taken_ms), _) => {
                    self.metrics.gauge(Gauge::InFlight, -1);
                    self.pay(&debt, Owed::GiveBack { taken_ms }, now_ms);
                }
                (_, Some(Usage::BodyBytes)) => {
                    let bytes = a.body_bytes;
                    self.pay_usage(&mut a, &debt, Some(bytes), now_ms, report);
                }
                _ => self.pay_usage(&mut a, &debt, None, now_ms, report),
            }
        }
    }

    /// Settles a usage debt with the usage the response reported (`None`: it never did, and
    /// the rule's default is charged), and hands it to `report`. A reservation counted at
    /// admission is trued up: what was not used is given back, the excess charged.
    fn pay_usage(
        &self,
        a: &mut Admitted,
        debt: &Debt,
        usage: Option<u64>,
        now_ms: u64,
        report: &mut impl FnMut(&str, u64),
    ) {
        let Some(rule) = self.config.rules.get(debt.rule) else {
            return;
        };
        let Cost::Response(charge) = &rule.cost else {
            return;
        };
        let reserved = match debt.kind {
            DebtKind::Reserved(r) => Some(r),
            _ => None,
        };
        if usage.is_none() {
            self.metrics.add(debt.rule, Counter::UsageUnreported, 1);
        }
        let used = usage.unwrap_or_else(|| charge.unreported(reserved.unwrap_or(0)));
        let t = self.true_up(debt.rule, reserved, used, a.admitted_ms);
        self.metrics.add(debt.rule, Counter::UsageCharged, t.used);
        report(&rule.name, t.used);
        let Some(owed) = t.owed else {
            return;
        };
        if let Some(v) = self.pay(debt, owed, now_ms) {
            a.update_verdict(debt.rule, v);
        }
    }

    /// What settling `used` against a reservation (if any) owes the store.
    fn true_up(&self, rule: usize, reserved: Option<u64>, used: u64, counted_ms: u64) -> TrueUp {
        let owed = match reserved {
            None => Some(Owed::Charge(used)),
            Some(r) if used > r => {
                self.metrics.add(rule, Counter::UsageExceeded, used - r);
                Some(Owed::Charge(used - r))
            }
            Some(r) if used < r => {
                self.metrics.add(rule, Counter::UsageRefunded, r - used);
                Some(Owed::Refund {
                    cost: r - used,
                    counted_ms,
                })
            }
            Some(_) => None,
        };
        TrueUp { used, owed }
    }

    /// Settles one debt in the store; the key's quota after it.
    fn pay(&self, debt: &Debt, owed: Owed, now_ms: u64) -> Option<Verdict> {
        let policy = &self.compiled.get(debt.rule)?.policy;
        let out = engine::settle(
            &self.store,
            debt.slot,
            debt.fingerprint,
            policy,
            owed,
            now_ms,
        );
        if let Some(failure) = self.store_work(debt.rule, &out) {
            // The request went through already: what it owed is lost (failing open).
            self.metrics.add(debt.rule, Counter::FailedOpen, 1);
            if self.may_log_failure(now_ms) {
                let name = self
                    .config
                    .rules
                    .get(debt.rule)
                    .map_or("", |r| r.name.as_str());
                log::warn!("rule {name} could not settle {owed:?} ({failure}): it is not counted");
            }
        }
        out.verdict
    }

    /// Where a rule's usage comes from, if it is charged by its responses.
    pub(super) fn charge_of(&self, rule: usize) -> Option<&Usage> {
        Some(&self.config.rules.get(rule)?.charge()?.usage)
    }
}
