//! The crate against Envoy's declarations: every `abi/<release>/abi.decl` is
//! parsed (a small parser for the C this header uses), and so are this crate's sources (a small
//! tokenizer for the Rust they use). For each release it checks
//! - every `extern "C"` function named `envoy_*` in `src/` (the callbacks of `sys.rs`): declared
//!   by the header, same number of parameters, each parameter and the return type the Rust type
//!   that [`TYPES`] maps the C type to;
//! - every `envoy_dynamic_module_on_*` hook `export_http_filter!` (hooks.rs) defines: the same,
//!   and the module defines exactly the hooks the description declares;
//! - every `#[repr(C)]` enum and `u32` newtype of `sys.rs` and their constants: the value of the
//!   C enumerator of the same name;
//! - every `#[repr(C)]` struct: field names, order and types, and the layout rustc gives it
//!   (size, alignment, offsets) against the layout C gives the header's struct;
//! - every pointer alias of `sys.rs` against the C typedef it stands for;
//! - that consecutive releases only add (functions, appended enumerators), so one set of
//!   declarations serves them all, and that the build's ABI string and marker come from the
//!   selected release.
//!
//! C's `T*` is Rust's `*mut T`, `const T*` is `*const T`. C enums are `int`-sized on the
//! targets Envoy ships for (SysV x86-64, AArch64): 4 bytes.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use crate::sys::*;
use std::collections::BTreeMap;
use std::mem::{align_of, offset_of, size_of};
use std::path::{Path, PathBuf};

/// Which Rust type stands for which C type. A C typedef of a pointer that is not listed is
/// compared by what it points to (`const char*`: `*const c_char`).
const TYPES: &[(&str, &str)] = &[
    (
        "envoy_dynamic_module_type_abi_version_module_ptr",
        "AbiVersionPtr",
    ),
    (
        "envoy_dynamic_module_type_http_filter_config_envoy_ptr",
        "ConfigEnvoyPtr",
    ),
    (
        "envoy_dynamic_module_type_http_filter_config_module_ptr",
        "ConfigModulePtr",
    ),
    (
        "envoy_dynamic_module_type_http_filter_envoy_ptr",
        "FilterEnvoyPtr",
    ),
    (
        "envoy_dynamic_module_type_http_filter_module_ptr",
        "FilterModulePtr",
    ),
    (
        "envoy_dynamic_module_type_http_filter_scheduler_module_ptr",
        "SchedulerPtr",
    ),
    (
        "envoy_dynamic_module_type_http_filter_config_scheduler_module_ptr",
        "ConfigSchedulerPtr",
    ),
    ("envoy_dynamic_module_type_envoy_buffer", "EnvoyBuffer"),
    ("envoy_dynamic_module_type_module_buffer", "ModuleBuffer"),
    (
        "envoy_dynamic_module_type_module_http_header",
        "ModuleHeader",
    ),
    ("envoy_dynamic_module_type_envoy_http_header", "EnvoyHeader"),
    ("envoy_dynamic_module_type_http_header_type", "HeaderType"),
    ("envoy_dynamic_module_type_http_body_type", "BodyType"),
    ("envoy_dynamic_module_type_log_level", "LogLevel"),
    (
        "envoy_dynamic_module_type_metadata_source",
        "MetadataSource",
    ),
    ("envoy_dynamic_module_type_attribute_id", "AttributeId"),
    ("envoy_dynamic_module_type_metrics_result", "Code"),
    ("envoy_dynamic_module_type_http_callout_init_result", "Code"),
    (
        "envoy_dynamic_module_type_http_callout_result",
        "CalloutResult",
    ),
    (
        "envoy_dynamic_module_type_http_stream_reset_reason",
        "ResetReason",
    ),
    (
        "envoy_dynamic_module_type_on_http_filter_request_headers_status",
        "HeadersStatus",
    ),
    (
        "envoy_dynamic_module_type_on_http_filter_response_headers_status",
        "HeadersStatus",
    ),
    (
        "envoy_dynamic_module_type_on_http_filter_request_body_status",
        "BodyStatus",
    ),
    (
        "envoy_dynamic_module_type_on_http_filter_response_body_status",
        "BodyStatus",
    ),
    (
        "envoy_dynamic_module_type_on_http_filter_request_trailers_status",
        "TrailersStatus",
    ),
    (
        "envoy_dynamic_module_type_on_http_filter_response_trailers_status",
        "TrailersStatus",
    ),
    (
        "envoy_dynamic_module_type_on_http_filter_local_reply_status",
        "LocalReplyStatus",
    ),
];

/// What rustc makes of the structs: (name, size, align, [(field, offset)]).
type RustLayout = (&'static str, usize, usize, Vec<(&'static str, usize)>);

macro_rules! layout {
    ($t:ident { $($f:ident),* }) => {
        (stringify!($t), size_of::<$t>(), align_of::<$t>(), vec![$((stringify!($f), offset_of!($t, $f))),*])
    };
}

fn rust_layouts() -> Vec<RustLayout> {
    vec![
        layout!(EnvoyBuffer { ptr, length }),
        layout!(ModuleBuffer { ptr, length }),
        layout!(ModuleHeader {
            key_ptr,
            key_length,
            value_ptr,
            value_length
        }),
        layout!(EnvoyHeader {
            key_ptr,
            key_length,
            value_ptr,
            value_length
        }),
    ]
}

/// What rustc makes of the enums and enum newtypes: (name, size, align).
fn rust_enum_sizes() -> Vec<(&'static str, usize, usize)> {
    macro_rules! sizes {
        ($($t:ident),*) => { vec![$((stringify!($t), size_of::<$t>(), align_of::<$t>())),*] };
    }
    sizes!(
        HeaderType,
        BodyType,
        LogLevel,
        HeadersStatus,
        BodyStatus,
        TrailersStatus,
        LocalReplyStatus,
        AttributeId,
        Code,
        ResetReason,
        CalloutResult,
        MetadataSource
    )
}

// ---------------------------------------------------------------------------------------------
// The C side
// ---------------------------------------------------------------------------------------------

#[derive(Clone, Debug, PartialEq, Eq)]
enum CType {
    /// A primitive, typedef, struct or enum name.
    Named(String),
    Void,
    Ptr {
        constant: bool,
        to: Box<CType>,
    },
}

#[derive(Clone, Debug, PartialEq, Eq)]
struct CFn {
    ret: CType,
    /// (name, type)
    params: Vec<(String, CType)>,
}

#[derive(Debug, Default)]
struct CHeader {
    abi_version: Option<String>,
    typedefs: BTreeMap<String, CType>,
    structs: BTreeMap<String, Vec<(String, CType)>>,
    /// Members in order, with their values.
    enums: BTreeMap<String, Vec<(String, i64)>>,
    functions: BTreeMap<String, CFn>,
}

/// `// ...` and `/* ... */` removed.
fn strip_c_comments(text: &str) -> String {
    let mut out = String::new();
    let mut rest = text;
    while !rest.is_empty() {
        if let Some(r) = rest.strip_prefix("//") {
            rest = r.find('\n').map_or("", |i| &r[i..]);
        } else if let Some(r) = rest.strip_prefix("/*") {
            rest = r.find("*/").map_or("", |i| &r[i + 2..]);
            out.push(' ');
        } else {
            let c = rest.chars().next().unwrap();
            out.push(c);
            rest = &rest[c.len_utf8()..];
        }
    }
    out
}

/// A C type from its words: `const T*`, `T*`, `void`, `T`.
fn c_type(words: &[&str]) -> CType {
    let mut constant = false;
    let mut base = None;
    let mut stars = 0;
    for w in words {
        match *w {
            "const" => constant = true,
            "*" => stars += 1,
            name => {
                assert!(base.is_none(), "two type names in {words:?}");
                base = Some(name);
            }
        }
    }
    let base = base.unwrap_or_else(|| panic!("no type name in {words:?}"));
    let mut t = if base == "void" {
        CType::Void
    } else {
        CType::Named(base.to_string())
    };
    for i in 0..stars {
        t = CType::Ptr {
            constant: constant && i == 0,
            to: Box::new(t),
        };
    }
    t
}

/// Words of a declaration: identifiers, numbers and `*` (other punctuation is handled by the
/// caller).
fn words(text: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let mut start = None;
    for (i, c) in text.char_indices() {
        let word = c.is_ascii_alphanumeric() || c == '_' || c == '-';
        match (word, start) {
            (true, None) => start = Some(i),
            (false, Some(s)) => {
                out.push(&text[s..i]);
                start = None;
            }
            _ => {}
        }
        if c == '*' {
            out.push("*");
        }
    }
    if let Some(s) = start {
        out.push(&text[s..]);
    }
    out
}

/// `type name`: the type and the name.
fn c_declarator(text: &str) -> (String, CType) {
    let w = words(text);
    let (name, ty) = w
        .split_last()
        .unwrap_or_else(|| panic!("empty declarator {text:?}"));
    (name.to_string(), c_type(ty))
}

fn parse_c(text: &str) -> CHeader {
    let mut h = CHeader::default();
    let text = strip_c_comments(text);
    let mut code = String::new();
    for line in text.lines() {
        let l = line.trim();
        if let Some(d) = l.strip_prefix('#') {
            let d = d.trim();
            if let Some(rest) = d.strip_prefix("define ENVOY_DYNAMIC_MODULES_ABI_VERSION") {
                h.abi_version = Some(rest.trim().trim_matches('"').to_string());
            }
            assert!(
                d.starts_with("define") || d.starts_with("include"),
                "unexpected preprocessor line {l:?}"
            );
            continue;
        }
        code.push_str(line);
        code.push('\n');
    }
    for decl in code.split(';') {
        let d = decl.split_whitespace().collect::<Vec<_>>().join(" ");
        if d.is_empty() {
            continue;
        }
        let open = d.find('{');
        assert!(
            !d.starts_with("typedef struct"),
            "struct bodies are taken out by parse_header: {d:?}"
        );
        if d.starts_with("typedef enum ") {
            let (o, close) = (open.unwrap(), d.rfind('}').unwrap());
            let name = words(&d[close + 1..]).join("");
            let mut next = 0i64;
            let mut members = Vec::new();
            for m in d[o + 1..close].split(',') {
                let m = m.trim();
                if m.is_empty() {
                    continue;
                }
                let (member, value) = match m.split_once('=') {
                    Some((n, v)) => (n.trim(), v.trim().parse::<i64>().unwrap()),
                    None => (m, next),
                };
                members.push((member.to_string(), value));
                next = value + 1;
            }
            h.enums.insert(name, members);
            continue;
        }
        if let Some(rest) = d.strip_prefix("typedef ") {
            let (name, ty) = c_declarator(rest);
            h.typedefs.insert(name, ty);
            continue;
        }
        let (Some(o), Some(c)) = (d.find('('), d.rfind(')')) else {
            panic!("unparsed declaration {d:?}");
        };
        let (name, ret) = c_declarator(&d[..o]);
        let inside = d[o + 1..c].trim();
        let params = if inside.is_empty() || inside == "void" {
            Vec::new()
        } else {
            inside.split(',').map(c_declarator).collect()
        };
        let f = CFn { ret, params };
        assert!(
            h.functions.insert(name.clone(), f).is_none(),
            "{name} twice"
        );
    }
    h
}

/// `parse_c`, with struct bodies first taken out (their fields end in ';' too).
fn parse_header(text: &str) -> CHeader {
    let text = strip_c_comments(text);
    let mut rest = text.as_str();
    let mut outside = String::new();
    let mut structs = BTreeMap::new();
    while let Some(i) = rest.find("typedef struct") {
        outside.push_str(&rest[..i]);
        let after = &rest[i..];
        let open = after.find('{').unwrap();
        let close = after.find('}').unwrap();
        let end = close + after[close..].find(';').unwrap();
        let name = words(&after[close + 1..end]).join("");
        let fields: Vec<(String, CType)> = after[open + 1..close]
            .split(';')
            .map(str::trim)
            .filter(|f| !f.is_empty())
            .map(c_declarator)
            .collect();
        structs.insert(name, fields);
        rest = &after[end + 1..];
    }
    outside.push_str(rest);
    let mut h = parse_c(&outside);
    h.structs = structs;
    h
}

fn vendored() -> Vec<(String, CHeader, String)> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("abi");
    let mut out: Vec<(String, CHeader, String)> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.join("abi.decl").is_file())
        .map(|p| {
            let version = p.file_name().unwrap().to_string_lossy().into_owned();
            let header = parse_header(&std::fs::read_to_string(p.join("abi.decl")).unwrap());
            let marker = std::fs::read_to_string(p.join("MARKER")).unwrap();
            (version, header, marker.trim().to_string())
        })
        .collect();
    out.sort_by_key(|(v, _, _)| version_key(v));
    assert!(
        out.len() >= 2,
        "expected the vendored releases in {}",
        dir.display()
    );
    out
}

fn version_key(v: &str) -> Vec<u32> {
    v.split('.').map(|p| p.parse().unwrap_or(0)).collect()
}

// ---------------------------------------------------------------------------------------------
// The Rust side
// ---------------------------------------------------------------------------------------------

#[derive(Clone, Debug, PartialEq, Eq)]
enum Tok {
    Ident(String),
    Punct(String),
    Lit(String),
    Str(String),
}

fn tokenize(src: &str) -> Vec<Tok> {
    let b: Vec<char> = src.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        if c.is_whitespace() {
            i += 1;
        } else if c == '/' && b.get(i + 1) == Some(&'/') {
            while i < b.len() && b[i] != '\n' {
                i += 1;
            }
        } else if c == '/' && b.get(i + 1) == Some(&'*') {
            i += 2;
            while i + 1 < b.len() && !(b[i] == '*' && b[i + 1] == '/') {
                i += 1;
            }
            i += 2;
        } else if c == '"' {
            let mut s = String::new();
            i += 1;
            while i < b.len() && b[i] != '"' {
                if b[i] == '\\' {
                    i += 1;
                }
                s.push(b[i]);
                i += 1;
            }
            i += 1;
            out.push(Tok::Str(s));
        } else if c == '\'' {
            // A lifetime ('a) or a char literal ('x').
            if b.get(i + 2) == Some(&'\'') {
                i += 3;
            } else {
                i += 1;
                while i < b.len() && (b[i].is_alphanumeric() || b[i] == '_') {
                    i += 1;
                }
            }
        } else if c.is_alphabetic() || c == '_' {
            let s = i;
            while i < b.len() && (b[i].is_alphanumeric() || b[i] == '_') {
                i += 1;
            }
            out.push(Tok::Ident(b[s..i].iter().collect()));
        } else if c.is_ascii_digit() {
            let s = i;
            while i < b.len() && (b[i].is_alphanumeric() || b[i] == '_') {
                i += 1;
            }
            out.push(Tok::Lit(b[s..i].iter().collect()));
        } else {
            let two: String = b[i..(i + 2).min(b.len())].iter().collect();
            if two == "::" || two == "->" || two == "=>" {
                out.push(Tok::Punct(two));
                i += 2;
            } else {
                out.push(Tok::Punct(c.to_string()));
                i += 1;
            }
        }
    }
    out
}

fn is(t: Option<&Tok>, p: &str) -> bool {
    matches!(t, Some(Tok::Punct(x)) | Some(Tok::Ident(x)) if x == p)
}

/// The index of the token closing the bracket opened at `open`.
fn closing(toks: &[Tok], open: usize) -> usize {
    let mut depth = 0i32;
    for (i, t) in toks.iter().enumerate().skip(open) {
        if let Tok::Punct(p) = t {
            match p.as_str() {
                "(" | "[" | "{" => depth += 1,
                ")" | "]" | "}" => {
                    depth -= 1;
                    if depth == 0 {
                        return i;
                    }
                }
                _ => {}
            }
        }
    }
    panic!("unbalanced brackets from token {open}")
}

/// A type written as tokens, normalized: paths reduced to their last segment, `*const T`,
/// `*mut T`; the empty string for none.
fn type_text(toks: &[Tok]) -> String {
    let mut out = String::new();
    let mut i = 0;
    while i < toks.len() {
        match &toks[i] {
            Tok::Punct(p) if p == "*" => {
                let q = match toks.get(i + 1) {
                    Some(Tok::Ident(q)) => q.clone(),
                    t => panic!("raw pointer without const/mut: {t:?}"),
                };
                out.push_str(&format!("*{q} "));
                i += 2;
            }
            Tok::Punct(p) if p == "::" || p == "$" => i += 1,
            Tok::Ident(name) => {
                if is(toks.get(i + 1), "::") {
                    i += 2;
                } else {
                    out.push_str(name);
                    i += 1;
                }
            }
            t => panic!("unexpected token {t:?} in a type"),
        }
    }
    out
}

/// Splits tokens at commas outside brackets.
fn split_commas(toks: &[Tok]) -> Vec<&[Tok]> {
    let mut out = Vec::new();
    let (mut depth, mut start) = (0i32, 0);
    for (i, t) in toks.iter().enumerate() {
        if let Tok::Punct(p) = t {
            match p.as_str() {
                "(" | "[" | "{" | "<" => depth += 1,
                ")" | "]" | "}" | ">" => depth -= 1,
                "," if depth == 0 => {
                    out.push(&toks[start..i]);
                    start = i + 1;
                }
                _ => {}
            }
        }
    }
    if start < toks.len() {
        out.push(&toks[start..]);
    }
    out
}

/// A Rust function signature: parameter types and the return type (normalized).
#[derive(Clone, Debug, PartialEq, Eq)]
struct RFn {
    params: Vec<(String, String)>,
    ret: String,
}

/// `fn NAME(params) -> RET` starting at the `fn` token; the signature and the index after it.
fn rust_fn(toks: &[Tok], at: usize) -> (String, RFn, usize) {
    let Some(Tok::Ident(name)) = toks.get(at + 1) else {
        panic!("fn without a name at token {at}");
    };
    assert!(is(toks.get(at + 2), "("), "{name}: no parameter list");
    let close = closing(toks, at + 2);
    let params = split_commas(&toks[at + 3..close])
        .into_iter()
        .map(|p| {
            let colon = p
                .iter()
                .position(|t| *t == Tok::Punct(":".into()))
                .unwrap_or_else(|| panic!("{name}: parameter without a type: {p:?}"));
            let pat = p[..colon]
                .iter()
                .map(|t| match t {
                    Tok::Ident(s) => s.clone(),
                    _ => String::new(),
                })
                .collect::<Vec<_>>()
                .join(" ");
            (pat, type_text(&p[colon + 1..]))
        })
        .collect();
    let mut end = close + 1;
    let ret = if is(toks.get(end), "->") {
        let s = end + 1;
        while !is(toks.get(end), ";") && !is(toks.get(end), "{") {
            end += 1;
        }
        type_text(&toks[s..end])
    } else {
        String::new()
    };
    (name.clone(), RFn { params, ret }, end)
}

#[derive(Debug, Default)]
struct RustDecls {
    /// `extern "C" { fn ... }` items named `envoy_*`, with the file they are in.
    callbacks: BTreeMap<String, (RFn, String)>,
    /// Other foreign functions (not Envoy's).
    foreign: Vec<String>,
    /// `extern "C" fn envoy_dynamic_module_on_*` definitions.
    hooks: BTreeMap<String, RFn>,
    /// `pub type NAME = TYPE;`
    aliases: BTreeMap<String, String>,
    /// `#[repr(C)] struct NAME { field: TYPE }`
    structs: BTreeMap<String, Vec<(String, String)>>,
    /// `#[repr(C)] enum NAME { V = n }`
    enums: BTreeMap<String, Vec<(String, i64)>>,
    /// `#[repr(transparent)] struct NAME(pub u32);`
    newtypes: BTreeMap<String, String>,
    /// `const NAME: T = T(n);` for newtypes T: (T, n)
    consts: BTreeMap<String, (String, i64)>,
    /// Types declared without the repr their kind needs.
    bad_repr: Vec<String>,
}

fn parse_rust(files: &[(String, String)]) -> RustDecls {
    let mut r = RustDecls::default();
    for (file, src) in files {
        let toks = tokenize(src);
        let mut repr = String::new();
        let mut i = 0;
        while i < toks.len() {
            // Attributes: remember the last repr.
            if is(toks.get(i), "#") && is(toks.get(i + 1), "[") {
                let close = closing(&toks, i + 1);
                if is(toks.get(i + 2), "repr") {
                    repr = format!("{:?}", &toks[i + 3..close]);
                }
                i = close + 1;
                continue;
            }
            let tok = &toks[i];
            if is(Some(tok), "pub") {
                i += 1;
                continue;
            }
            let item_repr = std::mem::take(&mut repr);
            if is(Some(tok), "extern") {
                if let Some(Tok::Str(abi)) = toks.get(i + 1) {
                    assert_eq!(abi, "C", "{file}: extern {abi:?}");
                    if is(toks.get(i + 2), "{") {
                        let close = closing(&toks, i + 2);
                        let mut j = i + 3;
                        while j < close {
                            if is(toks.get(j), "fn") {
                                let (name, f, end) = rust_fn(&toks, j);
                                if name.starts_with("envoy_") {
                                    let old = r.callbacks.insert(name.clone(), (f, file.clone()));
                                    assert!(old.is_none(), "{name} declared twice");
                                } else {
                                    r.foreign.push(name);
                                }
                                j = end;
                            }
                            j += 1;
                        }
                        i = close + 1;
                        continue;
                    }
                    if is(toks.get(i + 2), "fn") {
                        let (name, f, end) = rust_fn(&toks, i + 2);
                        if name.starts_with("envoy_dynamic_module_on_") {
                            assert!(r.hooks.insert(name.clone(), f).is_none(), "{name} twice");
                        }
                        i = end;
                        continue;
                    }
                }
            }
            if file.ends_with("sys.rs") {
                let name = match toks.get(i + 1) {
                    Some(Tok::Ident(n)) => n.clone(),
                    _ => String::new(),
                };
                if is(Some(tok), "type") && is(toks.get(i + 2), "=") {
                    let end = (i..toks.len()).find(|&k| is(toks.get(k), ";")).unwrap();
                    r.aliases.insert(name, type_text(&toks[i + 3..end]));
                    i = end;
                } else if is(Some(tok), "struct") && is(toks.get(i + 2), "{") {
                    let close = closing(&toks, i + 2);
                    let fields = split_commas(&toks[i + 3..close])
                        .into_iter()
                        .map(|f| {
                            let f: Vec<Tok> =
                                f.iter().filter(|t| !is(Some(t), "pub")).cloned().collect();
                            let Some(Tok::Ident(n)) = f.first() else {
                                panic!("{name}: field {f:?}");
                            };
                            (n.clone(), type_text(&f[2..]))
                        })
                        .collect();
                    if !item_repr.contains("Ident(\"C\")") {
                        r.bad_repr.push(name.clone());
                    }
                    r.structs.insert(name, fields);
                    i = close;
                } else if is(Some(tok), "struct") && is(toks.get(i + 2), "(") {
                    let close = closing(&toks, i + 2);
                    let inner: Vec<Tok> = toks[i + 3..close]
                        .iter()
                        .filter(|t| !is(Some(t), "pub"))
                        .cloned()
                        .collect();
                    if !item_repr.contains("transparent") {
                        r.bad_repr.push(name.clone());
                    }
                    r.newtypes.insert(name, type_text(&inner));
                    i = close;
                } else if is(Some(tok), "enum") && is(toks.get(i + 2), "{") {
                    let close = closing(&toks, i + 2);
                    let variants = split_commas(&toks[i + 3..close])
                        .into_iter()
                        .map(|v| match v {
                            [Tok::Ident(n), Tok::Punct(eq), Tok::Lit(x)] if eq == "=" => {
                                (n.clone(), x.parse().unwrap())
                            }
                            _ => panic!("{name}: variant without an explicit value: {v:?}"),
                        })
                        .collect();
                    if !item_repr.contains("Ident(\"C\")") {
                        r.bad_repr.push(name.clone());
                    }
                    r.enums.insert(name, variants);
                    i = close;
                } else if is(Some(tok), "const") && is(toks.get(i + 2), ":") {
                    let end = (i..toks.len()).find(|&k| is(toks.get(k), ";")).unwrap();
                    if let [Tok::Ident(t), Tok::Punct(eq), Tok::Ident(t2), Tok::Punct(o), Tok::Lit(v), Tok::Punct(c)] =
                        &toks[i + 3..end]
                    {
                        if eq == "=" && t == t2 && o == "(" && c == ")" {
                            r.consts.insert(name, (t.clone(), v.parse().unwrap()));
                        }
                    }
                    i = end;
                }
            }
            i += 1;
        }
    }
    r
}

fn crate_sources() -> Vec<(String, String)> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "rs"))
        .filter(|p| !p.ends_with("header_check.rs"))
        .collect();
    files.sort();
    files
        .into_iter()
        .map(|p| {
            let name = p.file_name().unwrap().to_string_lossy().into_owned();
            (name, std::fs::read_to_string(&p).unwrap())
        })
        .collect()
}

// ---------------------------------------------------------------------------------------------
// The comparisons (each returns the differences it found)
// ---------------------------------------------------------------------------------------------

/// The Rust type text a C type must be written as.
fn rust_of(t: &CType, h: &CHeader) -> Result<String, String> {
    Ok(match t {
        CType::Void => "c_void".into(),
        CType::Ptr { constant, to } => {
            format!(
                "*{} {}",
                if *constant { "const" } else { "mut" },
                rust_of(to, h)?
            )
        }
        CType::Named(n) => {
            if let Some((_, r)) = TYPES.iter().find(|(c, _)| c == n) {
                return Ok((*r).to_string());
            }
            match n.as_str() {
                "bool" => "bool".into(),
                "char" => "c_char".into(),
                "size_t" => "usize".into(),
                "uint64_t" => "u64".into(),
                "uint32_t" => "u32".into(),
                "double" => "f64".into(),
                _ => match h.typedefs.get(n) {
                    Some(def) => rust_of(def, h)?,
                    None => return Err(format!("no Rust type for the C type {n}")),
                },
            }
        }
    })
}

fn compare_fn(name: &str, c: &CFn, r: &RFn, h: &CHeader) -> Vec<String> {
    let mut errors = Vec::new();
    if c.params.len() != r.params.len() {
        errors.push(format!(
            "{name}: {} parameters in Rust, {} in the header",
            r.params.len(),
            c.params.len()
        ));
        return errors;
    }
    for (k, ((cn, ct), (_, rt))) in c.params.iter().zip(&r.params).enumerate() {
        match rust_of(ct, h) {
            Ok(want) if want.trim() == rt.trim() => {}
            Ok(want) => errors.push(format!(
                "{name}: parameter {k} ({cn}) is `{rt}` in Rust, the header's {ct:?} is `{want}`"
            )),
            Err(e) => errors.push(format!("{name}: parameter {k} ({cn}): {e}")),
        }
    }
    let want = if c.ret == CType::Void {
        Ok(String::new())
    } else {
        rust_of(&c.ret, h)
    };
    match want {
        Ok(want) if want.trim() == r.ret.trim() => {}
        Ok(want) => errors.push(format!(
            "{name}: returns `{}` in Rust, the header's {:?} is `{want}`",
            r.ret, c.ret
        )),
        Err(e) => errors.push(format!("{name}: return type: {e}")),
    }
    errors
}

/// Every callback the crate declares, against the header; and the header declares no callback
/// the crate does not use (but for the release's marker).
fn check_callbacks(h: &CHeader, r: &RustDecls, marker: &str) -> Vec<String> {
    let mut errors = Vec::new();
    for (name, (f, file)) in &r.callbacks {
        if file != "sys.rs" {
            errors.push(format!(
                "{name}: declared in {file}; Envoy's callbacks belong in sys.rs"
            ));
        }
        match h.functions.get(name) {
            Some(c) => errors.extend(compare_fn(name, c, f, h)),
            None => errors.push(format!("{name}: declared in Rust, not in the header")),
        }
    }
    for name in h.functions.keys() {
        let callback = name.starts_with("envoy_dynamic_module_callback_");
        if callback && !r.callbacks.contains_key(name) && name != marker {
            errors.push(format!("{name}: in abi.decl but not used by the crate"));
        }
    }
    errors
}

/// Every hook `export_http_filter!` defines, against the header; the same set both sides.
fn check_hooks(h: &CHeader, r: &RustDecls) -> Vec<String> {
    let mut errors = Vec::new();
    for (name, f) in &r.hooks {
        match h.functions.get(name) {
            Some(c) => errors.extend(compare_fn(name, c, f, h)),
            None => errors.push(format!("{name}: exported by the crate, not in the header")),
        }
    }
    for name in h.functions.keys() {
        if name.starts_with("envoy_dynamic_module_on_") && !r.hooks.contains_key(name) {
            errors.push(format!(
                "{name}: in the header, not exported by export_http_filter!"
            ));
        }
    }
    errors
}

/// The C enums a Rust type stands for.
fn c_enums_of(rust: &str) -> Vec<&'static str> {
    TYPES
        .iter()
        .filter(|(_, r)| *r == rust)
        .map(|(c, _)| *c)
        .collect()
}

/// `REQUEST_PATH` -> `RequestPath`.
fn camel(screaming: &str) -> String {
    screaming
        .split('_')
        .map(|w| {
            let mut c = w.chars();
            c.next().map_or(String::new(), |f| {
                f.to_ascii_uppercase().to_string() + &c.as_str().to_ascii_lowercase()
            })
        })
        .collect()
}

fn c_enum_value(h: &CHeader, c_enum: &str, member: &str) -> Option<i64> {
    let full = format!("{c_enum}_{member}");
    h.enums
        .get(c_enum)?
        .iter()
        .find(|(m, _)| *m == full)
        .map(|(_, v)| *v)
}

/// Every Rust enum variant and newtype constant has the value of the C enumerator it names.
fn check_enums(h: &CHeader, r: &RustDecls) -> Vec<String> {
    let mut errors = Vec::new();
    let mut check = |rust: &str, member: &str, value: i64| {
        let c_enums = c_enums_of(rust);
        if c_enums.is_empty() {
            errors.push(format!("{rust}: no C enum mapped to it in TYPES"));
        }
        for c in c_enums {
            if !h.enums.contains_key(c) {
                errors.push(format!("{rust}: the header has no enum {c}"));
                continue;
            }
            match c_enum_value(h, c, member) {
                Some(v) if v == value => {}
                Some(v) => errors.push(format!(
                    "{rust}::{member} = {value}, but {c}_{member} = {v}"
                )),
                None => errors.push(format!("{rust}::{member}: {c} has no {c}_{member}")),
            }
        }
    };
    for (e, variants) in &r.enums {
        for (v, value) in variants {
            check(e, v, *value);
        }
    }
    for (name, (t, value)) in &r.consts {
        if r.newtypes.contains_key(t) {
            check(t, &camel(name), *value);
        }
    }
    for (t, inner) in &r.newtypes {
        if inner != "u32" {
            errors.push(format!("{t}: wraps {inner}, not u32"));
        }
        for c in c_enums_of(t) {
            if !h.enums.contains_key(c) {
                errors.push(format!("{t}: the header has no enum {c}"));
            }
        }
    }
    for name in &r.bad_repr {
        errors.push(format!("{name}: missing #[repr(C)] / #[repr(transparent)]"));
    }
    errors
}

/// Size and alignment of a C type on this target.
fn c_size_align(t: &CType, h: &CHeader) -> (usize, usize) {
    match t {
        CType::Ptr { .. } => (size_of::<*const u8>(), align_of::<*const u8>()),
        CType::Void => panic!("sizeof(void)"),
        CType::Named(n) => match n.as_str() {
            "bool" | "char" => (1, 1),
            "size_t" => (size_of::<usize>(), align_of::<usize>()),
            "uint64_t" => (8, align_of::<u64>()),
            "uint32_t" => (4, 4),
            "double" => (8, align_of::<f64>()),
            _ if h.enums.contains_key(n) => (4, 4),
            _ if h.structs.contains_key(n) => {
                let (size, align, _) = c_layout(n, h);
                (size, align)
            }
            _ => c_size_align(
                h.typedefs
                    .get(n)
                    .unwrap_or_else(|| panic!("unknown C type {n}")),
                h,
            ),
        },
    }
}

/// A C struct's size, alignment and field offsets.
fn c_layout(name: &str, h: &CHeader) -> (usize, usize, Vec<(String, usize)>) {
    let (mut offset, mut align) = (0usize, 1usize);
    let mut fields = Vec::new();
    for (f, t) in &h.structs[name] {
        let (s, a) = c_size_align(t, h);
        offset = offset.next_multiple_of(a);
        fields.push((f.clone(), offset));
        offset += s;
        align = align.max(a);
    }
    (offset.next_multiple_of(align), align, fields)
}

/// Every Rust struct: fields and types as in the header, and rustc's layout as C's.
fn check_structs(h: &CHeader, r: &RustDecls, layouts: &[RustLayout]) -> Vec<String> {
    let mut errors = Vec::new();
    for (name, fields) in &r.structs {
        let Some((c_name, _)) = TYPES.iter().find(|(_, rr)| rr == name) else {
            errors.push(format!("{name}: no C struct mapped to it in TYPES"));
            continue;
        };
        let Some(c_fields) = h.structs.get(*c_name) else {
            errors.push(format!("{name}: the header has no struct {c_name}"));
            continue;
        };
        let c_names: Vec<&str> = c_fields.iter().map(|(f, _)| f.as_str()).collect();
        let r_names: Vec<&str> = fields.iter().map(|(f, _)| f.as_str()).collect();
        if c_names != r_names {
            errors.push(format!(
                "{name}: fields {r_names:?}, the header's {c_names:?}"
            ));
            continue;
        }
        for ((f, ct), (_, rt)) in c_fields.iter().zip(fields) {
            match rust_of(ct, h) {
                Ok(want) if want.trim() == rt.trim() => {}
                Ok(want) => errors.push(format!("{name}.{f}: `{rt}`, the header's is `{want}`")),
                Err(e) => errors.push(format!("{name}.{f}: {e}")),
            }
        }
        let Some((_, size, align, offsets)) = layouts.iter().find(|(n, ..)| n == name) else {
            errors.push(format!("{name}: missing from rust_layouts()"));
            continue;
        };
        let (c_size, c_align, c_offsets) = c_layout(c_name, h);
        let offsets: Vec<(String, usize)> = offsets
            .iter()
            .map(|(f, o)| ((*f).to_string(), *o))
            .collect();
        if (*size, *align, &offsets) != (c_size, c_align, &c_offsets) {
            errors.push(format!(
                "{name}: size {size} align {align} offsets {offsets:?}; C: size {c_size} align {c_align} offsets {c_offsets:?}"
            ));
        }
    }
    for (name, ..) in layouts {
        if !r.structs.contains_key(*name) {
            errors.push(format!(
                "{name}: in rust_layouts() but not a struct of sys.rs"
            ));
        }
    }
    errors
}

/// Every pointer alias against the C typedef it stands for.
fn check_aliases(h: &CHeader, r: &RustDecls) -> Vec<String> {
    let mut errors = Vec::new();
    for (alias, def) in &r.aliases {
        let Some((c_name, _)) = TYPES.iter().find(|(_, rr)| rr == alias) else {
            errors.push(format!("type {alias}: no C typedef mapped to it in TYPES"));
            continue;
        };
        match h.typedefs.get(*c_name).map(|t| rust_of(t, h)) {
            Some(Ok(want)) if want.trim() == def.trim() => {}
            Some(Ok(want)) => errors.push(format!("type {alias} = {def}; {c_name} is `{want}`")),
            Some(Err(e)) => errors.push(format!("type {alias}: {e}")),
            None => errors.push(format!("type {alias}: the header has no typedef {c_name}")),
        }
    }
    errors
}

/// Everything the crate checks against one header.
fn check_all(h: &CHeader, r: &RustDecls, marker: &str) -> Vec<String> {
    let mut errors = check_callbacks(h, r, marker);
    errors.extend(check_hooks(h, r));
    errors.extend(check_enums(h, r));
    errors.extend(check_structs(h, r, &rust_layouts()));
    errors.extend(check_aliases(h, r));
    errors
}

/// What changed from one release's description to the next: only additions are allowed (new
/// functions, enumerators appended at the end); returns the new functions.
fn additions(old: &CHeader, new: &CHeader) -> (Vec<String>, Vec<String>) {
    let mut errors = Vec::new();
    for (name, f) in &old.functions {
        match new.functions.get(name) {
            Some(g) if g == f => {}
            Some(g) => errors.push(format!("{name} changed: {f:?} -> {g:?}")),
            None => errors.push(format!("{name} removed")),
        }
    }
    for (name, s) in &old.structs {
        if new.structs.get(name) != Some(s) {
            errors.push(format!("struct {name} changed or removed"));
        }
    }
    for (name, t) in &old.typedefs {
        if new.typedefs.get(name) != Some(t) {
            errors.push(format!("typedef {name} changed or removed"));
        }
    }
    for (name, members) in &old.enums {
        match new.enums.get(name) {
            Some(m) if m.starts_with(members) => {}
            _ => errors.push(format!(
                "enum {name}: not the old members followed by new ones"
            )),
        }
    }
    let added = new
        .functions
        .keys()
        .filter(|n| !old.functions.contains_key(*n))
        .cloned()
        .collect();
    (errors, added)
}

// ---------------------------------------------------------------------------------------------
// Tests
// ---------------------------------------------------------------------------------------------

#[test]
fn the_crate_matches_every_vendored_header() {
    let r = parse_rust(&crate_sources());
    assert!(
        r.callbacks.len() >= 27,
        "callbacks found: {:?}",
        r.callbacks.keys()
    );
    assert!(r.hooks.len() >= 21, "hooks found: {:?}", r.hooks.keys());
    assert_eq!(r.foreign, ["dlsym"], "foreign functions besides Envoy's");
    for (version, h, marker) in vendored() {
        let errors = check_all(&h, &r, &marker);
        assert!(
            errors.is_empty(),
            "abi/{version}/abi.decl vs the crate:\n  {}",
            errors.join("\n  ")
        );
    }
}

#[test]
fn enum_types_are_the_size_of_a_c_enum() {
    let r = parse_rust(&crate_sources());
    let sizes = rust_enum_sizes();
    for name in r.enums.keys().chain(r.newtypes.keys()) {
        let Some((_, size, align)) = sizes.iter().find(|(n, ..)| n == name) else {
            panic!("{name}: missing from rust_enum_sizes()");
        };
        assert_eq!((*size, *align), (4, 4), "{name}: a C enum is an int");
    }
    assert_eq!(sizes.len(), r.enums.len() + r.newtypes.len());
}

/// Releases only add to what the crate uses: one set of declarations serves them all. Between
/// the vendored 1.39.3 and 1.40.0 descriptions the only differences are the ABI string, the three
/// attribute ids 1.40 appends and `log_v2` (which the crate only looks up, as 1.40's marker).
#[test]
fn vendored_releases_only_add() {
    let r = parse_rust(&crate_sources());
    let all = vendored();
    for pair in all.windows(2) {
        let ((v_old, old, _), (v_new, new, marker)) = (&pair[0], &pair[1]);
        let (errors, added) = additions(old, new);
        assert!(
            errors.is_empty(),
            "{v_old} -> {v_new}:\n  {}",
            errors.join("\n  ")
        );
        for f in &added {
            assert!(
                !r.callbacks.contains_key(f) && !r.hooks.contains_key(f),
                "{f}: new in {v_new}, but the crate declares it (a {v_old} Envoy lacks it)"
            );
        }
        assert!(
            added.contains(marker),
            "{v_new}'s marker {marker} is not new in it"
        );
        assert_ne!(old.abi_version, new.abi_version);
    }
    let by_version = |v: &str| &all.iter().find(|(x, ..)| x == v).unwrap().1;
    let (a, b) = (by_version("1.39.3"), by_version("1.40.0"));
    assert_eq!(additions(a, b).1, ["envoy_dynamic_module_callback_log_v2"]);
    let attributes = "envoy_dynamic_module_type_attribute_id";
    assert_eq!(a.enums[attributes].len() + 3, b.enums[attributes].len());
    for (name, members) in &a.enums {
        if name != attributes {
            assert_eq!(Some(members), b.enums.get(name), "{name}");
        }
    }
}

/// `build.rs` took the ABI string and the marker from the release `ENVOY_VERSION` selected.
#[test]
fn the_build_reports_the_selected_release() {
    let (_, h, marker) = vendored()
        .into_iter()
        .find(|(v, ..)| v == ENVOY_VERSION)
        .unwrap_or_else(|| panic!("ENVOY_VERSION {ENVOY_VERSION} is not vendored"));
    assert_eq!(h.abi_version.as_deref(), ABI_VERSION.to_str().ok());
    assert_eq!(Some(marker.as_str()), MARKER.to_str().ok());
    assert!(h.functions.contains_key(&marker), "{marker} not declared");
}

/// The checks fail on drift: a changed parameter type, a removed parameter, a renumbered
/// enumerator, a reordered struct, a hook the header lacks.
#[test]
fn the_check_catches_drift() {
    let sources = crate_sources();
    let r = parse_rust(&sources);
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("abi/1.40.0/abi.decl");
    let text = std::fs::read_to_string(path).unwrap();
    let marker = "envoy_dynamic_module_callback_log_v2";
    assert!(check_all(&parse_header(&text), &r, marker).is_empty());
    let drifted = |from: &str, to: &str| {
        assert!(text.contains(from), "{from}");
        check_all(&parse_header(&text.replacen(from, to, 1)), &r, marker).join("\n")
    };
    let e = drifted(
        "scheduler_module_ptr, uint64_t event_id);",
        "scheduler_module_ptr, uint32_t event_id);",
    );
    assert!(
        e.contains("scheduler_commit: parameter 1 (event_id) is `u64`"),
        "{e}"
    );
    let e = drifted(
        ", size_t index, size_t* optional_size)",
        ", size_t* optional_size)",
    );
    assert!(
        e.contains("http_get_header: 6 parameters in Rust, 5 in the header"),
        "{e}"
    );
    let e = drifted(
        " envoy_dynamic_module_type_log_level_Trace,",
        " envoy_dynamic_module_type_log_level_Trace = 1,",
    );
    assert!(e.contains("LogLevel::Trace = 0, but"), "{e}");
    let e = drifted(
        " envoy_dynamic_module_type_attribute_id_RequestUrlPath,",
        "",
    );
    assert!(e.contains("AttributeId::SourceAddress = 24, but"), "{e}");
    let e = drifted(
        "envoy_dynamic_module_type_buffer_envoy_ptr ptr; size_t length;",
        "size_t length; envoy_dynamic_module_type_buffer_envoy_ptr ptr;",
    );
    assert!(
        e.contains("EnvoyBuffer: fields [\"ptr\", \"length\"]"),
        "{e}"
    );
    let e = drifted("uint32_t response_code", "uint64_t response_code");
    assert!(
        e.contains("local_reply: parameter 2 (response_code) is `u32`"),
        "{e}"
    );
    let e = drifted(
        "bool envoy_dynamic_module_callback_log_enabled(",
        "size_t envoy_dynamic_module_callback_log_enabled(",
    );
    assert!(e.contains("log_enabled: returns `bool` in Rust"), "{e}");
    let e = drifted(
        "envoy_dynamic_module_on_http_filter_scheduled(",
        "envoy_dynamic_module_on_http_filter_tick(",
    );
    assert!(
        e.contains("on_http_filter_scheduled: exported by the crate, not in the header"),
        "{e}"
    );
    // The body and metadata declarations: a chunk array of the wrong type, a number that is not
    // a double, a renumbered body status and body type, a request body hook without its flag.
    let e = drifted(
        "envoy_dynamic_module_type_envoy_buffer* result_buffer_vector",
        "envoy_dynamic_module_type_module_buffer* result_buffer_vector",
    );
    assert!(
        e.contains("get_body_chunks: parameter 2 (result_buffer_vector) is `*mut EnvoyBuffer`"),
        "{e}"
    );
    let e = drifted(
        "envoy_dynamic_module_callback_http_get_body_chunks_size( envoy_dynamic_module_type_http_filter_envoy_ptr filter_envoy_ptr, envoy_dynamic_module_type_http_body_type body_type)",
        "envoy_dynamic_module_callback_http_get_body_chunks_size( envoy_dynamic_module_type_http_filter_envoy_ptr filter_envoy_ptr, envoy_dynamic_module_type_http_header_type body_type)",
    );
    assert!(
        e.contains("get_body_chunks_size: parameter 1 (body_type) is `BodyType`"),
        "{e}"
    );
    let e = drifted(
        "envoy_dynamic_module_type_module_buffer key, double value);",
        "envoy_dynamic_module_type_module_buffer key, uint64_t value);",
    );
    assert!(
        e.contains("set_dynamic_metadata_number: parameter 3 (value) is `f64`"),
        "{e}"
    );
    let e = drifted(
        "envoy_dynamic_module_type_module_buffer key, envoy_dynamic_module_type_module_buffer value);\nbool envoy_dynamic_module_callback_http_set_header(",
        "envoy_dynamic_module_type_module_buffer value);\nbool envoy_dynamic_module_callback_http_set_header(",
    );
    assert!(
        e.contains("set_dynamic_metadata_string: 4 parameters in Rust, 3 in the header"),
        "{e}"
    );
    let e = drifted(
        " envoy_dynamic_module_type_on_http_filter_response_body_status_Continue,",
        " envoy_dynamic_module_type_on_http_filter_response_body_status_Continue, envoy_dynamic_module_type_on_http_filter_response_body_status_Pause,",
    );
    assert!(
        e.contains("BodyStatus::StopIterationAndBuffer = 1, but envoy_dynamic_module_type_on_http_filter_response_body_status_StopIterationAndBuffer = 2"),
        "{e}"
    );
    let e = drifted(
        " envoy_dynamic_module_type_http_body_type_ReceivedRequestBody,",
        "",
    );
    assert!(e.contains("BodyType::ReceivedRequestBody: "), "{e}");
    assert!(e.contains("BodyType::BufferedResponseBody = 3, but"), "{e}");
    let e = drifted(
        "envoy_dynamic_module_on_http_filter_request_body( envoy_dynamic_module_type_http_filter_envoy_ptr filter_envoy_ptr, envoy_dynamic_module_type_http_filter_module_ptr filter_module_ptr, bool end_of_stream)",
        "envoy_dynamic_module_on_http_filter_request_body( envoy_dynamic_module_type_http_filter_envoy_ptr filter_envoy_ptr, envoy_dynamic_module_type_http_filter_module_ptr filter_module_ptr)",
    );
    assert!(
        e.contains("on_http_filter_request_body: 3 parameters in Rust, 2 in the header"),
        "{e}"
    );
    // And on the Rust side: a parameter type changed in sys.rs.
    let mut changed = sources.clone();
    for (file, src) in &mut changed {
        if file == "sys.rs" {
            *src = src.replacen("status_code: u32,", "status_code: u16,", 1);
        }
    }
    let e = check_all(&parse_header(&text), &parse_rust(&changed), marker).join("\n");
    assert!(
        e.contains("send_response: parameter 1 (status_code) is `u16`"),
        "{e}"
    );
}
