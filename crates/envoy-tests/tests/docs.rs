//! The documentation works as written: README.md, every page of the book (docs/src/**/*.md)
//! and every example's README, with their `{{#include}}`s expanded.
//!
//! - Every ```` ```console ```` block is a session, replayed as the marker on the line before
//!   its fence says (`<!-- replay: KIND ARGS -->`); a console block without one fails:
//!   - `demo` — the demo of `make run` (`envoy.yaml`) or `make run-native`
//!     (`envoy-native.yaml`), whichever build is under test, on free ports: `localhost:10000`
//!     is its listener, `localhost:9901` its admin port, `envoy.log` its log (`grep`);
//!   - `demo wasm`, `demo native` — the same, replayed only in that build;
//!   - `demo ... operator` — the demo with the operator route's block added to its
//!     configuration ([`OPERATOR`]: prefix `/.ratelimit/`, loopback only, a fixed token);
//!   - `demo ... seed` — the demo with `"key_seed": "000102030405060708090a0b0c0d0e0f"` added
//!     to its configuration unless it has a `key_seed`, so the keys it logs are fixed;
//!   - `example NAME` — `examples/NAME/envoy.yaml`, as written, on free ports (with its rate
//!     limit service when it has a `limits.json`);
//!   - `cli` — `cargo run -q --bin ratelimit-config -- ...` lines alone (no Envoy).
//!
//! Consecutive console blocks of one page with the same marker share one Envoy (a session
//! may go on after some prose: four requests, then a refused one); a block with another
//! marker in between (`cli` blocks aside: they touch no Envoy) ends it, and the next block
//! starts a fresh Envoy. The commands and how the output is compared: `common::replay`.
//!
//! - Every ```` ```json ```` block with `"rules"` is a valid configuration; every
//!   ```` ```yaml ```` block parses; the Envoy filter snippet (a ```` ```yaml ```` block that
//!   starts with `http_filters:`) runs in a real Envoy as written, wherever it is.
//! - The sizes of the `.wasm` and of the native module that the performance pages quote are
//!   those of the files built, within 5 %.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod common;

use common::pages::{self, Block};
use common::replay::{output_matches, Shell};
use common::{wasm_path, Build, Client, Envoy, Proc};
use ratelimit_config::manifest::yaml_documents;
use ratelimit_core::config::Config;
use std::collections::BTreeMap;

/// The operator block `demo ... operator` adds to the demo's configuration.
pub const OPERATOR: &str = r#""operator": {"path_prefix": "/.ratelimit/", "allow_from": ["127.0.0.1/32", "::1/128"], "token": "9c1f0e7a5b3d8f2e6a4c1b7d9e0f3a5c8b2d4e6f1a3c5e7b9d0f2a4c6e8b1d3f"}, "rules": ["#;

/// The seed `demo ... seed` gives the demo's configuration, unless it has one: keys hash as
/// `ratelimit-config explain --seed 000102030405060708090a0b0c0d0e0f` hashes them.
pub const SEED: &str = r#""key_seed": "000102030405060708090a0b0c0d0e0f", "rules": ["#;

/// How a console block is replayed.
#[derive(Debug, Clone, PartialEq)]
enum Kind {
    Demo {
        only: Option<Build>,
        operator: bool,
        seed: bool,
    },
    Example(String),
    Cli,
}

impl Kind {
    fn parse(marker: &str) -> Result<Kind, String> {
        let w: Vec<&str> = marker.split_whitespace().collect();
        match w.as_slice() {
            ["cli"] => Ok(Kind::Cli),
            ["example", name] => {
                if common::root()
                    .join("examples")
                    .join(name)
                    .join("envoy.yaml")
                    .is_file()
                {
                    Ok(Kind::Example(name.to_string()))
                } else {
                    Err(format!("no examples/{name}/envoy.yaml"))
                }
            }
            ["demo", rest @ ..] => {
                let (mut only, mut operator, mut seed) = (None, false, false);
                for word in rest {
                    match *word {
                        "wasm" if only.is_none() => only = Some(Build::Wasm),
                        "native" if only.is_none() => only = Some(Build::Native),
                        "operator" if !operator => operator = true,
                        "seed" if !seed => seed = true,
                        other => return Err(format!("demo: unknown word {other:?}")),
                    }
                }
                Ok(Kind::Demo {
                    only,
                    operator,
                    seed,
                })
            }
            _ => Err(format!(
                "unknown kind {marker:?} (demo [wasm|native] [operator] [seed], example NAME, cli)"
            )),
        }
    }

    /// The name counts are kept under.
    fn label(&self) -> String {
        match self {
            Kind::Demo {
                only,
                operator,
                seed,
            } => {
                let mut s = "demo".to_string();
                match only {
                    Some(Build::Wasm) => s.push_str(" wasm"),
                    Some(Build::Native) => s.push_str(" native"),
                    None => {}
                }
                if *operator {
                    s.push_str(" operator");
                }
                if *seed {
                    s.push_str(" seed");
                }
                s
            }
            Kind::Example(_) => "example".into(),
            Kind::Cli => "cli".into(),
        }
    }

    fn replayed_in(&self, build: Build) -> bool {
        match self {
            Kind::Demo { only, .. } => only.is_none_or(|b| b == build),
            _ => true,
        }
    }
}

/// Every page's blocks.
fn all_blocks() -> Vec<Block> {
    pages::all().iter().flat_map(|p| p.blocks()).collect()
}

#[test]
fn every_console_block_has_a_marker() {
    let mut errors = Vec::new();
    let mut n = 0;
    for b in all_blocks().into_iter().filter(|b| b.lang == "console") {
        n += 1;
        match &b.marker {
            None => errors.push(format!(
                "{}: a console block without a marker (<!-- replay: KIND --> on the line before)",
                b.at
            )),
            Some(m) => {
                if let Err(e) = Kind::parse(m) {
                    errors.push(format!("{}: {e}", b.at));
                } else if pages::commands(&b.text).is_empty() {
                    errors.push(format!("{}: a console block without a `$ ` command", b.at));
                }
            }
        }
    }
    println!("{n} console blocks");
    assert!(errors.is_empty(), "\n{}", errors.join("\n"));
}

/// The environment one or more consecutive blocks replay in.
struct Env {
    _envoy: Option<Envoy>,
    _services: Vec<Proc>,
    shell: Shell,
}

fn demo_env(operator: bool, seed: bool) -> Env {
    // `make run` serves envoy.yaml, `make run-native` envoy-native.yaml: the same demo.
    let demo = match common::build() {
        Build::Wasm => "envoy.yaml",
        Build::Native => "envoy-native.yaml",
    };
    let mut yaml = std::fs::read_to_string(common::root().join(demo))
        .unwrap()
        .replace("port_value: 10000", "port_value: 0")
        .replace("port_value: 9901", "port_value: 0")
        .replace(
            "target/wasm32-wasip1/release/wasm_ratelimit.wasm",
            &wasm_path().display().to_string(),
        );
    if operator {
        assert!(yaml.contains("\"rules\": ["), "{demo}: no \"rules\": [");
        yaml = yaml.replacen("\"rules\": [", OPERATOR, 1);
    }
    if seed && !yaml.contains("\"key_seed\"") {
        yaml = yaml.replacen("\"rules\": [", SEED, 1);
    }
    envoy_env(&yaml, Vec::new())
}

fn envoy_env(yaml: &str, services: Vec<Proc>) -> Env {
    // The log flushed every 100 ms, for `grep ... envoy.log`.
    let envoy = Envoy::start_yaml_args(yaml, &["--file-flush-interval-msec", "100"]);
    let shell = Shell::new(Some(envoy.addr), Some(envoy.admin), Some(envoy.log.clone()));
    Env {
        _envoy: Some(envoy),
        _services: services,
        shell,
    }
}

fn env_for(kind: &Kind) -> Env {
    match kind {
        Kind::Demo { operator, seed, .. } => demo_env(*operator, *seed),
        Kind::Example(name) => {
            let (yaml, services) = common::example(&common::root().join("examples").join(name));
            envoy_env(&common::for_build(&yaml), services)
        }
        Kind::Cli => unreachable!("a cli session needs no Envoy"),
    }
}

#[derive(Default)]
struct Count {
    sessions: usize,
    commands: usize,
    skipped: usize,
}

#[test]
fn every_console_session_replays() {
    let build = common::build();
    let mut failures = Vec::new();
    let mut by_kind: BTreeMap<String, Count> = BTreeMap::new();
    let mut by_file: BTreeMap<String, Count> = BTreeMap::new();
    for page in pages::all() {
        let mut env: Option<(String, Env)> = None;
        for b in page.blocks().into_iter().filter(|b| b.lang == "console") {
            // An unmarked or unknown block fails every_console_block_has_a_marker.
            let Some(marker) = b.marker.clone() else {
                env = None;
                continue;
            };
            let Ok(kind) = Kind::parse(&marker) else {
                env = None;
                continue;
            };
            let (k, f) = (
                by_kind.entry(kind.label()).or_default(),
                by_file.entry(page.path.clone()).or_default(),
            );
            if !kind.replayed_in(build) {
                k.skipped += 1;
                f.skipped += 1;
                env = None;
                continue;
            }
            let mut cli = Shell::cli();
            let shell = if kind == Kind::Cli {
                // No Envoy: a session of the CLI leaves the page's Envoy session running.
                &mut cli
            } else {
                if env.as_ref().is_none_or(|(m, _)| *m != marker) {
                    drop(env.take()); // stop the previous Envoy first
                    env = Some((marker.clone(), env_for(&kind)));
                }
                &mut env.as_mut().unwrap().1.shell
            };
            let steps = pages::commands(&b.text);
            k.sessions += 1;
            f.sessions += 1;
            for (cmd, expected) in steps {
                k.commands += 1;
                f.commands += 1;
                let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    shell.run(&cmd, &expected)
                }));
                let got = match run {
                    Ok(got) => got,
                    Err(e) => {
                        let why = e
                            .downcast_ref::<String>()
                            .cloned()
                            .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()))
                            .unwrap_or_default();
                        failures.push(format!("{} ({marker}): $ {cmd}\n--- failed: {why}", b.at));
                        break;
                    }
                };
                if !output_matches(&expected, &got) {
                    failures.push(format!(
                        "{} ({marker}): $ {cmd}\n--- the page shows:\n{expected}--- it printed:\n{got}",
                        b.at
                    ));
                }
            }
        }
    }
    println!("replayed ({build:?} build), by kind: sessions, commands (skipped: sessions of the other build)");
    for (k, c) in &by_kind {
        println!(
            "  {k:<24} {:>3} {:>4}  (skipped {})",
            c.sessions, c.commands, c.skipped
        );
    }
    println!("by file:");
    for (p, c) in &by_file {
        println!(
            "  {p:<48} {:>3} {:>4}  (skipped {})",
            c.sessions, c.commands, c.skipped
        );
    }
    for (k, c) in &by_kind {
        assert!(
            c.sessions == 0 || c.commands > 0,
            "{k}: {} sessions, no command replayed",
            c.sessions
        );
    }
    let total: usize = by_kind.values().map(|c| c.commands).sum();
    let eligible: usize = by_kind.values().map(|c| c.sessions).sum();
    assert!(eligible == 0 || total > 0, "nothing replayed");
    assert!(failures.is_empty(), "\n{}", failures.join("\n\n"));
}

/// The page that quotes the builds' sizes, and how far a built file may be from its figure.
const SIZES_PAGE: &str = "docs/src/performance/cost.md";
const SIZE_TOLERANCE: f64 = 0.05;

#[test]
fn the_build_sizes_the_book_quotes_are_the_files_built() {
    let page = std::fs::read_to_string(common::root().join(SIZES_PAGE)).unwrap();
    // Rows `| `target/…/FILE` | BYTES | … |`: the file, by its name, and its size in bytes.
    let quoted: BTreeMap<String, u64> = page
        .lines()
        .filter_map(|l| {
            let cells: Vec<&str> = l.split('|').map(str::trim).collect();
            let file = cells.get(1)?.strip_prefix("`target/")?.strip_suffix('`')?;
            let name = file.rsplit('/').next()?.to_string();
            let bytes = cells.get(2)?.replace(',', "").parse().ok()?;
            Some((name, bytes))
        })
        .collect();
    let files = [
        ("wasm_ratelimit.wasm", wasm_path(), Build::Wasm),
        (
            "libwasm_ratelimit.so",
            common::native_dir().join("libwasm_ratelimit.so"),
            Build::Native,
        ),
    ];
    for (name, path, build) in files {
        let want = *quoted
            .get(name)
            .unwrap_or_else(|| panic!("{SIZES_PAGE} quotes no size for {name}"));
        // The build under test must be there; the other is checked when it was built too.
        let Ok(meta) = std::fs::metadata(&path) else {
            assert!(build != common::build(), "{} is not built", path.display());
            continue;
        };
        let got = meta.len();
        let diff = got as f64 / want as f64 - 1.0;
        let off = diff.abs();
        println!(
            "{name}: {got} bytes, the page says {want} ({:+.1} %)",
            diff * 100.0
        );
        assert!(
            off <= SIZE_TOLERANCE,
            "{}: {got} bytes, {SIZES_PAGE} says {want}: more than {} % off; update the page",
            path.display(),
            SIZE_TOLERANCE * 100.0
        );
    }
}

#[test]
fn every_json_configuration_is_valid() {
    let mut n = 0;
    for b in all_blocks() {
        if b.lang == "json" && b.text.contains("\"rules\"") {
            if let Err(e) = Config::parse(b.text.as_bytes()) {
                panic!("{}: {e}\n{}", b.at, b.text);
            }
            n += 1;
        }
    }
    println!("{n} configurations");
    assert!(n >= 1, "{n} configurations");
}

#[test]
fn every_yaml_block_parses() {
    let mut n = 0;
    for b in all_blocks() {
        if b.lang == "yaml" {
            yaml_documents(&b.text).unwrap_or_else(|e| panic!("{}: {e}\n{}", b.at, b.text));
            n += 1;
        }
    }
    println!("{n} yaml blocks");
}

#[test]
fn the_envoy_snippet_runs_as_written() {
    // Deploy shows one snippet per build: a yaml block that starts with `http_filters:`.
    let filter = match common::build() {
        Build::Wasm => "envoy.filters.http.wasm",
        Build::Native => "envoy.filters.http.dynamic_modules",
    };
    let snippets: Vec<Block> = all_blocks()
        .into_iter()
        .filter(|b| {
            b.lang == "yaml" && b.text.starts_with("http_filters:\n") && b.text.contains(filter)
        })
        .collect();
    assert!(
        !snippets.is_empty(),
        "no yaml block starting with `http_filters:` with {filter} in any page"
    );
    for b in snippets {
        println!("{}", b.at);
        run_snippet(&b, filter);
    }
}

fn run_snippet(b: &Block, filter: &str) {
    let doc = yaml_documents(&b.text).unwrap().remove(0);
    let entry = doc["http_filters"]
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["name"] == filter)
        .unwrap();
    let tc = &entry["typed_config"];
    let (plugin, config) = match common::build() {
        Build::Wasm => (
            &tc["config"]["name"],
            &tc["config"]["configuration"]["value"],
        ),
        Build::Native => (&tc["filter_name"], &tc["filter_config"]["value"]),
    };
    let (plugin, config) = (plugin.as_str().unwrap(), config.as_str().unwrap());
    let rule = serde_json::from_str::<serde_json::Value>(config).unwrap()["rules"][0]["name"]
        .as_str()
        .unwrap()
        .to_string();
    // Put the snippet under an HTTP connection manager, pointing at the built module.
    let filters: String = b
        .text
        .replace(
            "/etc/envoy/wasm_ratelimit.wasm",
            &wasm_path().display().to_string(),
        )
        .lines()
        .skip(1)
        .map(|l| format!("          {l}\n"))
        .collect();
    let full = common::bootstrap("{}", &wasm_path());
    let start = full.find("          http_filters:").unwrap();
    let yaml = format!("{}          http_filters:\n{filters}", &full[..start]);
    let envoy = Envoy::start_yaml(&yaml);
    let mut c = Client::connect(envoy.addr).unwrap();
    let r = c.get("/").unwrap();
    assert_eq!(r.status, 200, "{}", b.at);
    let policy = r.header("ratelimit-policy").unwrap_or_default();
    assert!(
        policy.starts_with(&format!("\"{rule}\";")),
        "{}: {policy}",
        b.at
    );
    assert_eq!(
        envoy.wait_stat(&common::metric_of(plugin, Some(&rule), "allowed"), 1),
        Some(1),
        "{}",
        b.at
    );
}
