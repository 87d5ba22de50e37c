//! The oracle of the body scanners: a JSON document's values at the scanners' paths, in
//! document order, as `serde_json` reads them (its own parser, its own depth limit, its own
//! unescaping), walked with a `DeserializeSeed` so that repeated keys and document order are
//! kept (a `Value` would keep only a repeated key's last value).

use ratelimit_core::usage::MAX_TEXT;
use serde::de::{DeserializeSeed, Deserializer, Error, MapAccess, SeqAccess, Visitor};
use std::fmt;

/// A value at the end of a path.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Leaf {
    /// A string, unescaped.
    Str(Vec<u8>),
    /// A non-negative integer that fits u64 (no sign, fraction or exponent).
    U64(u64),
    /// Anything else: null, a boolean, another number, an object or array.
    Other,
}

/// The path of every value reached from the root through objects only (the scanners' paths
/// enter no array), with its leaf, in document order; `None` unless `doc` is exactly one JSON
/// document (whitespace around it allowed), as `serde_json` reads it.
pub fn leaves(doc: &[u8]) -> Option<Vec<(Vec<String>, Leaf)>> {
    let mut de = serde_json::Deserializer::from_slice(doc);
    let mut out = Vec::new();
    Walk {
        at: Some(Vec::new()),
        out: &mut out,
    }
    .deserialize(&mut de)
    .ok()?;
    de.end().ok()?;
    Some(out)
}

/// The values the scanners must find: each slot's last text (a string of at most MAX_TEXT
/// bytes, or a plain integer's digits; a longer string clears it) and last integer.
pub type Expected = (Vec<Option<Vec<u8>>>, Vec<Option<u64>>);

/// `request`: a request body's reading, where a later value of another type (or a string at
/// a number's slot) leaves the slot absent; otherwise (an answer's usage) it leaves it as it
/// was.
pub fn expect(
    leaves: &[(Vec<String>, Leaf)],
    paths: &[(Vec<String>, usize)],
    slots: usize,
    request: bool,
) -> Expected {
    let mut texts = vec![None; slots];
    let mut values = vec![None; slots];
    for (at, leaf) in leaves {
        for (path, slot) in paths {
            if path != at {
                continue;
            }
            match leaf {
                Leaf::Str(s) => {
                    texts[*slot] = (s.len() <= MAX_TEXT).then(|| s.clone());
                    if request {
                        values[*slot] = None;
                    }
                }
                Leaf::U64(n) => {
                    texts[*slot] = Some(n.to_string().into_bytes());
                    values[*slot] = Some(*n);
                }
                Leaf::Other if request => {
                    texts[*slot] = None;
                    values[*slot] = None;
                }
                Leaf::Other => {}
            }
        }
    }
    (texts, values)
}

struct Walk<'a> {
    /// The path here, `None` inside an array.
    at: Option<Vec<String>>,
    out: &'a mut Vec<(Vec<String>, Leaf)>,
}

impl Walk<'_> {
    fn leaf<E>(self, leaf: Leaf) -> Result<(), E> {
        if let Some(at) = self.at {
            if !at.is_empty() {
                self.out.push((at, leaf));
            }
        }
        Ok(())
    }
}

impl<'de> DeserializeSeed<'de> for Walk<'_> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Walk<'_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any JSON value")
    }
    fn visit_bool<E: Error>(self, _: bool) -> Result<(), E> {
        self.leaf(Leaf::Other)
    }
    fn visit_i64<E: Error>(self, _: i64) -> Result<(), E> {
        self.leaf(Leaf::Other)
    }
    fn visit_u64<E: Error>(self, n: u64) -> Result<(), E> {
        self.leaf(Leaf::U64(n))
    }
    fn visit_f64<E: Error>(self, _: f64) -> Result<(), E> {
        self.leaf(Leaf::Other)
    }
    fn visit_str<E: Error>(self, s: &str) -> Result<(), E> {
        self.leaf(Leaf::Str(s.as_bytes().to_vec()))
    }
    fn visit_unit<E: Error>(self) -> Result<(), E> {
        self.leaf(Leaf::Other)
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        let Walk { at, out } = self;
        while seq
            .next_element_seed(Walk {
                at: None,
                out: &mut *out,
            })?
            .is_some()
        {}
        Walk { at, out }.leaf(Leaf::Other)
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        let Walk { at, out } = self;
        while let Some(key) = map.next_key::<String>()? {
            let here = at.as_ref().map(|a| {
                let mut a = a.clone();
                a.push(key);
                a
            });
            map.next_value_seed(Walk {
                at: here,
                out: &mut *out,
            })?;
        }
        Walk { at, out }.leaf(Leaf::Other)
    }
}

/// The event stream's data by the core's reference parser; `None` for a body that is not UTF-8.
pub fn events(body: &[u8]) -> Option<Vec<String>> {
    std::str::from_utf8(body)
        .ok()
        .map(ratelimit_core::testkit::reference::sse_events)
}

/// Paths as the scanners take them, from `a.b` strings (keys split at '.').
pub fn compile(
    list: &[(&str, usize)],
) -> (ratelimit_core::usage::Paths, Vec<(Vec<String>, usize)>) {
    let list: Vec<(Vec<String>, usize)> = list
        .iter()
        .map(|(p, s)| (p.split('.').map(String::from).collect(), *s))
        .collect();
    (ratelimit_core::usage::Paths::new(&list).unwrap(), list)
}
