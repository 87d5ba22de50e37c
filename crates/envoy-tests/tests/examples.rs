//! Every example in examples/ is replayed from its README: each README has at least one console
//! session marked `<!-- replay: example NAME -->` with its own name, which docs.rs replays in a
//! real Envoy running `examples/NAME/envoy.yaml` (with the interpreter of `common::replay`).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod common;

use common::pages;
use std::path::PathBuf;

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
fn every_example_has_a_session_of_its_own() {
    let dirs = examples();
    assert!(dirs.len() >= 7, "{dirs:?}");
    for dir in dirs {
        let name = dir.file_name().unwrap().to_str().unwrap().to_string();
        assert!(dir.join("envoy.yaml").is_file(), "{name}: no envoy.yaml");
        let page = pages::page(&format!("examples/{name}/README.md"));
        let own = format!("example {name}");
        let n = page
            .blocks()
            .iter()
            .filter(|b| b.lang == "console" && b.marker.as_deref() == Some(own.as_str()))
            .count();
        assert!(
            n > 0,
            "examples/{name}/README.md: no session marked <!-- replay: {own} -->"
        );
    }
}
