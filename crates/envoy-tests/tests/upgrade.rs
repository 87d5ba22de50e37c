//! Upgrading the wasm build in a running Envoy (docs/src/how-to/upgrade.md): a listener update
//! whose filter names another `.wasm` starts new VMs with the new code, and with the same
//! `vm_id` and `root_id` they find the counters the old VMs kept in Envoy's shared data.
//!
//! The "other" module is the built filter with a custom section appended (a section the runtime
//! ignores): other bytes, another sha256, so Envoy must load it as new code, with the same state
//! layout, as a release that keeps the layout would have. The native build has no such path:
//! Envoy keeps a loaded module for the life of the process, and a new one needs a restart.
#![allow(clippy::unwrap_used, clippy::panic, clippy::indexing_slicing)]

mod common;

use common::http::assert_remaining;
use common::{free_port, wasm_path, Build, Client, Envoy};
use std::path::{Path, PathBuf};
use std::time::Duration;

const CONFIG: &str = r#"{"rules": [{"name": "r", "key": ["remote_address"],
    "rate_limit": {"requests_per_unit": 5, "unit": "hour"}}]}"#;

/// The built filter with a custom section (id 0, name "upgrade-test") appended.
fn other_module(dir: &Path) -> PathBuf {
    let mut bytes = std::fs::read(wasm_path()).unwrap();
    let name = b"upgrade-test";
    let payload = b"another build";
    bytes.push(0);
    bytes.push((1 + name.len() + payload.len()) as u8);
    bytes.push(name.len() as u8);
    bytes.extend_from_slice(name);
    bytes.extend_from_slice(payload);
    let path = dir.join("wasm_ratelimit-next.wasm");
    std::fs::write(&path, bytes).unwrap();
    path
}

#[test]
fn a_new_wasm_with_the_same_vm_id_keeps_the_counters() {
    if common::build() == Build::Native {
        return; // the native build is replaced by a restart only
    }
    let dir = common::scratch("upgrade");
    let port = free_port();
    common::publish_lds(&dir, &common::lds_listener(port, CONFIG, &wasm_path()));
    let envoy = Envoy::start_yaml(&common::lds_bootstrap(&dir));
    let created = envoy.stat("wasm.envoy.wasm.runtime.v8.created").unwrap();
    let mut c = Client::connect(envoy.addr).unwrap();
    assert_remaining(&mut c, &[4, 3, 2]);

    let next = other_module(&dir);
    common::publish_lds(&dir, &common::lds_listener(port, CONFIG, &next));
    let fifteen_s = Duration::from_secs(15);
    envoy.expect_stat("listener_manager.lds.update_success", fifteen_s, |v| v >= 2);
    // New VMs, with the new code.
    envoy.expect_stat("wasm.envoy.wasm.runtime.v8.created", fifteen_s, |v| {
        v > created
    });
    let mut c = Client::connect(envoy.addr).unwrap();
    let r = c.get("/").unwrap();
    assert_eq!(
        (r.status, r.header_u64("x-ratelimit-remaining")),
        (200, Some(1)),
        "the three requests counted by the old module stay counted"
    );
    assert_eq!(c.get("/").unwrap().status, 200);
    assert_eq!(c.get("/").unwrap().status, 429);
    let _ = std::fs::remove_dir_all(&dir);
}
