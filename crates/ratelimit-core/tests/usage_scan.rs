//! The body scanner (`ratelimit_core::usage`) on answers recorded in the formats the LLM APIs
//! send (`tests/fixtures/llm/`), with the config presets' paths: each sample fed whole, split
//! in two at every position, and one byte at a time, with LF, CRLF and CR line ends; then the
//! corner cases one by one, the scanner's size, and (ignored) the instruction count per byte.
//!
//! The instruction count, under callgrind (the test reads the figure from nothing; callgrind
//! counts what `feed_all` runs):
//! ```text
//! CARGO_PROFILE_RELEASE_STRIP=false CARGO_PROFILE_RELEASE_DEBUG=line-tables-only \
//!   cargo test --release -p ratelimit-core --test usage_scan --no-run
//! valgrind --tool=callgrind --toggle-collect='*feed_all*' target/release/deps/usage_scan-* \
//!   --ignored --exact instructions_openai_stream   # or instructions_openai_json
//! ```
//! (`instructions_chat_request`, a request body read for a field: `--toggle-collect='*read_model*'`.)
//! then instructions (the `Collected` line) / the bytes the test prints. Measured when written
//! (x86_64, AVX2): the 200-event stream 121,893 / 61,109 = 1.99 instructions per byte (the
//! 198 events without usage skipped by the prefilter); the 4 KB JSON answer 23,451 / 4,148 =
//! 5.7 (no prefilter for JSON: its structure is tokenized, its strings skipped with memchr2).
#![allow(clippy::unwrap_used, clippy::panic, clippy::indexing_slicing)]

use ratelimit_core::usage::{Format, Paths, Scanner, MAX_DEPTH, MAX_SLOTS};
use std::hint::black_box;

/// The presets of `cost.response`, as the config compiles them: (path, slot).
const OPENAI: &[(&str, usize)] = &[
    ("usage.total_tokens", 0),
    ("response.usage.total_tokens", 0),
];
const ANTHROPIC: &[(&str, usize)] = &[
    ("usage.input_tokens", 0),
    ("message.usage.input_tokens", 0),
    ("usage.output_tokens", 1),
    ("message.usage.output_tokens", 1),
];
const GEMINI: &[(&str, usize)] = &[("usageMetadata.totalTokenCount", 0)];
/// All three at once (slots 0; 1 and 2; 3), so that one scan checks every preset.
const ALL: &[(&str, usize)] = &[
    ("usage.total_tokens", 0),
    ("response.usage.total_tokens", 0),
    ("usage.input_tokens", 1),
    ("message.usage.input_tokens", 1),
    ("usage.output_tokens", 2),
    ("message.usage.output_tokens", 2),
    ("usageMetadata.totalTokenCount", 3),
];

fn paths(list: &[(&str, usize)]) -> Paths {
    let list: Vec<(Vec<String>, usize)> = list
        .iter()
        .map(|(p, s)| (p.split('.').map(String::from).collect(), *s))
        .collect();
    Paths::new(&list).unwrap()
}

/// The slots' values after feeding `chunks` and finishing.
fn scan<'a>(
    paths: &Paths,
    format: Format,
    chunks: impl IntoIterator<Item = &'a [u8]>,
) -> Vec<Option<u64>> {
    let mut scanner = Scanner::new(format);
    for chunk in chunks {
        scanner.feed(paths, chunk);
    }
    scanner.finish(paths);
    (0..paths.slots()).map(|s| scanner.value(s)).collect()
}

fn fixture(name: &str) -> Vec<u8> {
    let path = format!("{}/tests/fixtures/llm/{name}", env!("CARGO_MANIFEST_DIR"));
    std::fs::read(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// `body` with its line ends (CRLF, LF or CR, as found) made `eol`.
fn line_ends(body: &[u8], eol: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(body.len() * 2);
    let mut i = 0;
    while i < body.len() {
        match body[i] {
            b'\r' if body.get(i + 1) == Some(&b'\n') => {
                out.extend_from_slice(eol);
                i += 1;
            }
            b'\r' | b'\n' => out.extend_from_slice(eol),
            b => out.push(b),
        }
        i += 1;
    }
    out
}

/// Each sample with the values of `ALL`'s slots: openai total; anthropic input, output;
/// gemini total.
const SAMPLES: &[(&str, Format, [Option<u64>; 4])] = &[
    (
        "openai_chat.json",
        Format::Json,
        [Some(79), None, None, None],
    ),
    (
        "openai_chat_stream.sse",
        Format::Sse,
        [Some(41), None, None, None],
    ),
    (
        "openai_responses_stream.sse",
        Format::Sse,
        [Some(43), None, None, None],
    ),
    (
        "anthropic_messages.json",
        Format::Json,
        [None, Some(21), Some(29), None],
    ),
    (
        "anthropic_stream.sse",
        Format::Sse,
        [None, Some(472), Some(89), None],
    ),
    (
        "gemini_generate.json",
        Format::Json,
        [None, None, None, Some(33)],
    ),
    (
        "gemini_stream.sse",
        Format::Sse,
        [None, None, None, Some(33)],
    ),
];

#[test]
fn samples_every_split() {
    let all = paths(ALL);
    for &(name, format, expected) in SAMPLES {
        for (eol, shown) in [(&b"\n"[..], "LF"), (b"\r\n", "CRLF"), (b"\r", "CR")] {
            let body = line_ends(&fixture(name), eol);
            let whole = scan(&all, format, [&body[..]]);
            assert_eq!(whole, expected, "{name} ({shown}), whole");
            // Every split with LF line ends; with the others, those near a line end (and every
            // seventh), which is what they change: each split is a whole scan.
            let near_eol =
                |at: usize| body[at.saturating_sub(3)..(at + 3).min(body.len())].contains(&b'\r');
            for at in (0..=body.len()).filter(|&at| shown == "LF" || at % 7 == 0 || near_eol(at)) {
                let (a, b) = body.split_at(at);
                assert_eq!(
                    scan(&all, format, [a, b]),
                    expected,
                    "{name} ({shown}), split at {at}"
                );
            }
            let bytes = scan(&all, format, body.chunks(1));
            assert_eq!(bytes, expected, "{name} ({shown}), one byte at a time");
        }
    }
}

/// Each preset alone (a smaller prefilter than `ALL`'s), whole and one byte at a time.
#[test]
fn samples_each_preset() {
    let presets = [(OPENAI, [0]), (GEMINI, [3])];
    for &(name, format, expected) in SAMPLES {
        let body = fixture(name);
        for (preset, slots) in presets {
            let want: Vec<Option<u64>> = slots.iter().map(|&s| expected[s]).collect();
            assert_eq!(scan(&paths(preset), format, [&body[..]]), want, "{name}");
            assert_eq!(scan(&paths(preset), format, body.chunks(1)), want, "{name}");
        }
        let want = vec![expected[1], expected[2]];
        assert_eq!(scan(&paths(ANTHROPIC), format, [&body[..]]), want, "{name}");
        assert_eq!(
            scan(&paths(ANTHROPIC), format, body.chunks(1)),
            want,
            "{name}"
        );
    }
}

/// A JSON body's value of the one path `path` (slot 0), whole and one byte at a time.
fn json_value(path: &str, body: &str) -> Option<u64> {
    let p = paths(&[(path, 0)]);
    let whole = scan(&p, Format::Json, [body.as_bytes()])[0];
    assert_eq!(
        scan(&p, Format::Json, body.as_bytes().chunks(1))[0],
        whole,
        "{body}"
    );
    whole
}

/// An SSE body's value of `path`, the same ways.
fn sse_value(path: &str, body: &str) -> Option<u64> {
    let p = paths(&[(path, 0)]);
    let whole = scan(&p, Format::Sse, [body.as_bytes()])[0];
    assert_eq!(
        scan(&p, Format::Sse, body.as_bytes().chunks(1))[0],
        whole,
        "{body:?}"
    );
    whole
}

#[test]
fn keys_compare_unescaped() {
    let cases = [
        r#"{"usage":{"total_tokens":7}}"#,
        r#"{"us\u0061ge":{"total\u005Ftokens":7}}"#,
        r#"{"\u0075\u0073\u0061\u0067\u0065":{"total_tokens":7}}"#,
    ];
    for body in cases {
        assert_eq!(json_value("usage.total_tokens", body), Some(7), "{body}");
    }
    // Escapes of characters JSON must or may escape; a key with a surrogate pair.
    let p = Paths::new(&[(vec!["a/b".into(), "c\"d\\e\n".into()], 0)]).unwrap();
    let body = br#"{"a\/b":{"c\"d\\e\n":3}}"#;
    assert_eq!(scan(&p, Format::Json, [&body[..]]), [Some(3)]);
    assert_eq!(scan(&p, Format::Json, body.chunks(1)), [Some(3)]);
    let p = Paths::new(&[(vec!["t\u{e9}\u{1f600}".into()], 0)]).unwrap();
    for body in [
        &br#"{"t\u00e9\ud83d\ude00":4}"#[..],
        "{\"t\u{e9}\u{1f600}\":4}".as_bytes(),
        br#"{"t\u00E9\uD83D\uDE00":4}"#,
    ] {
        assert_eq!(scan(&p, Format::Json, [body]), [Some(4)]);
        assert_eq!(scan(&p, Format::Json, body.chunks(1)), [Some(4)]);
    }
    // A lone surrogate is invalid: the rest of the document is ignored.
    let body = br#"{"t\ud83d":1,"t\u00e9\ud83d\ude00":4}"#;
    assert_eq!(scan(&p, Format::Json, [&body[..]]), [None]);
    // Near misses.
    for body in [
        r#"{"usage":{"total_token":7}}"#,
        r#"{"usage":{"total_tokens_":7}}"#,
        r#"{"usage":{"Total_tokens":7}}"#,
        r#"{"usage_":{"total_tokens":7}}"#,
        r#"{"x":{"usage":{"total_tokens":7}}}"#,
        r#"{"total_tokens":7}"#,
    ] {
        assert_eq!(json_value("usage.total_tokens", body), None, "{body}");
    }
}

#[test]
fn only_plain_integers_count() {
    for (number, value) in [
        ("0", Some(0)),
        ("42", Some(42)),
        ("18446744073709551615", Some(u64::MAX)),
        ("18446744073709551616", None),
        ("99999999999999999999999", None),
        ("-1", None),
        ("-0", None),
        ("1.0", None),
        ("1e3", None),
        ("1E+3", None),
        ("0.5e-1", None),
        ("\"5\"", None),
        ("true", None),
        ("null", None),
        ("{\"n\":5}", None),
        ("[5]", None),
    ] {
        let body = format!("{{\"n\":{number}}}");
        assert_eq!(json_value("n", &body), value, "{body}");
        let spaced = format!("{{ \"n\" :\n\t{number} \r\n}}");
        assert_eq!(json_value("n", &spaced), value, "{spaced}");
    }
    // Invalid numbers end the document.
    for number in ["01", "1.", "-", "1e", "+1", ".5", "1.e3", "0x1"] {
        let body = format!("{{\"a\":{number},\"n\":5}}");
        assert_eq!(json_value("n", &body), None, "{body}");
    }
}

#[test]
fn paths_do_not_enter_arrays() {
    assert_eq!(json_value("a.b", r#"{"a":[{"b":1}]}"#), None);
    assert_eq!(json_value("b", r#"[{"b":1}]"#), None);
    assert_eq!(json_value("a.b", r#"{"a":{"c":[{"b":1}],"b":2}}"#), Some(2));
    // Deep and wide documents around the path.
    let deep = format!(
        "{{\"x\":{}1{},\"n\":3}}",
        "[{\"a\":".repeat(60),
        "}]".repeat(60)
    );
    assert_eq!(json_value("n", &deep), Some(3));
    // Deeper than serde_json reads is invalid.
    let too_deep = format!("{{\"x\":{}{},\"n\":3}}", "[".repeat(127), "]".repeat(127));
    assert_eq!(json_value("n", &too_deep), None);
}

/// A string no path leads into ends at the first quote after an even run of backslashes,
/// however the body is split (the scanner searches for quotes alone, then counts the
/// backslashes before one): keys and values with escaped quotes and backslash runs.
#[test]
fn skipped_strings_end_at_their_unescaped_quote() {
    let p = paths(&[("n", 0)]);
    let body = br#"{"s\\\"k\\": "a\\\\\"b\\\\", "t\"": ["\\\"", "x\\"], "n": 5, "u": "\"n\": 6"}"#;
    assert!(serde_json::from_slice::<serde_json::Value>(body).is_ok());
    for at in 0..=body.len() {
        for end in at..=body.len() {
            let pieces = [&body[..at], &body[at..end], &body[end..]];
            assert_eq!(
                scan(&p, Format::Json, pieces),
                [Some(5)],
                "split at {at}, {end}"
            );
        }
    }
}

#[test]
fn last_value_wins_and_alternatives_share_a_slot() {
    let p = paths(OPENAI);
    let body = br#"{"usage":{"total_tokens":1}} {"response":{"usage":{"total_tokens":2}}}
        {"usage":{"total_tokens":3,"total_tokens":4}}{"usage":null}"#;
    assert_eq!(scan(&p, Format::Json, [&body[..]]), [Some(4)]);
    // A path that is a prefix of another; the same path in two slots.
    let p = Paths::new(&[
        (vec!["a".into()], 0),
        (vec!["a".into(), "b".into()], 1),
        (vec!["a".into(), "b".into()], 2),
    ])
    .unwrap();
    assert_eq!(
        scan(&p, Format::Json, [&br#"{"a":{"b":5}}{"a":6}"#[..]]),
        [Some(6), Some(5), Some(5)]
    );
}

#[test]
fn invalid_json_keeps_what_came_before() {
    let body = r#"{"usage":{"total_tokens":5,"x":}} {"usage":{"total_tokens":6}}"#;
    // JSON: the rest of the body is ignored.
    assert_eq!(json_value("usage.total_tokens", body), Some(5));
    // SSE: the rest of the event is.
    let sse = "data: {\"n\":1,]\ndata: {\"n\":2}\n\ndata: {\"n\":3}\n\n";
    assert_eq!(sse_value("n", sse), Some(3));
    let sse = "data: {\"n\":1}\n\ndata: {\"n\":2,]\n\ndata: [DONE]\n\n";
    assert_eq!(sse_value("n", sse), Some(2));
    // A document cut short: the number before the cut counts.
    assert_eq!(json_value("n", r#"{"n":12"#), Some(12));
}

#[test]
fn event_stream_framing() {
    let cases = [
        // Comments, other fields, a space or none after "data:".
        (
            ": hi\nevent: x\nid: 1\nretry: 10\ndata:{\"n\":1}\n\n",
            Some(1),
        ),
        // Data lines joined with "\n" make one document.
        (
            "data: {\"a\":0,\ndata:  \"n\"\ndata: :\ndata: 2}\n\n",
            Some(2),
        ),
        ("data\ndata: {\"n\":3}\n\n", Some(3)),
        // A byte order mark first.
        ("\u{feff}data: {\"n\":4}\n\n", Some(4)),
        // Fields that are not exactly "data".
        (
            "Data: {\"n\":5}\n\ndat: {\"n\":5}\n\ndata : {\"n\":5}\n\n data: {\"n\":5}\n\n",
            None,
        ),
        ("datas: {\"n\":5}\n\n", None),
        // Two documents in one event's data are a sequence, as in a JSON body.
        ("data: {\"n\":6}\ndata: {\"n\":7}\n\n", Some(7)),
        // Blank lines only end events; [DONE] and text are not JSON.
        (
            "\n\n\r\ndata: {\"n\":8}\r\n\r\ndata: [DONE]\r\n\r\ndata: bye\n\n",
            Some(8),
        ),
        // An event the stream ends in the middle of still counts.
        ("data: {\"n\":9}", Some(9)),
        ("data: {\"n\":10}\n", Some(10)),
        // CR line ends, a CR then a LF.
        ("data: {\"n\":\rdata: 11}\r\r", Some(11)),
        ("data: {\"n\":\r\ndata: 12}\r\n\r\n", Some(12)),
    ];
    for (body, value) in cases {
        assert_eq!(sse_value("n", body), value, "{body:?}");
        // Every split in two.
        let p = paths(&[("n", 0)]);
        for at in 0..=body.len() {
            let (a, b) = body.as_bytes().split_at(at);
            assert_eq!(scan(&p, Format::Sse, [a, b])[0], value, "{body:?} at {at}");
        }
    }
    // A CRLF split across chunks, an empty chunk between.
    let p = paths(&[("n", 0)]);
    let chunks: [&[u8]; 4] = [b"data: {\"n\":1}\r", b"", b"\n", b"\r\ndata: {\"n\":2}\n\n"];
    assert_eq!(scan(&p, Format::Sse, chunks), [Some(2)]);
}

#[test]
fn the_prefilter_steps_aside_for_escapes() {
    // The needle ("total_tokens") is not in this line as written.
    let body = "data: {\"usage\":{\"total\\u005ftokens\":7}}\n\n";
    assert_eq!(sse_value("usage.total_tokens", body), Some(7));
    // Keys with characters JSON may escape otherwise turn the prefilter off.
    let p = Paths::new(&[(vec!["a/b".into()], 0)]).unwrap();
    assert_eq!(
        scan(&p, Format::Sse, [&b"data: {\"a\\/b\":7}\n\n"[..]]),
        [Some(7)]
    );
}

#[test]
fn paths_errors() {
    let err = |list: &[(Vec<&str>, usize)]| {
        let list: Vec<(Vec<String>, usize)> = list
            .iter()
            .map(|(p, s)| (p.iter().map(|k| k.to_string()).collect(), *s))
            .collect();
        Paths::new(&list).unwrap_err()
    };
    assert_eq!(err(&[(vec![], 0)]), "a usage path needs at least one key");
    assert_eq!(
        err(&[(vec!["a", ""], 0)]),
        "usage path 'a.' has an empty key"
    );
    assert_eq!(
        err(&[(vec!["a"; MAX_DEPTH + 1], 0)]),
        "usage path 'a.a.a.a.a.a.a.a.a' has 9 keys, the most is 8"
    );
    assert_eq!(
        err(&[(vec!["a"], MAX_SLOTS)]),
        "usage path 'a': slot 16, the most is 15"
    );
    let keys: Vec<String> = (0..300).map(|i| i.to_string()).collect();
    let many: Vec<(Vec<String>, usize)> = keys.iter().map(|k| (vec![k.clone()], 0)).collect();
    assert_eq!(
        Paths::new(&many).unwrap_err(),
        "usage paths: more than 254 keys in all"
    );
    assert_eq!(paths(ANTHROPIC).slots(), 2);
    assert_eq!(paths(ALL), paths(ALL));
}

/// The scanner is per stream, held by the stream's state: its size is fixed and small.
/// 128 bytes are the 16 slots' values; the rest is the tokenizer (a bit per open container,
/// the trie node of each of the first MAX_DEPTH + 1 open objects, a key's and a number's
/// progress) and the event-stream framing.
#[test]
fn scanner_size() {
    let size = std::mem::size_of::<Scanner>();
    println!("size_of::<Scanner>() = {size}");
    assert!(size <= 256, "{size}");
}

/// A 200-event OpenAI chat stream (usage in the last event, then [DONE]), one event per
/// chunk as the upstream flushes them, from the recorded sample's events.
fn openai_stream_200() -> Vec<Vec<u8>> {
    let sample = fixture("openai_chat_stream.sse");
    let text = std::str::from_utf8(&sample).unwrap();
    let events: Vec<String> = text.split_inclusive("\n\n").map(String::from).collect();
    let n = events.len();
    let (first, content, tail) = (&events[0], &events[1..n - 3], &events[n - 3..]);
    let mut out = vec![first.clone().into_bytes()];
    out.extend(
        content
            .iter()
            .cycle()
            .take(200 - 1 - tail.len())
            .map(|e| e.clone().into_bytes()),
    );
    out.extend(tail.iter().map(|e| e.clone().into_bytes()));
    out
}

/// A 4 KB OpenAI chat completion (pretty-printed, a long answer with escapes).
fn openai_json_4k() -> Vec<u8> {
    let sample = String::from_utf8(fixture("openai_chat.json")).unwrap();
    let line = "Token buckets refill at a fixed rate; a request spends tokens.\\n";
    let long = line.repeat((4096 - sample.len()) / line.len() + 1);
    sample
        .replacen("\"content\": \"", &format!("\"content\": \"{long}"), 1)
        .into_bytes()
}

/// What callgrind counts (`--toggle-collect='*feed_all*'`).
#[inline(never)]
fn feed_all(paths: &Paths, format: Format, chunks: &[Vec<u8>]) -> Option<u64> {
    let mut scanner = Scanner::new(format);
    for chunk in chunks {
        scanner.feed(paths, chunk);
    }
    scanner.finish(paths);
    scanner.value(0)
}

#[test]
#[ignore = "run under callgrind, see the file's doc"]
fn instructions_openai_stream() {
    let chunks = openai_stream_200();
    let p = paths(OPENAI);
    let bytes: usize = chunks.iter().map(Vec::len).sum();
    assert_eq!(
        black_box(feed_all(black_box(&p), Format::Sse, &chunks)),
        Some(41)
    );
    println!("{} events, {bytes} bytes", chunks.len());
}

#[test]
#[ignore = "run under callgrind, see the file's doc"]
fn instructions_openai_json() {
    let body = openai_json_4k();
    let p = paths(OPENAI);
    assert_eq!(
        black_box(feed_all(
            black_box(&p),
            Format::Json,
            std::slice::from_ref(&body)
        )),
        Some(79)
    );
    println!("{} bytes", body.len());
}

/// What callgrind counts of a request body's scan for its fields (`--toggle-collect='*read_model*'`):
/// as the filter reads a rule's `body:model`, the body in one piece, then its end.
#[inline(never)]
fn read_model(paths: &Paths, body: &[u8]) -> Option<usize> {
    let mut scanner = Scanner::with_texts(Format::Json);
    scanner.feed(paths, body);
    scanner.finish(paths);
    scanner.text(0).map(<[u8]>::len)
}

#[test]
#[ignore = "run under callgrind, see the file's doc"]
fn instructions_chat_request() {
    // bench.py's chat request: 2,048 bytes, the model after the messages.
    let head = r#"{"messages": [{"role": "user", "content": ""#;
    let tail = r#""}], "max_tokens": 300, "model": "gpt-4o-mini"}"#;
    let pad = "How does a token bucket work? ".repeat(80);
    let body = format!("{head}{}{tail}", &pad[..2048 - head.len() - tail.len()]);
    assert_eq!(body.len(), 2048);
    let p = paths(&[("model", 0)]);
    assert_eq!(
        black_box(read_model(black_box(&p), body.as_bytes())),
        Some(11)
    );
    println!("{} bytes", body.len());
}

/// The text values of `body` at `list`'s paths, fed whole, split in two at every position,
/// and a byte at a time: every split gives the same values, which are returned.
fn texts(list: &[(&str, usize)], body: &[u8]) -> Vec<Option<Vec<u8>>> {
    let paths = paths(list);
    let slots = list.iter().map(|(_, s)| s + 1).max().unwrap_or(0);
    let read = |chunks: &mut dyn Iterator<Item = &[u8]>| {
        let mut s = Scanner::with_texts(Format::Json);
        for c in chunks {
            s.feed(&paths, c);
        }
        s.finish(&paths);
        (0..slots)
            .map(|i| s.text(i).map(<[u8]>::to_vec))
            .collect::<Vec<_>>()
    };
    let whole = read(&mut std::iter::once(body));
    for at in 0..=body.len() {
        let (a, b) = body.split_at(at);
        assert_eq!(read(&mut [a, b].into_iter()), whole, "split at {at}");
    }
    assert_eq!(read(&mut body.chunks(1)), whole, "byte by byte");
    whole
}

#[test]
fn text_values_are_kept_unescaped_under_any_split() {
    let fields = &[("model", 0), ("metadata.user_id", 1), ("user", 2)];
    let t = |s: &str| Some(s.as_bytes().to_vec());
    assert_eq!(
        texts(
            fields,
            br#"{"messages": [{"role": "user", "content": "a \"model\": \"x\""}],
                "model": "gpt-4o-mini", "metadata": {"user_id": "u-7"}, "user": 42}"#
        ),
        [t("gpt-4o-mini"), t("u-7"), t("42")]
    );
    // Escapes, \u escapes and a surrogate pair are unescaped: one model whichever way it is
    // written.
    assert_eq!(
        texts(
            fields,
            br#"{"model": "gpt-4\u006f\/x\n\ud83d\ude00", "user": "\u00e9"}"#
        ),
        [t("gpt-4o/x\n\u{1f600}"), None, t("\u{e9}")]
    );
    // The last value counts; a value of another type, or one past MAX_TEXT bytes, is absent.
    let long = "m".repeat(ratelimit_core::usage::MAX_TEXT + 1);
    let body = format!(
        r#"{{"model": "a", "model": "{long}", "user": -1, "metadata": {{"user_id": null}}}}"#
    );
    assert_eq!(texts(fields, body.as_bytes()), [None, None, None]);
    let exact = "m".repeat(ratelimit_core::usage::MAX_TEXT);
    let body = format!(r#"{{"model": "{exact}"}}"#);
    assert_eq!(texts(fields, body.as_bytes())[0], t(&exact));
    // Nested deeper than the path, in an array, or not JSON: absent.
    for bad in [
        &br#"{"x": {"model": "a"}}"#[..],
        br#"[{"model": "a"}]"#,
        b"model=gpt-4o",
        br#"{"model": "a
b"}"#,
        br#"{"model": "\q"}"#,
    ] {
        assert_eq!(
            texts(fields, bad)[0],
            None,
            "{}",
            String::from_utf8_lossy(bad)
        );
    }
    // A scan that keeps no texts has none.
    let p = paths(fields);
    let mut s = Scanner::new(Format::Json);
    s.feed(&p, br#"{"model": "a"}"#);
    assert_eq!(s.text(0), None);
}

/// A string at a path's end that is invalid JSON (a raw control character, an unknown escape,
/// a lone surrogate) ends the document for a scan that keeps texts and for one that does not
/// alike: the numbers found after it are the same either way, so a reservation sized from
/// `max_tokens` does not change because another rule reads `model` (found by the body_scan
/// fuzz target).
#[test]
fn an_invalid_string_at_a_path_stops_both_scans_alike() {
    let fields = &[("model", 0), ("max_tokens", 1)];
    let p = paths(fields);
    for bad in [
        &b"{\"model\": \"a\x01b\", \"max_tokens\": 9}"[..],
        br#"{"model": "\q", "max_tokens": 9}"#,
        br#"{"model": "\ud800x", "max_tokens": 9}"#,
    ] {
        let values = |texts: bool| {
            let mut s = if texts {
                Scanner::with_texts(Format::Json)
            } else {
                Scanner::new(Format::Json)
            };
            s.feed(&p, bad);
            s.finish(&p);
            s.value(1)
        };
        let shown = String::from_utf8_lossy(bad);
        assert_eq!(values(true), None, "{shown}");
        assert_eq!(values(false), None, "{shown}");
    }
}

/// In a request body a field given twice counts as it comes last, as the backend reads it: a
/// last value that is neither a string nor a whole number leaves the field absent, and a
/// string leaves a number's slot without a number (found by envoy-tests' hostile.rs). In an
/// answer, a later null does not erase the usage an earlier event reported.
#[test]
fn in_a_request_a_field_given_twice_counts_as_it_comes_last() {
    let p = paths(&[("model", 0), ("max_tokens", 1)]);
    let read = |texts: bool, body: &[u8]| {
        let mut s = Scanner::request(texts);
        s.feed(&p, body);
        s.finish(&p);
        (s.text(0).map(<[u8]>::to_vec), s.value(1))
    };
    for last in ["null", "1.5", "[1]", "{\"x\": 1}", "true", "-1", "1e3"] {
        let body =
            format!(r#"{{"model": "a", "model": {last}, "max_tokens": 50, "max_tokens": {last}}}"#);
        assert_eq!(read(true, body.as_bytes()), (None, None), "{body}");
        assert_eq!(read(false, body.as_bytes()).1, None, "{body}");
    }
    let body = br#"{"model": "a", "model": "b", "max_tokens": 50, "max_tokens": "60"}"#;
    assert_eq!(read(true, body), (Some(b"b".to_vec()), None));
    let body = br#"{"model": null, "model": "b", "max_tokens": null, "max_tokens": 60}"#;
    assert_eq!(read(true, body), (Some(b"b".to_vec()), Some(60)));
    assert_eq!(read(false, body).1, Some(60));
    // An answer's usage: each event reports anew, and a null leaves what came before.
    let mut answer = Scanner::new(Format::Sse);
    answer.feed(
        &p,
        b"data: {\"max_tokens\": 7}\n\ndata: {\"max_tokens\": null}\n\n",
    );
    answer.finish(&p);
    assert_eq!(answer.value(1), Some(7));
}

/// An event stream's last event (OpenAI's `[DONE]`, Anthropic's message_stop) is seen under
/// any split, by the fast path and the slow one alike; anything close to it is not.
#[test]
fn the_last_event_of_a_stream_is_seen_under_any_split() {
    let ended = |list: &[(&str, usize)], body: &[u8]| {
        let p = paths(list);
        let mut whole = Scanner::new(Format::Sse);
        whole.feed(&p, body);
        for at in 0..=body.len() {
            let (a, b) = body.split_at(at);
            let mut s = Scanner::new(Format::Sse);
            s.feed(&p, a);
            s.feed(&p, b);
            assert_eq!(s.ended(), whole.ended(), "split at {at}");
        }
        let mut s = Scanner::new(Format::Sse);
        for b in body.chunks(1) {
            s.feed(&p, b);
        }
        assert_eq!(s.ended(), whole.ended(), "byte by byte");
        whole.ended()
    };
    let usage = &[("usage.total_tokens", 0)];
    // `[DONE]` never names a path: the fast path sees it unless there are no needles.
    for list in [&usage[..], &[("DONE", 0)][..]] {
        let openai = b"data: {\"usage\":{\"total_tokens\":9}}\n\ndata: [DONE]\n\n";
        assert!(ended(list, openai));
        assert!(ended(list, b"data:[DONE]\r\n\r\n"));
        assert!(ended(
            list,
            b"event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n"
        ));
        for not_yet in [
            &b"data: [DONE]\n"[..],
            b"data: [DONE]x\n\n",
            b"data: [DON\n\n",
            b"data: [DONE]\ndata: [DONE]\n\n",
            b"data: {\"type\": \"message_stop\"}\n\n",
            b"data: [done]\n\n",
            b": [DONE]\n\n",
            b"",
        ] {
            assert!(
                !ended(list, not_yet),
                "{}",
                String::from_utf8_lossy(not_yet)
            );
        }
    }
    // A JSON body has no last event.
    let p = paths(usage);
    let mut s = Scanner::new(Format::Json);
    s.feed(&p, b"data: [DONE]\n\n");
    assert!(!s.ended());
}

/// Each slot keeps its own last text, whichever order the slots' fields come in and however
/// many slots there are (more than the few kept without an allocation): a value too long, then
/// a short one, leaves the short one; a text then a number leaves the number's digits.
#[test]
fn each_slot_keeps_its_last_text_in_any_order() {
    let fields = &[("a", 0), ("b", 1), ("c", 2), ("d", 3), ("e", 4), ("x.a", 4)];
    let t = |s: &str| Some(s.as_bytes().to_vec());
    let long = "m".repeat(ratelimit_core::usage::MAX_TEXT + 1);
    let body = format!(
        r#"{{"e": "e1", "d": "{long}", "c": "c1", "b": "b1", "a": "a1", "c": 7, "d": "d2",
            "x": {{"a": "xa"}}, "b": "{long}"}}"#
    );
    assert_eq!(
        texts(fields, body.as_bytes()),
        [t("a1"), None, t("7"), t("d2"), t("xa")]
    );
}

/// Containers no path leads into (arrays, objects at no path) are skipped whole, following only
/// their brackets and strings: a wanted field after one, or beside one inside a wanted object,
/// is found under every split, whatever brackets, escaped quotes and backslash runs their
/// strings hold; their brackets still have to match.
#[test]
fn fields_after_skipped_containers_are_found_under_any_split() {
    let fields = &[("model", 0), ("metadata.user_id", 1), ("metadata.tier", 2)];
    let t = |s: &str| Some(s.as_bytes().to_vec());
    let body = br#"{"messages": [{"role": "user", "content": "]}[{ \"model\": \"no\" \\\\\"]"},
        {"content": [{"type": "text", "text": "\\\\"}, "}", "\\\"{", [[], {}]]}, "a\\"],
        "model": "gpt-4o", "tools": {"model": "no", "x": [{"model": "no"}], "y": "\\"},
        "metadata": {"n": {"user_id": "no", "z": ["}"]}, "user_id": "u-\"1\\",
            "l": [{"user_id": "no"}], "tier": {"a": "]"}, "tier": "gold", "o": {}},
        "stop": ["]", "\"", "\\"], "m": [], "model\\": "no"}"#;
    assert!(serde_json::from_slice::<serde_json::Value>(body).is_ok());
    assert_eq!(texts(fields, body), [t("gpt-4o"), t("u-\"1\\"), t("gold")]);
    // A repeated key after a skipped container still wins; mismatched brackets inside one make
    // the document invalid, as they did before skipping.
    assert_eq!(
        texts(
            fields,
            br#"{"model": "a", "m": [{"x": "]"}], "model": "b"}"#
        )[0],
        t("b")
    );
    for bad in [
        &br#"{"m": [{"x": 1]], "model": "a"}"#[..],
        br#"{"m": {"x": [1}}, "model": "a"}"#,
        br#"{"m": [[["]"]], "model": "a"}"#,
    ] {
        assert_eq!(
            texts(fields, bad)[0],
            None,
            "{}",
            String::from_utf8_lossy(bad)
        );
    }
}
