//! Loopback ports for the processes a test starts (Redis, the test rate limit service, stand-in
//! backends), and the proof that the process started is the one listening.
//!
//! A port the kernel picks (bind to port 0) and the test releases is anybody's again: two such
//! calls in a row give the same port about once in 15,000 pairs here, and another process (an
//! Envoy of another job binding port 0) may take it before the service meant for it starts.
//! Either way the service cannot bind it and exits, and a test content with anybody listening
//! there talks to somebody else: a CI run of share_fair_waits.rs had every lease claim of the
//! run unanswered so. Here a port comes from below the kernel's ephemeral range
//! (`ip_local_port_range`), where the kernel picks none (above it where there is no room
//! below), and is held for the whole test process by an advisory lock on a file named after it
//! (shared by every test process of the user), so no two test processes, and no two calls in
//! one, take the same one; and a started process must itself hold the listening socket of its
//! port.

use std::fs::File;
use std::net::TcpListener;
use std::path::PathBuf;
use std::process::Child;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How many ports below the ephemeral range are used.
const SPAN: u16 = 10_000;

/// The lock files of the ports this process holds, until it exits.
static HELD: Mutex<Vec<File>> = Mutex::new(Vec::new());

/// A loopback port nobody listens on (on any address), beside the kernel's ephemeral range
/// ([`ports_beside`]), held by no other test process (nor given twice in this one).
pub fn take() -> u16 {
    let (low, high) = range();
    let dir = std::env::temp_dir().join(format!("wasm-ratelimit-ports-{}", user()));
    std::fs::create_dir_all(&dir).unwrap();
    let span = u32::from(high - low);
    // Start somewhere else in each process, so that processes rarely contend.
    let start = std::process::id().wrapping_mul(2_654_435_761) % span;
    for i in 0..span {
        let port = low + ((start + i) % span) as u16;
        let lock = File::create(dir.join(port.to_string())).unwrap();
        if lock.try_lock().is_err() {
            continue;
        }
        // Nothing listens there (read, not tried: a listener of this process's, however brief,
        // is copied into any child another thread forks at that moment, and stays until that
        // child's exec, holding the port the test is about to give its own process).
        if !listening_inodes(port).is_empty() {
            continue;
        }
        HELD.lock().unwrap().push(lock);
        return port;
    }
    panic!("no free port in {low}..{high}");
}

/// The ports to take from, the kernel's ephemeral range as this machine sets it.
pub fn range() -> (u16, u16) {
    let text = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range");
    let mut bounds = text.iter().flat_map(|t| t.split_whitespace());
    let mut next = || bounds.next().and_then(|b| b.parse::<u16>().ok());
    let ephemeral = match (next(), next()) {
        (Some(low), Some(high)) if low <= high => (low, high),
        _ => (32_768, 60_999),
    };
    ports_beside(ephemeral)
}

/// The ports to take from (the first, and the end, not taken) beside the ephemeral range
/// `(low, high)` (both taken by the kernel): up to [`SPAN`] below it, else above it; where
/// neither leaves 1,000 ports, the ephemeral range itself (the locks still keep the test
/// processes apart, but the kernel may give another process a port between its check and the
/// start of the process meant for it).
fn ports_beside((low, high): (u16, u16)) -> (u16, u16) {
    if low >= 1024 + 1000 {
        (low.saturating_sub(SPAN).max(1024), low)
    } else if high <= u16::MAX - 1000 {
        (high + 1, high.saturating_add(1).saturating_add(SPAN))
    } else {
        (low.max(1024), high)
    }
}

fn user() -> String {
    std::env::var("USER").unwrap_or_else(|_| "user".into())
}

/// Waits (≤ 10 s) until `child` itself listens on 127.0.0.1:`port` (a listening socket of the
/// port among its open files); panics, naming `what`, if it exits first or something else holds
/// the port.
pub fn wait_listening(child: &mut Child, port: u16, what: &str) {
    if let Err(e) = listens(child, port, what) {
        panic!("{e}");
    }
}

/// [`wait_listening`], saying what went wrong.
pub fn listens(child: &mut Child, port: u16, what: &str) -> Result<(), String> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let inodes = listening_inodes(port);
        if let Some(status) = child.try_wait().unwrap() {
            let there = if inodes.is_empty() {
                "nobody"
            } else {
                "another process"
            };
            return Err(format!(
                "{what} exited ({status}) before listening on {port}; listening there now: {there}"
            ));
        }
        if !inodes.is_empty() && owns_any(child.id(), &inodes) {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(format!(
                "{what} does not listen on {port} after 10 s (another process does: {})",
                !inodes.is_empty()
            ));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The inodes of the listening TCP sockets on `port` (IPv4 and IPv6, any address).
fn listening_inodes(port: u16) -> Vec<String> {
    let want = format!(":{port:04X}");
    let mut inodes = Vec::new();
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        let Ok(text) = std::fs::read_to_string(table) else {
            continue;
        };
        for line in text.lines().skip(1) {
            let fields: Vec<&str> = line.split_whitespace().collect();
            // sl local rem st tx:rx tr:when retrnsmt uid timeout inode
            if fields.len() > 9 && fields[1].ends_with(&want) && fields[3] == "0A" {
                inodes.push(fields[9].to_string());
            }
        }
    }
    inodes
}

/// Whether process `pid` has one of the sockets `inodes` open.
fn owns_any(pid: u32, inodes: &[String]) -> bool {
    let Ok(fds) = std::fs::read_dir(PathBuf::from(format!("/proc/{pid}/fd"))) else {
        return false;
    };
    fds.flatten().any(|fd| {
        std::fs::read_link(fd.path()).is_ok_and(|target| {
            let t = target.to_string_lossy();
            inodes.iter().any(|i| t == format!("socket:[{i}]"))
        })
    })
}

// What takes sockets and processes is tested once, in services.rs, not in every test binary
// that compiles this module.
#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ports_are_taken_beside_the_ephemeral_range() {
        assert_eq!(ports_beside((32_768, 60_999)), (22_768, 32_768));
        assert_eq!(ports_beside((5_000, 60_999)), (1_024, 5_000));
        assert_eq!(ports_beside((1_024, 60_999)), (61_000, 65_535));
        assert_eq!(ports_beside((1_024, 65_000)), (1_024, 65_000));
    }
}
