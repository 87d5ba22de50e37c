//! Adversarial keys against a real Envoy, in the build under test: what an attacker who sends
//! many keys can and cannot do to a client the filter is limiting ([Failure and hostile
//! input], [Security: `key_seed` is a secret]).
//!
//! - A flood of distinct keys (`FLOOD_KEYS`, default 200,000) from many header values and 240
//!   source addresses, sent over keep-alive connections by several threads while a heavy client
//!   over its limit keeps sending from its own connection: none of the heavy client's requests
//!   is admitted, and Envoy's memory, sampled throughout, stays within `capacity` × the
//!   documented 70–80 bytes a key (plus slack for Envoy's own buffers) and stops growing once the
//!   table is full.
//! - Keys crafted offline, with the core's own hash functions, to land in the heavy client's
//!   bucket. With the configured `key_seed` known to the attacker, keys each sent up to the
//!   limit make the table forget the heavy client's counter, but not forgive it: its trace
//!   stays in the bucket, and the heavy client, back, starts from it, refused. Under a seed the
//!   attacker does not know (another `key_seed`, or none: a random one per Envoy) the same keys
//!   spread over the table and nothing is forgotten in the heavy client's bucket.
//! - A "smart flood" without the seed: fresh keys each sent up to the limit, so that they weigh
//!   as much as the heavy client's counter and win ties by being newer, at capacity 64 and at
//!   the default: the heavy client is forgotten and stays limited. What the traces cost the
//!   innocent new keys sent among the attacker's is measured.
//!
//! The aimed and smart floods send each key set once; with `FLOOD_SECONDS` set, each goes on
//! for that long (the same keys again, refused past their limits; one-off keys new throughout),
//! the heavy client trying all along.
//!
//! [Failure and hostile input]: ../../../docs/src/explanation/failure-and-hostile-input.md
//! [Security: `key_seed` is a secret]: ../../../docs/src/explanation/security.md
#![allow(clippy::unwrap_used, clippy::panic, clippy::indexing_slicing)]

mod common;

use common::{metric, Client, Envoy};
use ratelimit_core::config::Config;
use ratelimit_core::key::{self, PlainRequest};
use ratelimit_core::seed::Seed;
use ratelimit_core::table::{self, WAYS};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

// ---------------------------------------------------------------------------------------------
// The key flood

const CAPACITY: u64 = 16_384;
/// Client threads of the flood, each on its own keep-alive connections.
const FLOOD_THREADS: u64 = 4;
/// Requests a flood connection carries before the thread opens another from the next address.
const PER_CONNECTION: u64 = 500;
/// Memory samples taken during the flood (one every `FLOOD_KEYS / SAMPLES` keys).
const SAMPLES: u64 = 20;
/// The most Envoy's memory may grow across the second half of the flood, when the table is long
/// full: connection buffers and allocator noise, not keys.
const FLAT_SLACK: u64 = 256 * 1024;

/// The flood's size: `FLOOD_KEYS`, else 200,000 (under a minute per build on two loaded cores).
fn flood_keys() -> u64 {
    let n = match std::env::var("FLOOD_KEYS") {
        Ok(v) => v
            .parse()
            .unwrap_or_else(|_| panic!("FLOOD_KEYS={v:?} is not a number")),
        Err(_) => 200_000,
    };
    // The second half of the flood must come after the table is full (all its buckets made, in
    // the wasm build), or its memory may still grow legitimately.
    assert!(
        n >= 8 * CAPACITY,
        "FLOOD_KEYS={n}: at least {} keys, so that the table is full by the second half",
        8 * CAPACITY
    );
    n
}

#[test]
fn a_flood_of_keys_keeps_memory_bounded_and_the_heavy_client_limited() {
    let n = flood_keys();
    let config = format!(
        r#"{{"capacity": {CAPACITY}, "rules": [
        {{"name": "per-user", "key": ["header:x-user"],
          "rate_limit": {{"requests_per_unit": 5, "unit": "hour"}}}},
        {{"name": "per-ip", "key": ["remote_address"],
          "rate_limit": {{"requests_per_unit": 1000000, "unit": "hour"}}}}]}}"#
    );
    let envoy = Envoy::start(&config);
    // The heavy client: user "heavy" from 127.0.0.2, limited before the flood.
    let mut heavy = Client::connect_from(envoy.addr, "127.0.0.2").unwrap();
    let hit = |c: &mut Client| c.send("GET", "/", &[("x-user", "heavy")]).unwrap().status;
    let statuses: Vec<u16> = (0..7).map(|_| hit(&mut heavy)).collect();
    assert_eq!(statuses, [200, 200, 200, 200, 200, 429, 429]);
    let before = envoy.memory_allocated();

    let done = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let heavy_sent = Arc::new(AtomicU64::new(0));
    let start = Instant::now();
    // The heavy client keeps sending, as fast as its connection goes, all through the flood.
    let heavy_thread = {
        let (stop, sent) = (stop.clone(), heavy_sent.clone());
        std::thread::spawn(move || {
            let mut admitted = 0u64;
            while !stop.load(Ordering::Relaxed) {
                match hit(&mut heavy) {
                    429 => {}
                    200 => admitted += 1,
                    other => panic!("heavy client got {other}"),
                }
                sent.fetch_add(1, Ordering::Relaxed);
            }
            admitted
        })
    };
    // The flood: key i is user "u{i}", sent once; thread t sends the keys i ≡ t (mod threads),
    // opening a new connection every PER_CONNECTION requests, from 127.0.0.10 – 127.0.0.249 in
    // turn.
    let threads: Vec<_> = (0..FLOOD_THREADS)
        .map(|t| {
            let (addr, done) = (envoy.addr, done.clone());
            std::thread::spawn(move || {
                let mut client = None;
                for (j, i) in (t..n).step_by(FLOOD_THREADS as usize).enumerate() {
                    let j = j as u64;
                    let source = format!(
                        "127.0.0.{}",
                        10 + (j / PER_CONNECTION * FLOOD_THREADS + t) % 240
                    );
                    if j.is_multiple_of(PER_CONNECTION) {
                        client = Some(Client::connect_from(addr, &source).unwrap());
                    }
                    let c = client.as_mut().unwrap();
                    let user = format!("u{i}");
                    let r = c.send("GET", "/", &[("x-user", &user)]).unwrap();
                    assert_eq!(r.status, 200, "{user} from {source}: {r:?}");
                    done.fetch_add(1, Ordering::Relaxed);
                }
            })
        })
        .collect();
    // Memory every n / SAMPLES keys: (keys sent, bytes allocated, heavy requests sent).
    let step = n / SAMPLES;
    let mut samples: Vec<(u64, u64, u64)> = Vec::new();
    let mut next = step;
    while next <= n && !threads.iter().all(|t| t.is_finished()) {
        let d = done.load(Ordering::Relaxed);
        if d >= next {
            let sent = heavy_sent.load(Ordering::Relaxed);
            samples.push((d, envoy.memory_allocated(), sent));
            while next <= d {
                next += step;
            }
        } else {
            std::thread::sleep(Duration::from_millis(5));
        }
    }
    for t in threads {
        t.join().unwrap();
    }
    let seconds = start.elapsed().as_secs_f64();
    stop.store(true, Ordering::Relaxed);
    let past_limit = heavy_thread.join().unwrap();
    let heavy_total = heavy_sent.load(Ordering::Relaxed);
    let after = envoy.memory_allocated();
    let peak = samples.iter().map(|s| s.1).chain([after]).max().unwrap();
    let evictions = envoy
        .wait_stat_until(&metric(Some("per-user"), "slot_evictions"), |e| e > n / 2)
        .unwrap_or(0);
    eprintln!(
        "flood: {n} keys in {seconds:.1} s ({:.0} flood requests/s, {:.0} with the heavy \
         client's); heavy client sent {heavy_total}, {past_limit} admitted past its limit; Envoy memory before {before}, peak {peak} \
         (+{} B, {} B per key of capacity {CAPACITY}), after {after}; per-user slot_evictions \
         {evictions}",
        n as f64 / seconds,
        (n + heavy_total) as f64 / seconds,
        peak.saturating_sub(before),
        peak.saturating_sub(before) / CAPACITY,
    );
    eprintln!("flood: samples (keys, bytes, heavy requests) {samples:?}");

    // The heavy client kept sending through the flood, and none of it got through.
    assert!(samples.len() as u64 >= SAMPLES / 2, "{samples:?}");
    let (first, last) = (samples[0], samples[samples.len() - 1]);
    assert!(
        last.2 > first.2 && heavy_total >= 100,
        "the heavy client sent throughout the flood: {samples:?}"
    );
    assert_eq!(past_limit, 0, "heavy requests admitted past the limit");
    assert_eq!(hit(&mut Client::connect(envoy.addr).unwrap()), 429);
    // The documented 70–80 B per key of capacity, plus slack for Envoy's own buffers, at every
    // sample: the peak, not just the end.
    let bound = CAPACITY * 80 + 512 * 1024;
    assert!(peak - before.min(peak) < bound, "peak {peak} from {before}");
    // Once the table is full, no growth: the second half's samples stay within FLAT_SLACK of
    // its first.
    let second: Vec<u64> = samples
        .iter()
        .filter(|s| s.0 >= n / 2)
        .map(|s| s.1)
        .collect();
    assert!(second.len() >= 3, "{samples:?}");
    let top = second.iter().copied().max().unwrap();
    assert!(
        top <= second[0] + FLAT_SLACK && after <= second[0] + FLAT_SLACK,
        "memory grew in the second half of the flood: {second:?}, then {after}"
    );
    // The table was full and evicting, the flood keys one another: each weighs 1, the heavy
    // client 5.
    assert!(
        evictions > n / 2,
        "the table was full and evicting: {evictions}"
    );
}

// ---------------------------------------------------------------------------------------------
// Aimed keys

/// The per-user limit of the collision tests.
const LIMIT: u64 = 5;
/// The seed the attacker knows (the one configured in the first scenario).
const KNOWN_SEED: &str = "0123456789abcdeffedcba9876543210";
/// Another configured seed, which the attacker does not know.
const OTHER_SEED: &str = "00112233445566778899aabbccddeeff";

/// One rule keyed on `x-user`, LIMIT an hour, with `capacity` and, if given, `key_seed`.
fn user_config(capacity: u32, seed: Option<&str>) -> String {
    let seed = seed
        .map(|s| format!(r#""key_seed": "{s}", "#))
        .unwrap_or_default();
    format!(
        r#"{{{seed}"capacity": {capacity}, "rules": [
        {{"name": "per-user", "key": ["header:x-user"],
          "rate_limit": {{"requests_per_unit": {LIMIT}, "unit": "hour"}}}}]}}"#
    )
}

/// The two table buckets a value of `x-user` may live in (its first, its second), for the rule
/// of `config` hashed under `seed`: computed offline with the core's own functions, as the
/// filter's runtime does (the rule's fingerprint from its name, key and algorithm; the client
/// key from it; the buckets from the configured capacity).
fn bucket_fn(config: &str, seed: &str) -> impl Fn(&str) -> (u64, u64) {
    let seed = Seed::parse_hex(seed).unwrap();
    let mut config = Config::parse(config.as_bytes()).unwrap();
    let buckets = table::buckets_for(config.capacity);
    let rule = config.rules.swap_remove(0);
    let fingerprint =
        key::rule_fingerprint(seed, &rule.name, &rule.key, rule.limit.algorithm_name());
    move |user: &str| {
        let mut req = PlainRequest {
            headers: vec![("x-user".into(), user.as_bytes().to_vec())],
            ..PlainRequest::default()
        };
        let hash = key::client_key(seed, fingerprint, &rule.key, false, &mut req).unwrap();
        table::slots_of(hash, buckets)
    }
}

/// Whether two values share both their buckets (in either order).
fn same_pair((a, b): (u64, u64), (c, d): (u64, u64)) -> bool {
    (a, b) == (c, d) || (a, b) == (d, c)
}

/// The first `k` values "a0", "a1", … aimed at user "heavy"'s buckets under `bucket`: with
/// `both`, values whose two buckets are the heavy client's two (about one value in n²/2 of a
/// table of n buckets: the strongest aim); else values whose first bucket is the heavy
/// client's first (one in n: what an attacker gets cheaply).
fn aimed_at_heavy(bucket: &impl Fn(&str) -> (u64, u64), k: usize, both: bool) -> Vec<String> {
    let target = bucket("heavy");
    (0u64..)
        .map(|i| format!("a{i}"))
        .filter(|v| {
            let pair = bucket(v);
            if both {
                same_pair(pair, target)
            } else {
                pair.0 == target.0
            }
        })
        .take(k)
        .collect()
}

/// Limits user "heavy" (LIMIT admitted, then refused) on its own connection, which it returns.
fn limited_heavy(envoy: &Envoy) -> Client {
    let mut heavy = Client::connect(envoy.addr).unwrap();
    let statuses: Vec<u16> = (0..=LIMIT).map(|_| heavy_hit(&mut heavy)).collect();
    let mut expected = vec![200; LIMIT as usize];
    expected.push(429);
    assert_eq!(statuses, expected);
    heavy
}

fn heavy_hit(heavy: &mut Client) -> u16 {
    heavy
        .send("GET", "/", &[("x-user", "heavy")])
        .unwrap()
        .status
}

/// The attacker's cost when the heavy client was first admitted again.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Breach {
    /// Attacker keys used, the last one included.
    keys: u64,
    /// Attacker requests admitted.
    admitted: u64,
    /// Attacker requests sent (admitted and refused).
    sent: u64,
}

/// What an attack did: when the heavy client got through, if it did, and what the attacker's
/// keys (each new, as an innocent client's would be) and the innocent keys sent among them
/// paid for the traces of the keys the table forgot.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct Attack {
    breach: Option<Breach>,
    /// Attacker keys sent, and those refused before their limit (the first time each was sent).
    keys: u64,
    /// Attacker requests sent.
    requests: u64,
    keys_refused: u64,
    /// Innocent keys (one request each, one after every `INNOCENT_EVERY` attacker requests),
    /// and those refused.
    innocents: u64,
    innocents_refused: u64,
    /// The innocent keys refused.
    refused: Vec<String>,
}

/// An innocent key, one request, after this many attacker requests.
const INNOCENT_EVERY: u64 = 7;

/// How long each aimed and smart flood goes on: `FLOOD_SECONDS`, else once through its keys.
fn flood_seconds() -> Option<Duration> {
    std::env::var("FLOOD_SECONDS").ok().map(|v| {
        Duration::from_secs(
            v.parse()
                .unwrap_or_else(|_| panic!("FLOOD_SECONDS={v:?} is not a number")),
        )
    })
}

/// A flood's keys: `keys` once through, then again (the same keys, or new ones from `more`)
/// until [`flood_seconds`] have passed since the first.
fn for_the_run(keys: Vec<String>, more: Option<fn(u64) -> String>) -> impl Iterator<Item = String> {
    let (start, seconds) = (Instant::now(), flood_seconds().unwrap_or_default());
    let n = keys.len() as u64;
    (0u64..).map_while(move |i| {
        if i >= n && start.elapsed() >= seconds {
            return None;
        }
        match (
            usize::try_from(i % n.max(1)).ok().and_then(|j| keys.get(j)),
            more,
        ) {
            (_, Some(make)) if i >= n => Some(make(i)),
            (Some(k), _) => Some(k.clone()),
            (None, _) => None,
        }
    })
}

/// The attacker sends each of `values` `per_key` times on its own connection; after every
/// `heavy_every`-th attacker request the heavy client tries once, and after every
/// INNOCENT_EVERY-th an innocent new key sends one request. No attacker key is admitted more
/// than LIMIT times; one is refused before that only where the table forgot keys. Stops at the
/// heavy client's first admitted request.
fn attack(
    envoy: &Envoy,
    heavy: &mut Client,
    values: impl Iterator<Item = String>,
    per_key: u64,
    heavy_every: u64,
) -> Attack {
    let mut attacker = Client::connect(envoy.addr).unwrap();
    let mut innocent = Client::connect(envoy.addr).unwrap();
    let mut out = Attack::default();
    let (mut admitted, mut sent) = (0, 0);
    // Each attacker key's admissions over the whole flood (a key sent again comes back here).
    let mut admissions: std::collections::HashMap<String, u64> = Default::default();
    for v in values {
        let again = admissions.contains_key(&v);
        out.keys += u64::from(!again);
        let key_admitted = admissions.entry(v.clone()).or_default();
        let before = *key_admitted;
        for i in 0..per_key {
            let status = attacker.send("GET", "/", &[("x-user", &v)]).unwrap().status;
            sent += 1;
            *key_admitted += u64::from(status == 200);
            // Never past its limit; refused below it only where the table forgot keys.
            assert!(
                matches!(status, 200 | 429) && *key_admitted <= LIMIT,
                "attacker key {v}, request {i}: {status}, {key_admitted} admitted"
            );
            admitted += u64::from(status == 200);
            if sent % INNOCENT_EVERY == 0 {
                let user = format!("innocent{}", out.innocents);
                let r = innocent.send("GET", "/", &[("x-user", &user)]).unwrap();
                out.innocents += 1;
                if r.status == 429 {
                    out.innocents_refused += 1;
                    out.refused.push(user);
                }
            }
            if sent % heavy_every != 0 {
                continue;
            }
            match heavy_hit(heavy) {
                429 => {}
                200 => {
                    out.breach = Some(Breach {
                        keys: out.keys,
                        admitted,
                        sent,
                    });
                    return out;
                }
                other => panic!("heavy client got {other}"),
            }
        }
        out.requests = sent;
        if !again {
            out.keys_refused += u64::from(*key_admitted - before < per_key.min(LIMIT));
        }
    }
    out
}

/// What innocent keys paid, for the test's output.
fn paid(a: &Attack) -> String {
    format!(
        "{} attacker requests; attacker keys refused before their limit {}/{}, innocent keys \
         refused {}/{} ({:.2} %)",
        a.requests,
        a.keys_refused,
        a.keys,
        a.innocents_refused,
        a.innocents,
        100.0 * a.innocents_refused as f64 / a.innocents.max(1) as f64
    )
}

/// With the `key_seed` known, keys aimed at the heavy client's bucket, each sent up to the
/// limit (then once more, refused), fill it with entries as heavy as the heavy client's and
/// newer, and the table forgets the heavy client's counter: it leaves a trace, and the heavy
/// client, back, starts from it, refused. Four times as many aimed keys as the bucket holds,
/// at capacity 64 and at the default, and 0 requests past the limit. What it costs others:
/// aimed keys that land under the merged trace of forgotten ones are refused, and innocent
/// keys only in that bucket (computed offline), never elsewhere.
#[test]
fn aimed_keys_with_the_known_seed_leave_a_limited_client_limited() {
    for capacity in [64, 16_384] {
        let config = user_config(capacity, Some(KNOWN_SEED));
        let bucket = bucket_fn(&config, KNOWN_SEED);
        // Both buckets aimed at in the small table; the first only in the large one (values
        // aimed at both cost about 660,000 tries each there).
        let both = capacity == 64;
        let aimed = aimed_at_heavy(&bucket, 4 * WAYS, both);
        let envoy = Envoy::start(&config);
        let mut heavy = limited_heavy(&envoy);
        let a = attack(
            &envoy,
            &mut heavy,
            for_the_run(aimed.clone(), None),
            LIMIT + 1,
            1,
        );
        assert_eq!(
            a.breach, None,
            "capacity {capacity}, aimed values {aimed:?}: {a:?}"
        );
        assert_eq!(heavy_hit(&mut heavy), 429);
        // Aimed at both its buckets, the heavy client was forgotten (and its trace found): the
        // aimed buckets evicted at least once per aimed key past their ways. Aimed at its first
        // bucket only, the values mostly went to their second buckets.
        let evictions = metric(Some("per-user"), "slot_evictions");
        let evicted = if both {
            let e = envoy.wait_stat_until(&evictions, |e| e >= (2 * WAYS) as u64);
            assert!(e.is_some(), "the aimed buckets forgot keys: {e:?}");
            e
        } else {
            envoy.stat(&evictions)
        };
        let target = bucket("heavy");
        let touches = |v: &String| {
            let (a, b) = bucket(v);
            [a, b].iter().any(|x| *x == target.0 || *x == target.1)
        };
        let elsewhere: Vec<&String> = a.refused.iter().filter(|v| !touches(v)).collect();
        assert!(
            elsewhere.is_empty(),
            "innocent keys refused outside the aimed bucket: {elsewhere:?}"
        );
        eprintln!(
            "aimed, seed known: capacity {capacity}, buckets {target:?} of {} ({}), {} values each \
             sent {} times; the heavy client got 0 requests past its limit; {}; {} evictions",
            table::buckets_for(capacity),
            if both { "both aimed at" } else { "the first aimed at" },
            aimed.len(),
            LIMIT + 1,
            paid(&a),
            evicted.unwrap_or(0),
        );
    }
}

/// The same aimed values against an Envoy whose seed the attacker does not know (another
/// `key_seed`, or none: a random seed per Envoy) spread over the table: nothing is forgotten in
/// the heavy client's bucket, and it stays limited through the whole attack.
#[test]
fn aimed_keys_under_an_unknown_seed_leave_the_limited_client_limited() {
    let capacity = 4096;
    let attackers_guess = user_config(capacity, Some(KNOWN_SEED));
    let aimed = aimed_at_heavy(&bucket_fn(&attackers_guess, KNOWN_SEED), 2 * WAYS, false);
    for seed in [Some(OTHER_SEED), None] {
        let config = user_config(capacity, seed);
        if let Some(s) = seed {
            // Under the real seed, fewer than WAYS of the values share the heavy client's
            // bucket: nothing to evict it with (a precondition, computed offline).
            let bucket = bucket_fn(&config, s);
            let sharing = aimed
                .iter()
                .filter(|v| bucket(v).0 == bucket("heavy").0)
                .count();
            assert!(sharing < WAYS, "{sharing} aimed values share under {s}");
        }
        let envoy = Envoy::start(&config);
        let mut heavy = limited_heavy(&envoy);
        let a = attack(
            &envoy,
            &mut heavy,
            for_the_run(aimed.clone(), None),
            LIMIT + 1,
            1,
        );
        assert_eq!(a.breach, None, "key_seed {seed:?}: {a:?}");
        assert_eq!(a.keys_refused + a.innocents_refused, 0, "{}", paid(&a));
        assert_eq!(heavy_hit(&mut heavy), 429);
        eprintln!(
            "aimed, seed unknown (key_seed {seed:?}): {} values, {} attacker requests; the heavy \
             client got 0 requests past its limit",
            aimed.len(),
            a.requests
        );
    }
}

/// Without the seed an attacker cannot aim, but it can send fresh keys each up to the limit:
/// every one weighs what the limited client's counter weighs, and is newer, so the table
/// forgets the heavy client's counter once enough of them reach its bucket (about `capacity`
/// keys). Its trace stays: through `keys` such keys (the table's capacity, and four times it
/// in the small table), the heavy client gets 0 requests past its limit, at the default
/// capacity and at 64; so it does through one-off keys (each sent once, eight times the small
/// table), which cost nobody anything. What keys each up to the limit cost innocent keys is
/// printed, and bounded where the flood is the table's size; beyond, a table full of keys at
/// their limits refuses a share of new keys rather than give any forgotten key a fresh budget.
#[test]
fn a_smart_flood_without_the_seed_never_frees_a_limited_client() {
    // (capacity, keys, requests per key, how many attacker requests per heavy client's one)
    let floods = [
        (64u32, 512u64, 1u64, 1u64),
        (64, 64, LIMIT, 1),
        (64, 256, LIMIT, 1),
        (16_384, 16_384, LIMIT, 8),
    ];
    for (capacity, keys, per_key, heavy_every) in floods {
        let values = (0..keys).map(|i| format!("r{i}")).collect();
        // One-off keys stay new for the whole run; keys up to the limit are sent again.
        let more: Option<fn(u64) -> String> = (per_key == 1).then_some(|i| format!("r{i}"));
        // A seed the attacker does not use; fixed, so that the figures repeat.
        let config = user_config(capacity, Some(OTHER_SEED));
        let envoy = Envoy::start(&config);
        let mut heavy = limited_heavy(&envoy);
        let start = Instant::now();
        let a = attack(
            &envoy,
            &mut heavy,
            for_the_run(values, more),
            per_key,
            heavy_every,
        );
        let seconds = start.elapsed().as_secs_f64();
        assert_eq!(a.breach, None, "capacity {capacity}, {keys} keys: {a:?}");
        assert_eq!(heavy_hit(&mut heavy), 429);
        let evictions = metric(Some("per-user"), "slot_evictions");
        let evicted = envoy.wait_stat_until(&evictions, |e| e > 0).unwrap_or(0);
        assert!(
            evicted > 0,
            "capacity {capacity}: nothing forgotten, nothing tested"
        );
        if per_key == 1 {
            // One-off keys leave light traces, dropped: they cost nobody anything.
            assert_eq!(a.keys_refused + a.innocents_refused, 0, "{}", paid(&a));
        } else if keys <= u64::from(capacity) {
            assert!(a.innocents_refused * 20 <= a.innocents, "{}", paid(&a));
        }
        eprintln!(
            "smart flood, capacity {capacity} ({} buckets), {keys} keys each sent {per_key} times \
             ({:.1} s): the heavy client got 0 requests past its limit; {}; {evicted} evictions",
            table::buckets_for(capacity),
            seconds,
            paid(&a),
        );
    }
}
