use crate::engine::update_fair_record;
use crate::error::ServiceError;
use crate::key::Seed;
use crate::rls::{self, Code, DescriptorStatus};
use crate::runtime::{Background, Next, Runtime, StreamState};
use crate::store::MemoryStore;
use crate::testkit::fair::{jain, water_fill};
use crate::testkit::{FakeHost, FakeResponse};
use std::collections::HashMap;
use std::sync::Arc;

/// The service: the capacity's counter (100 a window of a second, checked then counted,
/// as limitador does) and, for the fair counters, a counter per descriptor adding each
/// descriptor's own `hits_addend`, as envoyproxy/ratelimit does (limit `u32::MAX`, an
/// hour). `statuses`: whether it answers the fair counters' statuses (Limitador's server
/// answers none).
struct Service {
    /// The capacity's counter: its window and what it counted there.
    lease: (u64, u64),
    /// The capacity and its window, ms.
    capacity: (u64, u64),
    counters: HashMap<Vec<(String, Vec<u8>)>, u64>,
    statuses: bool,
    reports: u64,
    claims: u64,
    /// Of the reports, those that rode on a claim (one call for both).
    rides: u64,
}

impl Service {
    /// A service of `capacity` (units, window ms), answering the fair counters' statuses
    /// if `statuses`; nothing counted yet.
    fn new(capacity: (u64, u64), statuses: bool) -> Service {
        Service {
            lease: (0, 0),
            capacity,
            counters: HashMap::new(),
            statuses,
            reports: 0,
            claims: 0,
            rides: 0,
        }
    }

    /// Answers a call: a report (its first descriptor a fair counter), a claim of the
    /// capacity, or a claim a report rides on (the claim's descriptor first, counted by
    /// the call's `hits_addend`, each fair counter by its own whatever the claim's fate).
    fn answer(&mut self, message: &[u8], now: u64) -> rls::Response {
        let req = rls::decode_request(message).unwrap();
        let fair = |d: &Vec<(String, Vec<u8>)>| d.first().map(|e| e.0.as_str()) == Some("fair");
        let from = usize::from(!req.descriptors.first().is_some_and(fair));
        let counted: Vec<DescriptorStatus> = req
            .descriptors
            .iter()
            .zip(&req.descriptor_hits)
            .skip(from)
            .map(|(d, hits)| {
                assert!(fair(d), "{d:?}");
                let c = self.counters.entry(d.clone()).or_insert(0);
                *c += hits.unwrap_or(req.hits);
                DescriptorStatus {
                    code: Code::Ok,
                    requests_per_unit: Some(u32::MAX),
                    unit_seconds: Some(3_600),
                    limit_remaining: u32::MAX - u32::try_from(*c).unwrap(),
                    reset_ms: Some(3_600_000),
                }
            })
            .collect();
        self.reports += u64::from(!counted.is_empty());
        if from == 0 {
            return rls::Response {
                overall_code: Code::Ok,
                statuses: if self.statuses { counted } else { Vec::new() },
                headers: Vec::new(),
            };
        }
        self.claims += 1;
        let mut claim =
            crate::testkit::window_counter(&mut self.lease, req.hits, now, self.capacity);
        if !counted.is_empty() {
            self.rides += 1;
            if self.statuses {
                claim.statuses.extend(counted);
            }
        }
        claim
    }
}

/// Tenants (name, Envoy, weight, requests a second).
const TENANTS: [(&str, usize, u16, f64); 5] = [
    ("solo", 0, 1, 60.0),
    ("b1", 1, 1, 60.0),
    ("b2", 1, 1, 60.0),
    ("c1", 2, 2, 60.0),
    ("light", 2, 1, 5.0),
];

/// What a run of [`pinned_on`] measured.
struct Run {
    /// Each tenant's admitted rate a second over the measured seconds.
    rates: Vec<f64>,
    /// The most admitted in one of the capacity's windows.
    most: u64,
    /// The fair rule's reports, and the lease's claims, over the run; of the reports,
    /// those that rode on a claim.
    reports: u64,
    claims: u64,
    rides: u64,
    /// Requests admitted over the run.
    admitted: u64,
    /// Requests the provider refused (a provider of [`Case::provider`]), each second.
    provider_refused: Vec<u64>,
    /// Each second's admitted requests, by tenant.
    per_s: Vec<Vec<u64>>,
    /// Each second's refused requests, by tenant (a request that waited: when its wait
    /// ended).
    refused_per_s: Vec<Vec<u64>>,
    /// Each request that waited for its turn: its tenant, when its wait ended (ms into the
    /// run), and how long it waited, ms.
    waits: Vec<(usize, u64, u64)>,
    /// Every Envoy's rule took the lone shared rule's short path.
    short_path: bool,
}

/// Three Envoys leasing one capacity of 100 a second (`fleet`: `share.fleet`), each
/// tenant pinned to one of them, on a virtual clock, every call answered at once: each
/// tenant's admitted rate over seconds 10 to 30, the most admitted in one second, and the
/// reports made.
fn pinned(fleet: &str, statuses: bool) -> (Vec<f64>, u64, u64) {
    let r = pinned_on(Case::new(fleet, statuses));
    (r.rates, r.most, r.reports)
}

/// The capacity's window: 100 a second (the run 30 s, measured from second 10), or 6,000
/// a minute (`max_block` 600; the run 5 minutes, measured from minute 2).
#[derive(Clone, Copy, PartialEq)]
enum Window {
    Second,
    Minute,
}

/// Where tenant `i`, pinned to Envoy `e`, sends its request at `ms` into the run
/// (`usize::MAX`: it sends nothing then).
type Placement<'a> = &'a dyn Fn(usize, usize, u64) -> usize;

/// A run of [`pinned_on`].
#[derive(Clone)]
struct Case<'a> {
    /// `share.fleet`.
    fleet: &'a str,
    /// Whether the service answers the fair counters' statuses.
    statuses: bool,
    /// Runtimes per Envoy over its one store (the wasm build's workers), each request
    /// going to the next worker of its Envoy.
    workers: usize,
    window: Window,
    /// Each request's Envoy.
    place: Placement<'a>,
    /// When the service does not answer (gRPC status 14), ms into the run.
    down: std::ops::Range<u64>,
    /// The configuration's `failure_mode`.
    failure_mode: &'a str,
    /// A provider behind the Envoys that admits this many requests in each clock second
    /// (429 past it) and says so in OpenAI's fields, every answer read by the rule's
    /// `share.learn` (`None`: no provider, no `learn`).
    provider: Option<u64>,
    /// The tenants (name, Envoy, weight, requests a second).
    tenants: &'a [(&'a str, usize, u16, f64)],
    /// Each tenant's band (`x-band`), by its place in `tenants` (none past the end).
    bands: &'a [&'a str],
    /// More members of the rule's `share` object (after a comma).
    share: &'a str,
    /// Every request through the general path (no lone shared rule's short path).
    general: bool,
    /// Each runtime's draws for rounding its fair parts (`None`: random, as in Envoy).
    dither: Option<u64>,
}

impl<'a> Case<'a> {
    /// Tenants pinned, one worker each, a second's window, the service always up.
    fn new(fleet: &'a str, statuses: bool) -> Case<'a> {
        Case {
            fleet,
            statuses,
            workers: 1,
            window: Window::Second,
            place: &|_, e, _| e,
            down: 0..0,
            failure_mode: "allow",
            provider: None,
            tenants: &TENANTS,
            bands: &[],
            share: "",
            general: false,
            dither: None,
        }
    }
}

/// [`pinned`] as `case` says.
fn pinned_on(case: Case<'_>) -> Run {
    let Case {
        fleet,
        statuses,
        workers,
        window,
        place,
        down,
        failure_mode,
        provider,
        tenants,
        bands,
        share,
        general,
        dither,
    } = case;
    let (limit, unit, window_ms, max_block, run_ms, from_s) = match window {
        Window::Second => (100, "second", 1_000, 10, 30_000u64, 10),
        Window::Minute => (6_000, "minute", 60_000, 600, 300_000, 120),
    };
    let learn = match provider {
        Some(_) => r#", "learn": {"from": "openai", "unit": "second"}"#,
        None => "",
    };
    let json = format!(
        r#"{{"failure_mode": "{failure_mode}", "rules": [{{"name": "p", "key": ["header:x-tenant"],
            "rate_limit": {{"requests_per_unit": {limit}, "unit": "{unit}"}},
            "global": {{"cluster": "rls", "domain": "edge", "mode": "lease", "flush_ms": 10,
                       "max_block": {max_block}}},
            "share": {{"weight": {{"from": "header:x-weight", "default": 1, "max": 4}},
                       "fleet": "{fleet}"{learn}{share}}}}}]}}"#
    );
    let config = crate::config::Config::parse(json.as_bytes()).unwrap();
    // Worker w of Envoy e is `envoys[e * workers + w]`.
    let mut envoys: Vec<Runtime<Arc<MemoryStore>>> = (0..3u64)
        .flat_map(|i| {
            let store = Arc::new(MemoryStore::new());
            let config = config.clone();
            (0..workers).map(move |_| Runtime::new(config.clone(), Seed([i + 1, 7]), store.clone()))
        })
        .collect();
    for (k, e) in envoys.iter_mut().enumerate() {
        if general {
            e.shared = None;
        }
        if let Some(d) = dither {
            e.fair_dither = d.wrapping_mul(k as u64 + 1) | 1;
        }
    }
    let short_path = envoys.iter().all(|e| e.shared.is_some());
    let mut bgs: Vec<Background> = envoys.iter().map(Background::new).collect();
    let mut turn = 0usize;
    let mut service = Service::new((limit, window_ms), statuses);
    let t0: u64 = 1_800_000_000_000;
    let mut next_at: Vec<f64> = (0..tenants.len()).map(|i| i as f64 * 2.3).collect();
    let seconds = (run_ms / 1000) as usize;
    let mut per_s = vec![vec![0u64; tenants.len()]; seconds];
    let mut refused_per_s = vec![vec![0u64; tenants.len()]; seconds];
    let mut id = 0u64;
    // The provider's count in the current clock second, and what it refused.
    let (mut provider_second, mut provider_count) = (0u64, 0u64);
    let mut provider_refused = vec![0u64; seconds];
    let mut buf = String::new();
    // Requests waiting for their turn: the stream, its tenant, its runtime, when it looks
    // next, when it came.
    let mut held: Vec<(StreamState, usize, usize, u64, u64)> = Vec::new();
    let mut waits = Vec::new();
    // A request admitted at `ms`: counted, and answered by the provider if there is one.
    let mut admitted = |st: &mut StreamState, rt: &Runtime<Arc<MemoryStore>>, i: usize, ms: u64| {
        let now = t0 + ms;
        per_s[(ms / 1000) as usize][i] += 1;
        let Some(p) = provider else {
            return;
        };
        if ms / 1000 != provider_second {
            (provider_second, provider_count) = (ms / 1000, 0);
        }
        let ok = provider_count < p;
        provider_count += u64::from(ok);
        provider_refused[(ms / 1000) as usize] += u64::from(!ok);
        let reset = format!("{}ms", 1000 - ms % 1000);
        let mut answer = FakeResponse(vec![
            (":status".into(), if ok { "200" } else { "429" }.into()),
            ("x-ratelimit-limit-requests".into(), p.to_string().into()),
            (
                "x-ratelimit-remaining-requests".into(),
                (p - provider_count).to_string().into(),
            ),
            ("x-ratelimit-reset-requests".into(), reset.into()),
        ]);
        st.response_headers(rt, &mut answer, || now, &mut buf, |_, _, _| {}, |_, _| {});
    };
    for ms in 0..run_ms {
        let now = t0 + ms;
        let mut answer = |message: &[u8]| {
            if down.contains(&ms) {
                Err(ServiceError::Grpc(14))
            } else {
                Ok(service.answer(message, now))
            }
        };
        for (i, &(name, e, weight, rate)) in tenants.iter().enumerate() {
            while next_at[i] <= ms as f64 {
                next_at[i] += 1000.0 / rate;
                turn += 1;
                let e = place(i, e, ms);
                if e == usize::MAX {
                    continue; // not sending yet
                }
                let k = e * workers + turn % workers;
                let rt = &envoys[k];
                let mut h = FakeHost::new("10.0.0.1", "/")
                    .header("x-tenant", name)
                    .header("x-weight", &weight.to_string());
                if let Some(band) = bands.get(i) {
                    h = h.header("x-band", band);
                }
                h.now = now;
                let mut st = StreamState::default();
                let next = st.request_headers(rt, &mut h);
                match settle(rt, &mut st, &mut h, next, &mut answer, &mut id) {
                    Next::Continue => admitted(&mut st, rt, i, ms),
                    Next::Reply(r) => {
                        assert_eq!(r.status, 429);
                        refused_per_s[(ms / 1000) as usize][i] += 1;
                    }
                    Next::Hold { until_ms } => held.push((st, i, k, until_ms, now)),
                    other => panic!("{other:?}"),
                }
            }
        }
        // The waiting requests whose time has come look at their lines.
        let mut still = Vec::with_capacity(held.len());
        for (mut st, i, k, until, came) in held.drain(..) {
            if until > now {
                still.push((st, i, k, until, came));
                continue;
            }
            match st.wake(&envoys[k], now) {
                Next::Hold { until_ms } => still.push((st, i, k, until_ms, came)),
                Next::Continue => {
                    waits.push((i, ms, now - came));
                    admitted(&mut st, &envoys[k], i, ms);
                }
                Next::Reply(r) => {
                    assert_eq!(r.status, 429);
                    waits.push((i, ms, now - came));
                    refused_per_s[(ms / 1000) as usize][i] += 1;
                }
                other => panic!("{other:?}"),
            }
        }
        held = still;
        for (n, (rt, bg)) in envoys.iter().zip(bgs.iter_mut()).enumerate() {
            // An Envoy no tenant is placed on now is down: no ticks either.
            if !(0..tenants.len()).any(|i| place(i, tenants[i].1, ms) == n / workers) {
                continue;
            }
            for call in bg.tick(rt, now, None).calls {
                id += 1;
                let a = answer(&call.message);
                bg.started(rt, call, Some(id));
                bg.answered(rt, id, a, now);
            }
        }
    }
    let measured = &per_s[from_s..];
    let rates = (0..tenants.len())
        .map(|i| measured.iter().map(|s| s[i]).sum::<u64>() as f64 / measured.len() as f64)
        .collect();
    // The capacity's windows are clock-aligned, as t0 is to a minute.
    let per_window = (window_ms / 1000) as usize;
    let most = per_s
        .chunks(per_window)
        .map(|w| w.iter().flatten().sum::<u64>())
        .max()
        .unwrap();
    let admitted = per_s.iter().flatten().sum();
    Run {
        rates,
        most,
        reports: service.reports,
        claims: service.claims,
        rides: service.rides,
        admitted,
        provider_refused,
        per_s,
        refused_per_s,
        waits,
        short_path,
    }
}

/// Steps a request through its calls to the service (each answered by `answer`) to what
/// it comes to: going on, refused, or held.
fn settle(
    rt: &Runtime<Arc<MemoryStore>>,
    st: &mut StreamState,
    h: &mut FakeHost,
    mut next: Next,
    answer: &mut dyn FnMut(&[u8]) -> Result<rls::Response, ServiceError>,
    id: &mut u64,
) -> Next {
    loop {
        next = match next {
            Next::Call { message, .. } => {
                *id += 1;
                assert!(matches!(st.started(rt, h, Ok(*id)), Next::Wait));
                let a = answer(&message);
                st.call_answer(rt, h, *id, a)
            }
            other => return other,
        }
    }
}

/// One Envoy of a fleet-fair rule of 100 a second leased in blocks of at most 10.
fn one_envoy() -> Runtime<Arc<MemoryStore>> {
    let json = r#"{"rules": [{"name": "p", "key": ["header:x-tenant"],
            "rate_limit": {"requests_per_unit": 100, "unit": "second"},
            "global": {"cluster": "rls", "domain": "edge", "mode": "lease", "flush_ms": 10,
                       "max_block": 10},
            "share": {"fleet": "fair"}}]}"#;
    let config = crate::config::Config::parse(json.as_bytes()).unwrap();
    Runtime::new(config, Seed([1, 7]), Arc::new(MemoryStore::new()))
}

/// A request of tenant `a` at `now`, its calls answered by `service` (`id`: the last call's).
fn tenants_request(rt: &Runtime<Arc<MemoryStore>>, now: u64, service: &mut Service, id: &mut u64) {
    let mut h = FakeHost::new("10.0.0.1", "/").header("x-tenant", "a");
    h.now = now;
    let mut st = StreamState::default();
    let next = st.request_headers(rt, &mut h);
    let mut answer = |m: &[u8]| Ok(service.answer(m, now));
    settle(rt, &mut st, &mut h, next, &mut answer, id);
}

/// One Envoy of the fleet-fair rule of [`pinned_on`] with a tenant's requests every 5 ms
/// answered by `service` and its background ticked every 10 ms for one window, then, in
/// the next window, requests and no tick until a claim ahead of need waits for the tick
/// its window's report is due at: the runtime, its background, and the time.
fn a_claim_and_a_report_due(service: &mut Service) -> (Runtime<Arc<MemoryStore>>, Background, u64) {
    let rt = one_envoy();
    let mut bg = Background::new(&rt);
    let t0: u64 = 1_800_000_000_000;
    let mut id = 0;
    let mut request = |rt: &Runtime<Arc<MemoryStore>>, now: u64, service: &mut Service| {
        tenants_request(rt, now, service, &mut id);
    };
    for ms in (0..1_000).step_by(5) {
        request(&rt, t0 + ms, service);
        if ms % 10 == 0 {
            for call in bg.tick(&rt, t0 + ms, None).calls {
                let a = service.answer(&call.message, t0 + ms);
                bg.started(&rt, call, Some(1_000 + ms));
                bg.answered(&rt, 1_000 + ms, Ok(a), t0 + ms);
            }
        }
    }
    let mut now = t0 + 1_000;
    while rt.ahead.lock().unwrap().waiting() == 0 {
        request(&rt, now, service);
        now += 1;
        assert!(now < t0 + 1_100, "no claim ahead of need");
    }
    (rt, bg, now)
}

/// A report rides on a claim while the service's window it last heard of has at least
/// four such blocks left, or ended (a new one has begun), or before any answer: not on a
/// claim the service may refuse.
#[test]
fn a_report_rides_only_on_a_claim_likely_granted() {
    use super::{rides, Left};
    let left = |units| {
        Some(Left {
            units,
            end_ms: 1_000,
        })
    };
    assert!(rides(None, 10, 500));
    assert!(rides(left(40), 10, 500));
    assert!(!rides(left(39), 10, 500));
    assert!(!rides(left(0), 1, 999));
    assert!(rides(left(0), 10, 1_000), "that window ended");
}

/// Once a view is in force, a window's report waits for a claim ahead of need to ride on
/// (one call for both) rather than going alone at the window's first tick: an Envoy
/// serving a tenant every 5 ms (blocks of at most 10: a claim ahead every 50 ms or so)
/// makes one call a window fewer. Without claims (no requests in the window) it goes
/// alone once half the window has passed, and the view it brings is read as before.
#[test]
fn a_report_waits_for_a_claim_to_ride_on_until_half_the_window() {
    let rt = one_envoy();
    let mut bg = Background::new(&rt);
    let mut service = Service::new((100, 1_000), true);
    let t0: u64 = 1_800_000_000_000;
    let mut id = 0;
    // Each window: its reports alone and riding, and when the first was made (ms into it).
    let mut windows: Vec<(u64, u64, Option<u64>)> = vec![(0, 0, None); 8];
    for ms in 0..8_000u64 {
        let now = t0 + ms;
        // Requests every 5 ms but in window 6.
        if ms % 5 == 0 && ms / 1_000 != 6 {
            tenants_request(&rt, now, &mut service, &mut id);
        }
        if ms % 10 != 0 {
            continue;
        }
        for call in bg.tick(&rt, now, None).calls {
            let (reports, rides) = (service.reports, service.rides);
            let a = service.answer(&call.message, now);
            let w = &mut windows[(ms / 1_000) as usize];
            // A report riding on a claim counts as a report and a ride.
            if service.rides > rides {
                w.1 += 1;
            } else if service.reports > reports {
                w.0 += 1;
            }
            if service.reports > reports && w.2.is_none() {
                w.2 = Some(ms % 1_000);
            }
            id += 1;
            bg.started(&rt, call, Some(id));
            bg.answered(&rt, id, Ok(a), now);
        }
    }
    println!("(alone, riding, made at) each window: {windows:?}");
    let c = &rt.compiled[0];
    assert!(rt.fair_view_fresh(c, t0 + 8_000), "the view is in force");
    // Windows 0 to 2 report at their first tick (no view yet that saw anything).
    for w in &windows[..3] {
        assert_eq!(w.2, Some(0), "{windows:?}");
    }
    // From window 3, one report a window riding on a claim, in the window's first half.
    for w in &windows[3..6] {
        assert_eq!((w.0, w.1), (0, 1), "{windows:?}");
        assert!(w.2.unwrap() < 500, "{windows:?}");
    }
    // No requests in window 6, so no claim: alone, at half the window.
    assert_eq!(
        (windows[6].0, windows[6].1, windows[6].2),
        (1, 0, Some(500))
    );
    let view = update_fair_record(&rt.store, c.fair_record(), 1, |r| (r.view.epoch, false));
    assert_eq!(view, Some(Some(t0 / 1_000 + 7 - 2)), "window 7's read");
}

/// A window's report due at the tick that sends a claim ahead of need rides on it: one
/// call, the claim's descriptor first (counted by the call's `hits_addend`), then the
/// fair counters (each by its own); the answer split, the grant held and the view read.
/// A claim refused whole (a service that counts a call whole or not at all) took its
/// report down with it: the report goes again, alone, at the next tick. Refused by
/// itself, the fair counters counted (`OK` each), the report stands.
#[test]
fn a_report_rides_on_a_claim_of_the_same_tick_and_goes_again_if_not_counted() {
    let mut service = Service::new((100, 1_000), true);
    let (rt, mut bg, now) = a_claim_and_a_report_due(&mut service);
    let epoch = now / 1_000;
    let calls = bg.tick(&rt, now, None).calls;
    assert_eq!(calls.len(), 1, "one call for both");
    let req = rls::decode_request(&calls[0].message).unwrap();
    assert_eq!(req.descriptors[0], [("rule".to_string(), b"p".to_vec())]);
    assert_eq!(req.descriptor_hits[0], None);
    assert!(req.hits > 1, "the claim's block: {}", req.hits);
    assert!(req.descriptors.len() > 2);
    assert!(req.descriptors[1..].iter().all(|d| d[0].0 == "fair"));
    assert!(req.descriptor_hits[1..].iter().all(Option::is_some));
    let (claims, reports) = (service.claims, service.reports);
    let answer = service.answer(&calls[0].message, now);
    assert_eq!(
        (service.claims, service.reports, service.rides),
        (claims + 1, reports + 1, 1)
    );
    assert_eq!(answer.statuses.len(), req.descriptors.len());
    let call = calls.into_iter().next().unwrap();
    bg.started(&rt, call, Some(7));
    bg.answered(&rt, 7, Ok(answer), now);
    let c = &rt.compiled[0];
    let record = |rt: &Runtime<Arc<MemoryStore>>| {
        update_fair_record(&rt.store, c.fair_record(), 1, |r| (r.clone(), false)).unwrap()
    };
    assert_eq!(record(&rt).reported, epoch);
    assert_eq!(record(&rt).view.epoch, Some(epoch - 2), "the view read");
    assert!(
        bg.tick(&rt, now + 10, None).calls.is_empty(),
        "nothing more is due"
    );

    // Refused whole: every status carries the refusal; the report is due again.
    for counted in [false, true] {
        let mut service = Service::new((100, 1_000), true);
        let (rt, mut bg, now) = a_claim_and_a_report_due(&mut service);
        let call = bg.tick(&rt, now, None).calls.into_iter().next().unwrap();
        let n = rls::decode_request(&call.message)
            .unwrap()
            .descriptors
            .len();
        let status = |code| DescriptorStatus {
            code,
            requests_per_unit: Some(100),
            unit_seconds: Some(1),
            limit_remaining: 0,
            reset_ms: Some(5),
        };
        let mut statuses = vec![status(Code::OverLimit); n];
        if counted {
            for s in &mut statuses[1..] {
                *s = DescriptorStatus {
                    code: Code::Ok,
                    requests_per_unit: Some(u32::MAX),
                    limit_remaining: u32::MAX - 1,
                    ..*s
                };
            }
        }
        let refused = rls::Response {
            overall_code: Code::OverLimit,
            statuses,
            headers: Vec::new(),
        };
        bg.started(&rt, call, Some(8));
        bg.answered(&rt, 8, Ok(refused), now);
        let c = &rt.compiled[0];
        let reported = update_fair_record(&rt.store, c.fair_record(), 1, |r| (r.reported, false));
        let next = bg.tick(&rt, now + 10, None).calls;
        if counted {
            assert_eq!(reported, Some(now / 1_000));
            assert!(next.is_empty(), "counted: not again");
        } else {
            assert_eq!(reported, Some(now / 1_000 - 1), "due again");
            assert_eq!(next.len(), 1);
            let again = rls::decode_request(&next[0].message).unwrap();
            assert!(again.descriptors.iter().all(|d| d[0].0 == "fair"), "alone");
            assert_eq!(again.descriptors.len(), n - 1, "the same counters");
        }
    }
}

/// Tenants pinned to Envoys share the capacity as the whole fleet's weighted max-min
/// shares say, not each Envoy's part: equal weights get equal rates and a double weight
/// twice theirs wherever they are (with each Envoy sharing its part locally, the lone
/// tenant of one Envoy gets more than its share and the tenant of weight 2 beside a light
/// one about half of its), the light one all it asks, and the fleet never more than the
/// capacity in a second. A service that answers no statuses (Limitador's server) leaves
/// each Envoy sharing locally.
#[test]
fn tenants_pinned_to_envoys_get_the_fleets_fair_shares() {
    let (fair, most, reports) = pinned("fair", true);
    let (local, _, _) = pinned("local", true);
    let (unread, _, _) = pinned("fair", false);
    let demands: Vec<f64> = TENANTS.iter().map(|t| t.3).collect();
    let weights: Vec<f64> = TENANTS.iter().map(|t| f64::from(t.2)).collect();
    let ideal = water_fill(97.0, &demands, &weights);
    println!("fair {fair:.1?}, local {local:.1?}, without statuses {unread:.1?}");
    println!("water-filling {ideal:.1?}; most in a second {most}; {reports} reports");
    assert!(most <= 100, "{most} in one second");
    let per_weight: Vec<f64> = (0..4).map(|i| fair[i] / weights[i]).collect();
    assert!(jain(&per_weight) >= 0.99, "{per_weight:?}");
    for i in 0..4 {
        let off = (fair[i] - ideal[i]).abs() / ideal[i];
        assert!(
            off <= 0.08,
            "{}: {:.1} for {:.1}",
            TENANTS[i].0,
            fair[i],
            ideal[i]
        );
    }
    assert!(fair[4] >= 0.99 * 5.0, "light {:.2}", fair[4]);
    let used: f64 = fair.iter().sum();
    assert!(used >= 90.0, "used {used:.1}");
    // One report a second and Envoy.
    assert!((85..=93).contains(&reports), "{reports}");
    // Shared locally, the lone tenant gets far more than its share; so it does when the
    // service says nothing of the fleet's counters.
    // Two workers per Envoy over its one store, as in the wasm build: the same shares,
    // still one report per Envoy and window.
    let two_workers = pinned_on(Case {
        workers: 2,
        ..Case::new("fair", true)
    });
    let (two, reports_two) = (two_workers.rates, two_workers.reports);
    println!("two workers each: {two:.1?}, {reports_two} reports");
    for i in 0..5 {
        assert!((two[i] - fair[i]).abs() <= 0.05 * ideal[i], "{two:?}");
    }
    assert!((85..=93).contains(&reports_two), "{reports_two}");
    for shares in [&local, &unread] {
        let per_weight: Vec<f64> = (0..4).map(|i| shares[i] / weights[i]).collect();
        assert!(jain(&per_weight) < 0.95, "{per_weight:?}");
        assert!(shares[4] >= 0.99 * 5.0, "light {:.2}", shares[4]);
    }
}

/// A tenant arrives (the lone one on the first Envoy, from second 15): until the fleet's
/// view counts it, two windows later, the others still get their old shares and the fleet's
/// quota runs out before the window ends. Its last grants then go to the light tenant,
/// which asks for them, not to the held ones (without that the light one lost about a
/// second's worth of its requests).
#[test]
fn the_fleets_last_grants_of_a_window_go_to_the_tenants_under_their_shares() {
    let r = pinned_on(Case {
        place: &|i, e, ms| if i == 0 && ms < 15_000 { usize::MAX } else { e },
        ..Case::new("fair", true)
    });
    let light: Vec<u64> = r.per_s.iter().map(|row| row[4]).collect();
    let sent: u64 = light.iter().skip(10).count() as u64 * 5;
    println!(
        "the light tenant each second {light:?}; most in a second {}",
        r.most
    );
    assert!(r.most <= 100, "{} in one second", r.most);
    assert_eq!(light.iter().skip(10).sum::<u64>(), sent, "{light:?}");
}

/// A provider's limit a minute (its requests or tokens per minute), shared fairly across
/// three Envoys: the same shares as a second's window, never more than the capacity in a
/// minute, and the service's calls (the lease's claims and the fair reports) per 100
/// requests admitted, a second's window against a minute's.
#[test]
fn a_minutes_capacity_is_shared_as_fairly_with_fewer_calls() {
    let second = pinned_on(Case::new("fair", true));
    let minute = pinned_on(Case {
        window: Window::Minute,
        ..Case::new("fair", true)
    });
    let per_100 = |r: &Run| 100.0 * (r.claims + r.reports - r.rides) as f64 / r.admitted as f64;
    let demands: Vec<f64> = TENANTS.iter().map(|t| t.3).collect();
    let weights: Vec<f64> = TENANTS.iter().map(|t| f64::from(t.2)).collect();
    let ideal = water_fill(97.0, &demands, &weights);
    println!(
        "a second: {:.1?}, {} claims, {} reports ({} riding), {} admitted: {:.2} calls per 100",
        second.rates,
        second.claims,
        second.reports,
        second.rides,
        second.admitted,
        per_100(&second)
    );
    println!(
            "a minute: {:.1?}, {} claims, {} reports ({} riding), {} admitted: {:.2} calls per 100; most in a minute {}",
            minute.rates,
            minute.claims,
            minute.reports,
            minute.rides,
            minute.admitted,
            per_100(&minute),
            minute.most
        );
    println!("water-filling {ideal:.1?}");
    assert!(minute.most <= 6_000, "{} in one minute", minute.most);
    let per_weight: Vec<f64> = (0..4).map(|i| minute.rates[i] / weights[i]).collect();
    assert!(jain(&per_weight) >= 0.99, "{per_weight:?}");
    for i in 0..4 {
        let off = (minute.rates[i] - ideal[i]).abs() / ideal[i];
        assert!(off <= 0.02, "{}: {:.1}", TENANTS[i].0, minute.rates[i]);
    }
    assert!(
        minute.rates[4] >= 0.97 * 5.0,
        "light {:.2}",
        minute.rates[4]
    );
    // A claim's block follows what an Envoy expects to admit in the rest of the window:
    // with a minute's, far fewer calls for as many requests.
    assert!(per_100(&minute) <= 2.0, "{:.2}", per_100(&minute));
    assert!(per_100(&second) > 10.0 * per_100(&minute));
}

/// Asserts that over `seconds` of `r` the backlogged tenants got their water-filling
/// shares of 97 a second within 3 %, and the light one at least 99 % of its demand.
fn assert_water_filling(r: &Run, seconds: std::ops::Range<usize>, what: &str) {
    let demands: Vec<f64> = TENANTS.iter().map(|t| t.3).collect();
    let weights: Vec<f64> = TENANTS.iter().map(|t| f64::from(t.2)).collect();
    let ideal = water_fill(97.0, &demands, &weights);
    let n = seconds.len() as f64;
    let rates: Vec<f64> = (0..TENANTS.len())
        .map(|i| r.per_s[seconds.clone()].iter().map(|s| s[i]).sum::<u64>() as f64 / n)
        .collect();
    println!("{what} seconds {seconds:?}: {rates:.1?}, water-filling {ideal:.1?}");
    for i in 0..4 {
        let off = (rates[i] - ideal[i]).abs() / ideal[i];
        assert!(
            off <= 0.03,
            "{what} {seconds:?} {}: {:.1}",
            TENANTS[i].0,
            rates[i]
        );
    }
    assert!(
        rates[4] >= 0.99 * 5.0,
        "{what} {seconds:?} light: {:.1}",
        rates[4]
    );
}

/// A replica killed, and one added: the third Envoy goes down at second 12 (its tenants
/// reconnect to the first), then comes back at second 20 (they move back); before the
/// first Envoy was there only from second 4 (its tenant sent to the second until then).
/// Never more than the capacity in a second; from three seconds after each change the
/// shares are the water-filling's again, within 3 % (between, an Envoy back with a view
/// gone stale shares locally until its first report is answered).
#[test]
fn replicas_killed_and_added_keep_the_fleet_within_its_capacity_and_fair() {
    let place = |_: usize, e: usize, ms: u64| match (e, ms) {
        (0, 0..4_000) => 1,
        (2, 12_000..20_000) => 0,
        _ => e,
    };
    let r = pinned_on(Case {
        place: &place,
        ..Case::new("fair", true)
    });
    assert!(r.most <= 100, "{} in one second", r.most);
    for (s, counts) in r.per_s.iter().enumerate() {
        println!("second {s}: {counts:?}");
    }
    // Before the kill; three seconds after it, and after the return, to the change that
    // follows.
    for (from, to) in [(9, 12), (15, 20), (23, 30)] {
        assert_water_filling(&r, from..to, "");
    }
}

/// The service down from second 10 to 15 (every call fails as unreachable), then back:
/// with `failure_mode: "deny"` the fleet never admits more than the capacity in a second
/// (what the Envoys held, then nothing that must claim); with `"allow"`, each Envoy what
/// its own shares let through, at most the capacity each; and from three seconds after the
/// service is back the shares are the water-filling's again.
#[test]
fn the_service_down_follows_failure_mode_and_the_shares_come_back() {
    for mode in ["deny", "allow"] {
        let r = pinned_on(Case {
            down: 10_000..15_000,
            failure_mode: mode,
            ..Case::new("fair", true)
        });
        let totals: Vec<u64> = r.per_s.iter().map(|s| s.iter().sum()).collect();
        println!("{mode}: admitted each second {totals:?}");
        let down = totals[10..15].iter().max().copied().unwrap_or(0);
        if mode == "deny" {
            assert!(r.most <= 100, "{} in one second", r.most);
        } else {
            // Each Envoy at most the capacity; the tenants ask 245 a second in all.
            assert!(down > 100 && down <= 3 * 100, "{down}");
        }
        assert_water_filling(&r, 18..30, mode);
        assert!(totals[18..].iter().all(|&t| t <= 100), "{totals:?}");
    }
}

/// The provider admits 70 a second where the rule says 100, and says so in every answer
/// (`share.learn`; every Envoy reads the same account's fields). Fair across the fleet,
/// the fleet shares 70 as it would share a configured 70: the water-filling's shares of
/// 97 % of it wherever the tenants are, the light one all it asks, and the provider never
/// refuses: from the first answers each Envoy's lease takes no more of the service's window
/// than 70 (the fleet's view of a window, read two windows later, sets the shares).
/// Leased and shared locally (`fleet: "local"`), each Envoy holds its own part to what it
/// learned: the light tenant is served, the provider refuses a few requests (5 over the run
/// after the second second), and the shares are each Envoy's (as without `learn`).
#[test]
fn a_provider_limit_below_the_configured_one_is_the_fleets() {
    let demands: Vec<f64> = TENANTS.iter().map(|t| t.3).collect();
    let weights: Vec<f64> = TENANTS.iter().map(|t| f64::from(t.2)).collect();
    let ideal = water_fill(0.97 * 70.0, &demands, &weights);
    for fleet in ["fair", "local"] {
        let r = pinned_on(Case {
            provider: Some(70),
            ..Case::new(fleet, true)
        });
        let used: f64 = r.rates.iter().sum();
        // From the third second: the fleet's view is read two windows after it is written.
        let late: u64 = r.provider_refused[3..].iter().sum();
        let most = r.per_s[3..].iter().map(|s| s.iter().sum::<u64>()).max();
        println!(
                "{fleet}: {:.1?} (water-filling of 97 % of 70: {ideal:.1?}), used {used:.1}, the provider refused {:?}, most in a second from the third {most:?}",
                r.rates, r.provider_refused
            );
        assert!(r.rates[4] >= 0.99 * 5.0, "{fleet}: light {:.2}", r.rates[4]);
        if fleet == "local" {
            assert!(late <= 10, "{fleet}: {:?}", r.provider_refused);
            continue;
        }
        assert!(
            r.provider_refused.iter().all(|&n| n == 0),
            "{fleet}: {:?}",
            r.provider_refused
        );
        assert!(r.most <= 70, "{fleet}: {} in a second", r.most);
        assert!(used >= 0.95 * 70.0, "{fleet}: used {used:.1}");
        for i in 0..4 {
            let off = (r.rates[i] - ideal[i]).abs() / ideal[i];
            assert!(off <= 0.03, "{fleet} {}: {:.1}", TENANTS[i].0, r.rates[i]);
        }
    }
}

/// Bands across the fleet: an interactive band (three tenants of 10 a second, one on each
/// Envoy) beside a batch band (three tenants of 60 a second, weights 1, 1 and 2, one on
/// each Envoy), sharing 100 a second fair across three Envoys; with and without waits
/// (`max_wait_ms`). The interactive tenants are never refused (and from the tenth second
/// never wait: before, a few waited 100 to 200 ms at the ends of windows) while the batch
/// band absorbs the overload in its tenants' weights' shares of the rest; a request waits
/// no longer than `max_wait_ms`; never more than the capacity in a second.
#[test]
fn bands_and_waits_hold_across_the_fleet() {
    let tenants = [
        ("i0", 0, 1, 10.0),
        ("i1", 1, 1, 10.0),
        ("i2", 2, 1, 10.0),
        ("b0", 0, 1, 60.0),
        ("b1", 1, 1, 60.0),
        ("b2", 2, 2, 60.0),
    ];
    let bands = [
        "interactive",
        "interactive",
        "interactive",
        "batch",
        "batch",
        "batch",
    ];
    let bands_json = r#", "bands": [{"name": "interactive", "min_share": 0.2},
            {"name": "batch", "min_share": 0.05}],
            "band": {"from": "header:x-band", "default": "batch"}"#;
    let waits_json = format!(r#"{bands_json}, "max_wait_ms": 1000"#);
    // Or the interactive tenants all on the first Envoy, the batch ones spread over the
    // three (a request's Envoy by the millisecond it is sent).
    let apart = |i: usize, _: usize, ms: u64| if i < 3 { 0 } else { (ms % 3) as usize };
    let cases: [(&str, &str, Placement<'_>); 4] = [
        ("bands, pinned", bands_json, &|_, e, _| e),
        ("waits, pinned", &waits_json, &|_, e, _| e),
        ("bands, apart", bands_json, &apart),
        ("waits, apart", &waits_json, &apart),
    ];
    for (what, share, place) in cases {
        let r = pinned_on(Case {
            tenants: &tenants,
            bands: &bands,
            share,
            place,
            ..Case::new("fair", true)
        });
        let refused: Vec<u64> = (0..tenants.len())
            .map(|i| r.refused_per_s[10..].iter().map(|s| s[i]).sum())
            .collect();
        let longest = r.waits.iter().map(|w| w.2).max().unwrap_or(0);
        // Interactive waits only in the first windows (at their ends, for the next), not once
        // the fleet's shares are settled.
        let interactive: Vec<&(usize, u64, u64)> = r
            .waits
            .iter()
            .filter(|w| w.0 < 3 && w.1 >= 10_000)
            .collect();
        println!(
                "{what}: {:.1?} a second, refused {refused:?}, {} waited (longest {longest} ms), most in a second {}",
                r.rates,
                r.waits.len(),
                r.most
            );
        for s in 8..14 {
            println!(
                "  second {s}: admitted {:?} refused {:?}",
                r.per_s[s], r.refused_per_s[s]
            );
        }
        assert!(r.most <= 100, "{what}: {} in one second", r.most);
        let ideal = water_fill(97.0 - 30.0, &[60.0; 3], &[1.0, 1.0, 2.0]);
        for i in 0..3 {
            assert_eq!(refused[i], 0, "{what}: {} refused", tenants[i].0);
            assert!(
                r.rates[i] >= 9.9,
                "{what}: {} {:.2}",
                tenants[i].0,
                r.rates[i]
            );
            let off = (r.rates[3 + i] - ideal[i]).abs() / ideal[i];
            assert!(
                off <= 0.05,
                "{what}: {} {:.1} for {:.1}",
                tenants[3 + i].0,
                r.rates[3 + i],
                ideal[i]
            );
        }
        let used: f64 = r.rates.iter().sum();
        assert!(used >= 95.0, "{what}: used {used:.1}");
        assert!(longest <= 1000, "{what}: a wait of {longest} ms");
        assert!(
            interactive.is_empty(),
            "{what}: interactive waited {interactive:?}"
        );
    }
}

/// A request whose lease claim the service refuses (the fleet's quota spent) is decided
/// before its shares are: its ask still counts in the fleet's demand, once, whether it is
/// refused at once or waits for its turn (and then not again at its turns or at the end of
/// its wait).
#[test]
fn a_request_the_service_refuses_counts_as_asked_once() {
    for wait in ["", r#", "max_wait_ms": 300"#] {
        let json = format!(
            r#"{{"rules": [{{"name": "p", "key": ["header:x-tenant"],
                "rate_limit": {{"requests_per_unit": 100, "unit": "second"}},
                "global": {{"cluster": "rls", "domain": "edge", "mode": "lease", "flush_ms": 10,
                           "max_block": 10}},
                "share": {{"fleet": "fair"{wait}}}}}]}}"#
        );
        let config = crate::config::Config::parse(json.as_bytes()).unwrap();
        let rt = Runtime::new(config, Seed([1, 7]), Arc::new(MemoryStore::new()));
        // A service whose window has nothing left.
        let mut service = Service::new((0, 1_000), true);
        let t0: u64 = 1_800_000_000_000;
        let mut id = 0;
        for n in 0..5u64 {
            let now = t0 + n * 20;
            let mut h = FakeHost::new("10.0.0.1", "/").header("x-tenant", "a");
            h.now = now;
            let mut st = StreamState::default();
            let next = st.request_headers(&rt, &mut h);
            let mut answer = |m: &[u8]| Ok(service.answer(m, now));
            let mut next = settle(&rt, &mut st, &mut h, next, &mut answer, &mut id);
            // Waiting: it looks at its line until it is decided (refused at its end).
            let mut at = now;
            while let Next::Hold { until_ms } = next {
                at = until_ms.max(at + 1);
                next = st.wake(&rt, at);
            }
            assert!(matches!(next, Next::Reply(_)), "{wait}: {next:?}");
        }
        let asked =
            crate::engine::update_fair_record(&rt.store, rt.compiled[0].fair_record(), 1, |r| {
                (r.tenants.clone(), false)
            })
            .unwrap();
        let asked: Vec<u32> = asked.iter().map(|t| t.local.asked.iter().sum()).collect();
        assert_eq!(asked, [5], "{wait}");
        assert!(service.claims >= 1);
    }
}

/// A lone shared rule's short path (`runtime/shared.rs`) against the general path, in the
/// fleet: three Envoys leasing one fleet-fair capacity (tenants pinned; two workers an
/// Envoy with bands and waits, spread; a provider whose limit is learned), and leasing it
/// shared locally: every second's admissions and refusals, every wait, every claim and
/// report the same (each runtime's fair rounding draws fixed: random, they differ by run).
#[test]
fn the_shared_path_leases_waits_and_shares_across_the_fleet_as_the_general_one() {
    let tenants = [
        ("i0", 0, 1, 10.0),
        ("b0", 0, 1, 60.0),
        ("b1", 1, 1, 60.0),
        ("b2", 2, 2, 60.0),
    ];
    let bands = ["interactive"];
    let waits = r#", "bands": [{"name": "interactive", "min_share": 0.2},
            {"name": "batch", "min_share": 0.05}],
            "band": {"from": "header:x-band", "default": "batch"}, "max_wait_ms": 1000"#;
    let spread = |i: usize, _: usize, ms: u64| (ms as usize + i) % 3;
    let cases: [(&str, Case<'_>); 4] = [
        ("fair, pinned", Case::new("fair", true)),
        (
            "fair, waits, two workers, spread",
            Case {
                tenants: &tenants,
                bands: &bands,
                share: waits,
                place: &spread,
                workers: 2,
                ..Case::new("fair", true)
            },
        ),
        (
            "fair, learned",
            Case {
                provider: Some(70),
                ..Case::new("fair", true)
            },
        ),
        ("local, pinned", Case::new("local", true)),
    ];
    for (what, case) in cases {
        let case = Case {
            dither: Some(0x9e37_79b9_7f4a_7c15),
            ..case
        };
        let (short, general) = (
            pinned_on(case.clone()),
            pinned_on(Case {
                general: true,
                ..case
            }),
        );
        assert!(
            short.short_path && !general.short_path,
            "{what}: the paths compared"
        );
        assert_eq!(short.per_s, general.per_s, "{what}");
        assert_eq!(short.refused_per_s, general.refused_per_s, "{what}");
        assert_eq!(short.waits, general.waits, "{what}");
        assert_eq!(short.provider_refused, general.provider_refused, "{what}");
        assert_eq!(
            (short.claims, short.reports),
            (general.claims, general.reports),
            "{what}"
        );
        let refused: u64 = short.refused_per_s.iter().flatten().sum();
        assert!(short.admitted > 1_000 && refused > 100, "{what}: {refused}");
    }
}
