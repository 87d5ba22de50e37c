//! What a request's rules are owed once its response is known, and the reservations sized from
//! its body: usage read from response headers, trailers and bodies (JSON and event streams,
//! scanned as they pass), charged afterwards or trued up against the reservation counted at
//! admission, and in-flight slots given back.
//!
//! A usage is known at the response header or trailer that reports it, or at the end of the
//! response body; a stream that ends before any of these (reset, cut short) is charged the
//! rule's default. Each usage settled is handed to the host's `report(rule, usage)` (the
//! access log's dynamic metadata or filter state).

use super::request::{Admitted, BodyScan, Debt, DebtKind, Host, Pending};
use super::response::Response;
use super::Runtime;
use crate::config::{self, Cost, Usage};
use crate::engine::{self, Check, Owed};
use crate::key::Attributes;
use crate::limiter::Verdict;
use crate::metrics::{Counter, Gauge};
use crate::store::Store;
use crate::usage::{Format, Scanner};
use std::sync::PoisonError;

/// The wait told a request refused because of reservations still in flight on its key, ms
/// (the wait of a request refused a slot in flight).
pub const RESERVATION_WAIT_MS: u64 = crate::limiter::in_flight::RETRY_HINT_MS;

/// Reads a request body for the fields that size its reservations.
#[derive(Debug)]
pub struct Reading {
    pub(super) pending: Pending,
    scanner: Scanner,
    /// Body bytes seen so far.
    bytes: u64,
}

impl Reading {
    /// Starts reading for `pending`'s sized checks and the rules waiting for body fields.
    pub(super) fn new(pending: Pending) -> Reading {
        let scanner = Scanner::request(!pending.deferred.is_empty());
        Reading {
            pending,
            scanner,
            bytes: 0,
        }
    }
}

/// What reading a piece of the request body came to.
#[derive(Debug)]
pub(super) enum Read {
    /// More of the body is needed.
    More,
    /// The fields are read: the request may be decided.
    Ready,
    /// A rule that waited for the body refuses the request for lacking its key
    /// (`on_missing_key: refuse`).
    Refused(Box<super::Reply>),
}

/// The host of a request whose body's fields are read: the host's attributes, and the fields.
struct WithBody<'a, H> {
    host: &'a mut H,
    scanner: &'a Scanner,
}

impl<H: Host> Attributes for WithBody<'_, H> {
    fn source_address(&mut self) -> Option<&str> {
        self.host.source_address()
    }
    fn path(&mut self) -> Option<&str> {
        self.host.path()
    }
    fn method(&mut self) -> Option<&str> {
        self.host.method()
    }
    fn authority(&mut self) -> Option<&str> {
        self.host.authority()
    }
    fn header(&mut self, name: &str) -> Option<&[u8]> {
        self.host.header(name)
    }
    fn metadata(&mut self, namespace: &str, key: &str) -> Option<config::Carried<'_>> {
        self.host.metadata(namespace, key)
    }
    fn filter_state(&mut self, key: &str) -> Option<&[u8]> {
        self.host.filter_state(key)
    }
    fn client_address(&mut self) -> Option<&str> {
        self.host.client_address()
    }
    fn body_field(&mut self, slot: usize) -> Option<&[u8]> {
        self.scanner.text(slot)
    }
}

impl<H: Host> Host for WithBody<'_, H> {
    fn now_ms(&mut self) -> u64 {
        self.host.now_ms()
    }
    fn held(&self) -> usize {
        self.host.held()
    }
    fn log(&mut self, level: log::Level, line: std::fmt::Arguments<'_>) {
        self.host.log(level, line);
    }
}

/// A usage settled: what the rule is charged for it in all, and what is still owed the store
/// (nothing when a reservation was exactly right).
struct TrueUp {
    used: u64,
    owed: Option<Owed>,
}

impl<S: Store> Runtime<S> {
    /// A piece of the request body (`end`: the last): scans it for the fields of the
    /// reservations and of the rules waiting for them. Ready once every sized check has its
    /// cost, and the rules that read body fields have seen the body to its end or past
    /// `max_body` (a key given twice counts as it comes last, as the backend reads it); a body
    /// that has not named a reservation's field within the rules' `max_body` bytes (the most
    /// of them: only that many are read), or that ended, reserves each rule's figure for those
    /// not found.
    pub(super) fn read_request(
        &self,
        r: &mut Reading,
        chunk: &[u8],
        end: bool,
        host: &mut impl Host,
    ) -> Read {
        let mut by_bytes = false;
        let mut max_body = 0u64;
        for &i in &r.pending.sized {
            let Some(sized) = self.sized_of(&r.pending, i) else {
                continue;
            };
            by_bytes |= matches!(sized.input, config::Input::PerBytes(_));
            max_body = max_body.max(u64::from(sized.max_body));
        }
        let fields = !r.pending.deferred.is_empty();
        if fields {
            max_body = max_body.max(u64::from(self.config.max_body));
        }
        // Only the first max_body bytes are read: a field past them is not seen, however the
        // body is cut into pieces.
        let paths = &self.config.request_paths;
        let room = usize::try_from(max_body.saturating_sub(r.bytes)).unwrap_or(usize::MAX);
        r.scanner.feed(paths, chunk.get(..room).unwrap_or(chunk));
        r.bytes = r.bytes.saturating_add(chunk.len() as u64);
        if end && r.bytes <= max_body {
            r.scanner.finish(paths);
        }
        let all_found = r.pending.sized.iter().all(|&i| {
            self.sized_of(&r.pending, i)
                .is_none_or(|sized| sized.maximum(|slot| r.scanner.value(slot)).is_some())
        });
        let known_length = r.pending.content_length.is_some() || !by_bytes;
        if !(end || r.bytes >= max_body || all_found && known_length && !fields) {
            return Read::More;
        }
        if fields {
            if self.config.log_body_fields {
                self.report_fields(&r.pending, &r.scanner, host);
            }
            let mut with = WithBody {
                host,
                scanner: &r.scanner,
            };
            if let Err(reply) = self.take_deferred(&mut r.pending, &mut with) {
                return Read::Refused(reply);
            }
        }
        let length = r.pending.content_length.unwrap_or(r.bytes);
        for i in std::mem::take(&mut r.pending.sized) {
            let Some((charge, sized, rule)) = self.charge_at(&r.pending, i) else {
                continue;
            };
            let input = sized.input.estimate(length);
            let cost = match (sized.maximum(|slot| r.scanner.value(slot)), rule.price()) {
                (Some(max), price) => price
                    .zip(r.pending.applied.get(i))
                    .map_or(max.saturating_add(input), |(price, a)| {
                        price.reservation(a.priced, max, input)
                    })
                    .clamp(1, u64::from(rule.limit.capacity().max(1))),
                (None, _) => charge.admission(),
            };
            if let Some(check) = r.pending.checks.get_mut(i) {
                check.cost = cost;
            }
        }
        Read::Ready
    }

    /// Hands the host each body field the waiting rules read, found in the body (once per
    /// field, however many rules read it).
    fn report_fields(&self, p: &Pending, scanner: &Scanner, host: &mut impl Host) {
        let mut done = 0u16;
        for rule in p.deferred.iter().filter_map(|&i| self.config.rules.get(i)) {
            let mut each = |f: &config::BodyField| {
                let bit = crate::usage::slot_bit(f.slot);
                if done & bit != 0 {
                    return;
                }
                done |= bit;
                if let (Some(value), Some(name)) =
                    (scanner.text(f.slot), self.logged_fields.get(f.slot))
                {
                    host.body_field_read(name, value);
                }
            };
            rule.matcher.body.iter().for_each(|m| each(&m.field));
            rule.key.iter().for_each(|k| k.each_body_field(&mut each));
        }
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
        let reads = |u: Option<&Usage>| matches!(u, Some(Usage::Body(_) | Usage::Price(_)));
        let reads_body = a
            .owed
            .iter()
            .any(|d| reads(self.charge_of(d.rule)) && !matches!(d.kind, DebtKind::Slot(_)));
        // The model an answer names is text: only then is it kept.
        let texts = a.owed.iter().any(|d| {
            matches!(self.charge_of(d.rule), Some(Usage::Price(p))
                if matches!(p.model, config::ModelFrom::Answer(_)))
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
            let format = if sse { Format::Sse } else { Format::Json };
            Some(if texts {
                Scanner::with_texts(format)
            } else {
                Scanner::new(format)
            })
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
        clock: impl FnOnce() -> u64,
        report: &mut impl FnMut(&str, u64),
    ) {
        a.body_bytes = a.body_bytes.saturating_add(len);
        let mut last_event = false;
        if let (Some(scan), Some(bytes)) = (a.scan.as_mut(), bytes) {
            if let Some(s) = scan.scanner.as_mut() {
                let before = s.ended();
                s.feed(&self.config.usage_paths, bytes);
                last_event = s.ended() && !before;
            }
        }
        // An event stream's last event says all its usage: charged at once, before the piece
        // carrying it passes on (a client may hang up as soon as it has it, before the body's
        // end reaches the proxy). Its bytes, if a rule counts them, wait for the end.
        if end {
            self.body_ended(a, clock(), report);
        } else if last_event {
            self.last_event(a, clock(), report);
        }
    }

    /// An event stream's last event came: charges what its events reported to the rules whose
    /// usage they carry (body bytes still wait for the end).
    fn last_event(&self, a: &mut Admitted, now_ms: u64, report: &mut impl FnMut(&str, u64)) {
        self.pay_known(a, now_ms, report, |rt, debt, a| {
            rt.reported_by_body(debt, a)
        });
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
        self.pay_known(a, now_ms, report, |rt, debt, a| {
            match rt.charge_of(debt.rule) {
                Some(Usage::Header(_)) | None => None,
                Some(Usage::BodyBytes) => Some(Some(a.body_bytes)),
                Some(Usage::Body(_) | Usage::Price(_)) => rt.reported_by_body(debt, a),
            }
        });
    }

    /// What the body's scan says `debt`'s rule used (`Some(None)`: it said nothing); `None` for
    /// a rule whose usage the body does not carry.
    fn reported_by_body(&self, debt: &Debt, a: &Admitted) -> Option<Option<u64>> {
        let scanner = a.scan.as_ref().and_then(|s| s.scanner.as_ref());
        match self.charge_of(debt.rule) {
            Some(Usage::Body(body)) => Some(scanner.and_then(|s| body.total(|slot| s.value(slot)))),
            Some(Usage::Price(price)) => {
                Some(scanner.and_then(|s| {
                    price.total(debt.priced, |slot| s.value(slot), |slot| s.text(slot))
                }))
            }
            _ => None,
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
        self.pay_known(a, now_ms, report, |rt, debt, _| {
            match rt.charge_of(debt.rule) {
                Some(Usage::Header(name)) => {
                    fields.field(name).and_then(config::parse_usage).map(Some)
                }
                _ => None,
            }
        });
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
        self.pay_known(a, now_ms, report, |rt, debt, _| {
            let rule = rt.config.rules.get(debt.rule)?;
            usage(&rule.name).map(Some)
        });
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

    /// Settles every usage debt whose usage `known` tells: `Some(usage)`, where `None` is a
    /// usage that will never be reported; `None` leaves the debt owed.
    fn pay_known(
        &self,
        a: &mut Admitted,
        now_ms: u64,
        report: &mut impl FnMut(&str, u64),
        mut known: impl FnMut(&Self, &Debt, &Admitted) -> Option<Option<u64>>,
    ) {
        let mut i = 0;
        while let Some(debt) = a.owed.get(i).cloned() {
            let usage = match debt.kind {
                DebtKind::Slot(_) => None,
                _ => known(self, &debt, a),
            };
            let Some(usage) = usage else {
                i += 1;
                continue;
            };
            a.owed.swap_remove(i);
            self.pay_usage(a, &debt, usage, now_ms, report);
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
        if let Some(r) = reserved {
            self.release_reservation(debt, r);
        }
        if usage.is_none() {
            self.metrics.add(debt.rule, Counter::UsageUnreported, 1);
        }
        let used = usage.unwrap_or_else(|| charge.unreported(reserved.unwrap_or(0)));
        let t = self.true_up(debt.rule, reserved, used, a.admitted_ms);
        self.metrics.add(debt.rule, Counter::UsageCharged, t.used);
        report(&rule.name, t.used);
        if let Some(r) = &debt.report {
            self.report_usage(r, t.used);
            if !r.local {
                return; // the service alone counts the key
            }
        }
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

    /// A request was admitted with `cost` reserved (counted) under `debt`'s rule and key.
    pub(super) fn hold_reservation(&self, debt: &Debt, cost: u64) {
        let mut held = self.reserved.lock().unwrap_or_else(PoisonError::into_inner);
        let n = held
            .entry((debt.rule, debt.slot, debt.fingerprint))
            .or_default();
        *n = n.saturating_add(cost);
    }

    /// The reservation `cost` of `debt` was settled (trued up).
    fn release_reservation(&self, debt: &Debt, cost: u64) {
        let mut held = self.reserved.lock().unwrap_or_else(PoisonError::into_inner);
        let key = (debt.rule, debt.slot, debt.fingerprint);
        if let Some(n) = held.get_mut(&key) {
            *n = n.saturating_sub(cost);
            if *n == 0 {
                held.remove(&key);
            }
        }
    }

    /// A rule refused a request with verdict `v`: if the reservations this runtime's requests
    /// still hold on the key would leave room for the request once given back, the refusal is
    /// theirs, not the window's: they settle when their answers end (a true-up gives back what
    /// was not used), which no one can foresee, so the request is told to come back in
    /// [`RESERVATION_WAIT_MS`], as a request refused a slot in flight is, instead of when the
    /// window would make room with the reservations used in full.
    pub(super) fn wait_for_reservations(&self, rule: usize, check: &Check, v: Verdict) -> Verdict {
        if check.charge_later || v.allowed || v.retry_after_ms <= RESERVATION_WAIT_MS {
            return v;
        }
        let held = self
            .reserved
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&(rule, check.slot, check.fingerprint))
            .copied()
            .unwrap_or(0);
        if held == 0 || v.remaining.saturating_add(held) < check.cost {
            return v;
        }
        Verdict {
            retry_after_ms: RESERVATION_WAIT_MS,
            ..v
        }
    }

    /// Settles one debt in the store; the key's quota after it.
    fn pay(&self, debt: &Debt, owed: Owed, now_ms: u64) -> Option<Verdict> {
        let out = match debt.share {
            Some((record, share)) => engine::settle_share(
                &self.store,
                (debt.slot, debt.alt),
                debt.fingerprint,
                record,
                &share,
                &debt.policy,
                owed,
                now_ms,
            ),
            None => engine::settle(
                &self.store,
                (debt.slot, debt.alt),
                debt.fingerprint,
                &debt.policy,
                owed,
                now_ms,
            ),
        };
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

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::panic, clippy::indexing_slicing)]
mod tests;
