//! The body scanner against a full parse, on random bodies from proptest: random JSON (keys
//! from the paths and others, written with and without escapes; nested objects and arrays;
//! numbers of every JSON form; strings with escapes and multi-byte UTF-8), random event-stream
//! framing (comments, `event:`/`id:` fields, data split over lines, `[DONE]`, CR/LF/CRLF, a
//! byte order mark), cut into random chunks. The scanner must find exactly what the reference
//! finds: each document parsed with serde_json (it must parse to the generated value), the
//! event stream with the small parser below, and each path's number read with
//! `Value::as_u64`, the last one found in document order winning in its slot.
//!
//! Each run draws new inputs (`PROPTEST_RNG_SEED=N` fixes the seed; `PROPTEST_CASES=N` runs
//! N cases of each property); failing seeds go to `proptest-regressions/usage_props.txt`.
#![allow(clippy::unwrap_used, clippy::panic, clippy::indexing_slicing)]

mod common;

use proptest::prelude::*;
use proptest::sample::select;
use proptest::test_runner::TestRunner;
use ratelimit_core::usage::{Format, Paths, Scanner};
use serde_json::Value;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

/// The longest one input may take (fastest of three, as in `props.rs`).
const LIMIT: Duration = Duration::from_millis(50);
/// Cases per property in a default run: about 2 s each in a debug build.
const CASES: u32 = 1_000;

/// Scans (of either set of paths) in which the reference found a value, to show that the
/// inputs reach the paths.
static FOUND: AtomicU32 = AtomicU32::new(0);

const REGRESSIONS: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/proptest-regressions/usage_props.txt"
);

/// Two sets of paths: plain keys (the prefilter on) and keys JSON may escape otherwise or
/// that are not ASCII (the prefilter off). (path, slot), keys split at '.'.
const PLAIN: &[(&str, usize)] = &[
    ("usage.total_tokens", 0),
    ("response.usage.total_tokens", 0),
    ("usage.input_tokens", 1),
    ("message.usage.input_tokens", 1),
    ("a", 2),
    ("usage", 3),
    ("a.a.a", 4),
];
const ODD: &[(&str, usize)] = &[
    ("é.t", 0),
    ("a/b", 1),
    ("q\"\\\n", 2),
    ("\u{1f600}", 3),
    ("usage.total_tokens", 3),
];

/// The keys documents use: the paths' keys, near misses, others.
const KEYS: &[&str] = &[
    "usage",
    "total_tokens",
    "input_tokens",
    "response",
    "message",
    "a",
    "t",
    "é",
    "a/b",
    "q\"\\\n",
    "\u{1f600}",
    "usag",
    "usage_",
    "total_token",
    "choices",
    "",
];

/// A generated JSON value, with the text each part is written as.
#[derive(Clone, Debug)]
enum J {
    Number(String),
    Str(String),
    Literal(&'static str),
    Array(Vec<J>),
    /// (key, key as written, value)
    Object(Vec<(String, String, J)>),
}

/// `s` as a JSON string, each character written as is or escaped, as `how` picks.
fn write_string(s: &str, how: &[u8]) -> String {
    let mut out = String::from("\"");
    for (i, c) in s.chars().enumerate() {
        let pick = how.get(i % how.len().max(1)).copied().unwrap_or(0) % 4;
        match c {
            '"' => out.push_str(if pick == 0 { "\\u0022" } else { "\\\"" }),
            '\\' => out.push_str(if pick == 0 { "\\u005C" } else { "\\\\" }),
            '\n' => out.push_str(if pick == 0 { "\\u000a" } else { "\\n" }),
            '/' if pick == 1 => out.push_str("\\/"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c if pick == 2 => {
                let mut units = [0u16; 2];
                for u in c.encode_utf16(&mut units) {
                    out.push_str(&format!("\\u{u:04X}"));
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

fn key() -> impl Strategy<Value = (String, String)> {
    let name = prop_oneof![
        4 => select(KEYS).prop_map(String::from),
        1 => "[a-zé\u{1f600}/\"\\\\\n]{0,5}",
    ];
    (name, prop::collection::vec(any::<u8>(), 1..6)).prop_map(|(k, how)| {
        let written = write_string(&k, &how);
        (k, written)
    })
}

fn number() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => (0u64..1000).prop_map(|n| n.to_string()),
        1 => any::<u64>().prop_map(|n| n.to_string()),
        1 => select(&[
            "0", "-0", "-1", "1.0", "0.5", "1e3", "1E+2", "2e-1", "-3.25E-7",
            "18446744073709551615", "18446744073709551616", "123456789012345678901234",
        ][..]).prop_map(String::from),
    ]
}

fn value() -> impl Strategy<Value = J> {
    let leaf = prop_oneof![
        4 => number().prop_map(J::Number),
        2 => ("[ -~é\u{1f600}\n\t\"\\\\]{0,8}", prop::collection::vec(any::<u8>(), 1..4))
            .prop_map(|(s, how)| J::Str(write_string(&s, &how))),
        1 => select(&["true", "false", "null"][..]).prop_map(J::Literal),
    ];
    leaf.prop_recursive(4, 40, 5, |inner| {
        prop_oneof![
            1 => prop::collection::vec(inner.clone(), 0..4).prop_map(J::Array),
            3 => prop::collection::vec((key(), inner), 0..5).prop_map(|entries| {
                J::Object(entries.into_iter().map(|((k, w), v)| (k, w, v)).collect())
            }),
        ]
    })
}

/// The keys of the paths, to plant along them: at the top, in the middle, at the end.
const TOP_KEYS: &[&str] = &[
    "usage",
    "response",
    "message",
    "a",
    "é",
    "a/b",
    "q\"\\\n",
    "\u{1f600}",
];
const MIDDLE_KEYS: &[&str] = &["usage", "total_tokens", "input_tokens", "t", "a"];
const END_KEYS: &[&str] = &["total_tokens", "input_tokens", "a"];

/// An object with keys of the paths, nested up to three deep, numbers mostly at the ends:
/// random documents alone seldom hold a path.
fn planted() -> impl Strategy<Value = J> {
    let entry = |keys: &'static [&'static str], v: BoxedStrategy<J>| {
        (select(keys), prop::collection::vec(any::<u8>(), 1..6), v)
            .prop_map(|(k, how, v)| (k.to_string(), write_string(k, &how), v))
    };
    let end = prop_oneof![3 => number().prop_map(J::Number), 1 => value()].boxed();
    let inner = prop::collection::vec(entry(END_KEYS, end.clone()), 1..4)
        .prop_map(J::Object)
        .boxed();
    let middle = prop_oneof![1 => end.clone(), 3 => inner].boxed();
    let middle = prop::collection::vec(entry(MIDDLE_KEYS, middle), 1..4)
        .prop_map(J::Object)
        .boxed();
    let top = prop_oneof![1 => end, 3 => middle].boxed();
    prop::collection::vec(entry(TOP_KEYS, top), 1..4).prop_map(J::Object)
}

/// A document: mostly an object, at times another value; an object with random entries and
/// planted ones, shuffled.
fn document() -> impl Strategy<Value = J> {
    let random = prop::collection::vec((key(), value()), 0..4).prop_map(|entries| {
        entries
            .into_iter()
            .map(|((k, w), v)| (k, w, v))
            .collect::<Vec<_>>()
    });
    let object = (random, prop::option::weighted(0.8, planted()))
        .prop_flat_map(|(mut entries, planted)| {
            if let Some(J::Object(p)) = planted {
                entries.extend(p);
            }
            Just(entries).prop_shuffle()
        })
        .prop_map(J::Object);
    prop_oneof![
        4 => object,
        1 => value(),
    ]
}

/// The text of `j`, compact or with newlines and indentation.
fn write(j: &J, pretty: bool, indent: usize, out: &mut String) {
    let newline = |out: &mut String, depth: usize| {
        if pretty {
            out.push('\n');
            out.push_str(&"  ".repeat(depth));
        }
    };
    match j {
        J::Number(n) => out.push_str(n),
        J::Str(s) => out.push_str(s),
        J::Literal(l) => out.push_str(l),
        J::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                newline(out, indent + 1);
                write(item, pretty, indent + 1, out);
            }
            newline(out, indent);
            out.push(']');
        }
        J::Object(entries) => {
            out.push('{');
            for (i, (_, written, v)) in entries.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                newline(out, indent + 1);
                out.push_str(written);
                out.push_str(if pretty { ": " } else { ":" });
                write(v, pretty, indent + 1, out);
            }
            newline(out, indent);
            out.push('}');
        }
    }
}

/// `j` as serde_json reads it (a repeated key: its last value).
fn to_value(j: &J) -> Value {
    match j {
        J::Number(n) => serde_json::from_str(n).unwrap(),
        J::Str(s) => serde_json::from_str(s).unwrap(),
        J::Literal(l) => serde_json::from_str(l).unwrap(),
        J::Array(items) => Value::Array(items.iter().map(to_value).collect()),
        J::Object(entries) => {
            let mut map = serde_json::Map::new();
            for (k, _, v) in entries {
                map.insert(k.clone(), to_value(v));
            }
            Value::Object(map)
        }
    }
}

/// The reference: `doc`'s values at `paths`, in document order, into `found`.
fn expect(j: &J, at: Option<Vec<&str>>, paths: &[(Vec<String>, usize)], found: &mut [Option<u64>]) {
    match j {
        J::Number(n) => {
            let number: Value = serde_json::from_str(n).unwrap();
            if let (Some(at), Some(v)) = (at, number.as_u64()) {
                for (path, slot) in paths {
                    if *path == at {
                        found[*slot] = Some(v);
                    }
                }
            }
        }
        J::Array(items) => items.iter().for_each(|i| expect(i, None, paths, found)),
        J::Object(entries) => {
            for (k, _, v) in entries {
                let here = at.clone().map(|mut a| {
                    a.push(k.as_str());
                    a
                });
                expect(v, here, paths, found);
            }
        }
        J::Str(_) | J::Literal(_) => {}
    }
}

fn compile(list: &[(&str, usize)]) -> (Paths, Vec<(Vec<String>, usize)>) {
    let list: Vec<(Vec<String>, usize)> = list
        .iter()
        .map(|(p, s)| (p.split('.').map(String::from).collect(), *s))
        .collect();
    (Paths::new(&list).unwrap(), list)
}

/// One event of a generated stream.
#[derive(Clone, Debug)]
enum Event {
    /// A JSON document, written pretty (and then one data line per line) or compact.
    Json(J, bool),
    /// `[DONE]`, or other text.
    Text(&'static str),
    /// Only comments and other fields.
    Empty,
}

fn event() -> impl Strategy<Value = Event> {
    prop_oneof![
        6 => (document(), any::<bool>()).prop_map(|(j, pretty)| Event::Json(j, pretty)),
        1 => select(&["[DONE]", "bye", ""][..]).prop_map(Event::Text),
        1 => Just(Event::Empty),
    ]
}

/// A stream's bytes, and the data of each event, as the generator means them.
fn write_stream(events: &[Event], framing: &[u8], bom: bool) -> (Vec<u8>, Vec<String>) {
    let mut out = String::new();
    if bom {
        out.push('\u{feff}');
    }
    let mut pick = framing.iter().copied().cycle();
    let mut last_cr = false;
    let mut line = |out: &mut String, text: &str, pick: &mut dyn Iterator<Item = u8>| {
        out.push_str(text);
        // A LF alone after a CR would join it (CRLF): a blank line there ends with CR or CRLF.
        let eol = match pick.next().unwrap_or(0) % 3 {
            0 if !(last_cr && text.is_empty()) => "\n",
            0 | 1 => "\r",
            _ => "\r\n",
        };
        out.push_str(eol);
        last_cr = eol == "\r";
    };
    let mut meant = Vec::new();
    for e in events {
        let extras = pick.next().unwrap_or(0);
        if extras % 4 == 1 {
            line(&mut out, ": keep-alive", &mut pick);
        }
        if extras % 3 == 1 {
            line(&mut out, "event: message", &mut pick);
        }
        if extras % 5 == 1 {
            line(&mut out, "id: 7", &mut pick);
        }
        let data = match e {
            Event::Json(j, pretty) => {
                let mut text = String::new();
                write(j, *pretty, 0, &mut text);
                Some(text)
            }
            Event::Text(t) => Some((*t).to_string()),
            Event::Empty => None,
        };
        if let Some(data) = &data {
            for part in data.split('\n') {
                let space = part.starts_with(' ') || pick.next().unwrap_or(0) % 2 == 0;
                line(
                    &mut out,
                    &format!("data:{}{part}", if space { " " } else { "" }),
                    &mut pick,
                );
            }
            meant.push(data.clone());
        }
        line(&mut out, "", &mut pick);
    }
    (out.into_bytes(), meant)
}

/// The scanner's values for `body` cut at `cuts` (taken modulo its length).
fn scan(paths: &Paths, format: Format, body: &[u8], cuts: &[usize]) -> Vec<Option<u64>> {
    let mut cuts: Vec<usize> = cuts.iter().map(|c| c % (body.len() + 1)).collect();
    cuts.sort_unstable();
    let mut scanner = Scanner::new(format);
    let mut from = 0;
    for cut in cuts.into_iter().chain([body.len()]) {
        scanner.feed(paths, &body[from..cut]);
        from = cut;
    }
    scanner.finish(paths);
    (0..paths.slots()).map(|s| scanner.value(s)).collect()
}

/// Runs `property` on `CASES` inputs (or `PROPTEST_CASES`).
fn check<S: Strategy>(
    name: &str,
    inputs: S,
    property: impl Fn(S::Value) -> Result<(), TestCaseError>,
) {
    let config = common::config(CASES, REGRESSIONS);
    let mut runner = TestRunner::new(config);
    let start = Instant::now();
    let result = runner.run(&inputs, property);
    println!(
        "{name}: {:.2?}, {} scans found a value",
        start.elapsed(),
        FOUND.swap(0, Ordering::Relaxed)
    );
    if let Err(e) = result {
        panic!("{name}: {e}\n{runner}");
    }
}

/// Scans `body` with both sets of paths against what `docs` hold, whole and cut.
fn compare(format: Format, body: &[u8], docs: &[&J], cuts: &[usize]) -> Result<(), TestCaseError> {
    for list in [PLAIN, ODD] {
        let (paths, list) = compile(list);
        let mut want = vec![None; paths.slots()];
        for doc in docs {
            expect(doc, Some(Vec::new()), &list, &mut want);
        }
        if want.iter().any(Option::is_some) {
            FOUND.fetch_add(1, Ordering::Relaxed);
        }
        let took = || {
            let t = Instant::now();
            let got = scan(&paths, format, body, cuts);
            (got, t.elapsed())
        };
        let (got, mut elapsed) = took();
        if elapsed >= LIMIT {
            elapsed = elapsed.min(took().1).min(took().1);
        }
        prop_assert!(elapsed < LIMIT, "took {elapsed:?}");
        prop_assert_eq!(&got, &want, "paths {:?}, cuts {:?}", list, cuts);
        prop_assert_eq!(scan(&paths, format, body, &[]), want);
    }
    Ok(())
}

#[test]
fn json_bodies_match_serde_json() {
    let inputs = (
        prop::collection::vec((document(), any::<bool>()), 1..4),
        prop::collection::vec(any::<usize>(), 0..8),
    );
    check("json bodies", inputs, |(docs, cuts)| {
        let mut body = String::new();
        for (doc, pretty) in &docs {
            write(doc, *pretty, 0, &mut body);
            body.push('\n');
        }
        // The reference reads the same documents from the text.
        let read: Vec<Value> = serde_json::Deserializer::from_str(&body)
            .into_iter()
            .collect::<Result<_, _>>()
            .unwrap();
        let meant: Vec<Value> = docs.iter().map(|(d, _)| to_value(d)).collect();
        prop_assert_eq!(read, meant);
        let docs: Vec<&J> = docs.iter().map(|(d, _)| d).collect();
        compare(Format::Json, body.as_bytes(), &docs, &cuts)
    });
}

#[test]
fn event_streams_match_a_reference_parser() {
    let inputs = (
        prop::collection::vec(event(), 0..6),
        prop::collection::vec(any::<u8>(), 1..16),
        any::<bool>(),
        prop::collection::vec(any::<usize>(), 0..8),
    );
    check("event streams", inputs, |(events, framing, bom, cuts)| {
        let (body, meant) = write_stream(&events, &framing, bom);
        // The framing is what the generator meant, and each JSON event parses to its value.
        prop_assert_eq!(
            ratelimit_core::testkit::reference::sse_events(&String::from_utf8_lossy(&body)),
            meant
        );
        let docs: Vec<&J> = events
            .iter()
            .filter_map(|e| match e {
                Event::Json(j, _) => Some(j),
                _ => None,
            })
            .collect();
        for doc in &docs {
            let mut text = String::new();
            write(doc, false, 0, &mut text);
            prop_assert_eq!(serde_json::from_str::<Value>(&text).unwrap(), to_value(doc));
        }
        compare(Format::Sse, &body, &docs, &cuts)
    });
}
