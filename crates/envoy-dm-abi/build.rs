//! Selects the Envoy release whose dynamic-module ABI this build targets: `ENVOY_VERSION`
//! (default 1.40.0) names a folder of `abi/` (the vendored declarations of that release). The
//! ABI version string and the marker callback are read from that folder into
//! `$OUT_DIR/abi_selection.rs`, included by `src/sys.rs`.
//!
//! The declarations the module uses are identical in every vendored release (checked by
//! `src/header_check.rs`), so the selection changes only the version string the module reports
//! to Envoy and the callback whose absence makes it refuse an older Envoy.

use std::path::Path;

const DEFAULT: &str = "1.40.0";

fn main() {
    println!("cargo:rerun-if-env-changed=ENVOY_VERSION");
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("abi");
    println!("cargo:rerun-if-changed={}", dir.display());
    let requested = std::env::var("ENVOY_VERSION").unwrap_or_default();
    let requested = if requested.trim().is_empty() {
        DEFAULT.to_string()
    } else {
        requested.trim().to_string()
    };
    let mut vendored: Vec<String> = std::fs::read_dir(&dir)
        .map(|entries| {
            entries
                .filter_map(Result::ok)
                .filter(|e| e.path().join("abi.decl").is_file())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    vendored.sort();
    let version = select(&requested, &vendored).unwrap_or_else(|| {
        fail(&format!(
            "ENVOY_VERSION={requested}: no vendored ABI for it in {}; supported: {}",
            dir.display(),
            vendored.join(", ")
        ))
    });
    if version != requested {
        println!(
            "cargo:warning=ENVOY_VERSION={requested}: building against the {version} ABI (same minor release)"
        );
    }
    let header_path = dir.join(&version).join("abi.decl");
    let marker_path = dir.join(&version).join("MARKER");
    println!("cargo:rerun-if-changed={}", header_path.display());
    println!("cargo:rerun-if-changed={}", marker_path.display());
    let header = std::fs::read_to_string(&header_path)
        .unwrap_or_else(|e| fail(&format!("{}: {e}", header_path.display())));
    let abi = abi_version(&header).unwrap_or_else(|| {
        fail(&format!(
            "{}: no #define ENVOY_DYNAMIC_MODULES_ABI_VERSION \"...\"",
            header_path.display()
        ))
    });
    let marker = std::fs::read_to_string(&marker_path)
        .unwrap_or_else(|e| fail(&format!("{}: {e}", marker_path.display())));
    let marker = marker.trim();
    if !marker.starts_with("envoy_dynamic_module_callback_") || !header.contains(marker) {
        fail(&format!(
            "{}: {marker:?} is not a callback declared in abi.decl",
            marker_path.display()
        ));
    }
    let out = Path::new(&std::env::var("OUT_DIR").unwrap_or_else(|_| fail("OUT_DIR not set")))
        .join("abi_selection.rs");
    let code = format!(
        "/// The Envoy release this build targets (`ENVOY_VERSION` at build time; `abi/{version}/`).\n\
         pub const ENVOY_VERSION: &str = {version:?};\n\
         /// The ABI version this module reports to Envoy: `ENVOY_DYNAMIC_MODULES_ABI_VERSION` of\n\
         /// `abi/{version}/abi.decl`.\n\
         pub const ABI_VERSION: &::std::ffi::CStr = c{abi:?};\n\
         /// A callback Envoy {version} exports and the release before it does not\n\
         /// (`abi/{version}/MARKER`): without it, this Envoy is older than the build's.\n\
         pub const MARKER: &::std::ffi::CStr = c{marker:?};\n"
    );
    std::fs::write(&out, code).unwrap_or_else(|e| fail(&format!("{}: {e}", out.display())));
}

/// The vendored folder for `requested`: the same version, else the only one of the same
/// `major.minor` (a patch release keeps its minor release's ABI).
fn select(requested: &str, vendored: &[String]) -> Option<String> {
    if vendored.iter().any(|v| v == requested) {
        return Some(requested.to_string());
    }
    let minor = |v: &str| v.splitn(3, '.').take(2).collect::<Vec<_>>().join(".");
    let same: Vec<&String> = vendored
        .iter()
        .filter(|v| minor(v) == minor(requested))
        .collect();
    match same.as_slice() {
        [one] => Some((*one).clone()),
        _ => None,
    }
}

/// The string of `#define ENVOY_DYNAMIC_MODULES_ABI_VERSION "..."`.
fn abi_version(header: &str) -> Option<String> {
    header.lines().find_map(|l| {
        let rest = l
            .trim()
            .strip_prefix("#define")?
            .trim_start()
            .strip_prefix("ENVOY_DYNAMIC_MODULES_ABI_VERSION")?;
        let s = rest.trim().strip_prefix('"')?.strip_suffix('"')?;
        Some(s.to_string())
    })
}

fn fail(message: &str) -> ! {
    eprintln!("envoy-dm-abi: {message}");
    std::process::exit(1)
}
