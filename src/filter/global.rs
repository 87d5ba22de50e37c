//! Global rules: Envoy's rate limit service protocol over `dispatch_grpc_call`.
//!
//! Sync rules ask the service before the request goes on. Async rules are decided locally at
//! once; each worker adds up the hits of each key and its root context reports them on a tick
//! (`hits_addend`); a key the service says is over its limit is blocked in the shared table until
//! the service's reset time, so every worker of this proxy refuses it from then on.

use super::host;
use super::{CompiledRule, Runtime};
use crate::config::{Global, GlobalMode, Rule};
use crate::key::Descriptor;
use crate::limiter::{Check, Policy, State, Verdict};
use crate::rls;
use crate::store::{Store, StoreError};
use crate::table::Slot;
use std::cell::RefCell;
use std::collections::HashMap;

/// The most distinct keys one worker gathers hits for between two flushes; hits of further
/// keys in that interval are not reported (they were still decided locally).
const MAX_ASYNC_KEYS: usize = 10_000;

/// Hits of one key since the last flush.
struct Hits {
    rule_fingerprint: u64,
    entries: Descriptor,
    hits: u64,
    slot: u64,
    fingerprint: u64,
}

/// A flush in flight: where to record a block.
struct Flush {
    rule_fingerprint: u64,
    slot: u64,
    fingerprint: u64,
}

thread_local! {
    static HITS: RefCell<HashMap<u64, Hits>> = RefCell::new(HashMap::new());
    static FLUSHES: RefCell<HashMap<u32, Flush>> = RefCell::new(HashMap::new());
}

fn entry_refs(entries: &Descriptor) -> Vec<(&str, &[u8])> {
    entries
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_slice()))
        .collect()
}

/// Sends one `ShouldRateLimit` for a descriptor; returns the call's token.
pub fn ask(g: &Global, entries: &Descriptor, hits: u64) -> Result<u32, String> {
    let hits = u32::try_from(hits).unwrap_or(u32::MAX);
    let message = rls::encode_request(&g.domain, &entry_refs(entries), hits);
    host::grpc_call(
        &g.cluster,
        rls::SERVICE,
        rls::METHOD,
        &message,
        g.timeout_ms,
    )
    .map_err(|s| format!("cannot call cluster {:?} (status {})", g.cluster, s.0))
}

/// Reads the answer being delivered to `on_grpc_call_response`.
pub fn read_answer(status: u32, size: usize) -> Result<rls::Response, String> {
    if status != 0 {
        // Also how a timeout arrives (DEADLINE_EXCEEDED) and an unreachable service.
        let code = host::grpc_status().unwrap_or(status);
        return Err(format!("gRPC status {code}"));
    }
    let body = host::grpc_response(size)
        .map_err(|s| format!("cannot read the answer (status {})", s.0))?
        .unwrap_or_default();
    rls::decode_response(&body).map_err(|_| "undecodable answer".to_string())
}

/// Rate-limit fields the filter computes itself from the service's numbers; the service's own
/// copies are not passed on, so none appears twice.
fn ours(name: &str) -> bool {
    let n = name.to_ascii_lowercase();
    n.starts_with("x-ratelimit") || n.starts_with("ratelimit") || n == "retry-after"
}

/// A sync rule's verdict from its service's answer, with the headers the service adds.
pub fn verdict(
    answer: Option<&Result<rls::Response, String>>,
    policy: &Policy,
) -> Result<(Verdict, Vec<(String, String)>), String> {
    let r = match answer {
        Some(Ok(r)) => r,
        Some(Err(e)) => return Err(e.clone()),
        None => return Err("no answer".into()),
    };
    let allowed = match r.overall_code {
        rls::Code::Ok => true,
        rls::Code::OverLimit => false,
        rls::Code::Unknown => return Err("the service answered UNKNOWN".into()),
    };
    let status = r.statuses.first().cloned().unwrap_or_default();
    let (limit, window_ms) = policy.limit_and_window();
    let reset_ms = status.reset_ms.unwrap_or(0);
    let v = Verdict {
        allowed,
        limit: status.requests_per_unit.map_or(limit, u64::from),
        window_s: status.unit_seconds.unwrap_or(window_ms / 1000),
        remaining: u64::from(status.limit_remaining),
        reset_ms,
        retry_after_ms: if allowed {
            0
        } else if reset_ms > 0 {
            reset_ms
        } else {
            window_ms
        },
        delay_ms: 0,
    };
    let headers = r
        .headers
        .iter()
        .filter(|(k, _)| !k.is_empty() && !ours(k))
        .cloned()
        .collect();
    Ok((v, headers))
}

/// Adds an admitted request's cost to its key's hits for the next flush (async rules).
pub fn count(hash: u64, rule_fingerprint: u64, g: &Global, entries: &Descriptor, check: &Check) {
    if g.mode != GlobalMode::Async {
        return;
    }
    HITS.with(|h| {
        let mut h = h.borrow_mut();
        if let Some(e) = h.get_mut(&hash) {
            e.hits = e.hits.saturating_add(check.cost);
        } else if h.len() < MAX_ASYNC_KEYS {
            h.insert(
                hash,
                Hits {
                    rule_fingerprint,
                    entries: entries.clone(),
                    hits: check.cost,
                    slot: check.slot,
                    fingerprint: check.fingerprint,
                },
            );
        }
    });
}

/// The rule (and its compiled form) with this fingerprint in the current configuration.
fn rule_by_fingerprint(rt: &Runtime, fingerprint: u64) -> Option<(&Rule, &CompiledRule)> {
    rt.config
        .rules
        .iter()
        .zip(&rt.rules)
        .find(|(_, c)| c.fingerprint == fingerprint)
}

/// Reports every key's hits since the last flush, one call per key (services read one
/// `hits_addend` per request).
pub fn flush(rt: &Runtime) {
    let hits: Vec<Hits> = HITS.with(|h| h.borrow_mut().drain().map(|(_, v)| v).collect());
    for h in hits {
        let Some((rule, compiled)) = rule_by_fingerprint(rt, h.rule_fingerprint) else {
            continue; // the rule went away with a new configuration
        };
        let Some(g) = &rule.global else {
            continue;
        };
        match ask(g, &h.entries, h.hits) {
            Ok(token) => {
                FLUSHES.with(|f| {
                    f.borrow_mut().insert(
                        token,
                        Flush {
                            rule_fingerprint: h.rule_fingerprint,
                            slot: h.slot,
                            fingerprint: h.fingerprint,
                        },
                    )
                });
            }
            Err(_) => compiled.metrics.add(super::Counter::GlobalErrors, 1),
        }
    }
}

/// A flush's answer: blocks the key in the table if the service says it is over its limit.
pub fn on_flush_answer(rt: &Runtime, token: u32, status: u32, size: usize) {
    let Some(flush) = FLUSHES.with(|f| f.borrow_mut().remove(&token)) else {
        return;
    };
    let Some((rule, compiled)) = rule_by_fingerprint(rt, flush.rule_fingerprint) else {
        return;
    };
    let answer = match read_answer(status, size) {
        Ok(a) => a,
        Err(_) => {
            compiled.metrics.add(super::Counter::GlobalErrors, 1);
            return;
        }
    };
    if answer.overall_code != rls::Code::OverLimit || rule.shadow {
        return;
    }
    let now = host::now_ms().unwrap_or(0);
    let (_, window_ms) = compiled.policy.limit_and_window();
    let wait = answer
        .statuses
        .first()
        .and_then(|s| s.reset_ms)
        .filter(|&ms| ms > 0)
        .unwrap_or(window_ms.max(1) - now % window_ms.max(1));
    log::debug!(
        "rule {} is over its global limit: blocked for {wait} ms",
        rule.name
    );
    block(&rt.store, &flush, now, now.saturating_add(wait));
}

/// Writes a block for a key into its bucket (a few CAS attempts; losing them all only delays
/// the block to the next flush).
fn block(store: &impl Store, flush: &Flush, now_ms: u64, until_ms: u64) {
    for _ in 0..8 {
        let Ok((bytes, cas)) = store.get(flush.slot) else {
            return;
        };
        let Ok(mut slot) = Slot::decode(flush.slot, bytes.as_deref()) else {
            return;
        };
        slot.put(flush.fingerprint, State::Blocked { until_ms }, now_ms);
        match store.set(
            flush.slot,
            &slot.encode(),
            cas.unwrap_or(crate::store::CREATE_CAS),
        ) {
            Err(StoreError::Conflict) => continue,
            _ => return,
        }
    }
}

/// Whether any rule reports to its service asynchronously, and the shortest flush interval.
pub fn flush_period(rules: &[Rule]) -> Option<u32> {
    rules
        .iter()
        .filter_map(|r| r.global.as_ref())
        .filter(|g| g.mode == GlobalMode::Async)
        .map(|g| g.flush_ms)
        .min()
}
