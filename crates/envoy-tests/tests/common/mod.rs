//! Test support: a real Envoy with the built filter, and a small HTTP/1.1 client.
//!
//! Envoy binds port 0 for both the listener and admin, writes the admin address to a file, and
//! the listener's port is read back from `/listeners`: no port is guessed, so tests can run in
//! parallel. Every Envoy is killed when its handle drops, and every wait is bounded.
#![allow(
    dead_code,
    unused_imports,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub mod fair;
pub mod http;
pub mod llm;
pub mod pages;
pub mod ports;
pub mod provider;
pub mod replay;
pub mod share;
pub mod upstream;
pub mod waits;

pub use http::{at_once, get, Client, Response};
pub use ratelimit_core::testkit::{fixture_files, fixtures, output, scratch, Rng};

/// The repository's root (examples, README, deploy files, the build's `target/`).
pub fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The `ratelimit-config` CLI: `$RATELIMIT_CONFIG`, else the debug build in this checkout
/// (`make integration` builds it first).
pub fn cli() -> PathBuf {
    match std::env::var("RATELIMIT_CONFIG") {
        Ok(p) => PathBuf::from(p),
        Err(_) => root().join("target/debug/ratelimit-config"),
    }
}

/// Splits a shell command line into words (single and double quotes, no expansion).
pub fn words(line: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut quote = None;
    let mut any = false;
    for c in line.chars() {
        match (quote, c) {
            (Some(q), c) if c == q => quote = None,
            (Some(_), c) => cur.push(c),
            (None, '\'' | '"') => {
                quote = Some(c);
                any = true;
            }
            (None, ' ') => {
                if any || !cur.is_empty() {
                    out.push(std::mem::take(&mut cur));
                }
                any = false;
            }
            (None, c) => cur.push(c),
        }
    }
    if any || !cur.is_empty() {
        out.push(cur);
    }
    out
}

/// Runs a page's `cargo run -q --bin ratelimit-config -- ARGS` line with the built CLI, from
/// the repository root: what it prints (`None` for any other line).
pub fn cli_line(line: &str) -> Option<String> {
    let args = line.strip_prefix("cargo run -q --bin ratelimit-config -- ")?;
    let (_, stdout, _) = output(Command::new(cli()).current_dir(root()).args(words(args)));
    Some(stdout)
}

/// A number (a run's seconds, a count of clients) from the variable `var`, else `default`.
pub fn env_number<T: std::str::FromStr>(var: &str, default: T) -> T {
    std::env::var(var)
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
}

/// The Python with the LLM SDKs: `$SDK_PYTHON`, else the checkout's `.venv` (`make sdks`).
pub fn python() -> PathBuf {
    std::env::var_os("SDK_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| root().join(".venv/bin/python"))
}

/// The Envoy binary: `$ENVOY`, else `envoy` on the PATH.
pub fn envoy_bin() -> String {
    std::env::var("ENVOY").unwrap_or_else(|_| "envoy".into())
}

/// Which build of the filter the tests drive: `FILTER=native` for the Envoy dynamic module,
/// anything else (or nothing) for the wasm build. `make integration` runs every test under both.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Build {
    Wasm,
    Native,
}

/// The build under test.
pub fn build() -> Build {
    match std::env::var("FILTER").as_deref() {
        Ok("native") => Build::Native,
        _ => Build::Wasm,
    }
}

/// The folder holding `libwasm_ratelimit.so`: `$NATIVE_DIR`, else `make build-native`'s.
pub fn native_dir() -> PathBuf {
    match std::env::var("NATIVE_DIR") {
        Ok(p) => PathBuf::from(p),
        Err(_) => root().join("target/native"),
    }
}

/// A metric's name in `/stats`, for plugin `test`: the wasm build's flat name, or the dynamic
/// module's labelled one. `rule`: `None` for a plugin-wide gauge.
pub fn metric(rule: Option<&str>, name: &str) -> String {
    metric_of("test", rule, name)
}

/// A metric's name in `/stats` for any plugin.
pub fn metric_of(plugin: &str, rule: Option<&str>, name: &str) -> String {
    match (build(), rule) {
        (Build::Wasm, Some(r)) => {
            format!("wasmcustom.wasm_ratelimit.plugin=.={plugin};.;rule=.={r};.;{name}")
        }
        (Build::Wasm, None) => format!("wasmcustom.wasm_ratelimit.plugin=.={plugin};.;{name}"),
        (Build::Native, Some(r)) => {
            format!("dynamicmodulescustom.wasm_ratelimit.{name}.plugin.{plugin}.rule.{r}")
        }
        (Build::Native, None) => {
            format!("dynamicmodulescustom.wasm_ratelimit.{name}.plugin.{plugin}")
        }
    }
}

/// A metric's series in `/stats/prometheus` (name and labels, without the value), for plugin
/// `test`, with the `stats_tags` of [`STATS_TAGS`] in the bootstrap.
pub fn prometheus(rule: Option<&str>, name: &str) -> String {
    match (build(), rule) {
        (Build::Wasm, Some(r)) => format!("wasm_ratelimit_{name}{{plugin=\"test\",rule=\"{r}\"}}"),
        (Build::Wasm, None) => format!("wasm_ratelimit_{name}{{plugin=\"test\"}}"),
        (Build::Native, Some(r)) => format!(
            "envoy_dynamicmodulescustom_wasm_ratelimit_{name}{{plugin=\"test\",rule=\"{r}\"}}"
        ),
        (Build::Native, None) => {
            format!("envoy_dynamicmodulescustom_wasm_ratelimit_{name}{{plugin=\"test\"}}")
        }
    }
}

/// The `stats_config` the README tells wasm users to add: Envoy extracts the plugin and the
/// rule from the filter's metric names as Prometheus labels.
pub const STATS_TAGS: &str = r#"stats_config:
  stats_tags:
  - tag_name: plugin
    regex: '(plugin=\.=(.*?);\.;)'
  - tag_name: rule
    regex: '(rule=\.=(.*?);\.;)'
"#;

/// The filter: `$WASM`, else the release build in this checkout.
pub fn wasm_path() -> PathBuf {
    match std::env::var("WASM") {
        Ok(p) => PathBuf::from(p),
        Err(_) => root().join("target/wasm32-wasip1/release/wasm_ratelimit.wasm"),
    }
}

/// A loopback port nobody listens on, for a process the test starts: held by this test process
/// alone, and never one the kernel gives another process's listener or connection
/// ([`ports`]).
pub fn free_port() -> u16 {
    ports::take()
}

/// Indents every line of `text` by `n` spaces (to embed JSON in YAML as a block scalar).
fn indent(text: &str, n: usize) -> String {
    let pad = " ".repeat(n);
    text.lines()
        .map(|l| format!("{pad}{l}\n"))
        .collect::<String>()
}

/// An LDS file's content: the listener of [`bootstrap`] on `port`, the filter configured by
/// `plugin_config` and loaded from `wasm`, re-indented as an LDS resource.
#[allow(dead_code)]
pub fn lds_listener(port: u16, plugin_config: &str, wasm: &Path) -> String {
    let full = bootstrap(plugin_config, wasm);
    let listener = full
        .split("  listeners:\n")
        .nth(1)
        .unwrap()
        .replace("port_value: 0", &format!("port_value: {port}"));
    let listener = listener.replacen(
        "  - name: test",
        "  - \"@type\": type.googleapis.com/envoy.config.listener.v3.Listener\n    name: test",
        1,
    );
    format!(
        "resources:\n{}",
        listener.replace("\n  ", "\n").trim_start_matches("  ")
    )
}

/// A bootstrap whose listeners come from `dir/lds.yaml` (LDS from the filesystem, watched).
pub fn lds_bootstrap(dir: &Path) -> String {
    format!(
        "node: {{id: test, cluster: test}}\n\
         admin:\n  address:\n    socket_address: {{address: 127.0.0.1, port_value: 0}}\n\
         dynamic_resources:\n  lds_config:\n    resource_api_version: V3\n    path_config_source:\n      path: {}\n      watched_directory: {{path: {}}}\n",
        dir.join("lds.yaml").display(),
        dir.display()
    )
}

/// Replaces the LDS file `lds.yaml` in `dir` atomically (Envoy watches for the rename).
#[allow(dead_code)]
pub fn publish_lds(dir: &Path, content: &str) {
    let tmp = dir.join("lds.tmp");
    std::fs::write(&tmp, content).unwrap();
    std::fs::rename(&tmp, dir.join("lds.yaml")).unwrap();
}

/// The Envoy bootstrap for one plugin configuration.
pub fn bootstrap(plugin_config: &str, wasm: &Path) -> String {
    bootstrap_with_policy(plugin_config, wasm, None)
}

/// The bootstrap with the wasm filter's `failure_policy` set (None: Envoy's default).
pub fn bootstrap_with_policy(
    plugin_config: &str,
    wasm: &Path,
    failure_policy: Option<&str>,
) -> String {
    bootstrap_plugin(
        &Plugin {
            name: "test",
            root_id: "test",
            vm_id: Some("test"),
            failure_policy,
        },
        plugin_config,
        wasm,
    )
}

/// How the wasm filter is declared (Istio: name `<namespace>.<name>`, root_id the plugin
/// name, no vm_id).
pub struct Plugin<'a> {
    pub name: &'a str,
    pub root_id: &'a str,
    pub vm_id: Option<&'a str>,
    pub failure_policy: Option<&'a str>,
}

/// The `http_filters` entry of the filter, in the build under test: the wasm filter declared as
/// `plugin`, or the dynamic module whose `filter_name` is the plugin's name.
pub fn http_filter(plugin: &Plugin, plugin_config: &str, wasm: &Path) -> String {
    if build() == Build::Native {
        return format!(
            r#"          - name: envoy.filters.http.dynamic_modules
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.dynamic_modules.v3.DynamicModuleFilter
              dynamic_module_config: {{name: wasm_ratelimit}}
              filter_name: "{name}"
              filter_config:
                "@type": type.googleapis.com/google.protobuf.StringValue
                value: |
{config}"#,
            name = plugin.name,
            config = indent(plugin_config, 18),
        );
    }
    let policy = plugin
        .failure_policy
        .map(|p| format!("\n                failure_policy: {p}"))
        .unwrap_or_default();
    let vm_id = plugin
        .vm_id
        .map(|v| format!("\n                  vm_id: {v}"))
        .unwrap_or_default();
    format!(
        r#"          - name: envoy.filters.http.wasm
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm
              config:
                name: "{name}"
                root_id: "{root_id}"{policy}
                vm_config:{vm_id}
                  runtime: envoy.wasm.runtime.v8
                  code: {{local: {{filename: "{wasm}"}}}}
                configuration:
                  "@type": type.googleapis.com/google.protobuf.StringValue
                  value: |
{config}"#,
        name = plugin.name,
        root_id = plugin.root_id,
        wasm = wasm.display(),
        config = indent(plugin_config, 20),
    )
}

/// The bootstrap of one listener named `test` with the filter declared as `plugin`.
pub fn bootstrap_plugin(plugin: &Plugin, plugin_config: &str, wasm: &Path) -> String {
    bootstrap_full(plugin, plugin_config, wasm, &Listener::default())
}

/// What the test listener does besides the filter.
#[derive(Default)]
pub struct Listener<'a> {
    /// Route every request to this upstream (HTTP/1.1, trailers on) instead of answering
    /// `ok` directly.
    pub upstream: Option<SocketAddr>,
    /// Take the client address from this request header (Envoy's custom-header original IP
    /// detection), so a test can be many clients, IPv6 ones included.
    pub client_ip_header: Option<&'a str>,
    /// Write an access log.
    pub access_log: Option<AccessLog<'a>>,
}

impl Listener<'_> {
    /// A listener routing every request to `upstream`, and nothing more.
    pub fn to(upstream: SocketAddr) -> Self {
        Listener {
            upstream: Some(upstream),
            ..Listener::default()
        }
    }
}

/// A file access log of the test listener.
pub struct AccessLog<'a> {
    /// Where Envoy writes it.
    pub path: &'a Path,
    /// `json_format` entries (key, format command); empty: Envoy's default text format.
    pub json: &'a [(&'a str, &'a str)],
}

impl AccessLog<'_> {
    /// The `access_log` of the connection manager, indented for it.
    fn yaml(&self) -> String {
        let mut out = format!(
            r#"
          access_log:
          - name: envoy.access_loggers.file
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog
              path: "{}""#,
            self.path.display()
        );
        if !self.json.is_empty() {
            out.push_str("\n              log_format:\n                json_format:");
            for (k, v) in self.json {
                out.push_str(&format!("\n                  \"{k}\": \"{v}\""));
            }
        }
        out
    }
}

/// A bootstrap for the filter in the build under test (plugin `test`) with `listener`.
pub fn bootstrap_with(plugin_config: &str, listener: &Listener) -> String {
    let plugin = Plugin {
        name: "test",
        root_id: "test",
        vm_id: Some("test"),
        failure_policy: None,
    };
    bootstrap_full(&plugin, plugin_config, &wasm_path(), listener)
}

/// The whole bootstrap.
pub fn bootstrap_full(
    plugin: &Plugin,
    plugin_config: &str,
    wasm: &Path,
    listener: &Listener,
) -> String {
    let action = match listener.upstream {
        Some(_) => "route: {cluster: upstream, timeout: 60s}".to_string(),
        None => r#"direct_response: {status: 200, body: {inline_string: "ok\n"}}"#.to_string(),
    };
    let detection = match listener.client_ip_header {
        Some(h) => format!(
            r#"
          original_ip_detection_extensions:
          - name: envoy.http.original_ip_detection.custom_header
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.http.original_ip_detection.custom_header.v3.CustomHeaderConfig
              header_name: {h}"#
        ),
        None => String::new(),
    };
    let access_log = listener
        .access_log
        .as_ref()
        .map(AccessLog::yaml)
        .unwrap_or_default();
    let clusters = match listener.upstream {
        Some(a) => format!(
            r#"  clusters:
  - name: upstream
    type: STATIC
    connect_timeout: 1s
    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        explicit_http_config:
          http_protocol_options: {{enable_trailers: true}}
    load_assignment:
      cluster_name: upstream
      endpoints:
      - lb_endpoints:
        - endpoint:
            address:
              socket_address: {{address: {ip}, port_value: {port}}}
"#,
            ip = a.ip(),
            port = a.port()
        ),
        None => String::new(),
    };
    format!(
        r#"{STATS_TAGS}admin:
  address:
    socket_address: {{address: 127.0.0.1, port_value: 0}}
static_resources:
  listeners:
  - name: test
    address:
      socket_address: {{address: 127.0.0.1, port_value: 0}}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: test{detection}{access_log}
          route_config:
            virtual_hosts:
            - name: all
              domains: ["*"]
              routes:
              - match: {{prefix: "/"}}
                {action}
          http_filters:
{filter}          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
{clusters}"#,
        filter = http_filter(plugin, plugin_config, wasm),
    )
}

/// A running Envoy, killed on drop.
pub struct Envoy {
    child: Child,
    /// The HTTP listener.
    pub addr: SocketAddr,
    /// The admin endpoint.
    pub admin: SocketAddr,
    /// Envoy's log file.
    pub log: PathBuf,
}

/// How a start that was expected to fail ended.
pub struct Refused {
    pub exit_ok: bool,
    pub log: String,
}

fn spawn(yaml: &str, concurrency: u32) -> (Child, PathBuf, PathBuf) {
    spawn_with(&envoy_bin(), yaml, concurrency, &native_dir(), &[])
}

fn spawn_with(
    bin: &str,
    yaml: &str,
    concurrency: u32,
    module_dir: &Path,
    extra: &[&str],
) -> (Child, PathBuf, PathBuf) {
    let dir = scratch("envoy");
    let cfg = dir.join("envoy.yaml");
    std::fs::write(&cfg, yaml).unwrap();
    let log = dir.join("envoy.log");
    let admin_file = dir.join("admin-address");
    // Envoy flushes its log file every 10 s by default: every 100 ms here, so that a test waiting
    // for a line waits for the line, not for the flush (unless the caller sets its own interval).
    let flush: &[&str] = if extra.contains(&"--file-flush-interval-msec") {
        &[]
    } else {
        &["--file-flush-interval-msec", "100"]
    };
    let child = Command::new(bin)
        .env("ENVOY_DYNAMIC_MODULES_SEARCH_PATH", module_dir)
        .arg("-c")
        .arg(&cfg)
        .args(["--concurrency", &concurrency.to_string()])
        .args(["--disable-hot-restart", "-l", "info"])
        .args(["--component-log-level", "wasm:debug,dynamic_modules:debug"])
        .arg("--admin-address-path")
        .arg(&admin_file)
        .arg("--log-path")
        .arg(&log)
        .args(flush)
        .args(extra)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {bin}: {e} (set ENVOY)"));
    (child, admin_file, log)
}

impl Envoy {
    /// Starts Envoy with the filter configured by `plugin_config` (JSON).
    pub fn start(plugin_config: &str) -> Envoy {
        Envoy::start_yaml(&bootstrap(plugin_config, &wasm_path()))
    }

    /// Starts Envoy with a whole bootstrap; waits (≤ 30 s) until the listener serves.
    pub fn start_yaml(yaml: &str) -> Envoy {
        Envoy::start_yaml_workers(yaml, 2)
    }

    /// Starts Envoy with a whole bootstrap and `concurrency` workers.
    pub fn start_yaml_workers(yaml: &str, concurrency: u32) -> Envoy {
        Envoy::start_with_modules(yaml, concurrency, &native_dir())
    }

    /// Starts Envoy with dynamic modules searched in `module_dir`.
    pub fn start_with_modules(yaml: &str, concurrency: u32, module_dir: &Path) -> Envoy {
        Envoy::start_full(&envoy_bin(), yaml, concurrency, module_dir, &[])
    }

    /// Starts the Envoy binary `bin` with dynamic modules searched in `module_dir`.
    pub fn start_on(bin: &str, yaml: &str, module_dir: &Path) -> Envoy {
        Envoy::start_full(bin, yaml, 2, module_dir, &[])
    }

    /// Starts Envoy with more command-line arguments.
    pub fn start_yaml_args(yaml: &str, extra: &[&str]) -> Envoy {
        Envoy::start_full(&envoy_bin(), yaml, 2, &native_dir(), extra)
    }

    fn start_full(
        bin: &str,
        yaml: &str,
        concurrency: u32,
        module_dir: &Path,
        extra: &[&str],
    ) -> Envoy {
        let (mut child, admin_file, log) = spawn_with(bin, yaml, concurrency, module_dir, extra);
        let deadline = Instant::now() + Duration::from_secs(30);
        let admin: SocketAddr = loop {
            if let Ok(s) = std::fs::read_to_string(&admin_file) {
                if let Ok(a) = s.trim().parse() {
                    break a;
                }
            }
            if let Ok(Some(status)) = child.try_wait() {
                panic!(
                    "envoy exited ({status}) while starting:\n{}",
                    std::fs::read_to_string(&log).unwrap_or_default()
                );
            }
            assert!(Instant::now() < deadline, "envoy did not start in 30 s");
            std::thread::sleep(Duration::from_millis(50));
        };
        let mut envoy = Envoy {
            child,
            addr: admin, // replaced below
            admin,
            log,
        };
        loop {
            // LIVE once initialisation (plugin configured on every worker) is done; the
            // listener's bound address is listed as `NAME::127.0.0.1:PORT`. No request is sent:
            // it would count against the rules under test.
            let live = get(admin, "/ready").is_ok_and(|r| r.body_str().trim() == "LIVE");
            if live {
                if let Ok(r) = get(admin, "/listeners") {
                    let body = r.body_str();
                    let bound = body.lines().next().and_then(|l| l.split_once("::"));
                    if let Some(Ok(addr)) = bound.map(|(_, a)| a.trim().parse()) {
                        envoy.addr = addr;
                        return envoy;
                    }
                }
            }
            assert!(Instant::now() < deadline, "listener not ready in 30 s");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Starts Envoy with a configuration it must refuse; returns its log once it exits (≤ 30 s).
    pub fn start_refused(plugin_config: &str) -> Refused {
        let (child, _, log) = spawn(&bootstrap(plugin_config, &wasm_path()), 2);
        Envoy::refused(child, &log)
    }

    /// Starts the Envoy binary `bin`, with dynamic modules searched in `module_dir`, on a
    /// bootstrap it must refuse; returns its log once it exits (≤ 30 s).
    pub fn refused_on(bin: &str, yaml: &str, module_dir: &Path) -> Refused {
        let (child, _, log) = spawn_with(bin, yaml, 2, module_dir, &[]);
        Envoy::refused(child, &log)
    }

    fn refused(mut child: Child, log: &Path) -> Refused {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Ok(Some(status)) = child.try_wait() {
                return Refused {
                    exit_ok: status.success(),
                    log: std::fs::read_to_string(log).unwrap_or_default(),
                };
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                panic!("envoy kept running with a bad configuration");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Bytes allocated by Envoy now (`/memory`'s `allocated`: the live value behind the
    /// `server.memory_allocated` gauge, which is only refreshed at each stats flush).
    pub fn memory_allocated(&self) -> u64 {
        let r = get(self.admin, "/memory").unwrap();
        let v: serde_json::Value = serde_json::from_slice(&r.body).unwrap();
        v["allocated"].as_str().unwrap().parse().unwrap()
    }

    /// The CPU time Envoy's process has used so far (user and system), ms; 0 where /proc does
    /// not say (`ENVOY` a launcher script rather than the binary: its own process is measured).
    pub fn cpu_ms(&self) -> u64 {
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", self.child.id()));
        // The fields after the command's closing parenthesis: utime and stime are the 12th and
        // 13th, in clock ticks (100 a second on Linux).
        stat.ok()
            .and_then(|s| {
                let rest = s.rsplit_once(')')?.1.to_string();
                let f: Vec<u64> = rest
                    .split_whitespace()
                    .skip(11)
                    .take(2)
                    .filter_map(|v| v.parse().ok())
                    .collect();
                Some(f.iter().sum::<u64>() * 10)
            })
            .unwrap_or(0)
    }

    /// Waits (≤ 10 s) until a stat has the `expected` value (the filter publishes its counters
    /// once a second per worker); returns the last value seen.
    pub fn wait_stat(&self, name: &str, expected: u64) -> Option<u64> {
        self.wait_stat_until(name, |v| v == expected)
    }

    /// Waits (≤ 10 s) until a stat satisfies `done`; returns the last value seen.
    pub fn wait_stat_until(&self, name: &str, done: impl Fn(u64) -> bool) -> Option<u64> {
        self.poll_stat(name, Duration::from_secs(10), done)
    }

    /// Waits up to `timeout` until a stat satisfies `done`: its value then; a panic, with the
    /// last value seen and Envoy's log, if it never does.
    pub fn expect_stat(&self, name: &str, timeout: Duration, done: impl Fn(u64) -> bool) -> u64 {
        match self.poll_stat(name, timeout, &done) {
            Some(v) if done(v) => v,
            last => panic!("{name} = {last:?} after {timeout:?}:\n{}", self.log()),
        }
    }

    fn poll_stat(&self, name: &str, timeout: Duration, done: impl Fn(u64) -> bool) -> Option<u64> {
        let deadline = Instant::now() + timeout;
        loop {
            let v = self.stat(name);
            if v.is_some_and(&done) || Instant::now() > deadline {
                return v;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// A stat's value from `/stats`.
    pub fn stat(&self, name: &str) -> Option<u64> {
        let filter: String = format!("^{}$", name.replace('.', "\\."))
            .bytes()
            .map(|b| match b {
                b'a'..=b'z' | b'A'..=b'Z' | b'0'..=b'9' | b'_' | b'-' => (b as char).to_string(),
                other => format!("%{other:02X}"),
            })
            .collect();
        let r = get(self.admin, &format!("/stats?filter={filter}")).ok()?;
        r.body_str()
            .lines()
            .find_map(|l| l.strip_prefix(&format!("{name}: ")))
            .and_then(|v| v.trim().parse().ok())
    }

    /// Envoy's log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Whether the log shows `needle` within 15 s (Envoy flushes its log file lazily).
    pub fn log_shows(&self, needle: &str) -> bool {
        let deadline = Instant::now() + Duration::from_secs(15);
        while Instant::now() < deadline {
            if self.log().contains(needle) {
                return true;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        false
    }
}

impl Drop for Envoy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// GNU `date` with `args`, as an integer: calendar figures computed apart from the filter's.
pub fn date(args: &[&str]) -> i64 {
    let out = Command::new("date").args(args).output().unwrap();
    assert!(out.status.success(), "date {args:?}");
    String::from_utf8(out.stdout)
        .unwrap()
        .trim()
        .parse()
        .unwrap()
}

/// The UTC calendar month holding `t` (s since the epoch): its start and end, by GNU `date`.
pub fn utc_month(t: i64) -> (i64, i64) {
    let first = Command::new("date")
        .args(["-u", "-d", &format!("@{t}"), "+%Y-%m-01"])
        .output()
        .unwrap()
        .stdout;
    let first = String::from_utf8(first).unwrap().trim().to_string();
    let start = date(&["-u", "-d", &first, "+%s"]);
    let end = date(&["-u", "-d", &format!("{first} +1 month"), "+%s"]);
    (start, end)
}

/// Wall-clock milliseconds since the epoch (the same clock Envoy uses).
pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

/// `examples/NAME/envoy.yaml` (given as its folder) as written, on free ports: Envoy's listener
/// and admin on any port, its stand-in backend (port 10001) on a free one, the `.wasm` of the
/// build under test. For the wasm build; [`for_build`] turns it into the native one.
pub fn example_yaml(dir: &Path) -> String {
    let backend = free_port();
    std::fs::read_to_string(dir.join("envoy.yaml"))
        .unwrap()
        .replace("port_value: 10000", "port_value: 0")
        .replace("port_value: 9901", "port_value: 0")
        .replace("port_value: 10001", &format!("port_value: {backend}"))
        .replace(
            "target/wasm32-wasip1/release/wasm_ratelimit.wasm",
            &wasm_path().display().to_string(),
        )
}

/// A child process killed on drop.
pub struct Proc(Child);
impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A Redis on `port`, in memory only.
#[allow(dead_code)]
pub fn redis(port: u16) -> Proc {
    let mut cmd = Command::new("redis-server");
    cmd.args([
        "--port",
        &port.to_string(),
        "--bind",
        "127.0.0.1",
        "--save",
        "",
    ])
    .args(["--appendonly", "no"]);
    listening(
        &mut cmd,
        port,
        "redis-server (apt-get install redis-server; .ci/run does)",
    )
}

/// Starts `cmd` (its output discarded) and waits until it listens on `port` itself; `what`
/// names it and where it comes from, should it not start.
fn listening(cmd: &mut Command, port: u16, what: &str) -> Proc {
    let mut child = cmd
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {what}: {e}"));
    ports::wait_listening(&mut child, port, what);
    Proc(child)
}

fn rls_server_bin() -> PathBuf {
    std::env::var("RLS_SERVER")
        .map(PathBuf::from)
        .unwrap_or_else(|_| root().join("crates/envoy-tests/rls-server/target/release/rls-server"))
}

/// The test rate limit service (the limitador engine over the Redis on `redis_port`) on
/// `port`, with Limitador's `limits` (JSON), each answer `delay_ms` late, one call at a time if
/// `serial`.
#[allow(dead_code)]
pub fn rls_server(port: u16, redis_port: u16, limits: &str, delay_ms: u64, serial: bool) -> Proc {
    let store = format!("redis://127.0.0.1:{redis_port}");
    rls_service(port, &store, limits, delay_ms, serial)
}

/// [`rls_server`] counting each descriptor by its own `hits_addend` and answering a status for
/// each, as envoyproxy/ratelimit does (`RLS_DESCRIPTORS=each`, rls-server's doc).
#[allow(dead_code)]
pub fn rls_server_each(port: u16, redis_port: u16, limits: &str, serial: bool) -> Proc {
    let store = format!("redis://127.0.0.1:{redis_port}");
    let mut cmd = rls_command(port, &store, limits, 0, serial);
    cmd.env("RLS_DESCRIPTORS", "each");
    listening(
        &mut cmd,
        port,
        "the test RLS server (make rls-server builds it)",
    )
}

/// [`rls_server`] over `store`: a Redis URL, or `memory` (the limitador engine's own counters).
pub fn rls_service(port: u16, store: &str, limits: &str, delay_ms: u64, serial: bool) -> Proc {
    let mut cmd = rls_command(port, store, limits, delay_ms, serial);
    listening(
        &mut cmd,
        port,
        "the test RLS server (make rls-server builds it)",
    )
}

/// The test RLS server's command line.
fn rls_command(port: u16, store: &str, limits: &str, delay_ms: u64, serial: bool) -> Command {
    let mut cmd = Command::new(rls_server_bin());
    cmd.args([
        format!("127.0.0.1:{port}"),
        store.to_string(),
        limits.to_string(),
        delay_ms.to_string(),
        if serial { "serial" } else { "concurrent" }.to_string(),
    ]);
    cmd
}

/// An example as [`example_yaml`] gives it, with what it needs running: for an example with a
/// `limits.json` (its global rules' limits, in Limitador's terms), a Redis and the test rate
/// limit service, on free ports (the example's `ratelimit` cluster, port 8081, pointed at it).
/// The processes stop when the guards are dropped.
#[allow(dead_code)]
pub fn example(dir: &Path) -> (String, Vec<Proc>) {
    let yaml = example_yaml(dir);
    let Ok(limits) = std::fs::read_to_string(dir.join("limits.json")) else {
        return (yaml, Vec::new());
    };
    let (redis_port, rls_port) = (free_port(), free_port());
    let store = redis(redis_port);
    let service = rls_server(rls_port, redis_port, &limits, 0, true);
    let yaml = yaml.replace("port_value: 8081", &format!("port_value: {rls_port}"));
    (yaml, vec![store, service])
}

/// The YAML documents of the repository's file `path` (a manifest), as JSON; empty ones
/// dropped.
pub fn manifests(path: &str) -> Vec<serde_json::Value> {
    let text = std::fs::read_to_string(root().join(path)).unwrap();
    ratelimit_config::manifest::yaml_documents(&text)
        .unwrap()
        .into_iter()
        .filter(|d| !d.is_null())
        .collect()
}

/// The string at `pointer` in `doc`; a panic naming the pointer where there is none.
pub fn str_at<'a>(doc: &'a serde_json::Value, pointer: &str) -> &'a str {
    doc.pointer(pointer)
        .and_then(serde_json::Value::as_str)
        .unwrap_or_else(|| panic!("{pointer} missing"))
}

/// An Envoy configuration for the build under test: as written for the wasm build; for the
/// native build, every wasm filter becomes the dynamic module with the same plugin name and
/// configuration (as JSON, which Envoy reads as YAML).
pub fn for_build(yaml: &str) -> String {
    if build() == Build::Wasm {
        return yaml.to_string();
    }
    let mut doc = ratelimit_config::manifest::yaml_documents(yaml)
        .unwrap()
        .remove(0);
    to_native(&mut doc);
    doc.to_string()
}

fn to_native(v: &mut serde_json::Value) {
    use serde_json::{json, Value};
    match v {
        Value::Object(map) => {
            if map.get("name").and_then(Value::as_str) == Some("envoy.filters.http.wasm") {
                let config = &map["typed_config"]["config"];
                let name = config["name"].clone();
                let value = config["configuration"]["value"].clone();
                *v = json!({
                    "name": "envoy.filters.http.dynamic_modules",
                    "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.filters.http.dynamic_modules.v3.DynamicModuleFilter",
                        "dynamic_module_config": {"name": "wasm_ratelimit"},
                        "filter_name": name,
                        "filter_config": {
                            "@type": "type.googleapis.com/google.protobuf.StringValue",
                            "value": value
                        }
                    }
                });
                return;
            }
            map.values_mut().for_each(to_native);
        }
        Value::Array(items) => items.iter_mut().for_each(to_native),
        _ => {}
    }
}

/// A bootstrap's `ratelimit` cluster (HTTP/2, for a rate limit service on `port`), as the
/// lines of a `clusters:` list.
#[allow(dead_code)]
pub fn rls_cluster(port: u16, connect_timeout: &str) -> String {
    rls_cluster_named("ratelimit", port, connect_timeout)
}

/// [`rls_cluster`] named `name`.
pub fn rls_cluster_named(name: &str, port: u16, connect_timeout: &str) -> String {
    format!(
        "  - name: {name}
    type: STATIC
    connect_timeout: {connect_timeout}
    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        \"@type\": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        explicit_http_config:
          http2_protocol_options: {{}}
    load_assignment:
      cluster_name: {name}
      endpoints:
      - lb_endpoints:
        - endpoint:
            address:
              socket_address: {{address: 127.0.0.1, port_value: {port}}}
"
    )
}
