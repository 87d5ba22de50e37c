//! A flood of distinct keys, from many header values and many source addresses, against a
//! real Envoy: memory stays fixed by `capacity` (the README's 70–80 bytes a key, with slack for
//! Envoy's own buffers), and a heavy client that was being limited stays limited.
#![allow(clippy::unwrap_used, clippy::panic, clippy::indexing_slicing)]

mod common;

use common::{Client, Envoy};

const CAPACITY: u64 = 16_384;

#[test]
fn a_flood_of_keys_keeps_memory_bounded_and_the_heavy_client_limited() {
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

    // 200,000 requests, each a new user; sources cycle over 127.0.0.10 – 127.0.0.249.
    let threads: Vec<_> = (0..4u32)
        .map(|t| {
            let addr = envoy.addr;
            std::thread::spawn(move || {
                for batch in 0..100u32 {
                    let source = format!("127.0.0.{}", 10 + (t * 100 + batch) % 240);
                    let mut c = Client::connect_from(addr, &source).unwrap();
                    for i in 0..500u32 {
                        let user = format!("u{t}-{batch}-{i}");
                        let r = c.send("GET", "/", &[("x-user", &user)]).unwrap();
                        assert_eq!(r.status, 200, "{user} from {source}");
                    }
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let after = envoy.memory_allocated();
    let growth = after.saturating_sub(before);
    eprintln!(
        "flood: 200,000 new keys from 240 addresses; Envoy memory {before} -> {after} (+{growth} B, \
         {} B per tracked key at capacity {CAPACITY})",
        growth / CAPACITY
    );
    // The documented 70–80 B per key of capacity, plus slack for Envoy's own buffers.
    assert!(growth < CAPACITY * 80 + 512 * 1024, "grew {growth} B");
    // The heavy client is still limited; the flood keys each weigh 1, it weighs 5.
    assert_eq!(hit(&mut heavy), 429);
    let evictions = envoy
        .wait_stat_until(&common::metric(Some("per-user"), "slot_evictions"), |n| {
            n > 100_000
        })
        .unwrap_or(0);
    assert!(
        evictions > 100_000,
        "the table was full and evicting: {evictions}"
    );
}
