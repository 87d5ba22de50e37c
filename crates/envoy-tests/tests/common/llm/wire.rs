//! How an answer travels, besides what it says: cut into pieces, slowed, reset, gzipped,
//! chunked or not, as the request's headers ask; what went out is hashed and counted.

use super::super::http::BodyHash;
use super::{header, Spec, MAX_CHUNK};
use ratelimit_core::testkit::Rng;
use std::io::{self, Write};
use std::time::Duration;

/// How the body is cut into writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Split {
    /// One piece per event (big events in [`MAX_CHUNK`] pieces).
    Event,
    /// Every byte its own piece.
    Every,
    /// Pieces of this many bytes.
    Size(usize),
    /// Pieces of random sizes, from this seed.
    Random(u64),
}

impl Split {
    pub fn parse(v: &str) -> Option<Split> {
        let v = v.trim();
        if v == "every" {
            return Some(Split::Every);
        }
        if let Some(seed) = v.strip_prefix("random:") {
            return seed.trim().parse().ok().map(Split::Random);
        }
        match v.parse::<usize>().ok()? {
            0 | 1 => Some(Split::Every),
            n => Some(Split::Size(n)),
        }
    }
}

/// How an answer travels, besides what it says.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Transport {
    pub split: Split,
    /// Between events.
    pub delay_ms: u64,
    /// Close after this many body bytes.
    pub reset_after: Option<u64>,
    pub gzip: bool,
    /// Chunked transfer-encoding (else a content-length).
    pub chunked: bool,
    /// One more header of the answer (name, value).
    pub extra: Option<(String, String)>,
}

impl Transport {
    pub fn from_headers(headers: &[(String, String)], spec: &Spec) -> Transport {
        let num = |name: &str| header(headers, name).and_then(|v| v.trim().parse::<u64>().ok());
        Transport {
            split: header(headers, "x-test-split")
                .and_then(Split::parse)
                .unwrap_or(Split::Event),
            delay_ms: num("x-test-delay-ms").unwrap_or(0),
            reset_after: num("x-test-reset-after"),
            gzip: header(headers, "x-test-encoding").is_some_and(|v| v.trim() == "gzip"),
            chunked: match header(headers, "x-test-framing").map(str::trim) {
                Some("length") => false,
                Some("chunked") => true,
                _ => spec.streams(),
            },
            extra: header(headers, "x-test-answer-header")
                .and_then(|v| v.trim().split_once('='))
                .map(|(k, v)| (k.to_string(), v.to_string())),
        }
    }
}

/// The body's way to the socket: cuts it into pieces as the [`Transport`] says, frames each
/// as a chunk (or not), flushes each, and hashes and counts what it sent.
pub(super) struct Wire<'a> {
    out: &'a mut dyn Write,
    chunked: bool,
    split: Split,
    rng: Rng,
    /// The size of the next piece (split modes).
    next: usize,
    buf: Vec<u8>,
    delay: Duration,
    /// An event ended: wait before the next byte.
    pending_delay: bool,
    reset_after: Option<u64>,
    pub(super) reset: bool,
    pub(super) sent: u64,
    pub(super) pieces: u64,
    pub(super) hash: BodyHash,
    keep: usize,
    pub(super) kept: Vec<u8>,
    pub(super) peak: usize,
}

impl<'a> Wire<'a> {
    pub(super) fn new(out: &'a mut dyn Write, t: &Transport, keep: usize) -> Wire<'a> {
        let seed = match t.split {
            Split::Random(s) => s,
            _ => 0,
        };
        let mut w = Wire {
            out,
            chunked: t.chunked,
            split: t.split,
            // xorshift is stuck at 0.
            rng: Rng(seed ^ 0x9e37_79b9_7f4a_7c15),
            next: 0,
            buf: Vec::new(),
            delay: Duration::from_millis(t.delay_ms),
            pending_delay: false,
            reset_after: t.reset_after,
            reset: false,
            sent: 0,
            pieces: 0,
            hash: BodyHash::default(),
            keep,
            kept: Vec::new(),
            peak: 0,
        };
        w.next = w.draw();
        w
    }

    fn draw(&mut self) -> usize {
        match self.split {
            Split::Event => MAX_CHUNK,
            Split::Every => 1,
            Split::Size(n) => n,
            Split::Random(_) => {
                if self.rng.below(16) == 0 {
                    1 + self.rng.below(256) as usize
                } else {
                    1 + self.rng.below(7) as usize
                }
            }
        }
    }

    /// Sends one piece; an error once the reset point is reached.
    fn emit(&mut self, piece: &[u8]) -> io::Result<()> {
        let mut piece = piece;
        if let Some(limit) = self.reset_after {
            let left = limit.saturating_sub(self.sent) as usize;
            if piece.len() >= left {
                piece = &piece[..left];
                self.reset = true;
            }
        }
        if !piece.is_empty() {
            if self.chunked {
                let mut frame = format!("{:x}\r\n", piece.len()).into_bytes();
                frame.extend_from_slice(piece);
                frame.extend_from_slice(b"\r\n");
                self.out.write_all(&frame)?;
            } else {
                self.out.write_all(piece)?;
            }
            self.out.flush()?;
            self.hash.update(piece);
            let room = self.keep.saturating_sub(self.kept.len());
            self.kept.extend_from_slice(&piece[..room.min(piece.len())]);
            self.sent += piece.len() as u64;
            self.pieces += 1;
        }
        if self.reset {
            return Err(io::Error::other("reset point reached"));
        }
        Ok(())
    }

    /// Sends what is buffered: whole pieces, and at an event's end without a split, the rest.
    fn drain(&mut self, event_end: bool) -> io::Result<()> {
        self.peak = self.peak.max(self.buf.capacity());
        let buf = std::mem::take(&mut self.buf);
        let mut at = 0;
        let result = (|| {
            if self.split == Split::Event {
                while buf.len() - at >= MAX_CHUNK || (event_end && at < buf.len()) {
                    let end = (at + MAX_CHUNK).min(buf.len());
                    self.emit(&buf[at..end])?;
                    at = end;
                }
            } else {
                while buf.len() - at >= self.next {
                    let end = at + self.next;
                    self.emit(&buf[at..end])?;
                    at = end;
                    self.next = self.draw();
                }
            }
            Ok(())
        })();
        self.buf = buf;
        self.buf.drain(..at);
        result
    }

    /// Sends the rest and ends the body.
    pub(super) fn finish(&mut self) -> io::Result<()> {
        // The delay after the last event holds the body's end too.
        if self.pending_delay {
            self.pending_delay = false;
            std::thread::sleep(self.delay);
        }
        let rest = std::mem::take(&mut self.buf);
        if !rest.is_empty() {
            self.emit(&rest)?;
        }
        if self.chunked {
            self.out.write_all(b"0\r\n\r\n")?;
        }
        self.out.flush()
    }
}

impl Write for Wire<'_> {
    fn write(&mut self, data: &[u8]) -> io::Result<usize> {
        if self.pending_delay {
            self.pending_delay = false;
            std::thread::sleep(self.delay);
        }
        self.buf.extend_from_slice(data);
        self.drain(false)?;
        Ok(data.len())
    }

    /// An event ended.
    fn flush(&mut self) -> io::Result<()> {
        self.drain(true)?;
        self.pending_delay = !self.delay.is_zero();
        Ok(())
    }
}
