//! The event-stream framing (WHATWG HTML, "server-sent events"): lines end with CRLF, LF or
//! CR; a line `data:VALUE` (one space after the colon dropped) adds VALUE to the event's data,
//! joined with "\n"; comments (`:...`) and other fields are ignored; a blank line ends the
//! event. The data goes to the JSON tokenizer as it comes, one document per event.
//!
//! The last event: a stream whose event's data is exactly `[DONE]` (OpenAI's chat completions)
//! or `{"type":"message_stop"}` (Anthropic's messages) has ended as far as its API goes, and
//! [`Sse::ended`] says so, so that its usage is charged even if the client hangs up before the
//! upstream's end reaches the proxy (OpenAI's SDK closes the stream at `[DONE]`).
//!
//! The fast path: a data line that is the event's only one (the next line is blank) and lies
//! whole in the chunk is a whole document; when it contains no needle of the paths, no path
//! has a value in it, and it is skipped without parsing. Streamed answers send one such line
//! per token, and the usage in one of them only.

use super::json::Json;
use super::paths::Paths;
use memchr::{memchr2, memchr3};

/// Where in a line the framing is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    /// The stream's first bytes, which may be a byte order mark: how many of it were read.
    Bom(u8),
    /// In a field name, of which the bytes read so far are the first bytes of "data".
    Field(u8),
    /// Just after "data:": an optional space.
    DataSpace,
    /// In a data line's value.
    Data,
    /// In a line that is not data.
    Ignore,
}

const BOM: &[u8] = b"\xef\xbb\xbf";

/// The data of the events that end a stream, as the APIs write them.
const LAST_EVENTS: [&[u8]; 2] = [b"[DONE]", br#"{"type":"message_stop"}"#];
/// `last` once the event's data can no longer be one of [`LAST_EVENTS`].
const NOT_LAST: u8 = u8::MAX;

#[derive(Clone, Debug)]
pub(super) struct Sse {
    state: State,
    /// The chunk ended with a CR: a LF first in the next one ends the same line.
    after_cr: bool,
    /// The event has had a data line.
    has_data: bool,
    /// How many bytes of the event's data matched the start of one of [`LAST_EVENTS`] (the
    /// candidate in `last_of`), or [`NOT_LAST`].
    last: u8,
    last_of: u8,
    /// A last event has ended.
    ended: bool,
}

impl Sse {
    pub(super) fn new() -> Sse {
        Sse {
            state: State::Bom(0),
            after_cr: false,
            has_data: false,
            last: 0,
            last_of: 0,
            ended: false,
        }
    }

    /// Whether a last event of its API has ended the stream.
    pub(super) fn ended(&self) -> bool {
        self.ended
    }

    /// The event's data goes on with `bytes`: is it still one of [`LAST_EVENTS`]?
    fn match_last(&mut self, bytes: &[u8]) {
        if self.last == NOT_LAST || bytes.is_empty() {
            return;
        }
        let at = usize::from(self.last);
        if at == 0 {
            // The first byte picks the candidate: they differ there.
            match LAST_EVENTS.iter().position(|e| e.first() == bytes.first()) {
                Some(i) => self.last_of = u8::try_from(i).unwrap_or(0),
                None => {
                    self.last = NOT_LAST;
                    return;
                }
            }
        }
        let candidate = LAST_EVENTS.get(usize::from(self.last_of));
        self.last = match candidate.and_then(|e| e.get(at..at + bytes.len())) {
            Some(part) if part == bytes => u8::try_from(at + bytes.len()).unwrap_or(NOT_LAST),
            _ => NOT_LAST,
        };
    }

    /// The event ends: was it a last one?
    fn end_event(&mut self) {
        let whole = LAST_EVENTS
            .get(usize::from(self.last_of))
            .is_some_and(|e| usize::from(self.last) == e.len());
        if self.has_data && whole {
            self.ended = true;
        }
        self.last = 0;
        self.last_of = 0;
    }

    pub(super) fn feed(&mut self, json: &mut Json, paths: &Paths, chunk: &[u8]) {
        let mut i = 0;
        if self.after_cr && !chunk.is_empty() {
            self.after_cr = false;
            if chunk.first() == Some(&b'\n') {
                i = 1;
            }
        }
        while let Some(rest) = chunk.get(i..) {
            let Some(&b) = rest.first() else { return };
            let eol = b == b'\n' || b == b'\r';
            match self.state {
                State::Bom(n) => match BOM.get(usize::from(n)) {
                    Some(&m) if m == b => {
                        i += 1;
                        self.state = if usize::from(n) + 1 == BOM.len() {
                            State::Field(0)
                        } else {
                            State::Bom(n + 1)
                        };
                    }
                    // A part of a BOM then something else: a field name that is not "data".
                    _ => {
                        self.state = if n == 0 {
                            State::Field(0)
                        } else {
                            State::Ignore
                        }
                    }
                },
                State::Field(0) if !eol && !self.has_data => match skip_document(paths, rest) {
                    Some((skip, document)) => {
                        if LAST_EVENTS.contains(&document) {
                            self.ended = true;
                        }
                        i += skip;
                    }
                    None => self.field(json, paths, b, 0, &mut i),
                },
                State::Field(n) if eol => {
                    if n == 0 {
                        // A blank line ends the event.
                        if self.has_data {
                            json.end_document(paths);
                        }
                        self.end_event();
                        self.has_data = false;
                    } else if n == 4 {
                        // "data" alone: a data line with an empty value.
                        self.data_line(json, paths);
                    }
                    i = self.end_line(chunk, i);
                }
                State::Field(n) => self.field(json, paths, b, n, &mut i),
                State::DataSpace if eol => i = self.end_line(chunk, i),
                State::DataSpace => {
                    if b == b' ' {
                        i += 1;
                    }
                    self.state = State::Data;
                }
                State::Data | State::Ignore => match memchr2(b'\n', b'\r', rest) {
                    Some(at) => {
                        if self.state == State::Data {
                            let value = rest.get(..at).unwrap_or_default();
                            self.match_last(value);
                            json.feed(paths, value);
                        }
                        i = self.end_line(chunk, i + at);
                    }
                    None => {
                        if self.state == State::Data {
                            self.match_last(rest);
                            json.feed(paths, rest);
                        }
                        return;
                    }
                },
            }
        }
    }

    /// The byte `b` at `*i` of a field name, of which `n` bytes matched "data".
    fn field(&mut self, json: &mut Json, paths: &Paths, b: u8, n: u8, i: &mut usize) {
        *i += 1;
        self.state = match (b"data".get(usize::from(n)), b) {
            (Some(&d), _) if d == b => State::Field(n + 1),
            (None, b':') => {
                self.data_line(json, paths);
                State::DataSpace
            }
            _ => State::Ignore,
        };
    }

    /// A data line starts: after another one of the event, the data has a "\n" between.
    fn data_line(&mut self, json: &mut Json, paths: &Paths) {
        if self.has_data {
            json.feed(paths, b"\n");
            // A last event's data is one line.
            self.last = NOT_LAST;
        }
        self.has_data = true;
    }

    /// The line ends with the CR or LF at `at`; where the next line starts.
    fn end_line(&mut self, chunk: &[u8], at: usize) -> usize {
        self.state = State::Field(0);
        match (chunk.get(at), chunk.get(at + 1)) {
            (Some(b'\r'), Some(b'\n')) => at + 2,
            (Some(b'\r'), None) => {
                self.after_cr = true;
                at + 1
            }
            _ => at + 1,
        }
    }

    /// The body ended: an event it ends in the middle of still counts.
    pub(super) fn finish(&mut self, json: &mut Json, paths: &Paths) {
        if self.has_data {
            json.end_document(paths);
        }
        self.end_event();
        self.has_data = false;
        self.state = State::Field(0);
    }
}

/// At the start of a line, outside any event's data: when the line is a data line whose event
/// ends right after it, all in `rest`, and it contains no needle and no `\u` escape, how many
/// bytes to skip to the blank line after it, and the line's document.
fn skip_document<'a>(paths: &Paths, rest: &'a [u8]) -> Option<(usize, &'a [u8])> {
    let value = rest.strip_prefix(b"data:")?;
    if !paths.prefilters() {
        return None;
    }
    // The line's end, and on the way any `\u` (a key may hide a needle behind escapes).
    let mut end = 0;
    loop {
        end += memchr3(b'\n', b'\r', b'\\', value.get(end..)?)?;
        if value.get(end) != Some(&b'\\') {
            break;
        }
        if value.get(end + 1) == Some(&b'u') {
            return None;
        }
        // (An escaped '\\' before a 'u' reads as `\u` too: the line is just not skipped.)
        end += 1;
    }
    let line = value.get(..end)?;
    let mut next = end + 1;
    if value.get(end) == Some(&b'\r') {
        match value.get(next) {
            Some(b'\n') => next += 1,
            Some(_) => {}
            // A LF may follow in the next chunk.
            None => return None,
        }
    }
    if !matches!(value.get(next), Some(b'\n' | b'\r')) {
        return None;
    }
    let document = line.strip_prefix(b" ").unwrap_or(line);
    if paths.may_match(document) {
        return None;
    }
    Some((b"data:".len() + next, document))
}
