//! The bytes of an answer: the text of its content events, and the body around it in the
//! API's shape (one JSON document, an event stream, or a JSON array of events), generated as
//! it is written; each API's documents are in its own file.

use super::gzip::Gzip;
use super::{Api, Mode, Spec};
use std::io::{self, Write};

/// Pieces of JSON string contents, already escaped: raw multi-byte UTF-8, `\uXXXX` escapes (a
/// surrogate pair too), `\"` `\\` `\n` `\t` `\/`, and usage-like words inside the text (a
/// scanner must not take them for keys). None ends with a comma (see [`DataLines`]).
const ATOMS: [&str; 13] = [
    "h\\u00e9llo",
    " w\u{f6}rld",
    " \u{2713}",
    " \u{1F600}",
    " \\\"quoted\\\"",
    " back\\\\slash",
    "\\n",
    " caf\u{e9}",
    " \\ud83d\\ude00",
    " tab\\t",
    " sl\\/ash",
    " usage",
    " \\\"total_tokens\\\": 999",
];

/// The escaped text of content event `i` (the contents of a JSON string).
pub fn delta_literal(spec: &Spec, i: usize) -> String {
    let start = i * 3;
    let atom = |k: usize| ATOMS[k % ATOMS.len()];
    match spec.pad {
        None => (start..start + 3).map(atom).collect(),
        Some(n) => {
            let mut s = String::with_capacity(n);
            // Whole turns of the atoms at once (what the loop below would write, faster).
            let turn: String = (start..start + ATOMS.len()).map(atom).collect();
            s.push_str(&turn.repeat(n / turn.len()));
            let mut k = start;
            while s.len() + atom(k).len() <= n {
                s.push_str(atom(k));
                k += 1;
            }
            s.push_str(&"x".repeat(n - s.len()));
            s
        }
    }
}

/// The whole answer's text, unescaped, as a client shows it.
pub fn text(spec: &Spec) -> String {
    (0..spec.events)
        .map(|i| {
            serde_json::from_str::<String>(&format!("\"{}\"", delta_literal(spec, i))).unwrap()
        })
        .collect()
}

/// The answer's body, uncompressed.
pub fn body_bytes(spec: &Spec) -> Vec<u8> {
    let mut out = Vec::new();
    write_body(spec, &mut out).unwrap();
    out
}

/// The body as it goes on the wire (gzip-encoded when `gzip`): what a client receives.
pub fn wire_body(spec: &Spec, gzip: bool) -> Vec<u8> {
    let mut out = Vec::new();
    write_encoded(spec, gzip, &mut out).unwrap();
    out
}

/// The length of [`wire_body`], without holding it.
pub fn wire_len(spec: &Spec, gzip: bool) -> u64 {
    let mut count = Count(0);
    write_encoded(spec, gzip, &mut count).unwrap();
    count.0
}

/// Writes the body to `out` as it goes on the wire (gzip-encoded when `gzip`).
pub fn write_encoded(spec: &Spec, gzip: bool, out: &mut dyn Write) -> io::Result<()> {
    if gzip {
        let mut g = Gzip::new(out);
        write_body(spec, &mut g)?;
        g.finish().map(|_| ())
    } else {
        write_body(spec, out)
    }
}

/// Writes the answer's body to `out`, generating it as it goes, and flushes `out` at the end
/// of each event (of the document, for JSON).
pub fn write_body(spec: &Spec, out: &mut dyn Write) -> io::Result<()> {
    let mut g = Gen {
        s: spec,
        model: serde_json::to_string(&spec.model).unwrap(),
        eol: if spec.crlf { "\r\n" } else { "\n" },
        out,
        n: 0,
    };
    if spec.status >= 400 {
        g.error()?;
    } else {
        match (spec.api, spec.mode) {
            (Api::Chat, Mode::Json) => g.chat_json()?,
            (Api::Chat, _) => g.chat_stream()?,
            (Api::Responses, Mode::Json) => g.responses_json()?,
            (Api::Responses, _) => g.responses_stream()?,
            (Api::Messages, Mode::Json) => g.messages_json()?,
            (Api::Messages, _) => g.messages_stream()?,
            (Api::Gemini, Mode::Json) => g.gemini_json()?,
            (Api::Gemini, _) => g.gemini_stream()?,
        }
    }
    g.out.flush()
}

pub(super) type Data<'a> = &'a dyn Fn(&mut dyn Write) -> io::Result<()>;

/// Writes one body.
pub(super) struct Gen<'a> {
    pub(super) s: &'a Spec,
    /// The model, as a JSON string.
    pub(super) model: String,
    eol: &'static str,
    pub(super) out: &'a mut dyn Write,
    /// Events written.
    n: usize,
}

impl Gen<'_> {
    /// One stream event: an SSE event (`event:` line when named), or an element of the array.
    pub(super) fn event(&mut self, name: Option<&str>, data: Data) -> io::Result<()> {
        let eol = self.eol;
        if self.s.mode == Mode::JsonArray {
            self.out
                .write_all(if self.n == 0 { b"[" } else { b",\r\n" })?;
            data(self.out)?;
        } else {
            if let Some(name) = name {
                write!(self.out, "event: {name}{eol}")?;
            }
            self.out.write_all(b"data: ")?;
            if self.s.multiline {
                data(&mut DataLines {
                    out: &mut *self.out,
                    eol,
                    comma: false,
                    depth: 0,
                })?;
            } else {
                data(self.out)?;
            }
            write!(self.out, "{eol}{eol}")?;
        }
        self.n += 1;
        self.out.flush()
    }

    /// OpenAI's last event (SSE only).
    pub(super) fn done(&mut self) -> io::Result<()> {
        if self.s.mode == Mode::Sse {
            let eol = self.eol;
            write!(self.out, "data: [DONE]{eol}{eol}")?;
            self.out.flush()?;
        }
        Ok(())
    }

    /// Closes a JSON array stream.
    pub(super) fn end(&mut self) -> io::Result<()> {
        if self.s.mode == Mode::JsonArray {
            self.out.write_all(if self.n == 0 { b"[]" } else { b"]" })?;
            self.out.flush()?;
        }
        Ok(())
    }

    fn error(&mut self) -> io::Result<()> {
        let code = self.s.status;
        let out = &mut *self.out;
        match self.s.api {
            Api::Chat | Api::Responses => write!(
                out,
                r#"{{"error":{{"message":"x-test-status asked for {code}","type":"invalid_request_error","param":null,"code":null}}}}"#
            ),
            Api::Messages => write!(
                out,
                r#"{{"type":"error","error":{{"type":"api_error","message":"x-test-status asked for {code}"}}}}"#
            ),
            Api::Gemini => write!(
                out,
                "{{\n  \"error\": {{\n    \"code\": {code},\n    \"message\": \"x-test-status asked for {code}\",\n    \"status\": \"UNAVAILABLE\"\n  }}\n}}\n"
            ),
        }
    }
}

/// Writes the escaped text of every content event, one after the other.
pub(super) fn full_text(s: &Spec, out: &mut dyn Write) -> io::Result<()> {
    for i in 0..s.events {
        out.write_all(delta_literal(s, i).as_bytes())?;
    }
    Ok(())
}

/// Cuts an SSE event's JSON into several `data:` lines: after each comma between members or
/// elements (outside strings), a line break and `data: `. Joined with "\n", the lines give
/// the same document.
struct DataLines<'a> {
    out: &'a mut dyn Write,
    eol: &'static str,
    /// The last byte written was a comma outside strings.
    comma: bool,
    /// Inside a string: 1; just after a backslash in one: 2.
    depth: u8,
}

impl Write for DataLines<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let mut from = 0;
        for (k, &b) in buf.iter().enumerate() {
            if self.comma && self.depth == 0 {
                self.out.write_all(&buf[from..k])?;
                write!(self.out, "{}data: ", self.eol)?;
                from = k;
            }
            self.comma = false;
            match (self.depth, b) {
                (0, b'"') => self.depth = 1,
                (0, b',') => self.comma = true,
                (1, b'"') => self.depth = 0,
                (1, b'\\') => self.depth = 2,
                (2, _) => self.depth = 1,
                _ => {}
            }
        }
        self.out.write_all(&buf[from..])?;
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// Counts bytes.
struct Count(u64);

impl Write for Count {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.0 += buf.len() as u64;
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}
