//! The usage scanners (a response body, JSON or an event stream, read for its `usage`) on
//! arbitrary bytes cut at points the input picks: the same values whatever the split, and no
//! panic. Where there is an oracle, the values it finds: `serde_json` on a JSON body that is one
//! document; for an event stream (UTF-8), the small WHATWG parser then `serde_json` on each
//! event's data, when every event's data is one JSON document or holds no `{` (so that no path
//! can be reached before the error that ends an invalid one).
//!
//! Input: a byte choosing the framing and the paths, four bytes seeding the split, the body.

use crate::body_scan::{scan_with, ODD};
use crate::reference::{self, compile};
use crate::{pieces, Bytes};
use ratelimit_core::usage::{Format, Scanner, MAX_SLOTS};

/// The usage fields of the APIs' answers (the presets'), and nested and repeated ones.
pub const USAGE: &[(&str, usize)] = &[
    ("usage.total_tokens", 0),
    ("response.usage.total_tokens", 0),
    ("usage.input_tokens", 1),
    ("message.usage.input_tokens", 1),
    ("usage.output_tokens", 2),
    ("response.usage.output_tokens", 2),
    ("usage.prompt_tokens", 3),
    ("usage.completion_tokens", 4),
    ("usageMetadata.totalTokenCount", 5),
    ("usageMetadata.candidatesTokenCount", 6),
    ("usage.prompt_tokens_details.cached_tokens", 7),
    ("usage.cache_read_input_tokens", 8),
    ("message.usage.cache_creation_input_tokens", 9),
    ("a", 10),
    ("a.a.a", 11),
    ("usage", 12),
];

pub fn run(data: &[u8]) {
    let mut input = Bytes(data);
    let choice = input.u8();
    let seed = input.u32();
    let body = input.rest();
    let format = if choice & 1 == 0 {
        Format::Json
    } else {
        Format::Sse
    };
    let (paths, list) = compile(if choice & 2 == 0 { USAGE } else { ODD });

    let (_, whole) = scan_with(Scanner::new(format), &paths, &[body]);
    let (_, split) = scan_with(Scanner::new(format), &paths, &pieces(body, seed));
    assert_eq!(split, whole, "a split changed the usage found");
    // Whether the stream's last event came does not depend on the split either.
    let ended = |chunks: &[&[u8]]| {
        let mut s = Scanner::new(format);
        for c in chunks {
            s.feed(&paths, c);
        }
        s.ended()
    };
    assert_eq!(
        ended(&pieces(body, seed)),
        ended(&[body]),
        "a split changed the last event"
    );
    if choice & 4 != 0 {
        let bytes: Vec<&[u8]> = body.chunks(1).collect();
        assert_eq!(
            scan_with(Scanner::new(format), &paths, &bytes).1,
            whole,
            "byte by byte"
        );
    }
    let (_, with_texts) = scan_with(
        Scanner::with_texts(format),
        &paths,
        &pieces(body, seed.rotate_left(7)),
    );

    let expected = match format {
        Format::Json => {
            reference::leaves(body).map(|l| reference::expect(&l, &list, MAX_SLOTS, false).1)
        }
        Format::Sse => sse_reference(body, &list),
    };
    if let Some(expected) = expected {
        // On valid documents only (see `body_scan`): keeping texts changes no value.
        assert_eq!(with_texts, whole, "keeping texts changed the values");
        assert_eq!(
            whole,
            expected,
            "the scanner and the reference disagree on {:?}",
            String::from_utf8_lossy(body)
        );
    }
}

/// The values of an event stream's events at `paths`, or `None` when an event's data could
/// have been read partly before an error (the reference cannot tell how far).
fn sse_reference(body: &[u8], paths: &[(Vec<String>, usize)]) -> Option<Vec<Option<u64>>> {
    let mut all = Vec::new();
    for data in reference::events(body)? {
        match reference::leaves(data.as_bytes()) {
            Some(leaves) => all.extend(leaves),
            None if !data.contains('{') => {}
            None => return None,
        }
    }
    Some(reference::expect(&all, paths, MAX_SLOTS, false).1)
}
