//! Keeps the fuzz targets honest between fuzzing runs, on stable and without libFuzzer's
//! instrumentation: every target's binary builds (`cargo test` builds a package's binaries for
//! its integration tests; each is named below, so a target missing from Cargo.toml fails to
//! compile), and every input of the seed corpora (`fuzz/corpus/<target>/`, the crashes fixed
//! included) passes its check.
//!
//! `cargo test --manifest-path fuzz/Cargo.toml` (`make fuzz-test`).

use std::path::Path;

/// Each target's binary, as cargo built it for this test.
const BINARIES: [(&str, &str); 12] = [
    ("config", env!("CARGO_BIN_EXE_config")),
    ("manifest", env!("CARGO_BIN_EXE_manifest")),
    ("body_scan", env!("CARGO_BIN_EXE_body_scan")),
    ("usage_scan", env!("CARGO_BIN_EXE_usage_scan")),
    ("rls", env!("CARGO_BIN_EXE_rls")),
    ("keys", env!("CARGO_BIN_EXE_keys")),
    ("operator", env!("CARGO_BIN_EXE_operator")),
    ("render", env!("CARGO_BIN_EXE_render")),
    ("algorithms", env!("CARGO_BIN_EXE_algorithms")),
    ("calendar", env!("CARGO_BIN_EXE_calendar")),
    ("provider", env!("CARGO_BIN_EXE_provider")),
    ("share", env!("CARGO_BIN_EXE_share")),
];

#[test]
fn every_target_builds() {
    for (name, path) in BINARIES {
        assert!(Path::new(path).is_file(), "{name}: no binary at {path}");
        assert!(ratelimit_fuzz::TARGETS.contains(&name), "{name}");
    }
    assert_eq!(BINARIES.len(), ratelimit_fuzz::TARGETS.len());
}

#[test]
fn every_seed_passes_its_target() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("corpus");
    for name in ratelimit_fuzz::TARGETS {
        let check = ratelimit_fuzz::target(name).unwrap();
        let dir = root.join(name);
        let mut n = 0;
        for entry in std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
            let path = entry.unwrap().path();
            let data = std::fs::read(&path).unwrap();
            let result = std::panic::catch_unwind(|| check(&data));
            assert!(result.is_ok(), "{name}: {} fails", path.display());
            n += 1;
        }
        assert!(n > 0, "{name}: no seeds in {}", dir.display());
    }
}

#[test]
fn empty_and_short_inputs_pass_every_target() {
    for name in ratelimit_fuzz::TARGETS {
        let check = ratelimit_fuzz::target(name).unwrap();
        for data in [&b""[..], b"\0", b"\xff\xff\xff\xff\xff\xff\xff\xff", b"{}"] {
            check(data);
        }
    }
}
