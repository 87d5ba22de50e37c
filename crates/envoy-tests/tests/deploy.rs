//! The Istio manifests in deploy/istio: every WasmPlugin's pluginConfig, converted to the JSON
//! Istio passes, is valid, and runs in a real Envoy configured the way Istio configures it
//! (filter name `<namespace>.<name>`, root_id the plugin name, no vm_id, the fail strategy); so
//! does the Istio tutorial's WasmPlugin, `examples/per-ip/wasmplugin.yaml`.
#![allow(clippy::unwrap_used, clippy::panic, clippy::indexing_slicing)]

mod common;

use common::{bootstrap_plugin, str_at, wasm_path, Client, Envoy, Plugin};
use ratelimit_core::config::Config;
use serde_json::Value;

fn manifests() -> Vec<Value> {
    common::manifests("deploy/istio/wasmplugin.yaml")
}

fn failure_policy(strategy: &str) -> &'static str {
    match strategy {
        "FAIL_OPEN" => "FAIL_OPEN",
        "FAIL_RELOAD" => "FAIL_RELOAD",
        _ => "FAIL_CLOSED",
    }
}

/// Starts Envoy with a manifest's plugin, as Istio would configure it.
fn start(doc: &Value) -> Envoy {
    let name = format!(
        "{}.{}",
        str_at(doc, "/metadata/namespace"),
        str_at(doc, "/metadata/name")
    );
    let config = doc.pointer("/spec/pluginConfig").unwrap().to_string();
    let plugin = Plugin {
        name: &name,
        root_id: str_at(doc, "/spec/pluginName"),
        vm_id: None,
        failure_policy: Some(failure_policy(str_at(doc, "/spec/failStrategy"))),
    };
    Envoy::start_yaml(&bootstrap_plugin(&plugin, &config, &wasm_path()))
}

#[test]
fn every_manifest_is_a_complete_valid_wasmplugin() {
    let docs = manifests();
    assert_eq!(docs.len(), 2);
    let mut urls = Vec::new();
    for doc in &docs {
        assert_eq!(str_at(doc, "/apiVersion"), "extensions.istio.io/v1alpha1");
        assert_eq!(str_at(doc, "/kind"), "WasmPlugin");
        assert!(doc.pointer("/spec/selector/matchLabels").is_some());
        assert!(["AUTHN", "AUTHZ", "STATS"].contains(&str_at(doc, "/spec/phase")));
        assert!(
            ["FAIL_OPEN", "FAIL_CLOSE", "FAIL_RELOAD"].contains(&str_at(doc, "/spec/failStrategy"))
        );
        assert!(["IfNotPresent", "Always"].contains(&str_at(doc, "/spec/imagePullPolicy")));
        urls.push(
            str_at(doc, "/spec/url")
                .split("://")
                .next()
                .unwrap()
                .to_string(),
        );
        let json = doc.pointer("/spec/pluginConfig").unwrap().to_string();
        if let Err(e) = Config::parse(json.as_bytes()) {
            panic!("{}: {e}", str_at(doc, "/metadata/name"));
        }
    }
    urls.sort();
    assert_eq!(
        urls,
        ["file", "oci"],
        "an oci:// image and the file:// alternative"
    );
}

#[test]
fn the_gateway_plugin_limits_logins_in_envoy() {
    let doc = manifests()
        .into_iter()
        .find(|d| str_at(d, "/metadata/name") == "ratelimit-gateway")
        .unwrap();
    let envoy = start(&doc);
    let mut c = Client::connect(envoy.addr).unwrap();
    let statuses: Vec<u16> = (0..6)
        .map(|_| c.send("POST", "/login", &[]).unwrap().status)
        .collect();
    assert_eq!(statuses, [200, 200, 200, 200, 200, 429]);
    let r = c.get("/").unwrap();
    assert_eq!(r.status, 200);
    // Istio names the filter <namespace>.<name>: so do the metrics, and with the tags Istio's
    // `extraStatTags: [plugin, rule]` extracts, Prometheus gets the name as a label.
    let stat = common::metric_of("istio-ingress.ratelimit-gateway", Some("login"), "limited");
    assert_eq!(envoy.wait_stat(&stat, 1), Some(1));
    let prom = common::get(envoy.admin, "/stats/prometheus")
        .unwrap()
        .body_str();
    assert!(
        prom.contains(
            "wasm_ratelimit_limited{plugin=\"istio-ingress.ratelimit-gateway\",rule=\"login\"} 1\n"
        ),
        "{prom}"
    );
}

#[test]
fn the_sidecar_plugin_applies_tier_limits_in_envoy() {
    let doc = manifests()
        .into_iter()
        .find(|d| str_at(d, "/metadata/name") == "ratelimit-api")
        .unwrap();
    let envoy = start(&doc);
    let mut c = Client::connect(envoy.addr).unwrap();
    let r = c
        .send(
            "GET",
            "/api/items",
            &[("x-tier", "free"), ("x-user-id", "u1")],
        )
        .unwrap();
    assert_eq!(r.status, 200);
    assert_eq!(
        r.header("ratelimit-policy"),
        Some("\"free-tier\";q=100;w=3600")
    );
    let r = c
        .send(
            "GET",
            "/api/items",
            &[("x-tier", "pro"), ("x-user-id", "u1")],
        )
        .unwrap();
    assert_eq!(
        r.header("ratelimit-policy"),
        Some("\"pro-tier\";q=10000;w=3600")
    );
    assert_eq!(r.header_u64("x-ratelimit-remaining"), Some(9_999));
}

/// `curl` of `path` on `envoy` with the Host `host`: the status.
fn status_for_host(envoy: &Envoy, host: &str, path: &str) -> String {
    let out = std::process::Command::new("curl")
        .args(["-s", "-o", "/dev/null", "-w", "%{http_code}", "-H"])
        .arg(format!("host: {host}"))
        .arg(format!("http://{}{path}", envoy.addr))
        .output()
        .unwrap();
    String::from_utf8(out.stdout).unwrap()
}

/// The Istio tutorial's WasmPlugin (examples/per-ip/wasmplugin.yaml), run as Istio configures
/// it: 100 requests a minute per client address for one service (its Host) and route (`/api/`)
/// of the gateway, and nothing else limited.
#[test]
fn the_istio_tutorials_plugin_limits_one_service_and_route() {
    let doc = common::manifests("examples/per-ip/wasmplugin.yaml").remove(0);
    assert_eq!(str_at(&doc, "/kind"), "WasmPlugin");
    let sha = str_at(&doc, "/spec/sha256");
    assert!(
        sha.len() == 64
            && sha
                .bytes()
                .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase()),
        "sha256 must match Istio's pattern ^[a-f0-9]{{64}}$: {sha}"
    );
    let envoy = start(&doc);
    let statuses: Vec<String> = (0..101)
        .map(|_| status_for_host(&envoy, "shop.example.com", "/api/items"))
        .collect();
    assert!(statuses[..100].iter().all(|s| s == "200"), "{statuses:?}");
    assert_eq!(statuses[100], "429");
    // Another route of the service, and another service at the gateway: not limited.
    assert_eq!(status_for_host(&envoy, "shop.example.com", "/"), "200");
    assert_eq!(
        status_for_host(&envoy, "blog.example.com", "/api/items"),
        "200"
    );
    let stat = common::metric_of("istio-ingress.ratelimit-per-ip", Some("per-ip"), "limited");
    assert_eq!(envoy.wait_stat(&stat, 1), Some(1));
}
