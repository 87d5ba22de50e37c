//! The Envoy Gateway manifests in deploy/envoy-gateway: every resource uses Envoy Gateway's
//! fields, every plugin configuration in them is valid, and each policy runs in a real Envoy
//! configured the way Envoy Gateway's translator configures it (internal/xds/translator/wasm.go
//! and dynamicmodule.go in envoyproxy/gateway):
//! - the wasm build: an HTTP filter named `envoy.filters.http.wasm/envoyextensionpolicy/<ns>/
//!   <policy>/wasm/<i>`, disabled in the connection manager and enabled on each route the
//!   policy reaches; `name` the entry's name, `root_id` its rootID, `fail_open`, a VM of its own
//!   (`vm_id` the filter's ir name), V8, the code fetched over HTTP from the gateway's cache of
//!   modules and checked against its sha256, the configuration the entry's JSON as a StringValue;
//! - the native build: `envoy.filters.http.dynamic_modules/envoyextensionpolicy/<ns>/<policy>/
//!   dynamic-module/<i>`, disabled likewise, the module loaded by its path (`module.local`),
//!   `filter_name` the entry's filterName, its JSON config as a StringValue.
//!
//! Not checked here (no Kubernetes, no Envoy Gateway controller): the CRDs' own validation, the
//! controller fetching an image or a URL, and the routes and clusters it makes around them.
#![allow(clippy::unwrap_used, clippy::panic, clippy::indexing_slicing)]

mod common;

use common::http::Server;
use common::{native_dir, root, str_at, wasm_path, Client, Envoy};
use ratelimit_core::config::Config;
use serde_json::{json, Value};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Duration;

fn manifests(file: &str) -> Vec<Value> {
    common::manifests(&format!("deploy/envoy-gateway/{file}"))
}

fn of_kind<'a>(docs: &'a [Value], kind: &str) -> Vec<&'a Value> {
    docs.iter().filter(|d| str_at(d, "/kind") == kind).collect()
}

fn find<'a>(docs: &'a [Value], name: &str) -> &'a Value {
    docs.iter()
        .find(|d| str_at(d, "/metadata/name") == name)
        .unwrap_or_else(|| panic!("no {name}"))
}

/// The keys of an object, each of which must be one of `allowed` (Envoy Gateway's JSON names).
fn only_fields(v: &Value, allowed: &[&str], what: &str) {
    for key in v.as_object().unwrap().keys() {
        assert!(
            allowed.contains(&key.as_str()),
            "{what}: {key} is not a field"
        );
    }
}

/// The plugin configuration as Envoy Gateway hands it to the filter: the entry's `config` as
/// JSON text. It must be one the filter accepts.
fn plugin_config(entry: &Value, what: &str) -> String {
    let json = entry.get("config").unwrap().to_string();
    if let Err(e) = Config::parse(json.as_bytes()) {
        panic!("{what}: {e}");
    }
    json
}

fn check_policy(doc: &Value) {
    assert_eq!(str_at(doc, "/apiVersion"), "gateway.envoyproxy.io/v1alpha1");
    assert_eq!(str_at(doc, "/kind"), "EnvoyExtensionPolicy");
    let refs = doc.pointer("/spec/targetRefs").unwrap().as_array().unwrap();
    assert!(!refs.is_empty());
    for r in refs {
        assert_eq!(str_at(r, "/group"), "gateway.networking.k8s.io");
        assert!(["Gateway", "HTTPRoute"].contains(&str_at(r, "/kind")));
        str_at(r, "/name");
    }
}

#[test]
fn every_wasm_policy_uses_envoy_gateways_fields_and_a_valid_configuration() {
    let docs = manifests("wasm.yaml");
    assert_eq!(docs.len(), 2);
    let mut sources = Vec::new();
    for doc in &docs {
        check_policy(doc);
        only_fields(doc.get("spec").unwrap(), &["targetRefs", "wasm"], "spec");
        for entry in doc.pointer("/spec/wasm").unwrap().as_array().unwrap() {
            let what = format!(
                "{} {}",
                str_at(doc, "/metadata/name"),
                str_at(entry, "/name")
            );
            only_fields(
                entry,
                &["name", "rootID", "code", "config", "failOpen", "env"],
                &what,
            );
            assert!(entry.get("failOpen").unwrap().is_boolean());
            let code = entry.get("code").unwrap();
            let kind = str_at(code, "/type");
            sources.push(kind.to_string());
            match kind {
                "Image" => {
                    only_fields(code, &["type", "image", "pullPolicy"], &what);
                    let image = code.get("image").unwrap();
                    only_fields(image, &["url", "sha256", "pullSecretRef", "tls"], &what);
                    assert!(!str_at(image, "/url").contains("://"), "an image reference");
                }
                "HTTP" => {
                    only_fields(code, &["type", "http", "pullPolicy"], &what);
                    let http = code.get("http").unwrap();
                    only_fields(http, &["url", "sha256", "tls"], &what);
                    assert!(str_at(http, "/url").starts_with("https://"));
                    let sha = str_at(http, "/sha256");
                    assert!(sha.len() == 64 && sha.bytes().all(|b| b.is_ascii_hexdigit()));
                }
                other => panic!("{what}: code type {other}"),
            }
            plugin_config(entry, &what);
        }
    }
    sources.sort();
    assert_eq!(
        sources,
        ["HTTP", "Image"],
        "an image and the HTTP alternative"
    );
}

#[test]
fn the_native_manifests_register_the_module_the_image_carries() {
    let docs = manifests("native.yaml");
    let proxy = of_kind(&docs, "EnvoyProxy");
    assert_eq!(proxy.len(), 1);
    let proxy = proxy[0];
    assert_eq!(
        str_at(proxy, "/apiVersion"),
        "gateway.envoyproxy.io/v1alpha1"
    );
    str_at(
        proxy,
        "/spec/provider/kubernetes/envoyDeployment/container/image",
    );
    let modules = proxy
        .pointer("/spec/dynamicModules")
        .unwrap()
        .as_array()
        .unwrap();
    assert_eq!(modules.len(), 1);
    let module = &modules[0];
    only_fields(
        module,
        &["name", "source", "doNotClose", "loadGlobally"],
        "module",
    );
    assert_eq!(str_at(module, "/source/type"), "Local");
    // The path the EnvoyProxy names is where deploy/native/Dockerfile puts the module.
    let path = str_at(module, "/source/local/path");
    let dockerfile = std::fs::read_to_string(root().join("deploy/native/Dockerfile")).unwrap();
    assert!(
        dockerfile
            .lines()
            .any(|l| l.starts_with("COPY ") && l.ends_with(&format!(" {path}"))),
        "deploy/native/Dockerfile copies the module to {path}"
    );

    let gateway = of_kind(&docs, "Gateway");
    assert_eq!(gateway.len(), 1);
    assert_eq!(
        str_at(gateway[0], "/spec/infrastructure/parametersRef/name"),
        str_at(proxy, "/metadata/name")
    );
    assert_eq!(
        str_at(gateway[0], "/spec/infrastructure/parametersRef/kind"),
        "EnvoyProxy"
    );

    let policies = of_kind(&docs, "EnvoyExtensionPolicy");
    assert_eq!(policies.len(), 1);
    for doc in policies {
        check_policy(doc);
        only_fields(
            doc.get("spec").unwrap(),
            &["targetRefs", "dynamicModule"],
            "spec",
        );
        for entry in doc
            .pointer("/spec/dynamicModule")
            .unwrap()
            .as_array()
            .unwrap()
        {
            only_fields(
                entry,
                &["name", "filterName", "config", "terminalFilter"],
                "dynamicModule",
            );
            assert_eq!(
                str_at(entry, "/name"),
                str_at(module, "/name"),
                "registered"
            );
            str_at(entry, "/filterName");
            plugin_config(entry, "dynamicModule");
        }
    }
}

/// Serves `file` over HTTP/1.1 on a loopback port, until dropped (Envoy Gateway
/// serves each module from its own cache the same way, to its proxies).
fn serve(file: PathBuf) -> Server<PathBuf> {
    Server::start(file, Duration::from_secs(60), |out, _, file| {
        let body = std::fs::read(file).unwrap();
        let head = format!(
            "HTTP/1.1 200 OK\r\ncontent-length: {}\r\ncontent-type: application/wasm\r\nconnection: close\r\n\r\n",
            body.len()
        );
        let _ = out.write_all(head.as_bytes());
        let _ = out.write_all(&body);
        false
    })
}

fn sha256(file: &Path) -> String {
    let out = std::process::Command::new("sha256sum")
        .arg(file)
        .output()
        .unwrap();
    String::from_utf8(out.stdout).unwrap()[..64].to_string()
}

/// The connection manager's filter for `entry` of `policy` (its index `i` in the policy's list),
/// as Envoy Gateway's translator writes it.
fn wasm_filter(policy: &Value, i: usize, entry: &Value, uri: &str, sha: &str) -> (String, Value) {
    let ir = format!(
        "envoyextensionpolicy/{}/{}/wasm/{i}",
        str_at(policy, "/metadata/namespace"),
        str_at(policy, "/metadata/name")
    );
    let name = format!("envoy.filters.http.wasm/{ir}");
    let filter = json!({
        "name": name,
        "disabled": true,
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm",
            "config": {
                "name": str_at(entry, "/name"),
                "root_id": str_at(entry, "/rootID"),
                "fail_open": entry.get("failOpen").and_then(Value::as_bool).unwrap_or(false),
                "vm_config": {
                    "vm_id": ir,
                    "runtime": "envoy.wasm.runtime.v8",
                    "code": {"remote": {
                        "http_uri": {"uri": uri, "cluster": "wasm_cluster", "timeout": "10s"},
                        "sha256": sha,
                        "retry_policy": {"num_retries": 10, "retry_back_off": {
                            "base_interval": "1s", "max_interval": "30s"}}
                    }}
                },
                "configuration": {
                    "@type": "type.googleapis.com/google.protobuf.StringValue",
                    "value": plugin_config(entry, &name)
                }
            }
        }
    });
    (name, filter)
}

/// A route enabling the filters `names` (Envoy Gateway's per-route FilterConfig).
fn route(match_: Value, names: &[&str]) -> Value {
    let enabled: serde_json::Map<String, Value> = names
        .iter()
        .map(|n| {
            (
                n.to_string(),
                json!({"@type": "type.googleapis.com/envoy.config.route.v3.FilterConfig", "config": {}}),
            )
        })
        .collect();
    json!({
        "match": match_,
        "direct_response": {"status": 200, "body": {"inline_string": "ok\n"}},
        "typed_per_filter_config": enabled
    })
}

fn bootstrap(filters: Vec<Value>, routes: Vec<Value>, clusters: Vec<Value>) -> String {
    let mut http_filters = filters;
    http_filters.push(
        json!({"name": "envoy.filters.http.router", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}),
    );
    json!({
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": 0}}},
        "static_resources": {
            "listeners": [{
                "name": "eg",
                "address": {"socket_address": {"address": "127.0.0.1", "port_value": 0}},
                "filter_chains": [{"filters": [{
                    "name": "envoy.filters.network.http_connection_manager",
                    "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
                        "stat_prefix": "eg",
                        "route_config": {"virtual_hosts": [{"name": "all", "domains": ["*"], "routes": routes}]},
                        "http_filters": http_filters
                    }
                }]}]
            }],
            "clusters": clusters
        }
    })
    .to_string()
}

fn statuses(c: &mut Client, method: &str, path: &str, n: usize) -> Vec<u16> {
    (0..n)
        .map(|_| c.send(method, path, &[]).unwrap().status)
        .collect()
}

#[test]
fn the_wasm_policies_limit_in_envoy_as_envoy_gateway_configures_them() {
    let docs = manifests("wasm.yaml");
    let wasm = wasm_path();
    let server = serve(wasm.clone());
    let port = server.addr.port();
    let uri = format!("http://127.0.0.1:{port}/{}.wasm", sha256(&wasm));
    let sha = sha256(&wasm);
    let gateway = find(&docs, "ratelimit-gateway");
    let search = find(&docs, "ratelimit-search");
    let (g_name, g_filter) = wasm_filter(
        gateway,
        0,
        &gateway.pointer("/spec/wasm/0").unwrap().clone(),
        &uri,
        &sha,
    );
    let (s_name, s_filter) = wasm_filter(
        search,
        0,
        &search.pointer("/spec/wasm/0").unwrap().clone(),
        &uri,
        &sha,
    );
    // The HTTPRoute's own policy replaces the Gateway's on its route; the Gateway's reaches
    // the others.
    let routes = vec![
        route(json!({"prefix": "/search"}), &[&s_name]),
        route(json!({"prefix": "/"}), &[&g_name]),
    ];
    let cluster = json!({
        "name": "wasm_cluster", "type": "STATIC", "connect_timeout": "1s",
        "load_assignment": {"cluster_name": "wasm_cluster", "endpoints": [{"lb_endpoints": [{
            "endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": port}}}}]}]}
    });
    let envoy = Envoy::start_yaml(&bootstrap(vec![g_filter, s_filter], routes, vec![cluster]));
    let mut c = Client::connect(envoy.addr).unwrap();
    assert_eq!(
        statuses(&mut c, "POST", "/login", 6),
        [200, 200, 200, 200, 200, 429]
    );
    assert_eq!(c.get("/").unwrap().status, 200);
    let searches = statuses(&mut c, "GET", "/search?q=x", 31);
    assert_eq!(searches.iter().filter(|&&s| s == 200).count(), 30);
    assert_eq!(searches[30], 429);
    // The entry's name is the plugin's name in the metrics.
    let stat = "wasmcustom.wasm_ratelimit.plugin=.=wasm-ratelimit;.;rule=.=login;.;limited";
    assert_eq!(envoy.wait_stat(stat, 1), Some(1));
    let stat = "wasmcustom.wasm_ratelimit.plugin=.=wasm-ratelimit-search;.;rule=.=search;.;limited";
    assert_eq!(envoy.wait_stat(stat, 1), Some(1));
}

#[test]
fn the_native_policy_limits_in_envoy_as_envoy_gateway_configures_it() {
    let docs = manifests("native.yaml");
    let policy = of_kind(&docs, "EnvoyExtensionPolicy")[0];
    let entry = policy.pointer("/spec/dynamicModule/0").unwrap();
    let ir = format!(
        "envoyextensionpolicy/{}/{}/dynamic-module/0",
        str_at(policy, "/metadata/namespace"),
        str_at(policy, "/metadata/name")
    );
    let name = format!("envoy.filters.http.dynamic_modules/{ir}");
    // The EnvoyProxy's path, here where `make build-native` puts the module.
    let module = native_dir().join("libwasm_ratelimit.so");
    let filter = json!({
        "name": name,
        "disabled": true,
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.dynamic_modules.v3.DynamicModuleFilter",
            "dynamic_module_config": {"module": {"local": {"filename": module.canonicalize().unwrap()}}},
            "filter_name": str_at(entry, "/filterName"),
            "filter_config": {
                "@type": "type.googleapis.com/google.protobuf.StringValue",
                "value": plugin_config(entry, &name)
            }
        }
    });
    let routes = vec![route(json!({"prefix": "/"}), &[&name])];
    // No search path: the module is found by its path alone.
    let envoy = Envoy::start_with_modules(
        &bootstrap(vec![filter], routes, vec![]),
        2,
        Path::new("/nonexistent"),
    );
    let mut c = Client::connect(envoy.addr).unwrap();
    assert_eq!(
        statuses(&mut c, "POST", "/login", 6),
        [200, 200, 200, 200, 200, 429]
    );
    assert_eq!(c.get("/").unwrap().status, 200);
    let stat = "dynamicmodulescustom.wasm_ratelimit.limited.plugin.edge.rule.login";
    assert_eq!(envoy.wait_stat(stat, 1), Some(1));
}
