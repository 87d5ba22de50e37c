//! HTTP/1.1 on the tests' side of the wire, written once for every stand-in and client: a
//! loopback server that hands each connection to its stand-in until dropped; reading a request,
//! a response's head, headers and a body however it is framed; hashing a body as it passes;
//! and a small keep-alive client.

use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Barrier};
use std::time::Duration;

// ---------------------------------------------------------------------------------------------
// A server

/// A loopback listener whose accept loop hands every connection to a stand-in whose state is
/// `S`; it stops accepting when dropped.
pub struct Server<S = ()> {
    pub addr: SocketAddr,
    state: Arc<S>,
    stop: Arc<AtomicBool>,
}

impl<S: Send + Sync + 'static> Server<S> {
    /// Listens on a free loopback port and serves each connection on its own thread, one
    /// request after another: `answer` writes the answer to each (the stand-in's `state` at
    /// hand) and says whether the connection stays open. A connection waits up to `idle` for
    /// its next request.
    pub fn start(
        state: S,
        idle: Duration,
        answer: fn(&mut TcpStream, Incoming, &S) -> bool,
    ) -> Server<S> {
        let state = Arc::new(state);
        let s = state.clone();
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        Server::accept_with(state, listener, move |conn| {
            let s = s.clone();
            std::thread::spawn(move || serve(conn, idle, &*s, answer));
        })
    }

    /// The stand-in's state.
    pub fn state(&self) -> &S {
        &self.state
    }

    fn accept_with(
        state: Arc<S>,
        listener: TcpListener,
        mut take: impl FnMut(TcpStream) + Send + 'static,
    ) -> Server<S> {
        let addr = listener.local_addr().unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                if s.load(Ordering::SeqCst) {
                    break;
                }
                if let Ok(conn) = conn {
                    take(conn);
                }
            }
        });
        Server { addr, state, stop }
    }
}

impl Server {
    /// Accepts on `listener`, handing each connection to `take` on the accept loop's thread.
    pub fn accept(listener: TcpListener, take: impl FnMut(TcpStream) + Send + 'static) -> Server {
        Server::accept_with(Arc::new(()), listener, take)
    }
}

impl<S> Drop for Server<S> {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        let _ = TcpStream::connect(self.addr); // wakes the accept loop
    }
}

/// Serves one keep-alive connection.
fn serve<S>(
    conn: TcpStream,
    idle: Duration,
    state: &S,
    answer: fn(&mut TcpStream, Incoming, &S) -> bool,
) {
    let _ = conn.set_read_timeout(Some(idle));
    // Each piece of an answer must leave at once: Nagle's algorithm would hold a small one
    // until the peer's delayed ACK, 40 ms later.
    let _ = conn.set_nodelay(true);
    let mut reader = BufReader::new(conn);
    while let Some(req) = read_request(&mut reader) {
        if !answer(reader.get_mut(), req, state) {
            return;
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Reading messages

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
#[derive(Clone, Debug)]
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

/// Reads one request (its body with a content-length or chunked, none without either); None at
/// the end of the connection or on garbage.
pub fn read_request(reader: &mut impl BufRead) -> Option<Incoming> {
    let mut line = String::new();
    if reader.read_line(&mut line).ok()? == 0 {
        return None;
    }
    let mut parts = line.split_whitespace();
    let method = parts.next()?.to_string();
    let path = parts.next()?.to_string();
    let headers = read_headers(reader).ok()?;
    let mut body = Vec::new();
    let mut body_len = 0u64;
    let mut h = BodyHash::default();
    let mut take = |piece: &[u8]| {
        h.update(piece);
        body_len += piece.len() as u64;
        let room = REQUEST_KEEP.saturating_sub(body.len());
        body.extend_from_slice(&piece[..room.min(piece.len())]);
    };
    let framing = Framing::of(&headers).unwrap_or(Framing::Length(0));
    if !read_body(reader, framing, &mut take).ok()?.complete {
        return None;
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

/// A whole response (a body without a content-length or chunks is empty: Envoy frames all it
/// sends).
pub fn read_response(reader: &mut impl BufRead) -> io::Result<Response> {
    let (status, headers) = read_head(reader)?;
    let framing = Framing::of(&headers).unwrap_or(Framing::Length(0));
    let mut body = Vec::new();
    let read = read_body(reader, framing, &mut |piece| body.extend_from_slice(piece))?;
    if !read.complete {
        return Err(io::ErrorKind::UnexpectedEof.into());
    }
    Ok(Response {
        status,
        headers,
        body,
    })
}

/// A response's status line and headers.
pub fn read_head(reader: &mut impl BufRead) -> io::Result<(u16, Vec<(String, String)>)> {
    let mut line = String::new();
    reader.read_line(&mut line)?;
    let status = line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| io::Error::other(format!("bad status line {line:?}")))?;
    Ok((status, read_headers(reader)?))
}

/// Header lines up to the blank line; names in lower case. An error if the connection ends
/// first.
pub fn read_headers(reader: &mut impl BufRead) -> io::Result<Vec<(String, String)>> {
    let mut headers = Vec::new();
    let mut line = String::new();
    loop {
        line.clear();
        if reader.read_line(&mut line)? == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "connection closed in the headers",
            ));
        }
        let l = line.trim_end();
        if l.is_empty() {
            return Ok(headers);
        }
        if let Some((k, v)) = l.split_once(':') {
            headers.push((k.trim().to_ascii_lowercase(), v.trim().to_string()));
        }
    }
}

/// How a message's body is delimited.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Framing {
    Chunked,
    Length(u64),
    /// By the end of the connection.
    Close,
}

impl Framing {
    /// The framing `headers` declare (None: neither chunked nor a content-length).
    pub fn of(headers: &[(String, String)]) -> Option<Framing> {
        if header(headers, "transfer-encoding")
            .is_some_and(|v| v.to_ascii_lowercase().contains("chunked"))
        {
            return Some(Framing::Chunked);
        }
        header(headers, "content-length")
            .and_then(|v| v.trim().parse().ok())
            .map(Framing::Length)
    }
}

/// What reading a body found.
pub struct Body {
    /// The body ended as its framing says (false: the connection closed first).
    pub complete: bool,
    /// Chunks read (0 without chunked encoding).
    pub chunks: u64,
}

/// Reads a body framed as `framing`, handing its bytes to `take` piece by piece (chunked: the
/// data of each chunk, and the trailers are read past).
pub fn read_body(
    reader: &mut impl BufRead,
    framing: Framing,
    take: &mut dyn FnMut(&[u8]),
) -> io::Result<Body> {
    let mut chunks = 0;
    let done = match framing {
        Framing::Chunked => read_chunks(reader, take, &mut chunks),
        Framing::Length(n) => copy_exact(reader, n, take).map(|()| true),
        Framing::Close => {
            let end = copy_exact(reader, u64::MAX, take).err();
            return Ok(Body {
                complete: end.is_some_and(|e| e.kind() == io::ErrorKind::UnexpectedEof),
                chunks,
            });
        }
    };
    let complete = match done {
        Ok(d) => d,
        Err(e) if is_eof(&e) => false,
        Err(e) => return Err(e),
    };
    Ok(Body { complete, chunks })
}

/// A chunked body's chunks (counted in `chunks`) and its trailers: whether it ended.
fn read_chunks(
    reader: &mut impl BufRead,
    take: &mut dyn FnMut(&[u8]),
    chunks: &mut u64,
) -> io::Result<bool> {
    let mut line = String::new();
    loop {
        line.clear();
        if reader.read_line(&mut line)? == 0 {
            return Ok(false);
        }
        let size_text = line.trim().split(';').next().unwrap_or("");
        let size = u64::from_str_radix(size_text, 16)
            .map_err(|_| io::Error::other(format!("bad chunk size {line:?}")))?;
        if size == 0 {
            read_headers(reader)?; // trailers
            return Ok(true);
        }
        *chunks += 1;
        copy_exact(reader, size, take)?;
        let mut crlf = [0u8; 2];
        reader.read_exact(&mut crlf)?;
        if &crlf != b"\r\n" {
            return Err(io::Error::other("chunk without its CRLF"));
        }
    }
}

/// Reads exactly `n` bytes, handing them to `take` piece by piece.
pub fn copy_exact(reader: &mut impl Read, n: u64, take: &mut dyn FnMut(&[u8])) -> io::Result<()> {
    let mut left = n;
    let mut buf = vec![0u8; n.min(64 * 1024) as usize];
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

// ---------------------------------------------------------------------------------------------
// A client

/// A parsed HTTP response.
#[derive(Debug, Clone)]
pub struct Response {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Response {
    /// The first value of a header (case-insensitive name).
    pub fn header(&self, name: &str) -> Option<&str> {
        header(&self.headers, name)
    }

    /// How many lines a header has.
    pub fn header_count(&self, name: &str) -> usize {
        self.headers
            .iter()
            .filter(|(n, _)| n.eq_ignore_ascii_case(name))
            .count()
    }

    /// A header parsed as an integer.
    pub fn header_u64(&self, name: &str) -> Option<u64> {
        self.header(name)?.parse().ok()
    }

    pub fn body_str(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

/// A keep-alive HTTP/1.1 connection, optionally from a chosen local address.
pub struct Client {
    reader: BufReader<TcpStream>,
}

impl Client {
    pub fn connect(addr: SocketAddr) -> io::Result<Client> {
        let stream = TcpStream::connect_timeout(&addr, Duration::from_secs(5))?;
        Client::wrap(stream)
    }

    /// Connects from `source` (e.g. 127.0.0.2), so Envoy sees that remote address.
    pub fn connect_from(addr: SocketAddr, source: &str) -> io::Result<Client> {
        use socket2::{Domain, Socket, Type};
        let socket = Socket::new(Domain::IPV4, Type::STREAM, None)?;
        let local: SocketAddr = format!("{source}:0").parse().unwrap();
        socket.bind(&local.into())?;
        socket.connect_timeout(&addr.into(), Duration::from_secs(5))?;
        Client::wrap(socket.into())
    }

    fn wrap(stream: TcpStream) -> io::Result<Client> {
        stream.set_read_timeout(Some(Duration::from_secs(10)))?;
        stream.set_nodelay(true)?;
        Ok(Client {
            reader: BufReader::new(stream),
        })
    }

    /// Sends one request and reads its response.
    pub fn send(
        &mut self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
    ) -> io::Result<Response> {
        let mut req = format!("{method} {path} HTTP/1.1\r\nhost: localhost\r\n");
        for (k, v) in headers {
            req.push_str(&format!("{k}: {v}\r\n"));
        }
        if method == "POST" || method == "PUT" {
            req.push_str("content-length: 0\r\n");
        }
        req.push_str("\r\n");
        self.reader.get_mut().write_all(req.as_bytes())?;
        read_response(&mut self.reader)
    }

    pub fn get(&mut self, path: &str) -> io::Result<Response> {
        self.send("GET", path, &[])
    }
}

/// GETs `/` once for each of `left`, each admitted with that many requests remaining.
pub fn assert_remaining(c: &mut Client, left: &[u64]) {
    for &n in left {
        let r = c.get("/").unwrap();
        assert_eq!(
            (r.status, r.header_u64("x-ratelimit-remaining")),
            (200, Some(n))
        );
    }
}

/// One GET on a fresh connection.
pub fn get(addr: SocketAddr, path: &str) -> io::Result<Response> {
    Client::connect(addr)?.get(path)
}

/// `n` clients, each on its own connection opened first, run `f` together (one barrier
/// releases them once all are connected); their results, in client order.
pub fn at_once<T: Send + 'static>(
    addr: SocketAddr,
    n: usize,
    f: impl Fn(&mut Client) -> T + Send + Sync + 'static,
) -> Vec<T> {
    let (go, f) = (Arc::new(Barrier::new(n)), Arc::new(f));
    let threads: Vec<_> = (0..n)
        .map(|_| {
            let (go, f, mut c) = (go.clone(), f.clone(), Client::connect(addr).unwrap());
            std::thread::spawn(move || {
                go.wait();
                f(&mut c)
            })
        })
        .collect();
    threads.into_iter().map(|t| t.join().unwrap()).collect()
}
