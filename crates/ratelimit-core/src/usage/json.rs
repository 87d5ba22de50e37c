//! A resumable JSON tokenizer that follows where it is from the document's root and records
//! the integers at the paths' ends. Its state is a few dozen bytes: the kind of every open
//! container (a bit each) and the trie node of each open object that a path leads to.

use super::paths::{NodeId, Paths, NONE, ROOT};
use super::{MAX_DEPTH, MAX_SLOTS};
use memchr::{memchr, memchr2};
use smallvec::SmallVec;

/// Containers nest at most this deep (serde_json's limit, so that both read the same
/// documents as valid).
const MAX_NESTING: u8 = 127;

/// [`Json::skip_to`] when no container is being skipped: above every depth.
const NOT_SKIPPING: u8 = u8::MAX;

/// What the tokenizer expects next.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    /// A value: after ':', or a document's first (depth 0).
    Value,
    /// After '{': a key or '}'.
    ObjectFirst,
    /// After ',' in an object: a key.
    KeyNext,
    /// Inside a key that may still match: its bytes are compared as they come.
    Key,
    /// After '\' in such a key.
    KeyEscape,
    /// In the hex digits of a `\u` escape in such a key.
    KeyHex,
    /// After a `\u` escape of a high surrogate: its low surrogate's '\'.
    KeyLowBackslash,
    /// Its 'u'.
    KeyLowU,
    /// Inside a key that cannot match.
    SkipKey,
    /// After '\' in such a key.
    SkipKeyEscape,
    /// After a key: ':'.
    Colon,
    /// Inside a string value.
    Str,
    /// Inside a string value at a path's end, kept (unescaped) as text.
    Text,
    /// After '\' in such a string.
    TextEscape,
    /// In the hex digits of a `\u` escape in such a string.
    TextHex,
    /// After a `\u` escape of a high surrogate in such a string: its low surrogate's '\'.
    TextLowBackslash,
    /// Its 'u'.
    TextLowU,
    /// After '\' in a string value.
    StrEscape,
    /// After '-'.
    Minus,
    /// After a leading '0'.
    Zero,
    /// In an integer's digits.
    Int,
    /// After '.'.
    Dot,
    /// In a fraction's digits.
    Fraction,
    /// After 'e' or 'E'.
    Exponent,
    /// After the exponent's sign.
    ExponentSign,
    /// In the exponent's digits.
    ExponentDigits,
    /// In `true`, `false` or `null`.
    Literal,
    /// After a value in a container: ',' or the container's end.
    After,
    /// Inside a container no path leads into (an array, or an object at no path), outside its
    /// strings: only brackets and quotes are looked at until it closes.
    Skip,
    /// The document is invalid: the rest of it is ignored.
    Dead,
}

/// Where a string that `rest` is inside of (its first byte not escaped) ends: its closing
/// '"'. `Err(escaped)` when it does not end in `rest`; `escaped`: its last byte is a backslash
/// whose escape follows. A quote ends the string when an even number of backslashes comes
/// right before it: one search for quotes is cheaper than one for quotes and backslashes.
fn string_end(rest: &[u8]) -> Result<usize, bool> {
    // Most strings a document's structure holds (keys, roles) are short: a look at their first
    // bytes is cheaper than a call to `memchr`.
    let head = rest.get(..SHORT).unwrap_or(rest);
    match find(head, |w| equal(w, b'"') | equal(w, b'\\')) {
        Some(at) if head.get(at) == Some(&b'"') => return Ok(at),
        None if head.len() == rest.len() => return Err(false),
        _ => {}
    }
    let mut from = 0;
    let backslashes = |before: &[u8]| before.iter().rev().take_while(|&&b| b == b'\\').count();
    while let Some(at) = rest.get(from..).and_then(|r| memchr(b'"', r)) {
        let quote = from + at;
        if backslashes(rest.get(..quote).unwrap_or_default()) % 2 == 0 {
            return Ok(quote);
        }
        from = quote + 1;
    }
    Err(backslashes(rest) % 2 == 1)
}

/// The bytes of a string [`string_end`] looks at (eight at a time) before it calls `memchr`.
const SHORT: usize = 16;

/// A byte in each of a word's eight.
const ONES: u64 = 0x0101_0101_0101_0101;
/// The high bit of each of a word's eight bytes.
const HIGHS: u64 = 0x8080_8080_8080_8080;

/// The high bit of each byte of `w` below `n` (`n` at most 0x80), exact up to the first such
/// byte (a borrow may flag bytes after it): all [`find`] reads.
fn below(w: u64, n: u8) -> u64 {
    w.wrapping_sub(ONES * u64::from(n)) & !w & HIGHS
}

/// The high bit of each byte of `w` that is `b`, exact up to the first.
fn equal(w: u64, b: u8) -> u64 {
    below(w ^ (ONES * u64::from(b)), 1)
}

/// Bytes that end a run of a string's plain bytes: '"', '\\', a raw control character.
fn string_stops(w: u64) -> u64 {
    equal(w, b'"') | equal(w, b'\\') | below(w, 0x20)
}

/// Bytes a skipped container is followed by: '"', and the brackets ('[' and ']' are '{' and
/// '}' but for a bit).
fn skip_stops(w: u64) -> u64 {
    let folded = w | (ONES * 0x20);
    equal(w, b'"') | equal(folded, b'{') | equal(folded, b'}')
}

/// The first byte of `bytes` that `stops` flags (of a word's eight bytes, as [`below`] does),
/// eight bytes at a time while eight are left: structure's runs (keys, short strings, the
/// bytes between brackets) are a few bytes to a few dozen, too short for a call to `memchr`.
fn find(bytes: &[u8], stops: impl Fn(u64) -> u64) -> Option<usize> {
    let mut words = bytes.chunks_exact(8);
    let mut at = 0;
    for eight in words.by_ref() {
        if let &[a, b, c, d, e, f, g, h] = eight {
            let hits = stops(u64::from_le_bytes([a, b, c, d, e, f, g, h]));
            if hits != 0 {
                return Some(at + (hits.trailing_zeros() / 8) as usize);
            }
        }
        at += 8;
    }
    // The last few bytes (fewer than eight) as a word of their own, the bytes past them not
    // looked at.
    let tail = words.remainder();
    let w = tail.iter().rev().fold(0, |w, &b| w << 8 | u64::from(b));
    let bits = u32::try_from(tail.len() * 8).unwrap_or(u32::MAX);
    let hits = stops(w) & 1u64.checked_shl(bits).map_or(u64::MAX, |bit| bit - 1);
    (hits != 0).then(|| at + (hits.trailing_zeros() / 8) as usize)
}

/// Where the run of a kept string's plain bytes that starts `rest` ends: at its first '"',
/// '\\' or raw control character (invalid), or at the end of `rest`.
fn text_end(rest: &[u8]) -> usize {
    // A model's name or a user id is short: looked at before `memchr2` is called.
    let head = rest.get(..SHORT).unwrap_or(rest);
    if let Some(at) = find(head, string_stops) {
        return at;
    }
    let tail = rest.get(head.len()..).unwrap_or_default();
    let at = memchr2(b'"', b'\\', tail).unwrap_or(tail.len());
    let control = tail
        .get(..at)
        .and_then(|run| run.iter().position(|&b| b < 0x20));
    head.len() + control.unwrap_or(at)
}

fn is_space(b: u8) -> bool {
    matches!(b, b' ' | b'\t' | b'\n' | b'\r')
}

/// `true`, `false`, `null`.
const LITERALS: [&[u8]; 3] = [b"true", b"false", b"null"];

/// The tokenizer, and the values found.
#[derive(Clone, Debug)]
pub(super) struct Json {
    /// Bit `d` set: the container at depth `d + 1` is an array.
    arrays: u128,
    /// Each slot's last value (meaningful where `found` has its bit).
    values: [u64; MAX_SLOTS],
    /// A number's value so far.
    number: u64,
    /// The bytes of the key being compared, so far.
    key_pos: u32,
    /// The edges whose keys start with those bytes.
    edges: (u16, u16),
    /// A `\u` escape's digits so far.
    hex: u16,
    /// A high surrogate waiting for its low one.
    high: u16,
    /// The slots that have a value, a bit each.
    found: u16,
    state: State,
    /// Open containers.
    depth: u8,
    /// While a container no path leads into is skipped ([`State::Skip`]), the depth around
    /// it (that of the container it is in); [`NOT_SKIPPING`] otherwise.
    skip_to: u8,
    /// Containers at depths `1..=live` are objects a path leads to; `nodes[d - 1]` is the
    /// node of the one at depth `d`. Its keys are compared only at depth `live`.
    live: u8,
    nodes: [NodeId; MAX_DEPTH + 1],
    /// The node of the value that comes next (NONE: no path leads there).
    target: NodeId,
    /// Whether the number being read can be a value (no minus, fraction, exponent, overflow).
    plain: bool,
    /// Hex digits read of a `\u` escape; or the position in a literal.
    count: u8,
    /// Which literal is being read.
    literal: u8,
    /// The text values at the paths' ends, when kept ([`Json::keep_texts`]; boxed: only a
    /// request body's scan keeps them).
    texts: Option<Box<Texts>>,
    /// A request body ([`Json::read_as_request`]): every value at a path's end replaces the
    /// last, so that one of another type (null, a fraction, an object) leaves the slot absent,
    /// as the backend reads a key given twice.
    request: bool,
}

/// The longest text value kept, bytes: a longer one counts as absent.
pub const MAX_TEXT: usize = 512;

/// A text value kept: a model's name or a user id fits inline (no allocation per request).
type Text = SmallVec<[u8; 32]>;

/// Sets `value` (`None`: too long) as the text of each of `slots` (a bit each); the slots that
/// have a text after it.
fn record(values: &mut Values, found: u16, slots: u16, value: Option<&[u8]>) -> u16 {
    let Some(value) = value else {
        // A slot's text is read only while its bit is set.
        return found & !slots;
    };
    let mut left = slots;
    while left != 0 {
        // Only the slots' own bits: usually one of sixteen.
        let slot = left.trailing_zeros() as u8;
        match values.iter_mut().find(|(s, _)| *s == slot) {
            Some((_, text)) => {
                text.clear();
                text.extend_from_slice(value);
            }
            None => values.push((slot, Text::from_slice(value))),
        }
        left &= left - 1;
    }
    found | slots
}

/// What a one-character escape stands for (`n` for `\n`); `None` for `u` and invalid ones.
fn simple_escape(b: u8) -> Option<u8> {
    match b {
        b'"' | b'\\' | b'/' => Some(b),
        b'b' => Some(0x08),
        b'f' => Some(0x0c),
        b'n' => Some(b'\n'),
        b'r' => Some(b'\r'),
        b't' => Some(b'\t'),
        _ => None,
    }
}

/// The slots that had a text value, each with its last: (slot, text). Usually one or two (a
/// request's model, its user): a list that starts empty costs nothing to make and to drop,
/// where an array of every slot's text costs its sixteen each time.
type Values = SmallVec<[(u8, Text); 2]>;

/// The text values found: each slot's last string (unescaped) or whole number.
#[derive(Clone, Debug, Default)]
struct Texts {
    /// Each slot's last value (a slot appears once).
    values: Values,
    /// The slots that have one, a bit each.
    found: u16,
    /// The string being read, when it comes in several pieces or has escapes (otherwise it is
    /// kept straight from the piece it is in).
    current: Vec<u8>,
    /// Whether it grew past [`MAX_TEXT`].
    long: bool,
}

impl Json {
    pub(super) fn new() -> Json {
        Json {
            arrays: 0,
            values: [0; MAX_SLOTS],
            number: 0,
            key_pos: 0,
            edges: (0, 0),
            hex: 0,
            high: 0,
            found: 0,
            state: State::Value,
            depth: 0,
            skip_to: NOT_SKIPPING,
            live: 0,
            nodes: [NONE; MAX_DEPTH + 1],
            target: ROOT,
            plain: false,
            count: 0,
            literal: 0,
            texts: None,
            request: false,
        }
    }

    /// Keeps the text values at the paths' ends too (strings, whole numbers), not only the
    /// numbers.
    pub(super) fn read_as_request(&mut self) {
        self.request = true;
    }

    pub(super) fn keep_texts(&mut self) {
        self.texts = Some(Box::default());
    }

    /// The last text value of `slot`: a string (unescaped) or a whole number as digits; `None`
    /// when none was found, or it was longer than [`MAX_TEXT`].
    pub(super) fn text(&self, slot: usize) -> Option<&[u8]> {
        let t = self.texts.as_deref()?;
        if t.found & super::slot_bit(slot) == 0 {
            return None;
        }
        t.values
            .iter()
            .find(|(s, _)| usize::from(*s) == slot)
            .map(|(_, text)| text.as_slice())
    }

    /// The string being kept ended: it is the text of every slot at the current target (none
    /// if it was too long).
    fn end_text(&mut self, paths: &Paths) {
        let slots = paths.slots_at(self.target);
        if let Some(t) = self.texts.as_deref_mut() {
            let value = (!t.long).then_some(t.current.as_slice());
            t.found = record(&mut t.values, t.found, slots, value);
            t.current.clear();
        }
    }

    /// The string being kept ended within one piece, without escapes: `run` is all of it.
    /// Whether it was taken (not when earlier bytes of it are in `current`).
    fn end_text_in(&mut self, paths: &Paths, run: &[u8]) -> bool {
        let slots = paths.slots_at(self.target);
        match self.texts.as_deref_mut() {
            Some(t) if t.current.is_empty() && !t.long => {
                let value = (run.len() <= MAX_TEXT).then_some(run);
                t.found = record(&mut t.values, t.found, slots, value);
                true
            }
            _ => false,
        }
    }

    /// Adds bytes to the string being kept.
    fn text_bytes(&mut self, bytes: &[u8]) {
        if let Some(t) = self.texts.as_deref_mut() {
            if t.current.len() + bytes.len() > MAX_TEXT {
                t.long = true;
            } else {
                t.current.extend_from_slice(bytes);
            }
        }
    }

    pub(super) fn value(&self, slot: usize) -> Option<u64> {
        let found = u32::try_from(slot)
            .ok()
            .and_then(|s| 1u16.checked_shl(s))
            .is_some_and(|bit| self.found & bit != 0);
        found.then(|| self.values.get(slot).copied()).flatten()
    }

    /// The document ended: a number at its very end is complete. Then a new document may
    /// start.
    pub(super) fn end_document(&mut self, paths: &Paths) {
        if matches!(
            self.state,
            State::Zero | State::Int | State::Fraction | State::ExponentDigits
        ) {
            self.end_number(paths);
        }
        self.reset();
    }

    /// Back to the start of a document, keeping the values found.
    fn reset(&mut self) {
        self.state = State::Value;
        self.depth = 0;
        self.skip_to = NOT_SKIPPING;
        self.live = 0;
        self.target = ROOT;
    }

    /// The document's next bytes.
    pub(super) fn feed(&mut self, paths: &Paths, bytes: &[u8]) {
        let mut i = 0;
        while let Some(rest) = bytes.get(i..) {
            match self.state {
                // Only '"' and '\' matter in a string no path can be inside.
                State::Str | State::SkipKey => match string_end(rest) {
                    Ok(at) => {
                        // Its closing quote, taken here.
                        i += at + 1;
                        if self.state == State::Str {
                            self.after_value();
                        } else {
                            self.target = NONE;
                            i += self.colon(bytes.get(i..).unwrap_or_default());
                        }
                        continue;
                    }
                    Err(escaped) => {
                        if escaped {
                            self.state = match self.state {
                                State::Str => State::StrEscape,
                                _ => State::SkipKeyEscape,
                            };
                        }
                        return;
                    }
                },
                State::Text => {
                    let at = text_end(rest);
                    let run = rest.get(..at).unwrap_or_default();
                    if rest.get(at).is_some_and(|&b| b < 0x20) {
                        self.state = State::Dead; // raw control characters are invalid
                        return;
                    }
                    if rest.get(at) == Some(&b'"') && self.end_text_in(paths, run) {
                        self.after_value();
                        i += at + 1;
                        continue;
                    }
                    self.text_bytes(run);
                    i += at;
                    if at == rest.len() {
                        return;
                    }
                }
                // A key's plain bytes, up to its end or an escape, are compared at once.
                State::Key => {
                    let at = find(rest, string_stops).unwrap_or(rest.len());
                    if at > 0 {
                        self.key_bytes(paths, rest.get(..at).unwrap_or_default());
                        i += at;
                    }
                    match rest.get(at) {
                        // The key ends (still matching): the node it names, if any.
                        Some(b'"') if self.state == State::Key => {
                            self.target = paths.exact(self.edges, self.key_pos);
                            i += 1;
                            i += self.colon(bytes.get(i..).unwrap_or_default());
                            continue;
                        }
                        None => return,
                        Some(_) if at > 0 => continue,
                        // An escape or a control character: a step.
                        Some(_) => {}
                    }
                }
                // Only brackets and quotes matter in a container no path leads into: the
                // bytes between them are passed over at once.
                State::Skip => match find(rest, skip_stops) {
                    Some(at) => i += at,
                    None => return,
                },
                State::Dead => return,
                // Indentation comes in runs.
                State::Value
                | State::ObjectFirst
                | State::KeyNext
                | State::Colon
                | State::After
                    if rest.first().is_some_and(|&b| is_space(b)) =>
                {
                    i += rest
                        .iter()
                        .position(|&b| !is_space(b))
                        .unwrap_or(rest.len());
                    continue;
                }
                _ => {}
            }
            let Some(&b) = bytes.get(i) else { return };
            if self.step(paths, b) {
                i += 1;
                // A separator is usually followed by one space: taken with it.
                if matches!(b, b':' | b',')
                    && matches!(self.state, State::Value | State::KeyNext)
                    && bytes.get(i) == Some(&b' ')
                {
                    i += 1;
                }
            }
        }
    }

    /// A key ended (its closing quote taken): its ':' and the one space usually after it are
    /// taken at once when `rest` starts with them. The bytes taken.
    fn colon(&mut self, rest: &[u8]) -> usize {
        let (state, taken) = match rest {
            [b':', b' ', ..] => (State::Value, 2),
            [b':', ..] => (State::Value, 1),
            _ => (State::Colon, 0),
        };
        self.state = state;
        taken
    }

    /// Takes one byte; false when it belongs to what comes next (the byte after a number),
    /// to be taken again.
    fn step(&mut self, paths: &Paths, b: u8) -> bool {
        let space = is_space(b);
        match self.state {
            State::Value if space => {}
            State::Value => self.start_value(paths, b),
            State::ObjectFirst | State::KeyNext | State::Colon | State::After if space => {}
            State::ObjectFirst if b == b'}' => self.close(true),
            State::ObjectFirst | State::KeyNext if b == b'"' => self.start_key(paths),
            State::Colon if b == b':' => self.state = State::Value,
            // In an object (arrays are skipped).
            State::After => match b {
                b',' => self.state = State::KeyNext,
                b'}' => self.close(true),
                _ => self.state = State::Dead,
            },
            State::Key => match b {
                b'"' => {
                    self.target = paths.exact(self.edges, self.key_pos);
                    self.state = State::Colon;
                }
                b'\\' => self.state = State::KeyEscape,
                // Raw control characters are invalid in a string.
                0..=0x1f => self.state = State::Dead,
                _ => {
                    self.key_bytes(paths, &[b]);
                }
            },
            State::KeyEscape | State::TextEscape => {
                let text = self.state == State::TextEscape;
                match simple_escape(b) {
                    _ if b == b'u' => self.start_hex(text),
                    Some(c) if text => {
                        self.state = State::Text;
                        self.text_bytes(&[c]);
                    }
                    Some(c) => {
                        self.state = State::Key;
                        self.key_bytes(paths, &[c]);
                    }
                    None => self.state = State::Dead,
                }
            }
            State::KeyHex => self.hex_digit(paths, b),
            State::KeyLowBackslash if b == b'\\' => self.state = State::KeyLowU,
            State::KeyLowU if b == b'u' => self.start_hex(false),
            State::SkipKey => match b {
                b'"' => {
                    self.target = NONE;
                    self.state = State::Colon;
                }
                b'\\' => self.state = State::SkipKeyEscape,
                _ => {}
            },
            State::SkipKeyEscape => self.state = State::SkipKey,
            State::Str => match b {
                b'"' => self.after_value(),
                b'\\' => self.state = State::StrEscape,
                _ => {}
            },
            State::StrEscape => self.state = State::Str,
            State::Skip => match b {
                b'"' => self.state = State::Str,
                b'[' => self.open(true),
                b'{' => self.open(false),
                b']' => self.close(false),
                b'}' => self.close(true),
                _ => {}
            },
            State::Text => match b {
                b'"' => {
                    self.end_text(paths);
                    self.after_value();
                }
                b'\\' => self.state = State::TextEscape,
                _ => self.state = State::Dead,
            },
            State::TextHex => self.hex_digit(paths, b),
            State::TextLowBackslash if b == b'\\' => self.state = State::TextLowU,
            State::TextLowU if b == b'u' => self.start_hex(true),
            State::Minus => match b {
                b'0' => self.state = State::Zero,
                b'1'..=b'9' => self.state = State::Int,
                _ => self.state = State::Dead,
            },
            State::Zero | State::Int | State::Fraction | State::ExponentDigits
                if b.is_ascii_digit() =>
            {
                match self.state {
                    // JSON has no leading zeros.
                    State::Zero => self.state = State::Dead,
                    State::Int => {
                        let digit = u64::from(b - b'0');
                        match self
                            .number
                            .checked_mul(10)
                            .and_then(|n| n.checked_add(digit))
                        {
                            Some(n) => self.number = n,
                            None => self.plain = false,
                        }
                    }
                    _ => {}
                }
            }
            State::Zero | State::Int if b == b'.' => {
                self.plain = false;
                self.state = State::Dot;
            }
            State::Zero | State::Int | State::Fraction if b == b'e' || b == b'E' => {
                self.plain = false;
                self.state = State::Exponent;
            }
            State::Zero | State::Int | State::Fraction | State::ExponentDigits => {
                self.end_number(paths);
                return false;
            }
            State::Dot if b.is_ascii_digit() => self.state = State::Fraction,
            State::Exponent if b == b'+' || b == b'-' => self.state = State::ExponentSign,
            State::Exponent | State::ExponentSign if b.is_ascii_digit() => {
                self.state = State::ExponentDigits;
            }
            State::Literal => {
                let word = LITERALS.get(usize::from(self.literal)).copied();
                let word = word.unwrap_or_default();
                if word.get(usize::from(self.count)) != Some(&b) {
                    self.state = State::Dead;
                } else {
                    self.count += 1;
                    if usize::from(self.count) == word.len() {
                        self.after_value();
                    }
                }
            }
            _ => self.state = State::Dead,
        }
        true
    }

    /// The first byte of a value (not whitespace).
    fn start_value(&mut self, paths: &Paths, b: u8) {
        if self.request && self.target != NONE {
            // This value replaces the last at its path: absent until it proves a string or a
            // whole number.
            let slots = paths.slots_at(self.target);
            self.found &= !slots;
            if let Some(t) = self.texts.as_deref_mut() {
                t.found &= !slots;
            }
        }
        match b {
            b'{' => self.open(false),
            b'[' => self.open(true),
            // A string at a path's end is read through (its escapes and control characters
            // checked) whether or not its text is kept, so that a scan that keeps texts and one
            // that does not stop at the same invalid byte and find the same values.
            b'"' if self.target != NONE => {
                if let Some(t) = self.texts.as_deref_mut() {
                    t.current.clear();
                    t.long = false;
                }
                self.high = 0;
                self.state = State::Text;
            }
            b'"' => self.state = State::Str,
            b'-' => {
                self.plain = false;
                self.state = State::Minus;
            }
            b'0'..=b'9' => {
                self.plain = true;
                self.number = u64::from(b - b'0');
                self.state = if b == b'0' { State::Zero } else { State::Int };
            }
            b't' | b'f' | b'n' => {
                self.literal = match b {
                    b't' => 0,
                    b'f' => 1,
                    _ => 2,
                };
                self.count = 1;
                self.state = State::Literal;
            }
            _ => self.state = State::Dead,
        }
    }

    fn in_array(&self) -> bool {
        let bit = self.depth.checked_sub(1).map_or(0, |d| 1u128 << d);
        self.arrays & bit != 0
    }

    fn open(&mut self, array: bool) {
        if self.depth >= MAX_NESTING {
            self.state = State::Dead;
            return;
        }
        // A path leads here only if it led to the container around (so that is at `live`).
        if !array && self.target != NONE {
            if let Some(node) = self.nodes.get_mut(usize::from(self.depth)) {
                *node = self.target;
                self.live = self.depth + 1;
            }
        }
        let bit = 1u128 << self.depth;
        if array {
            self.arrays |= bit;
        } else {
            self.arrays &= !bit;
        }
        // Paths do not enter arrays, nor objects no path leads to: those are skipped whole
        // (their brackets still checked), whatever they hold.
        if self.depth < self.skip_to && (array || self.target == NONE) {
            self.skip_to = self.depth;
        }
        // (So the containers read token by token are objects.)
        self.state = if self.depth >= self.skip_to {
            State::Skip
        } else {
            State::ObjectFirst
        };
        self.target = NONE;
        self.depth += 1;
    }

    fn close(&mut self, object: bool) {
        if self.in_array() == object {
            self.state = State::Dead;
            return;
        }
        self.depth -= 1;
        self.live = self.live.min(self.depth);
        if self.depth == self.skip_to {
            self.skip_to = NOT_SKIPPING;
        }
        self.after_value();
    }

    fn after_value(&mut self) {
        if self.depth == 0 {
            // The next document of a sequence.
            self.reset();
        } else if self.depth > self.skip_to {
            self.state = State::Skip;
        } else {
            self.state = State::After;
        }
    }

    fn end_number(&mut self, paths: &Paths) {
        if self.plain && self.target != NONE {
            let slots = paths.slots_at(self.target);
            if let Some(t) = self.texts.as_deref_mut() {
                let mut digits = itoa::Buffer::new();
                let digits = digits.format(self.number).as_bytes();
                t.found = record(&mut t.values, t.found, slots, Some(digits));
            }
            for (slot, value) in self.values.iter_mut().enumerate() {
                if slots & (1 << slot) != 0 {
                    *value = self.number;
                }
            }
            self.found |= slots;
        }
        self.after_value();
    }

    fn start_key(&mut self, paths: &Paths) {
        self.state = State::SkipKey;
        if self.depth == self.live {
            let node = self
                .nodes
                .get(usize::from(self.depth).wrapping_sub(1))
                .copied();
            self.edges = paths.children(node.unwrap_or(NONE));
            self.key_pos = 0;
            self.high = 0;
            if self.edges.0 < self.edges.1 {
                self.state = State::Key;
            }
        }
    }

    /// Compares the next bytes of a key (unescaped); no key can match any more: skip it.
    fn key_bytes(&mut self, paths: &Paths, bytes: &[u8]) {
        self.edges = paths.narrow(self.edges, self.key_pos, bytes);
        let len = u32::try_from(bytes.len()).unwrap_or(u32::MAX);
        self.key_pos = self.key_pos.saturating_add(len);
        self.state = if self.edges.0 < self.edges.1 {
            State::Key
        } else {
            State::SkipKey
        };
    }

    /// A `\u` escape's digits come next, in a key or (`text`) in a string kept as text.
    fn start_hex(&mut self, text: bool) {
        self.hex = 0;
        self.count = 0;
        self.state = if text { State::TextHex } else { State::KeyHex };
    }

    fn hex_digit(&mut self, paths: &Paths, b: u8) {
        let Some(digit) = char::from(b).to_digit(16) else {
            self.state = State::Dead;
            return;
        };
        // Four digits make at most 0xffff.
        self.hex = (self.hex << 4) | digit as u16;
        self.count += 1;
        if self.count < 4 {
            return;
        }
        let unit = u32::from(self.hex);
        let text = self.state == State::TextHex;
        let code = match (self.high, unit) {
            (0, 0xd800..=0xdbff) => {
                self.high = self.hex;
                self.state = if text {
                    State::TextLowBackslash
                } else {
                    State::KeyLowBackslash
                };
                return;
            }
            (0, 0xdc00..=0xdfff) => None,
            (0, _) => Some(unit),
            (high, 0xdc00..=0xdfff) => {
                self.high = 0;
                Some(0x10000 + ((u32::from(high) - 0xd800) << 10) + (unit - 0xdc00))
            }
            // A high surrogate alone is invalid, as in serde_json.
            _ => None,
        };
        match code.and_then(char::from_u32) {
            Some(c) if text => {
                let mut utf8 = [0; 4];
                self.state = State::Text;
                self.text_bytes(c.encode_utf8(&mut utf8).as_bytes());
            }
            Some(c) => {
                let mut utf8 = [0; 4];
                self.key_bytes(paths, c.encode_utf8(&mut utf8).as_bytes());
            }
            None => self.state = State::Dead,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `find` eight bytes at a time agrees with a byte-by-byte search, wherever the first stop
    /// is (in a word, past the last whole word, none), whatever stops or bytes that are one
    /// bit from a stop (a borrow's neighbours) come after it.
    #[test]
    fn find_agrees_with_a_search_byte_by_byte() {
        type Kind<'a> = (&'a dyn Fn(u64) -> u64, &'a dyn Fn(u8) -> bool);
        let kinds: [Kind; 2] = [
            (&string_stops, &|b| b == b'"' || b == b'\\' || b < 0x20),
            (&skip_stops, &|b| {
                matches!(b, b'"' | b'[' | b']' | b'{' | b'}')
            }),
        ];
        let fill = [
            b'a',
            b'!',
            b'#',
            b'Z',
            b'\\' + 1,
            b'z',
            0x20,
            0x7f,
            0x80,
            0xff,
            b'|',
        ];
        let stops = [b'"', b'\\', 0, 0x1f, b'\n', b'[', b']', b'{', b'}'];
        for (words, one) in kinds {
            for len in 0..27 {
                for at in 0..=len {
                    for (n, &stop) in stops.iter().enumerate() {
                        let mut bytes: Vec<u8> =
                            (0..len).map(|i| fill[(i + n) % fill.len()]).collect();
                        if at < len {
                            bytes[at] = stop;
                            // Stops and near-stops after it.
                            for (j, b) in bytes.iter_mut().enumerate().skip(at + 1) {
                                *b = [stop, 0, b'"' ^ 1, b'{', 0x21][j % 5];
                            }
                        }
                        let want = bytes.iter().position(|&b| one(b));
                        assert_eq!(find(&bytes, words), want, "{bytes:?}");
                    }
                }
            }
        }
    }
}
