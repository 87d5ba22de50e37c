//! What a configuration does between requests, as one state machine: reporting async global
//! rules' hits to their services, taking elastic rules' factors from the shared health, and
//! publishing the metrics, each on its own cadence from one timer.
//!
//! The host owns the timer and the calls; [`Background`] owns the decisions. At each tick the
//! host hands it the time and gets [`Work`]: the calls to start, what to publish and the period
//! to set the timer to. It starts each call and says whether it started
//! ([`Background::started`]), and hands each answer back ([`Background::answered`], or piece by
//! piece for a host whose answers come as a stream: [`Background::answer_headers`],
//! [`Background::answer_data`], [`Background::finished`]); the state machine knows which call
//! serves which purpose and what its answer means.

use super::Runtime;
use crate::global::{Answer, Claim, Target};
use crate::metrics;
use crate::rls::{self, GrpcAnswer};
use crate::share::fair_record::Report;
use crate::store::Store;
use std::collections::HashMap;

/// The shortest period of the timer while requests are held on a host that releases them from
/// its configuration's timer (the wasm build): they are released within about this much of
/// their turn. The timer comes at the next held request's turn, at most this often.
pub const RELEASE_PERIOD_MS: u32 = 1;

/// What a background call is for.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Purpose {
    /// Reports a key's hits of an async global rule (or the usage of a global rule charged by
    /// its responses); the answer may block the key.
    Flush(Target, u64),
    /// Claims a block for a lease rule's key ahead of need.
    Claim(Claim),
    /// Reports a fleet-fair shared rule's window and reads the fleet's
    /// ([`super::fleet`]).
    Report(usize, Report),
    /// Both at once: a claim ahead of need and the report of its rule that waited for it, in
    /// one call (the claim's descriptor first).
    Riding(Claim, Report),
}

/// A call the host is asked to start: one `ShouldRateLimit` to a rule's service.
#[derive(Debug)]
pub struct Call<'rt> {
    /// The Envoy cluster of the service.
    pub cluster: &'rt str,
    /// How long to wait for the answer, ms.
    pub timeout_ms: u32,
    /// The encoded `RateLimitRequest` (not framed).
    pub message: Vec<u8>,
    purpose: Purpose,
}

/// What a tick asks of the host, in this order: start the calls, publish the elastic factors,
/// publish the metrics, set the timer.
#[derive(Debug, Default)]
pub struct Work<'rt> {
    /// Calls to start; each one's fate goes back to [`Background::started`].
    pub calls: Vec<Call<'rt>>,
    /// Publish [`Runtime::elastic_factors`]: they have just been taken from the shared health
    /// (a factor held since the last report could be one no longer in force).
    pub elastic: bool,
    /// Publish [`Runtime::metrics`] (what was counted since the last publication).
    pub metrics: bool,
    /// Set the timer to this period, ms (`None`: leave it). A host whose timer cannot change
    /// runs at [`Background::period_ms`] and is never asked to.
    pub period_ms: Option<u32>,
}

/// A call in flight and what has come of its answer so far.
#[derive(Debug)]
struct InFlight {
    purpose: Purpose,
    answer: GrpcAnswer,
}

/// The timer's period for a request held at `now_ms` until `until_ms`: the time to its turn,
/// at least [`RELEASE_PERIOD_MS`] and at most `base_ms`.
fn release_period(until_ms: u64, now_ms: u64, base_ms: u32) -> u32 {
    let wait = u32::try_from(until_ms.saturating_sub(now_ms)).unwrap_or(u32::MAX);
    wait.clamp(RELEASE_PERIOD_MS, base_ms.max(RELEASE_PERIOD_MS))
}

/// One configuration's background work (one per configuration and timer: per process in the
/// native build, per VM in the wasm build).
#[derive(Debug)]
pub struct Background {
    /// The period the timer needs when no request is held, ms.
    base_ms: u32,
    /// The period the timer was last set to, ms: the one the next tick comes at.
    period_ms: u32,
    /// When async global rules last flushed, ms.
    last_flush_ms: u64,
    /// When the metrics were last published, ms.
    last_publish_ms: u64,
    /// Calls in flight, by the host's id.
    calls: HashMap<u64, InFlight>,
}

impl Background {
    /// The background of `rt`: the timer is to be started at [`Background::period_ms`] (the
    /// shortest of the metrics', the flushes' and the elastic rules' periods); the first tick
    /// flushes and publishes.
    pub fn new<S: Store>(rt: &Runtime<S>) -> Background {
        let base_ms = [rt.flush_period(), rt.tick_period()]
            .into_iter()
            .flatten()
            .fold(metrics::PUBLISH_PERIOD_MS, u32::min);
        Background {
            base_ms,
            period_ms: base_ms,
            last_flush_ms: 0,
            last_publish_ms: 0,
            calls: HashMap::new(),
        }
    }

    /// The timer's period, ms.
    pub fn period_ms(&self) -> u32 {
        self.period_ms
    }

    /// A request is held at `now_ms` until `until_ms`, to be released from this timer: the
    /// period to set the timer to, if the timer would come too late for it (else `None`: the
    /// timer stays as it is).
    pub fn hold(&mut self, until_ms: u64, now_ms: u64) -> Option<u32> {
        let period = release_period(until_ms, now_ms, self.base_ms);
        (period < self.period_ms).then(|| {
            self.period_ms = period;
            period
        })
    }

    /// The timer fired at `now_ms`; `next_release`: when the next request still held on this
    /// timer (after the host released those whose turn has come, whichever configuration holds
    /// it: the timer is the host's) is to be released. The timer then comes at that time (at
    /// least [`RELEASE_PERIOD_MS`] from now), or at the base period when nothing is held: a
    /// worker whose requests wait 10 ms between looks ticks every 10 ms, not every 1.
    pub fn tick<'rt, S: Store>(
        &mut self,
        rt: &'rt Runtime<S>,
        now_ms: u64,
        next_release: Option<u64>,
    ) -> Work<'rt> {
        let came_at = self.period_ms;
        let mut work = Work::default();
        let period =
            next_release.map_or(self.base_ms, |at| release_period(at, now_ms, self.base_ms));
        if period != self.period_ms || next_release.is_none() {
            self.period_ms = period;
            work.period_ms = Some(period);
        }
        if let Some(period) = rt.flush_period() {
            if now_ms >= self.last_flush_ms.saturating_add(u64::from(period)) {
                self.last_flush_ms = now_ms;
                let flushes = rt.flush().into_iter().map(|flush| {
                    (
                        flush.target.rule,
                        flush.message,
                        Purpose::Flush(flush.target, flush.hits),
                    )
                });
                // A report rides on a claim of its rule's lease going out at the same tick.
                let ahead = rt.claims_ahead(now_ms);
                let mut reports: Vec<Option<(usize, Report)>> = rt
                    .fair_reports(now_ms, &ahead)
                    .into_iter()
                    .map(Some)
                    .collect();
                let claims: Vec<_> = ahead
                    .into_iter()
                    .map(|(mut message, claim)| {
                        let rule = claim.target.rule;
                        let riding = reports
                            .iter_mut()
                            .find(|r| r.as_ref().is_some_and(|(of, _)| *of == rule))
                            .and_then(Option::take);
                        match riding {
                            Some((_, report)) => {
                                rt.ride(&mut message, rule, &report);
                                (rule, message, Purpose::Riding(claim, report))
                            }
                            None => (rule, message, Purpose::Claim(claim)),
                        }
                    })
                    .collect();
                let reports = reports.into_iter().flatten().map(|(rule, report)| {
                    let message = rt.report_message(rule, &report);
                    (rule, message, Purpose::Report(rule, report))
                });
                work.calls = flushes
                    .chain(claims)
                    .chain(reports)
                    .filter_map(|(rule, message, purpose)| {
                        let g = rt.global_of(rule)?;
                        Some(Call {
                            cluster: &g.cluster,
                            timeout_ms: g.timeout_ms,
                            message,
                            purpose,
                        })
                    })
                    .collect();
            }
        }
        work.elastic = rt.tick_period().is_some() && rt.tick(now_ms);
        if metrics::publish_due(self.last_publish_ms, now_ms, came_at) {
            self.last_publish_ms = now_ms;
            work.metrics = true;
        }
        work
    }

    /// The host started `call` as `id`, or could not (`None`: counted as the service's error).
    pub fn started<S: Store>(&mut self, rt: &Runtime<S>, call: Call<'_>, id: Option<u64>) {
        match (id, call.purpose) {
            (Some(id), purpose) => {
                self.calls.insert(
                    id,
                    InFlight {
                        purpose,
                        answer: GrpcAnswer::default(),
                    },
                );
            }
            (None, purpose) => settle(rt, purpose, Err(crate::error::ServiceError::NoAnswer), 0),
        }
    }

    /// A header or trailer block of call `id`'s answer.
    pub fn answer_headers<'a>(
        &mut self,
        id: u64,
        fields: impl IntoIterator<Item = (&'a [u8], &'a [u8])>,
    ) {
        if let Some(call) = self.calls.get_mut(&id) {
            call.answer.headers(fields);
        }
    }

    /// A piece of call `id`'s answer body (gRPC-framed).
    pub fn answer_data(&mut self, id: u64, bytes: &[u8]) {
        if let Some(call) = self.calls.get_mut(&id) {
            call.answer.data(bytes);
        }
    }

    /// Call `id`'s answer, put together from its pieces, is complete (`reset`: the call was
    /// reset, for this reason). Returns whether the call was this background's.
    pub fn finished<S: Store>(
        &mut self,
        rt: &Runtime<S>,
        id: u64,
        reset: Option<u32>,
        now_ms: u64,
    ) -> bool {
        let Some(call) = self.calls.remove(&id) else {
            return false;
        };
        let answer = match reset {
            Some(reason) => Err(crate::error::ServiceError::Reset(reason)),
            None => call.answer.finish(),
        };
        settle(rt, call.purpose, answer, now_ms);
        true
    }

    /// Call `id` was answered (or failed) at `now_ms`. Returns whether the call was this
    /// background's.
    pub fn answered<S: Store>(
        &mut self,
        rt: &Runtime<S>,
        id: u64,
        answer: Answer,
        now_ms: u64,
    ) -> bool {
        let Some(call) = self.calls.remove(&id) else {
            return false;
        };
        settle(rt, call.purpose, answer, now_ms);
        true
    }

    /// Whether call `id` is this background's and still unanswered.
    pub fn awaits(&self, id: u64) -> bool {
        self.calls.contains_key(&id)
    }

    /// How many calls are in flight.
    pub fn in_flight(&self) -> usize {
        self.calls.len()
    }
}

/// What an answer does, by what its call was for.
fn settle<S: Store>(rt: &Runtime<S>, purpose: Purpose, answer: Answer, now_ms: u64) {
    match purpose {
        Purpose::Flush(target, hits) => rt.flushed(&target, hits, answer, now_ms),
        Purpose::Claim(claim) => rt.ahead_answered(&claim, answer, now_ms),
        Purpose::Report(rule, report) => rt.fair_answered(rule, &report, &answer),
        Purpose::Riding(claim, report) => {
            let rule = claim.target.rule;
            let (for_claim, for_report) = match answer {
                Ok(a) => {
                    let (c, r) = split_ride(a, report.items.len());
                    (Ok(c), r.map(Ok))
                }
                Err(e) => (Err(e.clone()), Some(Err(e))),
            };
            rt.ahead_answered(&claim, for_claim, now_ms);
            match for_report {
                Some(answer) => rt.fair_answered(rule, &report, &answer),
                None => rt.fair_unreported(rule, &report),
            }
        }
    }
}

/// The answer to a claim a report of `items` counters rode on, split in two: the claim's
/// (its own status and code, the service's headers) and the report's (`None`: the service
/// counted none of it). With a status per descriptor, the claim's is the first: a report
/// rode on a refused claim was counted if each of its counters says `OK` (a service that
/// counts each descriptor by itself, as envoyproxy/ratelimit does), not if they carry the
/// refusal (one that counts a call whole or not at all). Without (Limitador's server
/// answers none), the call's code is the claim's, and a refused call counted nothing.
fn split_ride(answer: rls::Response, items: usize) -> (rls::Response, Option<rls::Response>) {
    let rls::Response {
        overall_code,
        mut statuses,
        headers,
    } = answer;
    if statuses.len() != items.saturating_add(1) {
        let counted = overall_code == rls::Code::Ok;
        let report = counted.then(|| rls::Response {
            overall_code,
            statuses: Vec::new(),
            headers: Vec::new(),
        });
        let claim = rls::Response {
            overall_code,
            statuses,
            headers,
        };
        return (claim, report);
    }
    let rest = statuses.split_off(1);
    let code = statuses.first().map_or(overall_code, |s| s.code);
    let all_ok = rest.iter().all(|s| s.code == rls::Code::Ok);
    let report = (code == rls::Code::Ok || all_ok).then(|| rls::Response {
        overall_code: if all_ok {
            rls::Code::Ok
        } else {
            rls::Code::OverLimit
        },
        statuses: rest,
        headers: Vec::new(),
    });
    let claim = rls::Response {
        overall_code: code,
        statuses,
        headers,
    };
    (claim, report)
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;
    use crate::error::ServiceError;
    use crate::global::Target;
    use crate::key::Seed;
    use crate::limiter::State;
    use crate::metrics::Counter;
    use crate::rls;
    use crate::store::MemoryStore;
    use crate::table::Slot;

    const ASYNC: &str = r#"{"rules": [{"name": "g", "key": ["remote_address"],
        "rate_limit": {"requests_per_unit": 100, "unit": "minute"},
        "global": {"cluster": "rls", "domain": "edge", "mode": "async", "flush_ms": 50,
                   "timeout_ms": 20}}]}"#;
    const ELASTIC: &str = r#"{"rules": [{"name": "e", "key": ["remote_address"],
        "rate_limit": {"requests_per_unit": 10, "unit": "hour"},
        "elastic": {"ceiling": 2.0, "floor": 0.5, "max_bad_share": 0.1,
                    "latency_ms": 500, "window_s": 10, "ramp_s": 5}}]}"#;
    const LOCAL: &str =
        r#"{"rules": [{"name": "l", "rate_limit": {"requests_per_unit": 1, "unit": "second"}}]}"#;

    fn runtime(json: &str) -> Runtime<MemoryStore> {
        crate::testkit::runtime(json, Seed([3, 4]))
    }

    /// Where key `n` of rule 0 is blocked.
    fn target(n: u64) -> Target {
        Target {
            rule: 0,
            slot: n,
            alt: n,
            fingerprint: 0x1000 + n,
        }
    }

    /// Counts `hits` of async key `n`, as an admitted request does.
    fn hit(rt: &Runtime<MemoryStore>, n: u64, hits: u64) {
        let entries = vec![(
            "remote_address".to_string(),
            format!("10.0.0.{n}").into_bytes(),
        )];
        rt.hits
            .lock()
            .unwrap()
            .count(n, || Some(entries.clone()), target(n), hits);
    }

    fn blocked(rt: &Runtime<MemoryStore>, t: Target) -> bool {
        let slot = rt
            .store()
            .read(t.slot, |bytes, _| Slot::decode(t.slot, bytes))
            .unwrap()
            .unwrap();
        matches!(slot.find(t.fingerprint), Some(State::Blocked { .. }))
    }

    fn errors(rt: &Runtime<MemoryStore>) -> u64 {
        let mut n = 0;
        rt.metrics().drain(
            |_, c, k| {
                if c == Counter::GlobalErrors {
                    n += k;
                }
            },
            |_, _| {},
        );
        n
    }

    fn over_limit() -> Answer {
        Ok(rls::Response {
            overall_code: rls::Code::OverLimit,
            statuses: vec![rls::DescriptorStatus {
                reset_ms: Some(30_000),
                ..rls::DescriptorStatus::default()
            }],
            headers: Vec::new(),
        })
    }

    /// A fake host: starts every call with the next id (or none, `refuse`), and keeps them.
    #[derive(Default)]
    struct FakeHost {
        next_id: u64,
        refuse: bool,
        started: Vec<(u64, String, u32, Vec<u8>)>,
    }

    impl FakeHost {
        fn carry_out(&mut self, bg: &mut Background, rt: &Runtime<MemoryStore>, work: Work<'_>) {
            for call in work.calls {
                let id = (!self.refuse).then(|| {
                    self.next_id += 1;
                    self.started.push((
                        self.next_id,
                        call.cluster.to_string(),
                        call.timeout_ms,
                        call.message.clone(),
                    ));
                    self.next_id
                });
                bg.started(rt, call, id);
            }
        }
    }

    #[test]
    fn the_timer_runs_at_the_shortest_period() {
        assert_eq!(Background::new(&runtime(LOCAL)).period_ms(), 1000);
        assert_eq!(Background::new(&runtime(ASYNC)).period_ms(), 50);
        assert_eq!(Background::new(&runtime(ELASTIC)).period_ms(), 250);
    }

    #[test]
    fn a_flush_is_due_once_per_period_and_sends_one_call_per_key() {
        let rt = runtime(ASYNC);
        let mut bg = Background::new(&rt);
        let mut host = FakeHost::default();
        hit(&rt, 1, 3);
        hit(&rt, 2, 1);
        hit(&rt, 1, 2);
        let work = bg.tick(&rt, 10_000, None);
        assert_eq!(work.calls.len(), 2);
        host.carry_out(&mut bg, &rt, work);
        assert_eq!(bg.in_flight(), 2);
        let mut sent: Vec<_> = host.started.iter().map(|s| s.3.clone()).collect();
        sent.sort();
        let mut want = vec![
            crate::global::request(
                "edge",
                &vec![("remote_address".to_string(), b"10.0.0.1".to_vec())],
                5,
            ),
            crate::global::request(
                "edge",
                &vec![("remote_address".to_string(), b"10.0.0.2".to_vec())],
                1,
            ),
        ];
        want.sort();
        assert_eq!(sent, want);
        assert!(host
            .started
            .iter()
            .all(|(_, cluster, timeout, _)| cluster == "rls" && *timeout == 20));
        // Not due 49 ms later, even with hits to report; due at 50 ms.
        hit(&rt, 3, 1);
        assert!(bg.tick(&rt, 10_049, None).calls.is_empty());
        let work = bg.tick(&rt, 10_050, None);
        assert_eq!(work.calls.len(), 1);
        host.carry_out(&mut bg, &rt, work);
        // Due, with nothing to report: no call.
        assert!(bg.tick(&rt, 10_100, None).calls.is_empty());
        assert_eq!(bg.in_flight(), 3);
    }

    #[test]
    fn a_call_that_cannot_start_counts_as_the_services_error() {
        let rt = runtime(ASYNC);
        let mut bg = Background::new(&rt);
        let mut host = FakeHost {
            refuse: true,
            ..FakeHost::default()
        };
        hit(&rt, 1, 1);
        let work = bg.tick(&rt, 10_000, None);
        host.carry_out(&mut bg, &rt, work);
        assert_eq!(bg.in_flight(), 0);
        assert_eq!(errors(&rt), 1);
    }

    #[test]
    fn an_answer_over_the_limit_blocks_the_key_and_an_error_is_counted() {
        let rt = runtime(ASYNC);
        let mut bg = Background::new(&rt);
        let mut host = FakeHost::default();
        hit(&rt, 1, 1);
        hit(&rt, 2, 1);
        let work = bg.tick(&rt, 10_000, None);
        host.carry_out(&mut bg, &rt, work);
        let id_of = |n: u64| {
            let key = format!("10.0.0.{n}");
            host.started
                .iter()
                .find(|s| s.3.windows(key.len()).any(|w| w == key.as_bytes()))
                .unwrap()
                .0
        };
        let (one, two) = (id_of(1), id_of(2));
        // An id this background never started is not its own.
        assert!(bg.awaits(one) && !bg.awaits(99));
        assert!(!bg.answered(&rt, 99, over_limit(), 10_010));
        assert!(bg.answered(&rt, one, over_limit(), 10_010));
        assert!(blocked(&rt, target(1)));
        assert!(!blocked(&rt, target(2)));
        assert_eq!(errors(&rt), 0);
        assert!(bg.answered(&rt, two, Err(ServiceError::Grpc(14)), 10_010));
        assert!(!blocked(&rt, target(2)));
        assert_eq!(errors(&rt), 1);
        // Each answer is taken once.
        assert!(!bg.awaits(one));
        assert!(!bg.answered(&rt, one, over_limit(), 10_020));
        assert_eq!(bg.in_flight(), 0);
    }

    #[test]
    fn an_answer_put_together_from_its_pieces() {
        let rt = runtime(ASYNC);
        let mut bg = Background::new(&rt);
        let mut host = FakeHost::default();
        hit(&rt, 1, 1);
        hit(&rt, 2, 1);
        let work = bg.tick(&rt, 10_000, None);
        host.carry_out(&mut bg, &rt, work);
        // RateLimitResponse { overall_code: OVER_LIMIT }, gRPC-framed, in two pieces.
        let frame = rls::grpc_frame(&[0x08, 0x02]);
        let (head, tail) = frame.split_at(3);
        for (id, _, _, _) in &host.started {
            bg.answer_headers(*id, [(&b":status"[..], &b"200"[..])]);
            bg.answer_data(*id, head);
            bg.answer_data(*id, tail);
            bg.answer_headers(*id, [(&b"grpc-status"[..], &b"0"[..])]);
        }
        let (first, second) = (host.started[0].0, host.started[1].0);
        assert!(bg.finished(&rt, first, None, 10_010));
        assert_eq!(errors(&rt), 0);
        // Blocked until the end of the minute's window (the service gave no reset time).
        assert_eq!(
            [blocked(&rt, target(1)), blocked(&rt, target(2))]
                .iter()
                .filter(|b| **b)
                .count(),
            1
        );
        // A reset call is the service's error, whatever came before it.
        assert!(bg.finished(&rt, second, Some(2), 10_010));
        assert_eq!(errors(&rt), 1);
        assert!(!bg.finished(&rt, second, None, 10_020));
    }

    #[test]
    fn metrics_are_published_once_a_period_at_the_tick_that_ends_it() {
        let rt = runtime(LOCAL);
        let mut bg = Background::new(&rt);
        // The first tick publishes (nothing was published yet).
        assert!(bg.tick(&rt, 10_000, None).metrics);
        // Ticks a second apart: one a little early still publishes, one half a tick early
        // does not.
        assert!(!bg.tick(&rt, 10_400, None).metrics);
        assert!(bg.tick(&rt, 10_998, None).metrics);
        assert!(!bg.tick(&rt, 11_497, None).metrics);
        assert!(bg.tick(&rt, 11_999, None).metrics);
    }

    #[test]
    fn a_held_request_speeds_the_timer_up_until_none_is_held() {
        let rt = runtime(LOCAL);
        let mut bg = Background::new(&rt);
        assert_eq!(bg.tick(&rt, 10_000, None).period_ms, Some(1000));
        // Held until 10 ms from now: the timer comes then; a later one changes nothing, a
        // sooner one brings it forward (at most every RELEASE_PERIOD_MS).
        assert_eq!(bg.hold(10_010, 10_000), Some(10));
        assert_eq!(bg.hold(10_030, 10_001), None);
        assert_eq!(bg.hold(10_001, 10_001), Some(RELEASE_PERIOD_MS));
        assert_eq!(bg.period_ms(), RELEASE_PERIOD_MS);
        // At each tick, the next held request's turn sets the period; the metrics wait for a
        // whole period (ticks of 1 ms have no slack).
        let work = bg.tick(&rt, 10_999, Some(11_000));
        assert_eq!(work.period_ms, None, "still 1 ms");
        assert!(!work.metrics);
        let work = bg.tick(&rt, 11_000, Some(11_010));
        assert!(work.metrics);
        assert_eq!(work.period_ms, Some(10));
        // Released: back to the base period.
        assert_eq!(bg.tick(&rt, 11_010, None).period_ms, Some(1000));
        assert_eq!(bg.period_ms(), 1000);
        // A turn further than the base period away: the base period.
        assert_eq!(bg.hold(20_000, 11_010), None);
        assert_eq!(bg.tick(&rt, 12_000, Some(20_000)).period_ms, None);
        assert_eq!(bg.period_ms(), 1000);
    }

    #[test]
    fn elastic_factors_are_published_when_taken_from_the_shared_health() {
        let rt = runtime(ELASTIC);
        let mut bg = Background::new(&rt);
        // A backend failing every request: the factor drops to the floor at the first step.
        let watch = rt.compiled[0].watch.as_ref().unwrap();
        for _ in 0..10 {
            watch.observe(503, 1);
        }
        assert!(bg.tick(&rt, 10_000, None).elastic);
        assert_eq!(rt.elastic_factors().collect::<Vec<_>>(), [(0, 50)]);
        // Not again before the elastic period is up.
        assert!(!bg.tick(&rt, 10_100, None).elastic);
        assert!(bg.tick(&rt, 10_250, None).elastic);
        // A configuration without elastic rules has none to publish.
        let local = runtime(LOCAL);
        assert!(!Background::new(&local).tick(&local, 10_000, None).elastic);
    }

    #[test]
    fn no_flush_without_async_rules() {
        let rt = runtime(ELASTIC);
        let mut bg = Background::new(&rt);
        assert!(bg.tick(&rt, 10_000, None).calls.is_empty());
        assert_eq!(bg.in_flight(), 0);
    }
}
