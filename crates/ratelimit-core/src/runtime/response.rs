//! The response's side of an admitted request: the fields added to its answer, and what the
//! answer says to the rules that watch it (an elastic rule's backend health, a shared rule's
//! provider). What a response owes its rules in usage is charged in [`super::charge`].
//!
//! May use the runtime's request pipeline (its verdicts, [`super::request::Admitted`]), the
//! configuration, the engine's shared records, the provider's fields and the headers and
//! dialects that write the rate-limit fields.

use super::request::Admitted;
use crate::config::Dialect;
use crate::dialect;
use crate::engine;
use crate::headers;
use crate::metrics::Counter;
use crate::runtime::Runtime;
use crate::store::Store;
use smallvec::SmallVec;

/// What the pipeline reads of a response: a header field in [`Runtime::response_headers`], a
/// trailer in [`Runtime::response_trailers`].
pub trait Response {
    /// A field's value by lower-case name (its first line, if it has several).
    fn field(&mut self, name: &str) -> Option<&[u8]>;
    /// Gives `line` each line of a field, in order; a host that has them joined by commas
    /// already may give them as one. HTTP reads several lines of one name as one
    /// comma-separated list (RFC 9110 §5.3), and so does the pipeline where two values must
    /// not pass for one (the provider's fields): this may cost a host more than
    /// [`Response::field`].
    fn field_lines(&mut self, name: &str, line: &mut dyn FnMut(&[u8]));
    /// Takes a field out (every line of it): a provider's fields a shared rule strips.
    fn remove(&mut self, name: &str);
}

/// A field's value as HTTP reads it, copied: its lines joined by `, ` (`None`: no line).
fn combined(response: &mut impl Response, name: &str) -> Option<SmallVec<[u8; 64]>> {
    let mut value: Option<SmallVec<[u8; 64]>> = None;
    response.field_lines(name, &mut |line| match &mut value {
        None => value = Some(SmallVec::from_slice(line)),
        Some(v) => {
            v.extend_from_slice(b", ");
            v.extend_from_slice(line);
        }
    });
    value
}

/// Takes every limit field of `api` out of a response: they describe the whole account (every
/// tenant's use), not the client's share.
fn strip_provider_fields(api: crate::provider::Api, response: &mut impl Response) {
    use crate::provider::{field_names, Measure};
    let measures = [
        Measure::Requests,
        Measure::Tokens,
        Measure::InputTokens,
        Measure::OutputTokens,
    ];
    for names in measures.iter().filter_map(|&m| field_names(api, m)) {
        for name in names {
            response.remove(name);
        }
    }
}

impl<S: Store> Runtime<S> {
    /// The response's headers are in: charges the rules whose usage they report, then hands
    /// every field to add to `emit(name, value, append)`, the values written into `buf` (keep
    /// one per thread: nothing is allocated then). A rule charged here reports its quota after
    /// the charge; one charged later (body, trailers) reports the quota as it was at admission.
    /// The rate-limit fields are added, not replaced, as Envoy's own local rate limit filter
    /// does (an upstream's own fields stay beside them; replacing costs a search of the
    /// response's headers per field); the services' headers and a dialect's fields replace.
    pub fn response_headers(
        &self,
        a: &mut Admitted,
        response: &mut impl Response,
        now_ms: u64,
        buf: &mut String,
        mut emit: impl FnMut(&str, &str, bool),
        report: &mut impl FnMut(&str, u64),
    ) {
        if !a.owed.is_empty() {
            self.charge_reported(a, response, now_ms, report);
            self.start_scan(a, response);
        }
        if !a.watched.is_empty() {
            self.observe(a, response, now_ms);
        }
        for (k, v) in &a.service {
            emit(k, v, false);
        }
        let describe = |i: usize| {
            let r = self.config.rules.get(i)?;
            Some((
                r.name.as_str(),
                r.quota_unit.as_deref(),
                self.compiled.get(i).map(|c| &c.texts),
            ))
        };
        let style = self.config.response.headers;
        headers::each_field(style, &a.verdicts, describe, false, buf, |k, v| {
            emit(k, v, true)
        });
        // A dialect's fields replace the backend's of the same name (a real API's own limits):
        // its SDK reads one value of each, and two would read as none.
        let dialect = self.config.response.dialect;
        if dialect != Dialect::Default && !a.verdicts.is_empty() {
            let classed = self.classed(&a.verdicts);
            dialect::each_field(dialect, &classed, now_ms, false, buf, |k, v| {
                emit(k, v, false)
            });
        }
    }

    /// Tells each elastic rule the request matched how its backend answered, and each shared
    /// rule what the provider said.
    fn observe(&self, a: &mut Admitted, response: &mut impl Response, now_ms: u64) {
        let status = response
            .field(":status")
            .and_then(|s| std::str::from_utf8(s).ok()?.parse::<u16>().ok())
            .unwrap_or(0);
        let latency = now_ms.saturating_sub(a.admitted_ms);
        // Every rule reads the provider's fields before any are taken out.
        let mut strip: SmallVec<[crate::provider::Api; 1]> = SmallVec::new();
        for rule in std::mem::take(&mut a.watched) {
            let Some(c) = self.compiled.get(rule) else {
                continue;
            };
            if let Some(w) = &c.watch {
                w.observe(status, latency);
            } else if let Some(sh) = self.config.rules.get(rule).and_then(|r| r.share.as_ref()) {
                self.learn(rule, sh, response, status, a.admitted_ms, now_ms);
                if let Some(l) = sh.learn.filter(|l| l.strip && !strip.contains(&l.api)) {
                    strip.push(l.api);
                }
            }
        }
        for api in strip {
            strip_provider_fields(api, response);
        }
    }

    /// A shared rule with `share.learn` had a request admitted and answered: a provider
    /// refusal is counted, and what the provider said of its limit is folded into the rule's
    /// record ([`crate::share::learn`]); [`Runtime::observe`] takes the fields out afterwards
    /// (`strip`).
    fn learn(
        &self,
        rule: usize,
        sh: &crate::config::ShareConfig,
        response: &mut impl Response,
        status: u16,
        admitted_ms: u64,
        now_ms: u64,
    ) {
        use crate::provider::{self, Reading};
        use crate::share::learn;
        let refused = status == 429;
        if refused {
            self.metrics.add(rule, Counter::ProviderLimited, 1);
        }
        let Some(l) = sh.learn else {
            return;
        };
        let Some(names) = provider::field_names(l.api, l.measure) else {
            return;
        };
        // The three fields, whole: a field on two lines is two values, malformed as one on a
        // line `5, 6`, not its first line taken for the limit.
        let mut values: [Option<SmallVec<[u8; 64]>>; 3] = [None, None, None];
        for (slot, name) in values.iter_mut().zip(names) {
            *slot = combined(response, name);
        }
        let reading = provider::read(l.api, l.measure, now_ms, |name| {
            let i = names.iter().position(|n| *n == name)?;
            values.get(i)?.as_deref()
        });
        let said = match reading {
            Reading::Said(s) => Some(s),
            Reading::Absent => None,
            Reading::Invalid => {
                self.metrics.add(rule, Counter::ProviderFieldsInvalid, 1);
                None
            }
        };
        let retry_after_ms = if refused {
            let ms = combined(response, "retry-after-ms");
            let s = combined(response, "retry-after");
            provider::retry_after_ms(ms.as_deref(), s.as_deref(), now_ms)
        } else {
            None
        };
        let answer = learn::Answer {
            said,
            refused,
            retry_after_ms,
        };
        if said.is_none() && !refused {
            return;
        }
        let Some((policy, slot, fleet)) = self
            .compiled
            .get(rule)
            .map(|c| (c.policy, c.share_record(), sh.fleet_fair))
        else {
            return;
        };
        let folded = engine::update_share_record(&self.store, slot, None, |record| {
            let at = (admitted_ms, now_ms);
            let f = learn::fold(&l, &sh.params, &policy, record, &answer, at, fleet);
            (f, f.changed)
        });
        if let Some(f) = folded {
            self.metrics.add(rule, Counter::ProviderSynced, f.synced);
        }
    }
}
