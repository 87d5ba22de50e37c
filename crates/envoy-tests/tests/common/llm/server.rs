//! The LLM-like upstream: it records every exchange and answers as the request says.

use super::super::http::{hash, Incoming, Server};
use super::body::{wire_len, write_encoded};
use super::wire::{Transport, Wire};
use super::{header, max_tokens_of, Spec, DEFAULT_KEEP};
use std::io::Write;
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// One request the upstream got, and what it answered.
#[derive(Clone, Debug)]
pub struct Exchange {
    /// Its number (the answer's `x-llm-seq`), from 0.
    pub seq: u64,
    pub request: Incoming,
    /// The `max_tokens`-like field of the body.
    pub max_tokens: Option<u64>,
    /// What was answered; None for an unknown route.
    pub spec: Option<Spec>,
    pub transport: Option<Transport>,
    /// None while the answer is being sent.
    pub sent: Option<Sent>,
}

impl Exchange {
    pub fn header(&self, name: &str) -> Option<&str> {
        header(&self.request.headers, name)
    }
}

/// What the upstream sent as a response body.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Sent {
    pub status: u16,
    /// Body bytes (after content-encoding, without the chunk framing).
    pub bytes: u64,
    /// [`BodyHash`] of those bytes.
    pub hash: u64,
    /// Writes (chunks, when chunked).
    pub pieces: u64,
    /// The body was sent whole (no reset, no broken connection).
    pub complete: bool,
    /// Its first bytes (as many as [`LlmUpstream::keep_bodies`] says).
    pub body: Vec<u8>,
    /// The most body bytes held at once on the way to the socket.
    pub peak_buffer: usize,
}

/// A running LLM-like upstream; it stops accepting when dropped.
pub struct LlmUpstream {
    pub addr: SocketAddr,
    server: Server<Shared>,
}

struct Shared {
    keep: AtomicUsize,
    seq: AtomicU64,
    peak: AtomicUsize,
    log: Mutex<Vec<Exchange>>,
}

impl LlmUpstream {
    /// Listens on a free loopback port.
    pub fn start() -> LlmUpstream {
        let shared = Shared {
            keep: AtomicUsize::new(DEFAULT_KEEP),
            seq: AtomicU64::new(0),
            peak: AtomicUsize::new(0),
            log: Mutex::new(Vec::new()),
        };
        let server = Server::start(shared, Duration::from_secs(60), answer);
        LlmUpstream {
            addr: server.addr,
            server,
        }
    }

    /// From now on, keep the first `bytes` of each response body in its [`Sent`] (all are
    /// hashed whatever this says).
    pub fn keep_bodies(&self, bytes: usize) {
        self.server.state().keep.store(bytes, Ordering::SeqCst);
    }

    /// Every exchange so far, in the order the requests came.
    pub fn exchanges(&self) -> Vec<Exchange> {
        self.server.state().log.lock().unwrap().clone()
    }

    /// The exchange numbered `seq` (as it is now).
    pub fn exchange(&self, seq: u64) -> Option<Exchange> {
        let log = self.server.state().log.lock().unwrap();
        log.iter().find(|e| e.seq == seq).cloned()
    }

    /// The exchange numbered `seq` once its answer is sent (or broke), waiting up to
    /// `timeout`: a client may read the last byte before the upstream records it.
    pub fn wait_sent(&self, seq: u64, timeout: Duration) -> Option<Exchange> {
        let deadline = Instant::now() + timeout;
        loop {
            let e = self.exchange(seq);
            if e.as_ref().is_some_and(|e| e.sent.is_some()) || Instant::now() >= deadline {
                return e.filter(|e| e.sent.is_some());
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    /// Requests received so far.
    pub fn received(&self) -> usize {
        self.server.state().log.lock().unwrap().len()
    }

    /// The most body bytes any answer held at once on the way to the socket.
    pub fn peak_buffer(&self) -> usize {
        self.server.state().peak.load(Ordering::SeqCst)
    }
}

fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        400 => "Bad Request",
        401 => "Unauthorized",
        404 => "Not Found",
        429 => "Too Many Requests",
        500 => "Internal Server Error",
        503 => "Service Unavailable",
        529 => "Overloaded",
        _ => "Status",
    }
}

/// Answers one request; false if the connection is to be closed (asked by the request, a
/// reset, or it broke).
fn answer(out: &mut TcpStream, req: Incoming, s: &Shared) -> bool {
    let close = header(&req.headers, "connection").is_some_and(|v| v == "close");
    respond(out, req, s) && !close
}

/// Answers one request; false if the connection broke or was reset.
fn respond(out: &mut TcpStream, req: Incoming, s: &Shared) -> bool {
    let seq = s.seq.fetch_add(1, Ordering::SeqCst);
    let spec = Spec::from_request(&req.path, &req.headers, &req.body);
    let transport = spec
        .as_ref()
        .map(|spec| Transport::from_headers(&req.headers, spec));
    s.log.lock().unwrap().push(Exchange {
        seq,
        max_tokens: max_tokens_of(&req.path, &req.body),
        request: req,
        spec: spec.clone(),
        transport: transport.clone(),
        sent: None,
    });
    let record = |sent: Sent| {
        s.peak.fetch_max(sent.peak_buffer, Ordering::SeqCst);
        let mut log = s.log.lock().unwrap();
        if let Some(e) = log.iter_mut().find(|e| e.seq == seq) {
            e.sent = Some(sent);
        }
    };
    let (Some(spec), Some(t)) = (spec, transport) else {
        let body = br#"{"error":{"message":"no such route","type":"invalid_request_error","param":null,"code":null}}"#;
        let head = format!(
            "HTTP/1.1 404 Not Found\r\ncontent-type: application/json\r\nx-llm-seq: {seq}\r\ncontent-length: {}\r\n\r\n",
            body.len()
        );
        let ok = out
            .write_all(head.as_bytes())
            .and_then(|_| out.write_all(body))
            .and_then(|_| out.flush())
            .is_ok();
        record(Sent {
            status: 404,
            bytes: body.len() as u64,
            hash: hash(body),
            pieces: 1,
            complete: ok,
            body: body.to_vec(),
            peak_buffer: 0,
        });
        return ok;
    };
    let mut head = format!(
        "HTTP/1.1 {} {}\r\ncontent-type: {}\r\nx-llm-seq: {seq}\r\n",
        spec.status,
        reason(spec.status),
        spec.content_type()
    );
    if spec.streams() {
        head.push_str("cache-control: no-cache\r\n");
    }
    if t.gzip {
        head.push_str("content-encoding: gzip\r\n");
    }
    if let Some((name, value)) = &t.extra {
        head.push_str(&format!("{name}: {value}\r\n"));
    }
    if t.chunked {
        head.push_str("transfer-encoding: chunked\r\n");
    } else {
        head.push_str(&format!("content-length: {}\r\n", wire_len(&spec, t.gzip)));
    }
    head.push_str("\r\n");
    if out.write_all(head.as_bytes()).is_err() {
        record(Sent {
            status: spec.status,
            ..Sent::default()
        });
        return false;
    }
    let mut sock = &*out;
    let mut wire = Wire::new(&mut sock, &t, s.keep.load(Ordering::SeqCst));
    let result = write_encoded(&spec, t.gzip, &mut wire).and_then(|_| wire.finish());
    let reset = wire.reset;
    record(Sent {
        status: spec.status,
        bytes: wire.sent,
        hash: wire.hash.value(),
        pieces: wire.pieces,
        complete: result.is_ok(),
        body: std::mem::take(&mut wire.kept),
        peak_buffer: wire.peak,
    });
    if reset {
        // Let the client read what was sent before the connection goes.
        std::thread::sleep(Duration::from_millis(50));
        let _ = out.shutdown(std::net::Shutdown::Both);
        return false;
    }
    result.is_ok()
}
