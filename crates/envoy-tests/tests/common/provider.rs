//! A stand-in for an LLM provider that enforces its own limit, as OpenAI does: each
//! organisation (the first segment of the request's path) has a token bucket of requests,
//! `rate` a second with room for one second's worth, and a request it has no token for gets a
//! 429 with `retry-after` and OpenAI's `x-ratelimit-*-requests` fields (a 200 gets them too).
//! It tallies what it admitted and refused per organisation and tenant (`x-tenant`), by the
//! second since it started, so a test measures the provider's side of a run.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A running provider; it stops accepting when dropped.
pub struct Provider {
    pub addr: SocketAddr,
    shared: Arc<Shared>,
}

struct Shared {
    rate: f64,
    started: Instant,
    stop: AtomicBool,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    /// Per organisation: tokens left, and when they were counted.
    buckets: HashMap<String, (f64, Instant)>,
    /// (organisation, tenant, second) → (admitted, refused).
    tally: HashMap<(String, String, u64), (u64, u64)>,
}

impl Provider {
    /// Listens on a free loopback port; every organisation gets `rate` requests a second.
    pub fn start(rate: f64) -> Provider {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let shared = Arc::new(Shared {
            rate,
            started: Instant::now(),
            stop: AtomicBool::new(false),
            state: Mutex::new(State::default()),
        });
        let s = shared.clone();
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                if s.stop.load(Ordering::Relaxed) {
                    break;
                }
                let Ok(conn) = conn else { continue };
                let s = s.clone();
                std::thread::spawn(move || serve(conn, &s));
            }
        });
        Provider { addr, shared }
    }

    /// Seconds since the provider started.
    pub fn elapsed_s(&self) -> f64 {
        self.shared.started.elapsed().as_secs_f64()
    }

    /// Per tenant of organisation `org`: (admitted, refused) over the seconds `from..to`
    /// since the provider started.
    pub fn tally(&self, org: &str, from: u64, to: u64) -> HashMap<String, (u64, u64)> {
        let state = self.shared.state.lock().unwrap();
        let mut out: HashMap<String, (u64, u64)> = HashMap::new();
        for ((o, tenant, second), (a, r)) in &state.tally {
            if o == org && (from..to).contains(second) {
                let e = out.entry(tenant.clone()).or_default();
                e.0 += a;
                e.1 += r;
            }
        }
        out
    }

    /// Requests the provider refused in all, every organisation and second.
    pub fn refused(&self) -> u64 {
        let state = self.shared.state.lock().unwrap();
        state.tally.values().map(|(_, r)| r).sum()
    }
}

impl Drop for Provider {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Relaxed);
        let _ = TcpStream::connect(self.addr); // wakes the accept loop
    }
}

fn serve(conn: TcpStream, s: &Shared) {
    let _ = conn.set_read_timeout(Some(Duration::from_secs(120)));
    let _ = conn.set_nodelay(true);
    let mut reader = BufReader::new(conn);
    loop {
        let mut request = String::new();
        if reader.read_line(&mut request).unwrap_or(0) == 0 {
            return;
        }
        let mut tenant = String::from("-");
        let mut line = String::new();
        loop {
            line.clear();
            if reader.read_line(&mut line).unwrap_or(0) == 0 {
                return;
            }
            let l = line.trim_end();
            if l.is_empty() {
                break;
            }
            if let Some((k, v)) = l.split_once(':') {
                if k.trim().eq_ignore_ascii_case("x-tenant") {
                    tenant = v.trim().to_string();
                }
            }
        }
        let path = request.split_whitespace().nth(1).unwrap_or("/");
        let org = path
            .trim_start_matches('/')
            .split('/')
            .next()
            .unwrap_or("")
            .to_string();
        let (admitted, remaining) = take(s, &org, &tenant);
        let limit = s.rate as u64;
        let head = if admitted {
            format!(
                "HTTP/1.1 200 OK\r\nx-ratelimit-limit-requests: {limit}\r\n\
                 x-ratelimit-remaining-requests: {remaining}\r\n\
                 x-ratelimit-reset-requests: 1s\r\ncontent-length: 2\r\n\r\nok"
            )
        } else {
            format!(
                "HTTP/1.1 429 Too Many Requests\r\nretry-after: 1\r\n\
                 x-ratelimit-limit-requests: {limit}\r\nx-ratelimit-remaining-requests: 0\r\n\
                 x-ratelimit-reset-requests: 1s\r\ncontent-length: 2\r\n\r\nno"
            )
        };
        if reader.get_mut().write_all(head.as_bytes()).is_err() {
            return;
        }
    }
}

/// Takes a token of `org`'s bucket for `tenant`: whether there was one, and the whole tokens
/// left.
fn take(s: &Shared, org: &str, tenant: &str) -> (bool, u64) {
    let now = Instant::now();
    let second = now.duration_since(s.started).as_secs();
    let mut state = s.state.lock().unwrap();
    let (tokens, at) = state
        .buckets
        .entry(org.to_string())
        .or_insert((s.rate, now));
    *tokens = (*tokens + now.duration_since(*at).as_secs_f64() * s.rate).min(s.rate);
    *at = now;
    let admitted = *tokens >= 1.0;
    if admitted {
        *tokens -= 1.0;
    }
    let left = *tokens as u64;
    let e = state
        .tally
        .entry((org.to_string(), tenant.to_string(), second))
        .or_default();
    if admitted {
        e.0 += 1;
    } else {
        e.1 += 1;
    }
    (admitted, left)
}
