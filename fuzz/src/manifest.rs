//! The CLI's readers of the files users hold configurations in (`ratelimit-config`'s
//! `manifest`): YAML, Istio `WasmPlugin` and Envoy Gateway manifests, Envoy configurations, on
//! arbitrary text. No panic; each configuration found is a string the filter then parses (and
//! a configuration it accepts keeps the promises of [`crate::config`]).

use ratelimit_config::manifest;
use ratelimit_core::config::Config;

pub fn run(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return; // the CLI reads files as UTF-8 and stops at any other
    };
    if let Ok(docs) = manifest::yaml_documents(text) {
        for d in &docs {
            let _ = d.to_string();
        }
    }
    if let Ok(configs) = manifest::plugin_configs(text) {
        for (_, json) in configs {
            if let Ok(config) = Config::parse(json.as_bytes()) {
                crate::config::accepted(config);
            }
        }
    }
}
