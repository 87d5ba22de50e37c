//! What the tutorials show that the docs' replay cannot run, run here against the shipped
//! examples in the build under test:
//!
//! - `docs/src/tutorials/llm-gateway.md`: `examples/llm-gateway/client.py` (the official OpenAI
//!   and Anthropic SDKs, from the project virtualenv) against the gateway prints `client.out`;
//! - `docs/src/tutorials/fleet.md`: three Envoys of `examples/fleet/envoy.yaml` sharing one rate
//!   limit service (the test one, answering one call at a time), three requests to each, give
//!   `three-envoys.out`: the fleet admits the key's 6, not 3 × 6.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod common;

use common::{root, Client, Envoy};
use std::process::Command;

fn read(path: &str) -> String {
    std::fs::read_to_string(root().join(path)).unwrap()
}

/// The refusal's wait is what is left of the service's window, which began at the first of the
/// SDK's calls: `retry in N s.` with N from 50 to 60 is shown as 60.
fn fixed_wait(line: &str) -> String {
    for n in 50..60 {
        let wait = format!("retry in {n} s.");
        if line.contains(&wait) {
            return line.replace(&wait, "retry in 60 s.");
        }
    }
    line.to_string()
}

#[test]
fn the_sdk_client_of_the_llm_gateway_prints_what_the_tutorial_shows() {
    let (yaml, _services) = common::example(&root().join("examples/llm-gateway"));
    let envoy = Envoy::start_yaml(&common::for_build(&yaml));
    let out = Command::new(common::python())
        .arg(root().join("examples/llm-gateway/client.py"))
        .env("GATEWAY_URL", format!("http://{}", envoy.addr))
        .output()
        .unwrap_or_else(|e| {
            panic!(
                "{}: {e} (make sdks installs the SDK)",
                common::python().display()
            )
        });
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let got: String = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| fixed_wait(l) + "\n")
        .collect();
    assert_eq!(got, read("examples/llm-gateway/client.out"), "{stderr}");
}

#[test]
fn three_envoys_share_one_quota_per_key() {
    // One service (and its Redis) for the three, as the tutorial starts them.
    let (yaml, _services) = common::example(&root().join("examples/fleet"));
    let yaml = common::for_build(&yaml);
    let envoys: Vec<Envoy> = (0..3).map(|_| Envoy::start_yaml(&yaml)).collect();
    // The tutorial's Envoys listen on 10000, 10010 and 10020.
    let mut got = String::new();
    for (envoy, port) in envoys.iter().zip([10000, 10010, 10020]) {
        for _ in 0..3 {
            let r = Client::connect(envoy.addr)
                .unwrap()
                .send("GET", "/api/items", &[("x-api-key", "k1")])
                .unwrap();
            let remaining = r.header("x-ratelimit-remaining").unwrap_or("");
            got.push_str(&format!("{port} {} {remaining}\n", r.status));
        }
    }
    assert_eq!(got, read("examples/fleet/three-envoys.out"));
}
