//! `ratelimit-config`: the plugin configuration's tools, built on the filter's own code.
//!
//! `check FILE...` validates plugin configurations. A FILE is the plugin configuration as JSON,
//! or YAML holding the configuration, Istio `WasmPlugin` manifests (each document's
//! `spec.pluginConfig` is checked) or an Envoy configuration (each wasm or dynamic-module
//! filter's configuration is checked). `-` reads standard input. Prints a summary of the rules of
//! each valid configuration, or every error with its field path; exits 0 if all are valid, 1 if
//! any is not, 2 on a usage or read error.
//!
//! `explain [OPTIONS] CONFIG` tells what each rule of a configuration makes of one request
//! described by the options (method, path, authority, headers, client address, dynamic
//! metadata, filter state), with the filter's own code: whether the rule applies, its client
//! key as the filter logs it (hashed under the configuration's `key_seed` or `--seed`, else
//! shown raw), its cost and the limit in force; or the `match` condition or key part that keeps
//! it from applying (`ratelimit-config explain` alone lists the options). A configuration file
//! is read as `check` reads it, each configuration in it explained; a bad one fails as `check`
//! reports it (exit 1); usage and read errors exit 2.
//!
//! `replay [OPTIONS] CONFIG LOG...` runs the requests of Envoy access logs through a
//! configuration, offline, and reports what each rule would have allowed and limited
//! (`ratelimit-config replay` alone lists the options). A bad configuration, or one a
//! `--what-if` makes, fails as `check` reports it (exit 1); usage and read errors exit 2.

#[cfg(target_arch = "wasm32")]
fn main() {}

#[cfg(not(target_arch = "wasm32"))]
fn main() {
    std::process::exit(cli::run(std::env::args().skip(1).collect()));
}

#[cfg(not(target_arch = "wasm32"))]
mod cli {
    use ratelimit_config::explain;
    use ratelimit_config::manifest::plugin_configs;
    use ratelimit_config::replay::{self, args::Options, sim::Variant, CONFIGURED};
    use ratelimit_config::summary::summary;
    use ratelimit_core::config::{Config, ConfigErrors};
    use std::io::Read;

    const USAGE: &str = "usage: ratelimit-config check FILE... (JSON, YAML, Istio WasmPlugin manifests or an Envoy configuration; - for stdin)
       ratelimit-config explain [OPTIONS] CONFIG (what each rule of CONFIG makes of one request)
       ratelimit-config replay [OPTIONS] CONFIG LOG... (what CONFIG does to Envoy access logs)";

    pub fn run(args: Vec<String>) -> i32 {
        match args.split_first() {
            Some((cmd, files)) if cmd == "check" && !files.is_empty() => check(files),
            Some((cmd, rest)) if cmd == "explain" => explain(rest),
            Some((cmd, rest)) if cmd == "replay" => replay(rest),
            _ => {
                eprintln!("{USAGE}");
                2
            }
        }
    }

    /// One configuration in a file: its `WasmPlugin` name if it comes from one, its name as
    /// reports print it, and its JSON.
    struct Found {
        plugin: Option<String>,
        name: String,
        json: String,
    }

    /// The configurations in `text`, read from `file`; `Err` if the file is not valid YAML.
    fn configurations(file: &str, text: &str) -> Result<Vec<Found>, String> {
        let configs = plugin_configs(text)?;
        // Nothing in the file: what the filter makes of an empty configuration.
        let configs = if configs.is_empty() {
            vec![(None, String::new())]
        } else {
            configs
        };
        Ok(configs
            .into_iter()
            .map(|(label, json)| Found {
                plugin: label
                    .as_deref()
                    .and_then(|l| l.strip_prefix("WasmPlugin "))
                    .map(str::to_string),
                name: match &label {
                    Some(l) => format!("{file} ({l})"),
                    None => file.to_string(),
                },
                json,
            })
            .collect())
    }

    fn invalid(name: &str, errors: &ConfigErrors) {
        println!("{name}: INVALID");
        for e in &errors.0 {
            println!("  {e}");
        }
    }

    /// A configuration of a file, by its name, parsed.
    type Loaded = (String, Result<Config, ConfigErrors>);

    /// Each configuration of `file` parsed, by name: `Err(2)` if the file cannot be read,
    /// `Err(1)` if it holds no configuration (both said).
    fn load(file: &str) -> Result<Vec<Loaded>, i32> {
        let text = read(file).map_err(|e| {
            eprintln!("{file}: cannot read: {e}");
            2
        })?;
        let configs = configurations(file, &text).map_err(|e| {
            println!("{file}: INVALID\n  config: {e}");
            1
        })?;
        Ok(configs
            .into_iter()
            .map(|found| (found.name, Config::parse(found.json.as_bytes())))
            .collect())
    }

    fn check(files: &[String]) -> i32 {
        let mut status = 0;
        for file in files {
            let configs = match load(file) {
                Ok(c) => c,
                Err(2) => return 2,
                Err(e) => {
                    status = e;
                    continue;
                }
            };
            for (name, parsed) in configs {
                match parsed {
                    Ok(config) => print!("{name}: OK\n{}", summary(&config)),
                    Err(errors) => {
                        invalid(&name, &errors);
                        status = 1;
                    }
                }
            }
        }
        status
    }

    fn explain(args: &[String]) -> i32 {
        let options = match explain::Options::parse(args) {
            Ok(o) => o,
            Err(e) => {
                eprintln!("ratelimit-config explain: {e}\n{}", explain::USAGE);
                return 2;
            }
        };
        let configs = match load(&options.config) {
            Ok(c) => c,
            Err(status) => return status,
        };
        let mut status = 0;
        for (name, parsed) in configs {
            match parsed {
                Ok(config) if options.json => {
                    for o in explain::json(&name, &config, &options) {
                        println!("{o}");
                    }
                }
                Ok(config) => print!("{}", explain::text(&name, &config, &options)),
                Err(errors) => {
                    invalid(&name, &errors);
                    status = 1;
                }
            }
        }
        status
    }

    fn replay(args: &[String]) -> i32 {
        let options = match Options::parse(args) {
            Ok(o) => o,
            Err(e) => {
                eprintln!("ratelimit-config replay: {e}\n{}", replay::args::USAGE);
                return 2;
            }
        };
        let file = &options.config;
        let text = match read(file) {
            Ok(t) => t,
            Err(e) => {
                eprintln!("{file}: cannot read: {e}");
                return 2;
            }
        };
        let mut configs = match configurations(file, &text) {
            Ok(c) => c,
            Err(e) => {
                println!("{file}: INVALID\n  config: {e}");
                return 1;
            }
        };
        if let Some(p) = &options.plugin {
            configs.retain(|c| c.plugin.as_deref() == Some(p.as_str()));
        }
        let found = match configs.len() {
            1 => configs.remove(0),
            0 => {
                eprintln!(
                    "{file}: no WasmPlugin named {}",
                    options.plugin.unwrap_or_default()
                );
                return 2;
            }
            n => {
                let names: Vec<&str> = configs.iter().filter_map(|c| c.plugin.as_deref()).collect();
                eprintln!(
                    "{file} holds {n} configurations: pick one with --plugin NAME ({})",
                    names.join(", ")
                );
                return 2;
            }
        };
        let parsed = match replay::configurations(&found.json, &options.what_ifs) {
            Ok(p) => p,
            Err(e) => {
                eprintln!("ratelimit-config replay: {e}");
                return 2;
            }
        };
        let mut configured = None;
        let mut variants = Vec::new();
        let mut status = 0;
        for c in parsed {
            match c.parsed {
                Ok(mut config) => {
                    if c.name == CONFIGURED {
                        configured = Some(config.clone());
                    }
                    replay::prepare(&mut config);
                    variants.push(Variant::new(c.name, c.changes, config));
                }
                Err(errors) if c.name == CONFIGURED => {
                    invalid(&found.name, &errors);
                    status = 1;
                }
                Err(errors) => {
                    invalid(&format!("{} (what-if {})", found.name, c.name), &errors);
                    status = 1;
                }
            }
        }
        let Some(configured) = configured.filter(|_| status == 0) else {
            return 1;
        };
        let run = match replay::run(&options, configured, variants, &mut std::io::stderr()) {
            Ok(r) => r,
            Err(e) => {
                eprintln!("{e}");
                return 2;
            }
        };
        if let Some(path) = &options.html {
            if let Err(e) = std::fs::write(path, replay::report::html(&run, options.raw_keys)) {
                eprintln!("{path}: cannot write: {e}");
                return 2;
            }
        }
        if options.json {
            println!("{:#}", replay::report::json(&run, options.raw_keys));
        } else {
            print!("{}", replay::report::text(&run, options.raw_keys));
        }
        0
    }

    fn read(file: &str) -> std::io::Result<String> {
        if file == "-" {
            let mut s = String::new();
            std::io::stdin().read_to_string(&mut s)?;
            Ok(s)
        } else {
            std::fs::read_to_string(file)
        }
    }
}
