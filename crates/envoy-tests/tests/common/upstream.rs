//! A tiny HTTP/1.1 upstream whose answers the test chooses, request by request, with headers:
//!
//! - `x-delay-ms: N`: wait N ms before answering;
//! - `x-usage: N`: answer with the header `x-usage-tokens: N`;
//! - `x-usage-trailer: N`: answer chunked, with the trailer `x-usage-tokens: N`;
//! - `x-body: N`: a body of N bytes (`x-chunked: 1`: in chunks of 1,000 bytes; else with a
//!   content-length);
//! - `x-reset-after: N`: send the headers (content-length `x-body`) and N body bytes, then close
//!   the connection (a reset, as Envoy sees it);
//! - `x-status: N`: answer with this status (200 otherwise).
//!
//! The test can also make the upstream itself fail a share of its answers (503) or answer
//! slowly, whatever the requests say ([`Upstream::set_failing`], [`Upstream::set_delay_ms`]).
//! It counts the requests it is serving right now and the most it ever served at once.

use super::http::{header, Incoming, Server};
use std::io::Write;
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

/// A running upstream; it stops accepting when dropped.
pub struct Upstream {
    pub addr: SocketAddr,
    server: Server<Counts>,
}

#[derive(Default)]
struct Counts {
    now: AtomicUsize,
    most: AtomicUsize,
    served: AtomicUsize,
    /// Answers failed with 503, permille, spread evenly.
    failing: AtomicU64,
    /// Every answer waits this long, ms.
    delay_ms: AtomicU64,
    /// Answers so far, to spread the failures.
    seq: AtomicU64,
}

impl Upstream {
    /// Listens on a free loopback port.
    pub fn start() -> Upstream {
        let server = Server::start(Counts::default(), Duration::from_secs(60), answer);
        Upstream {
            addr: server.addr,
            server,
        }
    }

    /// Requests being served right now.
    pub fn in_flight(&self) -> usize {
        self.server.state().now.load(Ordering::SeqCst)
    }

    /// The most requests ever served at once.
    pub fn most_in_flight(&self) -> usize {
        self.server.state().most.load(Ordering::SeqCst)
    }

    /// From now on, fail this share of answers (permille) with a 503, evenly spread.
    pub fn set_failing(&self, permille: u64) {
        self.server
            .state()
            .failing
            .store(permille, Ordering::SeqCst);
    }

    /// From now on, wait this long before every answer.
    pub fn set_delay_ms(&self, ms: u64) {
        self.server.state().delay_ms.store(ms, Ordering::SeqCst);
    }

    /// Requests answered (or reset) so far.
    pub fn served(&self) -> usize {
        self.server.state().served.load(Ordering::SeqCst)
    }
}

/// Answers one request, counted; false if the connection is to be closed (or broke).
fn answer(out: &mut TcpStream, req: Incoming, c: &Counts) -> bool {
    let get = |name: &str| header(&req.headers, name).map(str::to_string);
    let num = |name: &str| get(name).and_then(|v| v.parse::<usize>().ok());
    let now = c.now.fetch_add(1, Ordering::SeqCst) + 1;
    c.most.fetch_max(now, Ordering::SeqCst);
    let delay = num("x-delay-ms").map_or(c.delay_ms.load(Ordering::SeqCst), |ms| ms as u64);
    if delay > 0 {
        std::thread::sleep(Duration::from_millis(delay));
    }
    // Answer n fails when the running count of failures n × share steps up.
    let n = c.seq.fetch_add(1, Ordering::SeqCst);
    let share = c.failing.load(Ordering::SeqCst);
    let fail = (n + 1) * share / 1000 != n * share / 1000;
    let num = |name: &str| match name {
        "x-status" if fail => Some(503),
        other => num(other),
    };
    let kept = write_answer(out, &get, &num);
    c.now.fetch_sub(1, Ordering::SeqCst);
    c.served.fetch_add(1, Ordering::SeqCst);
    kept
}

/// Writes one answer; false if the connection is to be closed (or broke).
fn write_answer(
    out: &mut TcpStream,
    get: &dyn Fn(&str) -> Option<String>,
    num: &dyn Fn(&str) -> Option<usize>,
) -> bool {
    let status = num("x-status").unwrap_or(200);
    let body = vec![b'x'; num("x-body").unwrap_or(3)];
    let mut head = format!("HTTP/1.1 {status} OK\r\n");
    if let Some(u) = get("x-usage") {
        head.push_str(&format!("x-usage-tokens: {u}\r\n"));
    }
    let trailer = get("x-usage-trailer");
    let chunked = trailer.is_some() || get("x-chunked").is_some();
    if chunked {
        head.push_str("transfer-encoding: chunked\r\n");
        if trailer.is_some() {
            head.push_str("trailer: x-usage-tokens\r\n");
        }
    } else {
        head.push_str(&format!("content-length: {}\r\n", body.len()));
    }
    head.push_str("\r\n");
    let mut w = || -> std::io::Result<bool> {
        out.write_all(head.as_bytes())?;
        if let Some(n) = num("x-reset-after") {
            out.write_all(&body[..n.min(body.len())])?;
            out.flush()?;
            std::thread::sleep(Duration::from_millis(50));
            let _ = out.shutdown(std::net::Shutdown::Both);
            return Ok(false);
        }
        if chunked {
            for piece in body.chunks(1000) {
                out.write_all(format!("{:x}\r\n", piece.len()).as_bytes())?;
                out.write_all(piece)?;
                out.write_all(b"\r\n")?;
                out.flush()?;
            }
            out.write_all(b"0\r\n")?;
            if let Some(t) = &trailer {
                out.write_all(format!("x-usage-tokens: {t}\r\n").as_bytes())?;
            }
            out.write_all(b"\r\n")?;
        } else {
            out.write_all(&body)?;
        }
        out.flush()?;
        Ok(true)
    };
    w().unwrap_or(false)
}
