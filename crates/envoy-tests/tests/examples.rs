//! Every example in examples/ runs in a real Envoy, and its README's curl session is replayed:
//! each command's output must be what the README says. The few curl forms the READMEs use are
//! interpreted here (no curl needed): `-s`, `-o /dev/null`, `-w` with `%{http_code}` and
//! `%header{NAME}`, `-H`, `-X`, `-d` (a POST body, inline), `--interface`;
//! `for i in $(seq N); do …; done`; and
//! `seq N | xargs -P N -I{} … | sort | uniq -c`; and `cargo run -q --bin ratelimit-config -- …`
//! (the CLI, run from the repository root).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod common;

use common::llm::LlmClient;
use common::{sessions, words, Client, Envoy, Response};
use std::net::SocketAddr;
use std::path::PathBuf;

/// Runs one `curl` invocation against `addr` (the README says localhost:10000).
fn curl(args: &[String], addr: SocketAddr) -> String {
    assert_eq!(args[0], "curl", "{args:?}");
    let (mut method, mut format, mut source, mut url, mut discard) =
        (None, None, None, None, false);
    let mut data: Option<String> = None;
    let mut headers: Vec<(String, String)> = Vec::new();
    let mut i = 1;
    while i < args.len() {
        match args[i].as_str() {
            "-s" => {}
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
                method = if args[i + 1] == "POST" {
                    Some("POST")
                } else {
                    panic!("{args:?}")
                };
                i += 1;
            }
            "-d" => {
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
    let path = url
        .trim_start_matches("http://")
        .strip_prefix("localhost:10000")
        .unwrap_or_else(|| panic!("URL {url} is not localhost:10000"));
    // As curl: -d makes a POST, its body form-encoded unless the command names a type.
    let method = method.unwrap_or(if data.is_some() { "POST" } else { "GET" });
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
                .send(method, path, &h, body.as_bytes(), None)
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
            .send(method, path, &h)
            .unwrap(),
        (None, None) => Client::connect(addr)
            .unwrap()
            .send(method, path, &h)
            .unwrap(),
    };
    let mut out = if discard { String::new() } else { r.body_str() };
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

/// Runs one README command line; returns what it prints.
fn run(line: &str, addr: SocketAddr) -> String {
    if let Some(out) = common::cli_line(line) {
        return out;
    }
    if let Some(rest) = line.strip_prefix("for i in $(seq ") {
        let (n, rest) = rest.split_once("); do ").unwrap();
        let cmd = rest.strip_suffix("; done").unwrap();
        let n: usize = n.parse().unwrap();
        return (0..n).map(|_| curl(&words(cmd), addr)).collect();
    }
    if let Some(rest) = line.strip_prefix("seq ") {
        // seq N | xargs -P N -I{} CMD | sort | uniq -c
        let parts: Vec<&str> = rest.split(" | ").collect();
        assert_eq!(&parts[2..], ["sort", "uniq -c"], "{line}");
        let n: usize = parts[0].parse().unwrap();
        let cmd = parts[1].split_once("-I{} ").unwrap().1.to_string();
        let threads: Vec<_> = (0..n)
            .map(|_| {
                let cmd = cmd.clone();
                std::thread::spawn(move || curl(&words(&cmd), addr))
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
    curl(&words(line), addr)
}

fn examples() -> Vec<PathBuf> {
    let dir = common::root().join("examples");
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_dir())
        .collect();
    dirs.sort();
    dirs
}

#[test]
fn every_example_does_what_its_readme_says() {
    let dirs = examples();
    assert!(dirs.len() >= 7, "{dirs:?}");
    for dir in dirs {
        // The example as written, on free ports, its stand-in backend on a free one too.
        let (yaml, _services) = common::example(&dir);
        let envoy = Envoy::start_yaml(&common::for_build(&yaml));
        let readme = std::fs::read_to_string(dir.join("README.md")).unwrap();
        let steps = sessions(&readme);
        assert!(!steps.is_empty(), "{}: no console session", dir.display());
        for (cmd, expected) in steps {
            let got = run(&cmd, envoy.addr);
            assert_eq!(got, expected, "{}: $ {cmd}", dir.display());
        }
    }
}
