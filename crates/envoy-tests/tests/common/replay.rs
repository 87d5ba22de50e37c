//! Replays the documentation's console sessions: a small interpreter of the shell lines the
//! pages show (no shell, no curl needed), and the comparison of what they print with what the
//! page shows.
//!
//! Lines understood:
//! - `curl` with `-s`, `-i`, `-o /dev/null`, `-w` (`%{http_code}`, `%header{NAME}`, `\n`),
//!   `-H`, `-X`, `-d` (an inline body: a POST), `--interface ADDR`; URLs on `localhost:10000`
//!   (the listener) or `localhost:9901` (the admin port), with or without `http://`;
//! - `for i in $(seq N); do CMD; done` and `for i in 1 2 3; do CMD; done`;
//! - `seq N | xargs -P N -I{} CMD | sort | uniq -c` (N requests at once);
//! - `NAME=VALUE` (no output), then `$NAME` / `${NAME}` in later lines;
//! - `grep PATTERN envoy.log` (Envoy's log; waits up to 15 s for as many lines as the page shows);
//! - `cargo run -q --bin ratelimit-config -- ARGS` (the built CLI, from the repository root).
//!
//! Expected output: compared line by line; `…` in a line stands for any text within that line;
//! a line that is `…` alone stands for any number of lines. In a response shown with `curl -i`
//! the value of a header that depends on the clock ([`TIMED`]) is only checked to be there.
use super::llm::LlmClient;
use super::{cli_line, words, Client, Response};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// Header lines whose values depend on the clock: in a `curl -i` response, checked for
/// presence only.
pub const TIMED: [&str; 6] = [
    "date",
    "ratelimit",
    "x-ratelimit-reset",
    "retry-after",
    "x-ratelimit-retry-after",
    "content-length",
];

/// Where a session's commands go.
pub struct Shell {
    /// `localhost:10000`.
    pub addr: Option<SocketAddr>,
    /// `localhost:9901`.
    pub admin: Option<SocketAddr>,
    /// `envoy.log`.
    pub log: Option<PathBuf>,
    vars: HashMap<String, String>,
}

impl Shell {
    pub fn new(addr: Option<SocketAddr>, admin: Option<SocketAddr>, log: Option<PathBuf>) -> Shell {
        Shell {
            addr,
            admin,
            log,
            vars: HashMap::new(),
        }
    }

    /// A shell for the CLI alone.
    pub fn cli() -> Shell {
        Shell::new(None, None, None)
    }

    /// Runs one command line; returns what it prints. `expected` (what the page shows) tells
    /// `grep` how many lines to wait for.
    pub fn run(&mut self, line: &str, expected: &str) -> String {
        let line = self.expand(line);
        if let Some((name, value)) = assignment(&line) {
            let value = words(value).concat();
            self.vars.insert(name.to_string(), value);
            return String::new();
        }
        if let Some(out) = cli_line(&line) {
            return out;
        }
        if let Some(rest) = line.strip_prefix("grep ") {
            return self.grep(rest, expected);
        }
        if let Some(rest) = line.strip_prefix("for i in ") {
            let (list, rest) = rest.split_once("; do ").expect("for ... ; do");
            let cmd = rest.strip_suffix("; done").expect("; done");
            let n = match list.strip_prefix("$(seq ") {
                Some(n) => n.strip_suffix(')').unwrap().parse().unwrap(),
                None => list.split_whitespace().count(),
            };
            return (0..n).map(|_| self.curl(&words(cmd))).collect();
        }
        if let Some(rest) = line.strip_prefix("seq ") {
            // seq N | xargs -P N -I{} CMD | sort | uniq -c
            let parts: Vec<&str> = rest.split(" | ").collect();
            assert_eq!(&parts[2..], ["sort", "uniq -c"], "{line}");
            let n: usize = parts[0].parse().unwrap();
            let cmd = parts[1].split_once("-I{} ").unwrap().1.to_string();
            let targets = (self.addr, self.admin);
            let threads: Vec<_> = (0..n)
                .map(|_| {
                    let cmd = cmd.clone();
                    std::thread::spawn(move || curl(&words(&cmd), targets))
                })
                .collect();
            let mut lines: Vec<String> = threads
                .into_iter()
                .flat_map(|t| {
                    t.join()
                        .unwrap()
                        .lines()
                        .map(str::to_string)
                        .collect::<Vec<_>>()
                })
                .collect();
            lines.sort();
            let mut out = String::new();
            let mut i = 0;
            while i < lines.len() {
                let same = lines[i..].iter().take_while(|l| **l == lines[i]).count();
                out.push_str(&format!("{same:>7} {}\n", lines[i]));
                i += same;
            }
            return out;
        }
        self.curl(&words(&line))
    }

    fn curl(&self, args: &[String]) -> String {
        curl(args, (self.addr, self.admin))
    }

    /// `$NAME` and `${NAME}` of the variables set so far.
    fn expand(&self, line: &str) -> String {
        let mut out = line.to_string();
        for (k, v) in &self.vars {
            out = out
                .replace(&format!("${{{k}}}"), v)
                .replace(&format!("${k}"), v);
        }
        out
    }

    /// `grep PATTERN envoy.log`: the log's lines holding PATTERN (a fixed string), once there
    /// are as many as `expected` has (Envoy writes its log lazily), or after 15 s.
    fn grep(&self, args: &str, expected: &str) -> String {
        let w = words(args);
        assert_eq!(w.len(), 2, "grep PATTERN envoy.log: {args}");
        assert_eq!(w[1], "envoy.log", "grep reads envoy.log only: {args}");
        let log = self.log.as_ref().expect("no Envoy log in this session");
        let want = expected.lines().count();
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            let text = std::fs::read_to_string(log).unwrap_or_default();
            let found: Vec<&str> = text.lines().filter(|l| l.contains(&w[0])).collect();
            if found.len() >= want || Instant::now() > deadline {
                return found.iter().map(|l| format!("{l}\n")).collect();
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

fn assignment(line: &str) -> Option<(&str, &str)> {
    let (name, value) = line.split_once('=')?;
    let ok = !name.is_empty()
        && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
        && !name.starts_with(|c: char| c.is_ascii_digit());
    ok.then_some((name, value))
}

/// The reason phrase curl shows for a status.
fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        201 => "Created",
        204 => "No Content",
        400 => "Bad Request",
        401 => "Unauthorized",
        403 => "Forbidden",
        404 => "Not Found",
        405 => "Method Not Allowed",
        413 => "Payload Too Large",
        429 => "Too Many Requests",
        500 => "Internal Server Error",
        502 => "Bad Gateway",
        503 => "Service Unavailable",
        504 => "Gateway Timeout",
        _ => "",
    }
}

/// Runs one `curl` invocation; `targets`: the listener (`localhost:10000`) and the admin port
/// (`localhost:9901`).
pub fn curl(args: &[String], targets: (Option<SocketAddr>, Option<SocketAddr>)) -> String {
    assert_eq!(args[0], "curl", "{args:?}");
    let (mut method, mut format, mut source, mut url, mut discard, mut include) =
        (None, None, None, None, false, false);
    let mut data: Option<String> = None;
    let mut headers: Vec<(String, String)> = Vec::new();
    let mut i = 1;
    while i < args.len() {
        match args[i].as_str() {
            "-s" | "-sS" => {}
            "-i" | "-si" | "-is" => include = true,
            "-o" => {
                assert_eq!(args[i + 1], "/dev/null");
                discard = true;
                i += 1;
            }
            "-w" => {
                format = Some(args[i + 1].clone());
                i += 1;
            }
            "-X" => {
                method = Some(args[i + 1].clone());
                i += 1;
            }
            "-d" | "--data" => {
                assert!(!args[i + 1].starts_with('@'), "-d @FILE: {args:?}");
                data = Some(args[i + 1].clone());
                i += 1;
            }
            "-H" => {
                let (k, v) = args[i + 1].split_once(':').unwrap();
                headers.push((k.trim().to_ascii_lowercase(), v.trim().to_string()));
                i += 1;
            }
            "--interface" => {
                source = Some(args[i + 1].clone());
                i += 1;
            }
            other if other.starts_with('-') => panic!("unsupported curl option {other}"),
            other => url = Some(other.to_string()),
        }
        i += 1;
    }
    let url = url.expect("a URL");
    let rest = url.trim_start_matches("http://");
    let (addr, path) = if let Some(p) = rest.strip_prefix("localhost:10000") {
        (targets.0.expect("no listener in this session"), p)
    } else if let Some(p) = rest.strip_prefix("localhost:9901") {
        (targets.1.expect("no admin port in this session"), p)
    } else {
        panic!("URL {url} is neither localhost:10000 nor localhost:9901")
    };
    let path = if path.is_empty() { "/" } else { path };
    // As curl: -d makes a POST, its body form-encoded unless the command names a type.
    let method = method.unwrap_or_else(|| if data.is_some() { "POST" } else { "GET" }.into());
    if data.is_some() && !headers.iter().any(|(k, _)| k == "content-type") {
        headers.push((
            "content-type".into(),
            "application/x-www-form-urlencoded".into(),
        ));
    }
    let h: Vec<(&str, &str)> = headers
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    let r = match (&data, &source) {
        (Some(body), None) => {
            let r = LlmClient::connect(addr)
                .unwrap()
                .send(&method, path, &h, body.as_bytes(), None)
                .unwrap();
            Response {
                status: r.status,
                headers: r.headers,
                body: r.body,
            }
        }
        (Some(_), Some(_)) => panic!("-d with --interface: {args:?}"),
        (None, Some(s)) => Client::connect_from(addr, s)
            .unwrap()
            .send(&method, path, &h)
            .unwrap(),
        (None, None) => Client::connect(addr)
            .unwrap()
            .send(&method, path, &h)
            .unwrap(),
    };
    let mut out = String::new();
    if include {
        out.push_str(&format!("HTTP/1.1 {} {}\n", r.status, reason(r.status)));
        for (k, v) in &r.headers {
            out.push_str(&format!("{k}: {v}\n"));
        }
        out.push('\n');
    }
    if !discard {
        out.push_str(&r.body_str());
    }
    if let Some(f) = format {
        let mut f = f
            .replace("\\n", "\n")
            .replace("%{http_code}", &r.status.to_string());
        while let Some(start) = f.find("%header{") {
            let end = start + f[start..].find('}').unwrap();
            let name = &f[start + 8..end];
            let value = r.header(name).unwrap_or("").to_string();
            f.replace_range(start..=end, &value);
        }
        out.push_str(&f);
    }
    out
}

/// Whether one line of output is what the page shows: equal, or `…` standing for any text.
fn line_matches(want: &str, got: &str) -> bool {
    if !want.contains('…') {
        return want == got;
    }
    let parts: Vec<&str> = want.split('…').collect();
    let (first, last) = (parts[0], parts[parts.len() - 1]);
    if !got.starts_with(first) || got.len() < first.len() + last.len() || !got.ends_with(last) {
        return false;
    }
    let mut rest = &got[first.len()..got.len() - last.len()];
    for p in &parts[1..parts.len() - 1] {
        match rest.find(p) {
            Some(i) => rest = &rest[i + p.len()..],
            None => return false,
        }
    }
    true
}

/// A header line of a `curl -i` response whose value depends on the clock.
fn timed(want: &str, got: &str) -> bool {
    match (want.split_once(": "), got.split_once(": ")) {
        (Some((a, _)), Some((b, _))) => a == b && TIMED.contains(&a),
        _ => false,
    }
}

fn lines_match(want: &[&str], got: &[&str], headers: bool) -> bool {
    match want.first() {
        None => got.is_empty(),
        Some(&"…") => (0..=got.len()).any(|k| lines_match(&want[1..], &got[k..], headers)),
        Some(w) => {
            let Some(g) = got.first() else {
                return false;
            };
            // Headers run up to the first empty line.
            let ok = line_matches(w, g) || (headers && timed(w, g));
            ok && lines_match(&want[1..], &got[1..], headers && !w.is_empty())
        }
    }
}

/// Whether `got` is what the page shows as `want` (see the module's comment).
pub fn output_matches(want: &str, got: &str) -> bool {
    let want: Vec<&str> = want.lines().collect();
    let got: Vec<&str> = got.lines().collect();
    let headers = want.first().is_some_and(|l| l.starts_with("HTTP/"));
    // Trailing empty lines are not told apart.
    let trim = |v: &[&str]| -> usize { v.iter().rposition(|l| !l.is_empty()).map_or(0, |i| i + 1) };
    lines_match(&want[..trim(&want)], &got[..trim(&got)], headers)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ellipses() {
        assert!(line_matches("a…c", "abbbc"));
        assert!(line_matches("…", "anything"));
        assert!(!line_matches("a…c", "abbb"));
        assert!(output_matches("x\n…\n", "x\ny\nz\n"));
        assert!(output_matches("x\n…\nz\n", "x\ny\nw\nz\n"));
        assert!(!output_matches("x\n", "x\ny\n"));
        assert!(output_matches(
            "HTTP/1.1 200 OK\ndate: Thu\nserver: envoy\n\nok\n",
            "HTTP/1.1 200 OK\ndate: Fri\nserver: envoy\n\nok\n"
        ));
        assert!(!output_matches(
            "HTTP/1.1 200 OK\nserver: envoy\n\ndate: Thu\n",
            "HTTP/1.1 200 OK\nserver: envoy\n\ndate: Fri\n"
        ));
    }
}
