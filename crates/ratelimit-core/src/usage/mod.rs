//! The usage an LLM answer reports in its body (`"usage": {"total_tokens": 42}`), found while
//! the body streams through, without buffering it and without allocating per stream.
//!
//! [`Paths`] are the JSON paths to look for, compiled once from the config. A [`Scanner`] is
//! one body's scan: fixed-size state fed chunk by chunk, which keeps for each slot the last
//! non-negative integer seen at any of the slot's paths (streams repeat cumulative counts, so
//! the last one is the total). Any split of the body into chunks gives the same values.
//!
//! [`Format::Json`]: the body is a sequence of JSON texts (usually one). [`Format::Sse`]: the
//! body is a `text/event-stream`; the data lines of each event, joined with `"\n"`, form one
//! JSON document whose root the paths start from, and data that is not JSON (`[DONE]`) is
//! ignored. The parts:
//! - [`paths`](Paths): the trie of path segments, and the needles of the prefilter;
//! - `json`: the resumable JSON tokenizer that follows the path from the root;
//! - `sse`: the event-stream framing around it, and its fast path: a data line that is a whole
//!   document is skipped unparsed when it contains no needle.
//!
//! Where this departs from the standards, on purpose or by economy:
//! - an event's data is read as a JSON body is, a sequence of texts (usually one);
//! - an event the stream ends in the middle of still counts (the event-stream standard drops
//!   it): what the upstream reported is charged;
//! - invalid JSON ends its document (for SSE, until the event ends; for JSON, the rest of the
//!   body), but the values found before the error stay. Inside strings and keys that cannot
//!   match, escapes and control characters are not checked, only skipped over; inside arrays
//!   and objects no path leads into (skipped whole), only brackets and strings are followed:
//!   the brackets must match, the rest is not checked;
//! - JSON nested deeper than 127 levels is invalid, as for `serde_json`.

mod json;
mod paths;
mod sse;

pub use json::MAX_TEXT;
pub use paths::Paths;

/// The most segments a path may have.
pub const MAX_DEPTH: usize = 8;
/// The most values one [`Paths`] collects.
pub const MAX_SLOTS: usize = 16;

/// A slot's bit in a set of slots (0 past [`MAX_SLOTS`], which no slot is).
pub fn slot_bit(slot: usize) -> u16 {
    u32::try_from(slot)
        .ok()
        .and_then(|s| 1u16.checked_shl(s))
        .unwrap_or(0)
}

/// How a body is framed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// One or more JSON texts (`application/json`).
    Json,
    /// A server-sent event stream (`text/event-stream`), one JSON document per event.
    Sse,
}

/// One body's scan. Its size is fixed (no heap), whatever the body.
#[derive(Clone, Debug)]
pub struct Scanner {
    format: Format,
    sse: sse::Sse,
    json: json::Json,
}

impl Scanner {
    /// A scan of a body framed as `format`, before its first byte.
    pub fn new(format: Format) -> Scanner {
        Scanner {
            format,
            sse: sse::Sse::new(),
            json: json::Json::new(),
        }
    }

    /// The body's next bytes.
    pub fn feed(&mut self, paths: &Paths, chunk: &[u8]) {
        match self.format {
            Format::Json => self.json.feed(paths, chunk),
            Format::Sse => self.sse.feed(&mut self.json, paths, chunk),
        }
    }

    /// The body ended (completes a number at the very end).
    pub fn finish(&mut self, paths: &Paths) {
        match self.format {
            Format::Json => self.json.end_document(paths),
            Format::Sse => self.sse.finish(&mut self.json, paths),
        }
    }

    /// A scan that also keeps the text values at the paths' ends (for keys and matches on a
    /// request body's fields): each slot's last string, unescaped, or whole number, as digits.
    pub fn with_texts(format: Format) -> Scanner {
        let mut s = Scanner::new(format);
        s.json.keep_texts();
        s
    }

    /// A scan of a request's JSON body (keeping texts or not): a field given twice counts as
    /// it comes last, as the backend reads it, so a last value that is neither a string nor a
    /// whole number (null, `1.5`, an object) leaves the field absent. (In an answer, where
    /// each event reports usage anew, a later null does not erase what an earlier event said.)
    pub fn request(texts: bool) -> Scanner {
        let mut s = if texts {
            Scanner::with_texts(Format::Json)
        } else {
            Scanner::new(Format::Json)
        };
        s.json.read_as_request();
        s
    }

    /// The last text value seen at any path of `slot` (a scan [`Scanner::with_texts`]): a
    /// string, unescaped, or a whole number as its digits; `None` when none was found or the
    /// last was longer than [`MAX_TEXT`] bytes.
    pub fn text(&self, slot: usize) -> Option<&[u8]> {
        self.json.text(slot)
    }

    /// Whether the body is an event stream that its API's last event has ended (`[DONE]`,
    /// `{"type":"message_stop"}`): what it reported is all it will report, whether or not the
    /// body's end follows.
    pub fn ended(&self) -> bool {
        self.format == Format::Sse && self.sse.ended()
    }

    /// The last value seen at any path of `slot`: non-negative integers only (no fraction, no
    /// exponent, fits u64); `None` when no path of the slot had one.
    pub fn value(&self, slot: usize) -> Option<u64> {
        self.json.value(slot)
    }
}
