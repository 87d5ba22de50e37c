//! A client that sends request bodies and reads any response body, whole or as it comes.

use super::super::http::{read_body, read_head, BodyHash, Framing};
use super::header;
use super::sse::{sse_events, SseEvent};
use serde_json::Value;
use std::io::{self, BufReader, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

/// A response as a client read it.
#[derive(Clone, Debug)]
pub struct Reply {
    pub status: u16,
    /// Names in lower case.
    pub headers: Vec<(String, String)>,
    /// The body (de-chunked, not decoded); empty when a sink took it.
    pub body: Vec<u8>,
    /// Body bytes received.
    pub len: u64,
    /// [`BodyHash`] of the body bytes received.
    pub hash: u64,
    /// Chunks received (0 without chunked encoding).
    pub chunks: u64,
    /// The body ended as its framing says (false: the connection closed first).
    pub complete: bool,
}

impl Reply {
    pub fn header(&self, name: &str) -> Option<&str> {
        header(&self.headers, name)
    }

    /// The upstream's number for this exchange (`x-llm-seq`).
    pub fn seq(&self) -> Option<u64> {
        self.header("x-llm-seq")?.parse().ok()
    }

    /// The body as JSON.
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap()
    }

    /// The body's SSE events.
    pub fn events(&self) -> Vec<SseEvent> {
        sse_events(&self.body)
    }
}

/// Where a response body goes as it arrives.
pub type Sink<'a> = &'a mut dyn FnMut(&[u8]);

/// A keep-alive HTTP/1.1 connection that sends request bodies and reads any response body,
/// whole or as it comes.
pub struct LlmClient {
    reader: BufReader<TcpStream>,
}

impl LlmClient {
    pub fn connect(addr: SocketAddr) -> io::Result<LlmClient> {
        let stream = TcpStream::connect_timeout(&addr, Duration::from_secs(5))?;
        stream.set_read_timeout(Some(Duration::from_secs(20)))?;
        stream.set_nodelay(true)?;
        Ok(LlmClient {
            reader: BufReader::new(stream),
        })
    }

    /// POSTs `body` (with a content-length) and reads the whole response.
    pub fn post(&mut self, path: &str, headers: &[(&str, &str)], body: &[u8]) -> io::Result<Reply> {
        self.send("POST", path, headers, body, None)
    }

    /// Sends one request; the response body goes to `sink` as it arrives if given (and is
    /// then not kept), else into [`Reply::body`].
    pub fn send(
        &mut self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: &[u8],
        sink: Option<Sink>,
    ) -> io::Result<Reply> {
        self.send_pieces(method, path, headers, &[body], Duration::ZERO, sink)
    }

    /// Sends one request whose body (with a content-length, unless `headers` frame it) is
    /// written in `pieces`, the headers with the first, `gap` apart (so that the proxy sees
    /// each as its own body event); reads the response as [`LlmClient::send`] does.
    pub fn send_pieces(
        &mut self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        pieces: &[&[u8]],
        gap: Duration,
        mut sink: Option<Sink>,
    ) -> io::Result<Reply> {
        let mut req = format!("{method} {path} HTTP/1.1\r\nhost: localhost\r\n");
        let mut has_length = false;
        for (k, v) in headers {
            has_length |= k.eq_ignore_ascii_case("content-length")
                || k.eq_ignore_ascii_case("transfer-encoding");
            req.push_str(&format!("{k}: {v}\r\n"));
        }
        if !has_length {
            let len: usize = pieces.iter().map(|p| p.len()).sum();
            req.push_str(&format!("content-length: {len}\r\n"));
        }
        req.push_str("\r\n");
        let w = self.reader.get_mut();
        w.write_all(req.as_bytes())?;
        for (i, piece) in pieces.iter().enumerate() {
            if i > 0 {
                std::thread::sleep(gap);
            }
            w.write_all(piece)?;
            w.flush()?;
        }
        w.flush()?;
        let (status, headers) = read_head(&mut self.reader)?;
        let mut h = BodyHash::default();
        let keep = sink.is_none();
        let mut kept = Vec::new();
        let mut len = 0u64;
        let mut take = |piece: &[u8]| {
            h.update(piece);
            len += piece.len() as u64;
            match &mut sink {
                Some(f) => f(piece),
                None if keep => kept.extend_from_slice(piece),
                None => {}
            }
        };
        let framing = Framing::of(&headers).unwrap_or(Framing::Close);
        let read = read_body(&mut self.reader, framing, &mut take)?;
        Ok(Reply {
            status,
            headers,
            body: kept,
            len,
            hash: h.value(),
            chunks: read.chunks,
            complete: read.complete,
        })
    }
}

/// One POST on a fresh connection.
pub fn post(
    addr: SocketAddr,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> io::Result<Reply> {
    LlmClient::connect(addr)?.post(path, headers, body)
}
