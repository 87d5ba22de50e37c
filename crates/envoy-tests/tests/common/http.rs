//! HTTP/1.1 on the tests' side of the wire: reading a request, its headers and its body, and
//! hashing a body as it passes.

use std::io::{self, BufRead, BufReader, Read};
use std::net::TcpStream;

/// Request body bytes an [`Incoming`] keeps (all are counted).
pub const REQUEST_KEEP: usize = 1 << 20;

/// A 64-bit hash of a body, fed piece by piece: the same value however the bytes were cut.
/// SipHash-1-3 with fixed keys (std's `DefaultHasher::new()`, streaming over `write`): std is
/// built optimized, so even a debug build hashes 100 MB in a fraction of a second.
#[derive(Clone, Debug, Default)]
pub struct BodyHash(std::hash::DefaultHasher);

impl BodyHash {
    pub fn update(&mut self, bytes: &[u8]) {
        std::hash::Hasher::write(&mut self.0, bytes);
    }

    pub fn value(&self) -> u64 {
        std::hash::Hasher::finish(&self.0)
    }
}

/// The hash of a whole body.
pub fn hash(bytes: &[u8]) -> u64 {
    let mut h = BodyHash::default();
    h.update(bytes);
    h.value()
}

/// The first value of a header (case-insensitive name).
pub fn header<'a>(headers: &'a [(String, String)], name: &str) -> Option<&'a str> {
    headers
        .iter()
        .find(|(k, _)| k.eq_ignore_ascii_case(name))
        .map(|(_, v)| v.as_str())
}

/// A request as read.
pub struct Incoming {
    pub method: String,
    /// With the query.
    pub path: String,
    /// Names in lower case, in the order received.
    pub headers: Vec<(String, String)>,
    /// Its first [`REQUEST_KEEP`] bytes.
    pub body: Vec<u8>,
    pub body_len: u64,
    /// [`BodyHash`] of the whole body.
    pub body_hash: u64,
}

/// Reads one request; None at the end of the connection or on garbage.
pub fn read_request(reader: &mut BufReader<TcpStream>) -> Option<Incoming> {
    let mut line = String::new();
    if reader.read_line(&mut line).ok()? == 0 {
        return None;
    }
    let mut parts = line.split_whitespace();
    let method = parts.next()?.to_string();
    let path = parts.next()?.to_string();
    let headers = read_headers(reader)?;
    let mut body = Vec::new();
    let mut body_len = 0u64;
    let mut h = BodyHash::default();
    let mut take = |piece: &[u8]| {
        h.update(piece);
        body_len += piece.len() as u64;
        let room = REQUEST_KEEP.saturating_sub(body.len());
        body.extend_from_slice(&piece[..room.min(piece.len())]);
    };
    let chunked = header(&headers, "transfer-encoding")
        .is_some_and(|v| v.to_ascii_lowercase().contains("chunked"));
    if chunked {
        loop {
            line.clear();
            reader.read_line(&mut line).ok()?;
            let size_text = line.trim().split(';').next()?;
            let size = usize::from_str_radix(size_text, 16).ok()?;
            if size == 0 {
                read_headers(reader)?; // trailers
                break;
            }
            copy_exact(reader, size as u64, &mut take).ok()?;
            let mut crlf = [0u8; 2];
            reader.read_exact(&mut crlf).ok()?;
        }
    } else {
        let len = header(&headers, "content-length")
            .and_then(|v| v.trim().parse::<u64>().ok())
            .unwrap_or(0);
        copy_exact(reader, len, &mut take).ok()?;
    }
    Some(Incoming {
        method,
        path,
        headers,
        body,
        body_len,
        body_hash: h.value(),
    })
}

/// Header lines up to the blank line; names in lower case.
pub fn read_headers(reader: &mut impl BufRead) -> Option<Vec<(String, String)>> {
    let mut headers = Vec::new();
    let mut line = String::new();
    loop {
        line.clear();
        if reader.read_line(&mut line).ok()? == 0 {
            return None;
        }
        let l = line.trim_end();
        if l.is_empty() {
            return Some(headers);
        }
        if let Some((k, v)) = l.split_once(':') {
            headers.push((k.trim().to_ascii_lowercase(), v.trim().to_string()));
        }
    }
}

/// Reads exactly `n` bytes, handing them to `take` piece by piece.
pub fn copy_exact(reader: &mut impl Read, n: u64, take: &mut dyn FnMut(&[u8])) -> io::Result<()> {
    let mut left = n;
    let mut buf = vec![0u8; 64 * 1024];
    while left > 0 {
        let want = (left as usize).min(buf.len());
        let got = reader.read(&mut buf[..want])?;
        if got == 0 {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        take(&buf[..got]);
        left -= got as u64;
    }
    Ok(())
}

/// The peer closed (or reset) the connection.
pub fn is_eof(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::UnexpectedEof
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::BrokenPipe
    )
}
