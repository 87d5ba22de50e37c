//! A client that sends request bodies and reads any response body, whole or as it comes.

use super::super::http::{copy_exact, is_eof, read_headers, BodyHash};
use super::header;
use super::sse::{sse_events, SseEvent};
use serde_json::Value;
use std::io::{self, BufRead, BufReader, Read, Write};
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
        let mut line = String::new();
        self.reader.read_line(&mut line)?;
        let status = line
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| io::Error::other(format!("bad status line {line:?}")))?;
        let headers = read_headers(&mut self.reader)
            .ok_or_else(|| io::Error::other("connection closed in the headers"))?;
        let mut reply = Reply {
            status,
            headers,
            body: Vec::new(),
            len: 0,
            hash: 0,
            chunks: 0,
            complete: false,
        };
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
        let chunked = reply
            .header("transfer-encoding")
            .is_some_and(|v| v.eq_ignore_ascii_case("chunked"));
        let length = reply
            .header("content-length")
            .and_then(|v| v.parse::<u64>().ok());
        reply.complete = if chunked {
            let mut chunks = 0;
            let done = (|| -> io::Result<bool> {
                loop {
                    line.clear();
                    if self.reader.read_line(&mut line)? == 0 {
                        return Ok(false);
                    }
                    let size_text = line.trim().split(';').next().unwrap_or("");
                    let size = u64::from_str_radix(size_text, 16)
                        .map_err(|_| io::Error::other(format!("bad chunk size {line:?}")))?;
                    if size == 0 {
                        return Ok(read_headers(&mut self.reader).is_some());
                    }
                    chunks += 1;
                    copy_exact(&mut self.reader, size, &mut take)?;
                    let mut crlf = [0u8; 2];
                    self.reader.read_exact(&mut crlf)?;
                    if &crlf != b"\r\n" {
                        return Err(io::Error::other("chunk without its CRLF"));
                    }
                }
            })();
            reply.chunks = chunks;
            match done {
                Ok(d) => d,
                Err(e) if is_eof(&e) => false,
                Err(e) => return Err(e),
            }
        } else if let Some(n) = length {
            match copy_exact(&mut self.reader, n, &mut take) {
                Ok(()) => true,
                Err(e) if is_eof(&e) => false,
                Err(e) => return Err(e),
            }
        } else {
            // Delimited by the end of the connection.
            copy_exact(&mut self.reader, u64::MAX, &mut take)
                .err()
                .is_some_and(|e| e.kind() == io::ErrorKind::UnexpectedEof)
        };
        reply.len = len;
        reply.hash = h.value();
        reply.body = kept;
        Ok(reply)
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
