//! Global rules: what the filter makes of Envoy's rate limit service protocol, whichever host
//! carries the calls (gRPC in the wasm build, an HTTP/2 stream in the native one).
//!
//! Sync rules ask the service before the request goes on ([`Question`], [`verdict`]). Async rules
//! are decided locally at once; the runtime adds up the hits of each key ([`Hits`]) and the host
//! reports them on a timer ([`Flush`]); a key the service says is over its limit is blocked in the
//! shared table until the service's reset time, so every worker refuses it from then on.

use crate::config::{GlobalMode, Rule};
use crate::engine;
use crate::error::ServiceError;
use crate::key::Descriptor;
use crate::limiter::{Policy, State, Verdict};
use crate::rls;
use crate::store::Store;
use std::collections::HashMap;

/// The most distinct keys gathered between two flushes; hits of further keys in that interval
/// are not reported (they were still decided locally).
pub const MAX_ASYNC_KEYS: usize = 10_000;

/// A sync rule's question to its service.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Question {
    /// The rule's index in the configuration.
    pub rule: usize,
    /// The keyed hash of the client key (for the log line of a refusal).
    pub hash: u64,
    /// What the request costs under the rule (`hits_addend`).
    pub cost: u64,
    /// The encoded `RateLimitRequest`.
    pub message: Vec<u8>,
    /// A lease rule's claim (`None`: a sync rule's question).
    pub claim: Option<Claim>,
    /// Asked again by a later question (a claim of what the service said remained).
    pub retried: bool,
}

/// A lease rule's claim of a block: where its grant goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Claim {
    /// Where the key's lease is.
    pub target: Target,
    /// The block claimed (`hits_addend`).
    pub block: u64,
    /// When the claim was sent, ms: the grant lasts the service's reset from then.
    pub sent_ms: u64,
    /// A claim of what the service said remained, after it refused a block (no further one).
    pub last: bool,
}

/// When quota the service granted at `answer` to a claim sent at `sent_ms` lapses: the
/// service's reset counted from the claim (its window ends no earlier; a reset of 0, under a
/// millisecond left, lapses at once: the service's next window has its own quota), else the
/// end of the rule's window holding `sent_ms` (a clock-aligned window, as envoyproxy/ratelimit
/// counts).
pub fn lease_expiry(answer: &rls::Response, policy: &Policy, sent_ms: u64) -> u64 {
    let end = policy.window_at(sent_ms).map_or(sent_ms, |(_, end)| end);
    match answer.statuses.first().and_then(|s| s.reset_ms) {
        Some(ms) => sent_ms.saturating_add(ms),
        _ => end,
    }
}

/// Claims ahead of need of lease rules, gathered between two ticks (one per key).
#[derive(Debug, Default)]
pub struct Ahead {
    keys: HashMap<u64, (Descriptor, Claim)>,
}

impl Ahead {
    /// Adds a claim for key `hash`; `false` when too many keys wait already (the claim is
    /// not made: the key's lease is told so).
    pub fn add(&mut self, hash: u64, entries: &Descriptor, claim: Claim) -> bool {
        if self.keys.len() >= MAX_ASYNC_KEYS && !self.keys.contains_key(&hash) {
            return false;
        }
        self.keys.insert(hash, (entries.clone(), claim));
        true
    }

    /// How many claims wait for the next tick.
    pub fn waiting(&self) -> usize {
        self.keys.len()
    }

    /// The claims to send now, each with its `RateLimitRequest`; none left.
    pub fn drain(&mut self, rules: &[Rule], now_ms: u64) -> Vec<(Vec<u8>, Claim)> {
        self.keys
            .drain()
            .filter_map(|(_, (entries, mut claim))| {
                let g = rules.get(claim.target.rule)?.global.as_ref()?;
                claim.sent_ms = now_ms;
                Some((request(&g.domain, &entries, claim.block), claim))
            })
            .collect()
    }
}

/// A service's answer, or why there is none.
pub type Answer = Result<rls::Response, ServiceError>;

/// The descriptor entries as the encoder takes them.
fn entry_refs(entries: &Descriptor) -> Vec<(&str, &[u8])> {
    entries
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_slice()))
        .collect()
}

/// Encodes one `ShouldRateLimit` request for a descriptor.
pub fn request(domain: &str, entries: &Descriptor, hits: u64) -> Vec<u8> {
    let hits = u32::try_from(hits).unwrap_or(u32::MAX);
    rls::encode_request(domain, &entry_refs(entries), hits)
}

/// Rate-limit fields the filter computes itself from the service's numbers; the service's own
/// copies are not passed on, so none appears twice.
fn ours(name: &str) -> bool {
    let n = name.to_ascii_lowercase();
    n.starts_with("x-ratelimit") || n.starts_with("ratelimit") || n == "retry-after"
}

/// A sync rule's verdict from its service's answer at `now_ms`, with the headers the service
/// adds. What the service leaves out is the rule's own: its limit, its window holding `now_ms`
/// (a calendar month's length, for a month), and, to wait, the time to a fixed window's end or
/// a whole window of the other algorithms.
pub fn verdict(
    answer: Option<&Answer>,
    policy: &Policy,
    now_ms: u64,
) -> Result<(Verdict, Vec<(String, String)>), ServiceError> {
    let r = match answer {
        Some(Ok(r)) => r,
        Some(Err(e)) => return Err(e.clone()),
        None => return Err(ServiceError::NoAnswer),
    };
    let allowed = match r.overall_code {
        rls::Code::Ok => true,
        rls::Code::OverLimit => false,
        rls::Code::Unknown => return Err(ServiceError::Unknown),
    };
    let status = r.statuses.first().cloned().unwrap_or_default();
    let limit = policy.limit_and_window().0;
    let (start, end) = policy.window_at(now_ms).unwrap_or((now_ms, now_ms));
    // A fixed window ends at a known time; the others may refuse for a whole window.
    let wait = match policy {
        Policy::FixedWindow { .. } => end.saturating_sub(now_ms),
        _ => end - start,
    };
    let reset_ms = status.reset_ms.unwrap_or(0);
    let v = Verdict {
        allowed,
        limit: status.requests_per_unit.map_or(limit, u64::from),
        window_s: status.unit_seconds.unwrap_or((end - start) / 1000),
        remaining: u64::from(status.limit_remaining),
        reset_ms,
        retry_after_ms: if allowed {
            0
        } else if reset_ms > 0 {
            reset_ms
        } else {
            wait
        },
        delay_ms: 0,
    };
    let headers = r
        .headers
        .iter()
        .filter(|(k, v)| crate::http::is_safe_field(k, v) && !ours(k))
        .cloned()
        .collect();
    Ok((v, headers))
}

/// Where a block for a key is written.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Target {
    /// The rule's index in the configuration.
    pub rule: usize,
    /// The key's store slot (its first bucket).
    pub slot: u64,
    /// The key's second bucket.
    pub alt: u64,
    /// The key's fingerprint in the slot.
    pub fingerprint: u64,
}

impl Target {
    /// Where rule `rule`'s `check` counts.
    pub fn of(rule: usize, check: &engine::Check) -> Target {
        Target {
            rule,
            slot: check.slot,
            alt: check.alt,
            fingerprint: check.fingerprint,
        }
    }
}

/// One key's hits since the last flush.
#[derive(Debug)]
struct Hit {
    entries: Descriptor,
    hits: u64,
    target: Target,
}

/// Hits of async rules' keys, gathered between two flushes.
#[derive(Debug, Default)]
pub struct Hits {
    keys: HashMap<u64, Hit>,
}

impl Hits {
    /// Adds an admitted request's cost (or a settled usage) to its key's hits; `false` when
    /// too many keys wait already, or the key's first hits have no descriptor (the hits are
    /// not reported). `entries` is called for a key's first hits only.
    pub fn count(
        &mut self,
        hash: u64,
        entries: impl FnOnce() -> Option<Descriptor>,
        target: Target,
        cost: u64,
    ) -> bool {
        if let Some(h) = self.keys.get_mut(&hash) {
            h.hits = h.hits.saturating_add(cost);
            return true;
        }
        if self.keys.len() >= MAX_ASYNC_KEYS {
            return false;
        }
        let Some(entries) = entries() else {
            return false;
        };
        let hit = Hit {
            entries,
            hits: cost,
            target,
        };
        self.keys.insert(hash, hit);
        true
    }

    /// One call per key (services read one `hits_addend` per request), and no hits left.
    pub fn drain(&mut self, rules: &[Rule]) -> Vec<Flush> {
        self.keys
            .drain()
            .filter_map(|(_, h)| {
                let g = rules.get(h.target.rule)?.global.as_ref()?;
                Some(Flush {
                    message: request(&g.domain, &h.entries, h.hits),
                    target: h.target,
                    hits: h.hits,
                })
            })
            .collect()
    }
}

/// A report of one key's hits to its rule's service.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Flush {
    /// The encoded `RateLimitRequest` (`hits_addend` = the key's hits).
    pub message: Vec<u8>,
    /// Where to block the key if the service says it is over its limit.
    pub target: Target,
    /// The hits reported.
    pub hits: u64,
}

/// How long a key the service found over its limit stays blocked: the service's reset time,
/// else until the end of the rule's window holding `now_ms` (a calendar month's, for a month).
pub fn block_ms(answer: &rls::Response, policy: &Policy, now_ms: u64) -> u64 {
    let end = policy.window_at(now_ms).map_or(now_ms, |(_, end)| end);
    answer
        .statuses
        .first()
        .and_then(|s| s.reset_ms)
        .filter(|&ms| ms > 0)
        .unwrap_or(end.saturating_sub(now_ms).max(1))
}

/// Writes a block for a key into its bucket (a few CAS attempts; losing them all only delays the
/// block to the next flush).
pub fn block(store: &impl Store, target: &Target, now_ms: u64, until_ms: u64) {
    let slots = (target.slot, target.alt);
    let _ = engine::put(
        store,
        slots,
        target.fingerprint,
        now_ms,
        State::Blocked { until_ms },
    );
}

/// The shortest flush interval of the global rules that report or claim in the background
/// (async and lease rules, and sync rules charged by their responses), if there are any.
pub fn flush_period(rules: &[Rule]) -> Option<u32> {
    rules
        .iter()
        .filter_map(|r| {
            let g = r.global.as_ref()?;
            (g.mode != GlobalMode::Sync || r.charge().is_some()).then_some(g.flush_ms)
        })
        .min()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rls::{Code, DescriptorStatus, Response};

    const POLICY: Policy = Policy::SlidingWindow {
        limit: 10,
        window_ms: 60_000,
    };

    #[test]
    fn sync_verdicts_from_answers() {
        let over = Response {
            overall_code: Code::OverLimit,
            statuses: vec![DescriptorStatus {
                code: Code::OverLimit,
                requests_per_unit: Some(5),
                unit_seconds: Some(1),
                limit_remaining: 0,
                reset_ms: Some(700),
            }],
            headers: vec![
                ("x-ratelimit-limit".into(), "5".into()),
                ("x-service".into(), "a".into()),
                // Unsafe to write: a split response, a NUL, a name that is no token.
                ("x-split".into(), "a\r\nset-cookie: b".into()),
                ("x-nul".into(), "a\u{0}".into()),
                (":status".into(), "200".into()),
                ("bad name".into(), "1".into()),
                (String::new(), "1".into()),
            ],
        };
        let (v, headers) = verdict(Some(&Ok(over)), &POLICY, 61_000).unwrap();
        assert_eq!(
            (v.allowed, v.limit, v.window_s, v.retry_after_ms),
            (false, 5, 1, 700)
        );
        // The service's own rate-limit fields are dropped: the filter writes its own; and so
        // is what would not be a safe header (found by the rls fuzz target).
        assert_eq!(headers, [("x-service".to_string(), "a".to_string())]);
        // No numbers from the service: the rule's own, and a whole window to wait.
        let bare = Response {
            overall_code: Code::OverLimit,
            ..Response::default()
        };
        let (v, _) = verdict(Some(&Ok(bare)), &POLICY, 61_000).unwrap();
        assert_eq!((v.limit, v.window_s, v.retry_after_ms), (10, 60, 60_000));
        let unknown = Response::default();
        assert!(verdict(Some(&Ok(unknown)), &POLICY, 61_000).is_err());
        assert_eq!(
            verdict(Some(&Err(ServiceError::Grpc(4))), &POLICY, 61_000),
            Err(ServiceError::Grpc(4))
        );
        assert!(verdict(None, &POLICY, 61_000).is_err());
    }

    #[test]
    fn blocks_last_until_the_reset_or_the_window_end() {
        let mut answer = Response::default();
        assert_eq!(block_ms(&answer, &POLICY, 61_000), 59_000);
        answer.statuses.push(DescriptorStatus {
            reset_ms: Some(1_234),
            ..DescriptorStatus::default()
        });
        assert_eq!(block_ms(&answer, &POLICY, 61_000), 1_234);
    }

    #[test]
    fn hits_add_up_per_key_and_drain_once() {
        let rule = crate::config::Config::parse(
            br#"{"rules": [{"name": "g", "key": ["remote_address"],
                "rate_limit": {"requests_per_unit": 10, "unit": "minute"},
                "global": {"cluster": "rls", "domain": "edge", "mode": "async"}}]}"#,
        )
        .unwrap()
        .rules;
        let entries: Descriptor = vec![("rule".into(), b"g".to_vec())];
        let target = Target {
            rule: 0,
            slot: 3,
            alt: 3,
            fingerprint: 5,
        };
        let mut hits = Hits::default();
        let mut built = 0;
        for cost in [2, 3] {
            hits.count(
                1,
                || {
                    built += 1;
                    Some(entries.clone())
                },
                target,
                cost,
            );
        }
        assert_eq!(
            built, 1,
            "a key's descriptor is built for its first hits only"
        );
        assert!(
            !hits.count(2, || None, target, 1),
            "no descriptor, no report"
        );
        let flushes = hits.drain(&rule);
        assert_eq!(flushes.len(), 1);
        assert_eq!(flushes[0].message, request("edge", &entries, 5));
        assert!(hits.drain(&rule).is_empty());
        for k in 0..MAX_ASYNC_KEYS as u64 + 5 {
            hits.count(k, || Some(entries.clone()), target, 1);
        }
        assert_eq!(hits.drain(&rule).len(), MAX_ASYNC_KEYS);
    }
}
