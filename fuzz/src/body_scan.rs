//! The request-body scanner (the one that reads `body:` key parts, `match.body` fields and the
//! fields reservations are sized by: `Scanner::request` over a JSON body) on arbitrary
//! bytes cut at points the input picks: the same texts and values whatever the split, the same
//! values as a scan that keeps no texts, and, when `serde_json` reads the body as one document,
//! exactly the values it reads at the paths; a scan that keeps no texts finds the same numbers,
//! valid JSON or not.
//!
//! Input: a byte choosing the paths, four bytes seeding the split, the body.

use crate::reference::{self, compile};
use crate::{pieces, Bytes};
use ratelimit_core::usage::{Paths, Scanner, MAX_SLOTS};

/// A request's fields, as configurations read them, and nested and repeated ones.
pub const REQUEST: &[(&str, usize)] = &[
    ("model", 0),
    ("metadata.user_id", 1),
    ("user", 2),
    ("max_tokens", 3),
    ("max_completion_tokens", 3),
    ("max_output_tokens", 3),
    ("a", 4),
    ("a.a.a", 5),
    ("usage", 6),
    ("usage.total_tokens", 7),
    ("x.y.z.w.v.u.t.s", 8),
    ("stream", 9),
];

/// Keys JSON may write with escapes (or must), and keys that are not ASCII.
pub const ODD: &[(&str, usize)] = &[
    ("é.t", 0),
    ("a/b", 1),
    ("q\"\\\n", 2),
    ("\u{1f600}", 3),
    ("model", 3),
    ("\u{0}", 4),
    ("A", 5),
    ("a.A", 6),
    ("é", 7),
];

/// Each slot's text and value after feeding `chunks`.
pub type Found = (Vec<Option<Vec<u8>>>, Vec<Option<u64>>);

/// A request body's scan (`Scanner::request`), keeping texts or not.
pub fn scan(paths: &Paths, texts: bool, chunks: &[&[u8]]) -> Found {
    scan_with(Scanner::request(texts), paths, chunks)
}

/// What scan `s` finds in `chunks`.
pub fn scan_with(mut s: Scanner, paths: &Paths, chunks: &[&[u8]]) -> Found {
    for c in chunks {
        s.feed(paths, c);
    }
    s.finish(paths);
    (
        (0..MAX_SLOTS)
            .map(|i| s.text(i).map(<[u8]>::to_vec))
            .collect(),
        (0..MAX_SLOTS).map(|i| s.value(i)).collect(),
    )
}

pub fn run(data: &[u8]) {
    let mut input = Bytes(data);
    let choice = input.u8();
    let seed = input.u32();
    let body = input.rest();
    let (paths, list) = compile(if choice & 1 == 0 { REQUEST } else { ODD });

    let whole = scan(&paths, true, &[body]);
    let split = scan(&paths, true, &pieces(body, seed));
    assert_eq!(split, whole, "a split changed what was found");
    if choice & 2 != 0 {
        let bytes: Vec<&[u8]> = body.chunks(1).collect();
        assert_eq!(scan(&paths, true, &bytes), whole, "byte by byte");
    }
    let (no_texts, values) = scan(&paths, false, &[body]);
    assert!(no_texts.iter().all(Option::is_none));
    // Valid or not, a scan that keeps texts and one that does not find the same values: a
    // string at a path's end is checked by both (a reservation's size must not depend on
    // whether another rule reads body fields).
    assert_eq!(values, whole.1, "keeping texts changed the values");
    for text in whole.0.iter().flatten() {
        assert!(text.len() <= ratelimit_core::usage::MAX_TEXT);
    }

    if let Some(leaves) = reference::leaves(body) {
        let expected = reference::expect(&leaves, &list, MAX_SLOTS, true);
        assert_eq!(
            whole,
            expected,
            "the scanner and serde_json disagree on {:?}",
            String::from_utf8_lossy(body)
        );
    }
}
