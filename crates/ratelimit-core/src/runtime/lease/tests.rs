use crate::config::Config;
use crate::key::Seed;
use crate::metrics::{Counter, Gauge};
use crate::rls::{self, Code, DescriptorStatus};
use crate::runtime::{Background, Next, Runtime, StreamState};
use crate::store::{MemoryStore, Store};
use crate::testkit::FakeHost;

const LEASE: &str = r#"{"rules": [{"name": "g", "key": ["remote_address"],
    "rate_limit": {"requests_per_unit": 100, "unit": "minute"},
    "global": {"cluster": "rls", "domain": "edge", "mode": "lease", "flush_ms": 10}}]}"#;

fn runtime(json: &str) -> Runtime<MemoryStore> {
    crate::testkit::runtime(json, Seed([3, 4]))
}

fn answer(code: Code, remaining: u32) -> rls::Response {
    rls::Response {
        overall_code: code,
        statuses: vec![DescriptorStatus {
            code,
            requests_per_unit: Some(100),
            unit_seconds: Some(60),
            limit_remaining: remaining,
            reset_ms: Some(30_000),
        }],
        headers: Vec::new(),
    }
}

fn claims(rt: &Runtime<MemoryStore>) -> u64 {
    let mut n = 0;
    rt.metrics().drain(
        |_, c, k| {
            if c == Counter::LeaseClaims {
                n += k;
            }
        },
        |_, _| {},
    );
    n
}

/// One request at `now`, each claim it makes answered by `answer`: the last claim's
/// block, if it claimed, and whether it was admitted.
fn request(
    rt: &Runtime<MemoryStore>,
    now: u64,
    answer: impl Fn(u64) -> rls::Response,
) -> (Option<u64>, bool) {
    let mut h = FakeHost::new("10.0.0.1", "/");
    request_from(rt, &mut h, now, answer)
}

/// [`request`] from `h`.
fn request_from(
    rt: &Runtime<MemoryStore>,
    h: &mut FakeHost,
    now: u64,
    answer: impl Fn(u64) -> rls::Response,
) -> (Option<u64>, bool) {
    h.now = now;
    let mut st = StreamState::default();
    let mut next = st.request_headers(rt, h);
    let mut claimed = None;
    for id in 1.. {
        match next {
            Next::Continue => return (claimed, true),
            Next::Reply(_) => return (claimed, false),
            Next::Call { message, .. } => {
                let hits = rls::decode_request(&message).unwrap().hits;
                claimed = Some(hits);
                assert!(matches!(st.started(rt, h, Ok(id)), Next::Wait));
                next = st.call_answer(rt, h, id, Ok(answer(hits)));
            }
            other => panic!("{other:?}"),
        }
    }
    unreachable!()
}

/// What [`leased_waits`] saw: admitted by second (all tenants), each tenant's rate over
/// seconds 3 to 10, requests that joined the line, admitted from it, the longest wait, and
/// refusals that named no rule, or, the share's, said something remained.
struct Waited {
    by_second: Vec<u64>,
    rates: Vec<f64>,
    queued: u64,
    from_line: u64,
    longest: u64,
    unnamed: u64,
}

/// A leased shared capacity (100 a second, counted by the service in windows of a second)
/// with `share.max_wait_ms` `max_wait_ms`, on a virtual clock, the service answering at
/// once: four tenants at 50 a second, twice their share, and a light one at 8.
fn leased_waits(max_wait_ms: u64) -> Waited {
    let rt = runtime(&format!(
        r#"{{"rules": [{{"name": "p", "key": ["header:x-tenant"],
        "rate_limit": {{"requests_per_unit": 100, "unit": "second"}},
        "global": {{"cluster": "rls", "domain": "edge", "mode": "lease", "flush_ms": 10,
                   "max_block": 8}},
        "share": {{"max_wait_ms": {max_wait_ms}, "max_queued": 256,
                   "max_queued_per_tenant": 64}}}}]}}"#
    ));
    let mut bg = Background::new(&rt);
    let t0: u64 = 1_800_000_000_000;
    // The service: one counter, 100 a window of a second.
    let service = std::cell::RefCell::new((0u64, 0u64));
    let grant =
        |hits: u64, now: u64| crate::testkit::second_counter(&mut service.borrow_mut(), hits, now);
    let tenants: [(&str, f64); 5] = [
        ("equal0", 50.0),
        ("equal1", 50.0),
        ("equal2", 50.0),
        ("equal3", 50.0),
        ("light", 8.0),
    ];
    let run_ms: u64 = 12_000;
    let mut next_at: Vec<f64> = (0..5).map(|i| f64::from(i) * 3.7).collect();
    // Waiting streams: (stream, its host, when it looks again, tenant, joined).
    let mut waiting: Vec<(StreamState, FakeHost, u64, usize, u64)> = Vec::new();
    let mut per_s = vec![[0u64; 5]; (run_ms / 1000 + 2) as usize];
    let (mut queued, mut from_line, mut longest, mut unnamed) = (0u64, 0u64, 0u64, 0u64);
    let mut call_id = 0u64;
    for ms in 0..run_ms + 1_200 {
        let now = t0 + ms;
        let second = (ms / 1000) as usize;
        for (i, (name, rate)) in tenants.iter().enumerate() {
            while ms < run_ms && next_at[i] <= ms as f64 {
                next_at[i] += 1000.0 / rate;
                let mut h = FakeHost::new("10.0.0.1", "/").header("x-tenant", name);
                h.now = now;
                let mut st = StreamState::default();
                let mut next = st.request_headers(&rt, &mut h);
                loop {
                    next = match next {
                        Next::Call { message, .. } => {
                            let hits = rls::decode_request(&message).unwrap().hits;
                            call_id += 1;
                            assert!(matches!(st.started(&rt, &mut h, Ok(call_id)), Next::Wait));
                            st.call_answer(&rt, &mut h, call_id, Ok(grant(hits, now)))
                        }
                        Next::Continue => {
                            per_s[second][i] += 1;
                            break;
                        }
                        Next::Hold { until_ms } => {
                            queued += 1;
                            waiting.push((st, h, until_ms, i, now));
                            break;
                        }
                        Next::Reply(r) => {
                            assert_eq!(r.status, 429);
                            break;
                        }
                        other => panic!("{other:?}"),
                    };
                }
            }
        }
        let mut k = 0;
        while k < waiting.len() {
            let (st, _, until, i, joined) = &mut waiting[k];
            if *until > now {
                k += 1;
                continue;
            }
            match st.wake(&rt, now) {
                Next::Hold { until_ms } => {
                    *until = until_ms;
                    k += 1;
                    continue;
                }
                Next::Continue => {
                    per_s[second][*i] += 1;
                    from_line += 1;
                    longest = longest.max(now - *joined);
                }
                Next::Reply(r) => {
                    assert_eq!(r.status, 429);
                    longest = longest.max(now - *joined);
                    // Refused by the lease or the share, a 429 names the rule; refused
                    // by the share alone (one policy in its fields), it says nothing
                    // remains.
                    let field = |name: &str| {
                        r.headers()
                            .find(|(k, _)| *k == name)
                            .map(|(_, v)| v.to_string())
                    };
                    let by_share = field("ratelimit").is_some_and(|f| !f.contains(", "));
                    let left = field("x-ratelimit-remaining");
                    unnamed += u64::from(
                        !r.body.contains(r#""violated-policies":["p"]"#)
                            || (by_share && left.as_deref() != Some("0")),
                    );
                }
                other => panic!("{other:?}"),
            }
            waiting.swap_remove(k);
        }
        let work = bg.tick(&rt, now, None);
        for call in work.calls {
            let hits = rls::decode_request(&call.message).unwrap().hits;
            call_id += 1;
            bg.started(&rt, call, Some(call_id));
            bg.answered(&rt, call_id, Ok(grant(hits, now)), now);
        }
    }
    let measured = &per_s[3..11];
    let rate = |i: usize| measured.iter().map(|s| s[i]).sum::<u64>() as f64 / 8.0;
    Waited {
        by_second: per_s.iter().map(|s| s.iter().sum()).collect(),
        rates: (0..5).map(rate).collect(),
        queued,
        from_line,
        longest,
        unnamed,
    }
}

/// A leased shared capacity's refused requests wait their turn (`max_wait_ms`): requests
/// whose claims were granted and whose shares refused them join the line, and turns take
/// from the lease (claiming ahead of need when it runs dry). Every admission is covered
/// (at most the service's 100 a window), the light tenant is served whole, the equal ones
/// alike, no request waits past `max_wait_ms`, and the capacity is used as much as when
/// every refusal comes at once.
#[test]
fn a_leased_shared_capacity_lets_refused_requests_wait_their_turn() {
    let at_once = leased_waits(0);
    let w = leased_waits(1_000);
    let used = |w: &Waited| w.rates.iter().sum::<f64>();
    println!(
        "leased, refused at once: {:.2}/s used, {:?}; waiting: {:.2}/s used, {:?}, \
         {} queued, {} admitted from the line, longest wait {} ms, by second {:?}",
        used(&at_once),
        at_once.rates,
        used(&w),
        w.rates,
        w.queued,
        w.from_line,
        w.longest,
        w.by_second
    );
    assert_eq!((at_once.queued, at_once.from_line), (0, 0));
    assert!(w.by_second.iter().all(|&n| n <= 100), "{:?}", w.by_second);
    assert!(w.from_line > 500, "{} admitted from the line", w.from_line);
    assert!(w.longest <= 1_010, "waited {} ms", w.longest);
    // A wait that ends refused by the lease says so (171 of them named no rule before the
    // lease's refusal was reported), and the share's refusal says nothing remains (282
    // said 1 before a share that is no whole number of requests reported 0).
    assert_eq!(w.unnamed, 0, "429s after a wait naming no rule or not at 0");
    assert!(used(&w) >= used(&at_once) - 3.0, "{:.2}/s", used(&w));
    assert_eq!(w.rates[4], 8.0, "the light tenant");
    let equal = &w.rates[..4];
    let (least, most) = equal
        .iter()
        .fold((f64::MAX, 0.0f64), |(l, m), &r| (l.min(r), m.max(r)));
    assert!(most - least <= 1.0, "equal tenants {equal:?}");
}

/// The fleet's quota spent (the service refuses the claim): a request of a leased shared
/// rule that lets requests wait waits for the next window; one that another rule, which
/// refuses at once, also matched is refused at once (that rule is not decided before the
/// wait, so the wait could end in a refusal it would have given now).
#[test]
fn a_request_the_spent_quota_refuses_waits_only_where_every_rule_waits() {
    let shared = r#"{"name": "p", "key": ["header:x-tenant"],
        "rate_limit": {"requests_per_unit": 100, "unit": "second"},
        "global": {"cluster": "rls", "domain": "edge", "mode": "lease", "flush_ms": 10},
        "share": {"max_wait_ms": 1000}}"#;
    let plain = r#"{"name": "ip", "key": ["remote_address"],
        "rate_limit": {"requests_per_unit": 1000, "unit": "minute"}}"#;
    let spent = |now: u64| rls::Response {
        overall_code: Code::OverLimit,
        statuses: vec![DescriptorStatus {
            code: Code::OverLimit,
            requests_per_unit: Some(100),
            unit_seconds: Some(1),
            limit_remaining: 0,
            reset_ms: Some(1000 - now % 1000),
        }],
        headers: Vec::new(),
    };
    for (rules, waits) in [
        (format!("[{shared}]"), true),
        (format!("[{shared}, {plain}]"), false),
    ] {
        let rt = runtime(&format!(r#"{{"rules": {rules}}}"#));
        let mut h = FakeHost::new("10.0.0.1", "/").header("x-tenant", "a");
        h.now = 1_800_000_000_400;
        let mut st = StreamState::default();
        let Next::Call { .. } = st.request_headers(&rt, &mut h) else {
            panic!("no claim")
        };
        assert!(matches!(st.started(&rt, &mut h, Ok(1)), Next::Wait));
        let answer = spent(h.now);
        let next = st.call_answer(&rt, &mut h, 1, Ok(answer));
        match (waits, next) {
            (true, Next::Hold { .. }) => {}
            (false, Next::Reply(r)) => assert_eq!(r.status, 429),
            (_, other) => panic!("{rules}: {other:?}"),
        }
    }
}

#[test]
fn a_granted_block_admits_locally_and_a_low_key_claims_ahead() {
    let rt = runtime(LEASE);
    let mut bg = Background::new(&rt);
    // The first request claims a block and takes its cost from it.
    let (hits, ok) = request(&rt, 1_000, |_| answer(Code::Ok, 90));
    let first = hits.expect("a claim");
    assert!(ok && first >= 1, "{first}");
    // The rest of the block is admitted with no call.
    for t in 1..first {
        let (hits, ok) = request(&rt, 1_000 + t, |_| panic!("claimed"));
        assert_eq!((hits, ok), (None, true));
    }
    assert_eq!(claims(&rt), 1);
    // Running low queued a claim ahead of need: the next tick sends it.
    let work = bg.tick(&rt, 2_000, None);
    assert_eq!(work.calls.len(), 1, "a claim ahead");
    let call = work.calls.into_iter().next().unwrap();
    let block = rls::decode_request(&call.message).unwrap().hits;
    assert!(block >= 2, "the block grows with the rate: {block}");
    bg.started(&rt, call, Some(9));
    assert!(bg.answered(&rt, 9, Ok(answer(Code::Ok, 80)), 2_010));
    for t in 0..block {
        let (hits, ok) = request(&rt, 2_100 + t, |_| panic!("claimed"));
        assert_eq!((hits, ok), (None, true), "request {t} of the block");
    }
}

#[test]
fn only_a_claim_builds_a_descriptor() {
    // The key is read once per request; a claim reads it again for its descriptor (now or
    // ahead of need); a request admitted from what is held builds none.
    let rt = runtime(LEASE);
    let reads = |now, answered: bool| {
        let mut h = FakeHost::new("10.0.0.1", "/");
        let (hits, ok) = request_from(&rt, &mut h, now, |_| answer(Code::Ok, 90));
        assert!(ok && hits.is_some() == answered);
        h.address_reads
    };
    assert_eq!(reads(1_000, true), 2, "claims");
    let held = (1..4).map(|t| reads(1_000 + t, false)).collect::<Vec<_>>();
    assert!(held.contains(&1), "admitted from the block: {held:?}");
    assert!(held.contains(&2), "ran low, claims ahead: {held:?}");
    let mut bg = Background::new(&rt);
    let work = bg.tick(&rt, 2_000, None);
    let call = work.calls.first().expect("a claim ahead");
    let entries = rls::decode_request(&call.message).unwrap().descriptors;
    assert_eq!(
        entries,
        [vec![
            ("rule".to_string(), b"g".to_vec()),
            ("remote_address".to_string(), b"10.0.0.1".to_vec())
        ]]
    );
}

#[test]
fn a_lease_takes_an_entry_of_the_table_like_any_key() {
    // The first claim writes the key's lease: the tracked keys count it.
    let rt = runtime(LEASE);
    let (hits, ok) = request(&rt, 1_000, |_| answer(Code::Ok, 90));
    assert!(hits.is_some() && ok);
    let mut gauges = Vec::new();
    rt.metrics().drain(|_, _, _| {}, |g, d| gauges.push((g, d)));
    assert_eq!(gauges, [(Gauge::TrackedKeys, 1)]);
}

/// A claim refused at the turn of the service's window (this proxy's estimate of its end
/// is early by a round trip, and the service still counts the old, spent window) is made
/// again, and the request admitted from the next window's grant, not refused for the old
/// one; at most [`super::TURN_ASKS`] times. Away from the turn a refusal stands.
#[test]
fn a_claim_refused_at_the_windows_turn_is_made_again() {
    // A grant whose window ends, as estimated here, at 31,000 (a reset of 30 s).
    let granted_then = |rt: &Runtime<MemoryStore>| {
        assert_eq!(
            request(rt, 1_000, |_| answer(Code::Ok, 96)),
            (Some(4), true)
        );
    };
    // The service refuses the first `n` claims (nothing left), then grants.
    let refusing = |n: u64| {
        let calls = std::cell::Cell::new(0u64);
        move |_hits: u64| {
            calls.set(calls.get() + 1);
            match calls.get() <= n {
                true => answer(Code::OverLimit, 0),
                false => answer(Code::Ok, 96),
            }
        }
    };
    // 20 ms after the estimated end: refused once, then granted; admitted.
    let rt = runtime(LEASE);
    granted_then(&rt);
    claims(&rt);
    assert!(request(&rt, 31_020, refusing(1)).1);
    assert_eq!(claims(&rt), 2);
    // Refused three times, then granted: still admitted (three asks again).
    let rt = runtime(LEASE);
    granted_then(&rt);
    claims(&rt);
    assert!(request(&rt, 31_020, refusing(3)).1);
    assert_eq!(claims(&rt), 4);
    // Refused every time: asked four times in all, then refused; the service's new window
    // is spent (each refusal a round trip apart), so the refusal stands: the next requests
    // at the turn are refused here, without a call, until the service's reset.
    let rt = runtime(LEASE);
    granted_then(&rt);
    claims(&rt);
    assert!(!request(&rt, 31_020, refusing(u64::MAX)).1);
    assert_eq!(claims(&rt), 4);
    assert_eq!(request(&rt, 31_030, refusing(u64::MAX)), (None, false));
    assert_eq!(claims(&rt), 0);
    // Past the turn (the window it knew ended 200 ms ago): the refusal stands, one claim.
    let rt = runtime(LEASE);
    granted_then(&rt);
    claims(&rt);
    assert!(!request(&rt, 31_200, refusing(1)).1);
    assert_eq!(claims(&rt), 1);
    // Within the window it knows (the fleet's quota spent early), what is held spent
    // first: the same.
    let rt = runtime(LEASE);
    granted_then(&rt);
    for _ in 0..3 {
        assert_eq!(request(&rt, 19_990, refusing(u64::MAX)), (None, true));
    }
    claims(&rt);
    assert!(!request(&rt, 20_000, refusing(1)).1);
    assert_eq!(claims(&rt), 1);
}

#[test]
fn quota_held_when_the_window_turns_lapses_at_the_next_claim() {
    // A block of 4, one used; the service's window (30 s) turns; the next request claims
    // afresh, and the 3 held lapse.
    let rt = runtime(LEASE);
    assert_eq!(
        request(&rt, 1_000, |_| answer(Code::Ok, 96)),
        (Some(4), true)
    );
    let (hits, ok) = request(&rt, 40_000, |_| answer(Code::Ok, 96));
    assert!(hits.is_some() && ok);
    let mut counts = Vec::new();
    rt.metrics().drain(|_, c, n| counts.push((c, n)), |_, _| {});
    assert!(counts.contains(&(Counter::LeaseLapsed, 3)), "{counts:?}");
}

#[test]
fn a_grant_whose_window_ends_now_is_not_held_into_the_next() {
    // The service grants a block with under a millisecond of its window left (a reset of
    // 0): its window turns at once, so nothing of the block may be held past now. Before,
    // a reset of 0 read as none and the block was held to the end of the rule's
    // clock-aligned window, admitted in the service's next window beside that window's
    // own grants (fleet-sim's runtime runs found up to 2.3 % over the capacity there).
    let rt = runtime(LEASE);
    let (hits, ok) = request(&rt, 1_000, |_| {
        let mut a = answer(Code::Ok, 96);
        a.statuses[0].reset_ms = Some(0);
        a
    });
    assert_eq!((hits, ok), (Some(4), true));
    // A millisecond later: the 3 left of the block lapsed, a claim is made again.
    let (hits, ok) = request(&rt, 1_001, |_| answer(Code::Ok, 92));
    assert!(hits.is_some() && ok, "{hits:?}");
}

#[test]
fn a_refused_claim_of_a_block_claims_what_remains_then_refuses_locally() {
    let rt = runtime(LEASE);
    let (hits, ok) = request(&rt, 1_000, |hits| {
        if hits > 1 {
            answer(Code::OverLimit, 1)
        } else {
            answer(Code::Ok, 0)
        }
    });
    assert_eq!((hits, ok), (Some(1), true), "claimed what remained");
    // None left: refused by the service once, then locally until its reset.
    let (hits, ok) = request(&rt, 1_100, |_| answer(Code::OverLimit, 0));
    assert!(hits.is_some() && !ok);
    let (hits, ok) = request(&rt, 1_200, |_| panic!("claimed"));
    assert_eq!((hits, ok), (None, false));
    // After the service's reset, a claim again.
    let (hits, ok) = request(&rt, 1_100 + 30_000, |_| answer(Code::Ok, 50));
    assert!(hits.is_some() && ok);
}

#[test]
fn no_request_waits_past_its_timeout_in_all() {
    // timeout_ms 20 (the default): the first claim's answer comes after 15 ms; the claim
    // of what remains gets the 5 ms left; after 20 ms, the refusal stands.
    for (answered_at, again) in [(15u64, Some(5u32)), (20, None)] {
        let rt = runtime(&LEASE.replace(r#""flush_ms": 10"#, r#""flush_ms": 10, "max_block": 8"#));
        let mut h = FakeHost::new("10.0.0.1", "/");
        h.now = 1_000;
        let mut st = StreamState::default();
        let Next::Call { timeout_ms, .. } = st.request_headers(&rt, &mut h) else {
            panic!("no claim")
        };
        assert_eq!(timeout_ms, 20);
        st.started(&rt, &mut h, Ok(1));
        h.now += answered_at;
        let next = st.call_answer(&rt, &mut h, 1, Ok(answer(Code::OverLimit, 2)));
        match (next, again) {
            (Next::Call { timeout_ms, .. }, Some(left)) => assert_eq!(timeout_ms, left),
            (Next::Reply(r), None) => assert_eq!(r.status, 429),
            (other, _) => panic!("{other:?} after {answered_at} ms"),
        }
    }
}

const SHARED: &str = r#"{"rules": [{"name": "p", "key": ["header:x-tenant"],
    "rate_limit": {"requests_per_unit": 100, "unit": "second"},
    "global": {"cluster": "rls", "domain": "edge", "mode": "lease", "flush_ms": 10,
               "max_block": 8},
    "share": {}}]}"#;

/// The shared rule's record as stored.
fn record(rt: &Runtime<MemoryStore>) -> crate::share::Record {
    let slot = rt.compiled[0].share_record();
    rt.store
        .read(slot, |b, _| b.and_then(crate::share::Record::decode))
        .unwrap()
        .unwrap()
}

#[test]
fn a_shared_capacity_leases_one_quota_for_all_its_tenants() {
    let rt = runtime(SHARED);
    let tenant = |name: &str| FakeHost::new("10.0.0.1", "/").header("x-tenant", name);
    // The first request claims for the capacity: the descriptor names the rule alone.
    let mut h = tenant("a");
    h.now = 1_000;
    let mut st = StreamState::default();
    let Next::Call { message, .. } = st.request_headers(&rt, &mut h) else {
        panic!("no claim")
    };
    let asked = rls::decode_request(&message).unwrap();
    assert_eq!(
        asked.descriptors,
        [vec![("rule".to_string(), b"p".to_vec())]]
    );
    let block = asked.hits;
    st.started(&rt, &mut h, Ok(1));
    let next = st.call_answer(&rt, &mut h, 1, Ok(answer(Code::Ok, 90)));
    assert!(matches!(next, Next::Continue), "{next:?}");
    // Another tenant is admitted from the same block, with no call.
    for t in 1..block.min(3) {
        let (hits, ok) = request_from(&rt, &mut tenant("b"), 1_000 + t, |_| panic!("claimed"));
        assert_eq!((hits, ok), (None, true), "request {t}");
    }
    let mut counts = Vec::new();
    rt.metrics().drain(|_, c, n| counts.push((c, n)), |_, _| {});
    let allowed: u64 = counts
        .iter()
        .filter(|(c, _)| *c == Counter::Allowed)
        .map(|(_, n)| n)
        .sum();
    assert_eq!(
        allowed,
        block.min(3),
        "each request counted once: {counts:?}"
    );
}

#[test]
fn a_claim_before_a_shared_rule_leaves_its_share_to_it() {
    // A lease rule's claim takes its check out of the request's (it becomes a question):
    // the shared rule after it still decides its tenant against the record.
    let rt = runtime(
        r#"{"rules": [{"name": "g", "key": ["remote_address"],
            "rate_limit": {"requests_per_unit": 100, "unit": "minute"},
            "global": {"cluster": "rls", "domain": "edge", "mode": "lease", "flush_ms": 10}},
          {"name": "p", "key": ["header:x-tenant"],
            "rate_limit": {"requests_per_unit": 100, "unit": "second"},
            "global": {"cluster": "rls", "domain": "edge", "mode": "lease", "flush_ms": 10,
                       "max_block": 8},
            "share": {}}]}"#,
    );
    let mut h = FakeHost::new("10.0.0.1", "/").header("x-tenant", "a");
    h.now = 1_000;
    let mut st = StreamState::default();
    let mut next = st.request_headers(&rt, &mut h);
    let (mut calls, mut waiting) = (0, Vec::new());
    loop {
        next = match next {
            Next::Call { .. } => {
                calls += 1;
                waiting.push(calls);
                st.started(&rt, &mut h, Ok(calls))
            }
            Next::Wait => {
                let id = waiting.remove(0);
                st.call_answer(&rt, &mut h, id, Ok(answer(Code::Ok, 90)))
            }
            Next::Continue => break,
            other => panic!("{other:?}"),
        };
    }
    assert_eq!(calls, 2, "both rules claim");
    let slot = rt.compiled[1].share_record();
    let r = rt
        .store
        .read(slot, |b, _| b.and_then(crate::share::Record::decode))
        .unwrap()
        .expect("the shared rule's record");
    assert_eq!(
        r.bands[0].used.current, 1,
        "the tenant's request counted once"
    );
}

#[test]
fn the_fleets_quota_running_out_sets_this_proxys_part() {
    let rt = runtime(SHARED);
    let mut h = FakeHost::new("10.0.0.1", "/").header("x-tenant", "a");
    let ours = std::cell::Cell::new(0u64);
    let granted = |hits: u64| {
        ours.set(ours.get() + hits);
        answer(Code::Ok, 50)
    };
    for t in 0..12 {
        let (_, ok) = request_from(&rt, &mut h, 1_000 + t, granted);
        assert!(ok, "request {t}");
    }
    let r = record(&rt);
    assert_eq!(
        r.fleet.part_pm, 0,
        "not known while the fleet's quota lasts"
    );
    assert_eq!(r.fleet.granted, u32::try_from(ours.get()).unwrap());
    assert_eq!(r.fleet.window_end_ms, 1_000 + 30_000, "the service's reset");
    assert_eq!(crate::share::fleet_limit(&r, 100, 1_000, 2_000), None);
    // The service refuses: this proxy's part is cut from what it was granted of the 100.
    let mut refused = 0;
    for t in 12..40 {
        let (_, ok) = request_from(&rt, &mut h, 1_000 + t, |_| answer(Code::OverLimit, 0));
        refused += u64::from(!ok);
    }
    assert!(refused >= 1, "the fleet's quota is spent");
    let r = record(&rt);
    let part = ours.get() * 10 * crate::share::PART_CUT_PM / 1000;
    assert_eq!(u64::from(r.fleet.part_pm), part, "{:?}", r.fleet);
    assert!(r.fleet.spent);
    // Its tenants share that part; a window after the last answer's, this proxy alone.
    assert_eq!(
        crate::share::fleet_limit(&r, 100, 1_000, 2_000),
        Some(part / 10)
    );
    assert_eq!(crate::share::fleet_limit(&r, 100, 1_000, 32_000), None);
    // A refused request logged why: the capacity.
    let shared: Vec<_> = h
        .logs
        .iter()
        .filter(|(_, l)| l.starts_with("shared rule=p"))
        .collect();
    assert!(
        shared.iter().all(|(_, l)| l.contains("reason=capacity")) && !shared.is_empty(),
        "{shared:?}"
    );
}

#[test]
fn a_configuration_update_keeps_what_is_held() {
    let store = std::sync::Arc::new(MemoryStore::new());
    let parse = |json: &str| Config::parse(json.as_bytes()).unwrap();
    let old = Runtime::new(parse(LEASE), Seed([3, 4]), store.clone());
    let mut h = FakeHost::new("10.0.0.1", "/");
    h.now = 1_000;
    let mut st = StreamState::default();
    let Next::Call { message, .. } = st.request_headers(&old, &mut h) else {
        panic!("no claim")
    };
    let block = rls::decode_request(&message).unwrap().hits;
    st.started(&old, &mut h, Ok(1));
    st.call_answer(&old, &mut h, 1, Ok(answer(Code::Ok, 90)));
    // The new configuration (other blocks, another timeout) admits from the same lease.
    let new = Runtime::new(
        parse(&LEASE.replace(
            r#""flush_ms": 10"#,
            r#""flush_ms": 50, "max_block": 2, "timeout_ms": 80"#,
        )),
        Seed([3, 4]),
        store,
    );
    for _ in 1..block {
        let mut st = StreamState::default();
        assert!(matches!(st.request_headers(&new, &mut h), Next::Continue));
    }
}

/// A fleet-fair rule's block cap is kept for a 64th of its window (15 ms of a second's):
/// worked out again once that has passed, and at once after an answer that changes what it
/// follows (the service's window end), not before.
#[test]
fn a_fleet_fair_rules_block_cap_is_kept_for_a_64th_of_the_window_or_until_an_answer() {
    use std::sync::atomic::Ordering::Relaxed;
    let rt = runtime(
        r#"{"rules": [{"name": "p", "key": ["header:x-tenant"],
            "rate_limit": {"requests_per_unit": 100000, "unit": "second"},
            "global": {"cluster": "rls", "domain": "edge", "mode": "lease", "flush_ms": 10,
                       "max_block": 100000},
            "share": {"fleet": "fair"}}]}"#,
    );
    let c = &rt.compiled[0];
    let t0: u64 = 1_800_000_000_000;
    // A view in force; this Envoy expects to admit 6,400 a window.
    c.fair_view.store(t0 / 1_000 - 2, Relaxed);
    let part = |requests: u64| requests * crate::share::LEVEL_ONE;
    c.fair_part.store(part(6_400), Relaxed);
    let applied = super::Applied {
        rule: 0,
        hash: c.capacity_key.unwrap(),
        descriptor: None,
        priced: crate::config::Priced::Default,
        capacity: true,
    };
    let cap = |now| rt.block_cap(&applied, 100_000, 100_000, now);
    // Half the part, and half of what it expects to admit to the window's end.
    assert_eq!(cap(t0), 3_200);
    // The part doubles without an answer to say so: kept until 15 ms have passed.
    c.fair_part.store(part(12_800), Relaxed);
    assert_eq!(cap(t0 + 14), 3_200, "kept");
    assert_eq!(cap(t0 + 15), 12_800 * 985 / 2_000, "worked out again");
    // An answer of the service: worked out again at once.
    c.fair_part.store(part(25_600), Relaxed);
    assert_eq!(cap(t0 + 20), 12_800 * 985 / 2_000, "kept");
    rt.capacity_answered(0, (100, 50_000, false), (t0 + 1_000, t0 + 21));
    assert_eq!(cap(t0 + 21), 25_600 * 979 / 2_000, "after the answer");
}
