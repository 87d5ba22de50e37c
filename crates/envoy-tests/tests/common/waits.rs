//! Clients of the tests whose requests may wait for their turn (`share.max_wait_ms`): every
//! request on its own connection and thread, so that a waiting request holds nobody else up,
//! and what each saw (its status and how long it took).
use super::provider::Provider;
use super::share::paced;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// What one request saw: when it was sent (s since the provider started), status, wait.
#[derive(Clone, Copy, Debug)]
pub struct Seen {
    pub at_s: f64,
    pub status: u16,
    pub ms: u64,
}

/// One GET of `path` for `tenant` on its own connection, with more header lines (`extra`, each
/// ending in CRLF): (status, milliseconds until the answer); status 0 when `hang_up_ms` passed
/// first and the client closed the connection.
pub fn request_at(
    addr: SocketAddr,
    path: &str,
    tenant: &str,
    extra: &str,
    hang_up_ms: Option<u64>,
) -> (u16, u64) {
    let start = Instant::now();
    let mut s = TcpStream::connect(addr).unwrap();
    let _ = s.set_nodelay(true);
    let timeout = Duration::from_millis(hang_up_ms.unwrap_or(10_000));
    s.set_read_timeout(Some(timeout)).unwrap();
    let head = format!(
        "GET {path} HTTP/1.1\r\nhost: test\r\nx-tenant: {tenant}\r\n{extra}connection: close\r\n\r\n"
    );
    s.write_all(head.as_bytes()).unwrap();
    let mut buf = [0u8; 64];
    let mut got = Vec::new();
    while got.len() < 12 {
        match s.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(_) => return (0, start.elapsed().as_millis() as u64), // hung up
        }
    }
    let status = std::str::from_utf8(&got)
        .ok()
        .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        .unwrap_or(0);
    (status, start.elapsed().as_millis() as u64)
}

/// A tenant sending `rate` requests a second to `path`, paced, each on its own thread and
/// connection, to the next of `addrs` in turn (a load balancer in front of replicas), until
/// `run_s`; what each request saw.
#[allow(clippy::too_many_arguments)]
pub fn drive_over(
    addrs: &[SocketAddr],
    path: &'static str,
    provider: &Arc<Provider>,
    tenant: &str,
    extra: &str,
    rate: f64,
    run_s: u64,
    hang_up_ms: Option<u64>,
) -> std::thread::JoinHandle<Vec<Seen>> {
    let extra = extra.to_string();
    let provider = provider.clone();
    let tenant = tenant.to_string();
    let addrs = addrs.to_vec();
    std::thread::spawn(move || {
        let mut threads = Vec::new();
        let mut n = 0usize;
        paced(rate, Duration::from_secs(run_s), |_| {
            let (tenant, extra) = (tenant.clone(), extra.clone());
            let addr = addrs[n % addrs.len()];
            n += 1;
            let at_s = provider.elapsed_s();
            threads.push(std::thread::spawn(move || {
                let (status, ms) = request_at(addr, path, &tenant, &extra, hang_up_ms);
                Seen { at_s, status, ms }
            }));
            true
        });
        threads.into_iter().map(|t| t.join().unwrap()).collect()
    })
}
