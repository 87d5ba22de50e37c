//! Running the built CLI from the repository root, for the CLI's tests.
#![allow(dead_code, clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::process::Command;

/// `path` under the repository root.
pub fn root(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .join(path)
}

/// Runs `ratelimit-config ARGS` from the repository root: (exit code, stdout, stderr).
pub fn cli(args: &[&str]) -> (i32, String, String) {
    ratelimit_core::testkit::output(
        Command::new(env!("CARGO_BIN_EXE_ratelimit-config"))
            .current_dir(root(""))
            .args(args),
    )
}
