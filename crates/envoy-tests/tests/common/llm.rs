//! A test upstream that answers like the LLM APIs whose token usage the filter charges:
//! OpenAI chat completions and Responses, Anthropic messages, Gemini generateContent. Each
//! answer is a JSON document or a `text/event-stream` in the real API's shape, with the usage
//! (or none) where the real API puts it.
//!
//! Routes (POST; the request body is JSON, read with a content-length or chunked):
//!
//! - `/v1/chat/completions`: `"stream": true` streams `chat.completion.chunk`s and
//!   `data: [DONE]`; `"stream_options": {"include_usage": true}` adds the usage chunk (empty
//!   `choices`) before `[DONE]`, and `"usage": null` to every other chunk;
//! - `/v1/responses`: `"stream": true` streams `response.created` ... `response.output_text.delta`
//!   ... `response.completed` (whose `response.usage` has the figures);
//! - `/v1/messages`: `"stream": true` streams `message_start` (`message.usage` with the input and
//!   `output_tokens: 1`) ... `message_delta` (`usage.output_tokens`) ... `message_stop`;
//! - `/v1beta/models/{model}:generateContent` (pretty-printed JSON, as Gemini answers) and
//!   `:streamGenerateContent?alt=sse` (`usageMetadata` cumulative in every event); without
//!   `alt=sse`, `:streamGenerateContent` streams one JSON array of those documents.
//!
//! The test chooses the rest with request headers:
//!
//! - `x-test-input-tokens: N`, `x-test-output-tokens: N`: the usage reported (12 and 34);
//! - `x-test-events: N`: content events in a stream (5);
//! - `x-test-pad: N`: bytes of (JSON-escaped) text per content event; the answer is generated
//!   as it is sent, so a stream of any size takes bounded memory;
//! - `x-test-split: every|N|random:SEED`: send the body in pieces (each one chunk and one
//!   flush) of one byte, N bytes, or seeded random sizes (1 to 7 bytes, one in 16 up to 256), across event
//!   boundaries; without it, one chunk and one flush per event (events over 256 KiB in
//!   256 KiB chunks);
//! - `x-test-crlf: 1`: SSE lines end with CRLF;
//! - `x-test-multiline: 1`: each SSE event's JSON is cut into several `data:` lines (after
//!   every comma between members or elements);
//! - `x-test-delay-ms: N`: wait N ms between events (a slow stream);
//! - `x-test-reset-after: N`: send the headers and N body bytes, then close the connection
//!   without ending the body;
//! - `x-test-no-usage: 1`: no usage anywhere in the answer;
//! - `x-test-status: N`: answer with this status; 400 and above get the API's error JSON;
//! - `x-test-encoding: gzip`: `content-encoding: gzip` with real gzip bytes (deflate "stored"
//!   blocks, one per event: std has no compressor, and any gunzip reads them);
//! - `x-test-framing: length|chunked`: how the body is delimited (default: JSON with a
//!   content-length, streams chunked);
//! - `x-test-answer-header: NAME=VALUE`: one more header in the answer (as a real API sends
//!   its own rate-limit fields).
//!
//! Every answer has the header `x-llm-seq: N`, the number of its [`Exchange`]: the upstream
//! records each request (path, headers, body, the `max_tokens`-like field) and what it sent
//! (bytes, their [`BodyHash`], the first bytes), so a test can check what went through the
//! proxy unchanged, both ways. [`body_bytes`] and [`wire_body`] give the bytes of an answer
//! without a server.
#![allow(
    dead_code,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use ratelimit_core::testkit::Rng;
use serde_json::Value;
use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Usage reported when the request does not say.
pub const DEFAULT_INPUT_TOKENS: u64 = 12;
pub const DEFAULT_OUTPUT_TOKENS: u64 = 34;
/// Content events in a stream when the request does not say.
pub const DEFAULT_EVENTS: usize = 5;
/// Without a split, an event bigger than this goes out in chunks of this size.
pub const MAX_CHUNK: usize = 256 * 1024;
/// Response body bytes an [`Exchange`] keeps by default (all are hashed).
pub const DEFAULT_KEEP: usize = 1 << 20;
/// Request body bytes an [`Exchange`] keeps (all are counted).
pub const REQUEST_KEEP: usize = 1 << 20;

/// The API an answer speaks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Api {
    /// OpenAI `/v1/chat/completions`.
    Chat,
    /// OpenAI `/v1/responses`.
    Responses,
    /// Anthropic `/v1/messages`.
    Messages,
    /// Gemini `generateContent` / `streamGenerateContent`.
    Gemini,
}

impl Api {
    pub const ALL: [Api; 4] = [Api::Chat, Api::Responses, Api::Messages, Api::Gemini];

    /// The model named in answers when the request names none.
    pub fn default_model(self) -> &'static str {
        match self {
            Api::Chat => "gpt-4o-mini-2024-07-18",
            Api::Responses => "gpt-4.1-2025-04-14",
            Api::Messages => "claude-sonnet-4-20250514",
            Api::Gemini => "gemini-2.0-flash",
        }
    }

    /// The request path (with its query) for this mode.
    pub fn path(self, mode: Mode) -> String {
        match (self, mode) {
            (Api::Chat, _) => "/v1/chat/completions".into(),
            (Api::Responses, _) => "/v1/responses".into(),
            (Api::Messages, _) => "/v1/messages".into(),
            (Api::Gemini, Mode::Json) => "/v1beta/models/gemini-2.0-flash:generateContent".into(),
            (Api::Gemini, Mode::Sse) => {
                "/v1beta/models/gemini-2.0-flash:streamGenerateContent?alt=sse".into()
            }
            (Api::Gemini, Mode::JsonArray) => {
                "/v1beta/models/gemini-2.0-flash:streamGenerateContent".into()
            }
        }
    }

    /// A request body as a client of this API sends it (`max_tokens` in the API's own field).
    pub fn request_body(self, mode: Mode, include_usage: bool, max_tokens: u64) -> String {
        let stream = mode != Mode::Json;
        match self {
            Api::Chat => {
                let opts = if include_usage {
                    r#","stream_options":{"include_usage":true}"#
                } else {
                    ""
                };
                format!(
                    r#"{{"model":"gpt-4o-mini","messages":[{{"role":"user","content":"Say h\u00e9llo"}}],"stream":{stream}{opts},"max_completion_tokens":{max_tokens}}}"#
                )
            }
            Api::Responses => format!(
                r#"{{"model":"gpt-4.1","input":"Say h\u00e9llo","stream":{stream},"max_output_tokens":{max_tokens}}}"#
            ),
            Api::Messages => format!(
                r#"{{"model":"claude-sonnet-4-20250514","max_tokens":{max_tokens},"messages":[{{"role":"user","content":"Say h\u00e9llo"}}],"stream":{stream}}}"#
            ),
            Api::Gemini => format!(
                r#"{{"contents":[{{"role":"user","parts":[{{"text":"Say h\u00e9llo"}}]}}],"generationConfig":{{"maxOutputTokens":{max_tokens}}}}}"#
            ),
        }
    }
}

/// How an answer's body is laid out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// One JSON document.
    Json,
    /// `text/event-stream`.
    Sse,
    /// One JSON array of the stream's documents, sent as they come (Gemini's
    /// `streamGenerateContent` without `alt=sse`).
    JsonArray,
}

/// What one answer says: everything its body bytes depend on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Spec {
    pub api: Api,
    pub mode: Mode,
    /// Named in the answer (the request's `model`, or the Gemini path's).
    pub model: String,
    /// 400 and above: the API's error document instead of an answer.
    pub status: u16,
    pub input_tokens: u64,
    pub output_tokens: u64,
    /// Content events (text deltas) in a stream.
    pub events: usize,
    /// Bytes of escaped text per content event; None: a short phrase.
    pub pad: Option<usize>,
    /// false: no usage anywhere.
    pub usage: bool,
    /// OpenAI chat streams: `stream_options.include_usage`.
    pub include_usage: bool,
    /// SSE lines end with CRLF.
    pub crlf: bool,
    /// SSE data cut into several `data:` lines.
    pub multiline: bool,
}

impl Spec {
    /// The defaults: status 200, the default figures, events and model, usage on (and
    /// `include_usage` on, so a chat stream carries its usage).
    pub fn new(api: Api, mode: Mode) -> Spec {
        Spec {
            api,
            mode,
            model: api.default_model().into(),
            status: 200,
            input_tokens: DEFAULT_INPUT_TOKENS,
            output_tokens: DEFAULT_OUTPUT_TOKENS,
            events: DEFAULT_EVENTS,
            pad: None,
            usage: true,
            include_usage: true,
            crlf: false,
            multiline: false,
        }
    }

    /// The answer's content-type.
    pub fn content_type(&self) -> &'static str {
        if self.mode == Mode::Sse && self.status < 400 {
            "text/event-stream"
        } else {
            "application/json"
        }
    }

    /// Whether the body is a stream (chunked by default).
    pub fn streams(&self) -> bool {
        self.mode != Mode::Json && self.status < 400
    }

    /// What the upstream answers to this request; None for a path no API has.
    pub fn from_request(path: &str, headers: &[(String, String)], body: &[u8]) -> Option<Spec> {
        let (route, query) = path.split_once('?').unwrap_or((path, ""));
        let json: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
        let streamed = json.get("stream").and_then(Value::as_bool) == Some(true);
        let stream_mode = if streamed { Mode::Sse } else { Mode::Json };
        let (api, mode) = match route {
            "/v1/chat/completions" => (Api::Chat, stream_mode),
            "/v1/responses" => (Api::Responses, stream_mode),
            "/v1/messages" => (Api::Messages, stream_mode),
            _ => {
                let rest = route
                    .strip_prefix("/v1beta/models/")
                    .or_else(|| route.strip_prefix("/v1/models/"))?;
                let (_, method) = rest.split_once(':')?;
                match method {
                    "generateContent" => (Api::Gemini, Mode::Json),
                    "streamGenerateContent" if query.split('&').any(|q| q == "alt=sse") => {
                        (Api::Gemini, Mode::Sse)
                    }
                    "streamGenerateContent" => (Api::Gemini, Mode::JsonArray),
                    _ => return None,
                }
            }
        };
        let mut spec = Spec::new(api, mode);
        spec.include_usage = json
            .pointer("/stream_options/include_usage")
            .and_then(Value::as_bool)
            == Some(true);
        let model = match api {
            Api::Gemini => route
                .rsplit('/')
                .next()
                .and_then(|m| m.split(':').next())
                .map(str::to_string),
            _ => json
                .get("model")
                .and_then(Value::as_str)
                .map(str::to_string),
        };
        if let Some(m) = model.filter(|m| !m.is_empty()) {
            spec.model = m;
        }
        let num = |name: &str| header(headers, name).and_then(|v| v.trim().parse::<u64>().ok());
        let on = |name: &str| header(headers, name).is_some_and(|v| v.trim() == "1");
        spec.input_tokens = num("x-test-input-tokens").unwrap_or(spec.input_tokens);
        spec.output_tokens = num("x-test-output-tokens").unwrap_or(spec.output_tokens);
        spec.events = num("x-test-events").map_or(spec.events, |n| n as usize);
        spec.pad = num("x-test-pad").map(|n| n as usize);
        spec.status = num("x-test-status").map_or(200, |s| s as u16);
        spec.usage = !on("x-test-no-usage");
        spec.crlf = on("x-test-crlf");
        spec.multiline = on("x-test-multiline");
        Some(spec)
    }
}

/// The `max_tokens`-like field of a request body, in the API's own place.
pub fn max_tokens_of(path: &str, body: &[u8]) -> Option<u64> {
    let json: Value = serde_json::from_slice(body).ok()?;
    let pointers: &[&str] = if path.starts_with("/v1/chat/completions") {
        &["/max_completion_tokens", "/max_tokens"]
    } else if path.starts_with("/v1/responses") {
        &["/max_output_tokens"]
    } else if path.starts_with("/v1/messages") {
        &["/max_tokens"]
    } else {
        &["/generationConfig/maxOutputTokens"]
    };
    pointers
        .iter()
        .find_map(|p| json.pointer(p).and_then(Value::as_u64))
}

/// The first value of a header (case-insensitive name).
pub fn header<'a>(headers: &'a [(String, String)], name: &str) -> Option<&'a str> {
    headers
        .iter()
        .find(|(k, _)| k.eq_ignore_ascii_case(name))
        .map(|(_, v)| v.as_str())
}

// ---------------------------------------------------------------------------------------------
// The text

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

// ---------------------------------------------------------------------------------------------
// The body

const CREATED: u64 = 1_741_569_952;
const CHAT_ID: &str = "chatcmpl-B9MBs8CjcvOU2jLn4n570S5qMJKcT";
const FINGERPRINT: &str = "fp_06737a9306";
const RESP_ID: &str = "resp_67ccd2bed1ec8190b14f964abc0542670bb6a6b452d3795b";
const ITEM_ID: &str = "msg_67ccd2bf17f0819081ff3bb2cf6508e60bb6a6b452d3795b";
const MSG_ID: &str = "msg_01XFDUDYJgAACzvnptvVoYEL";
const GEMINI_ID: &str = "mKZ0aOq9D4-ejMcP7sTfmQk";

/// The answer's body, uncompressed.
pub fn body_bytes(spec: &Spec) -> Vec<u8> {
    let mut out = Vec::new();
    write_body(spec, &mut out).unwrap();
    out
}

/// The body as it goes on the wire (gzip-encoded when `gzip`): what a client receives.
pub fn wire_body(spec: &Spec, gzip: bool) -> Vec<u8> {
    let mut out = Vec::new();
    if gzip {
        let mut g = Gzip::new(&mut out);
        write_body(spec, &mut g).unwrap();
        g.finish().unwrap();
    } else {
        write_body(spec, &mut out).unwrap();
    }
    out
}

/// The length of [`wire_body`], without holding it.
pub fn wire_len(spec: &Spec, gzip: bool) -> u64 {
    let mut count = Count(0);
    if gzip {
        let mut g = Gzip::new(&mut count);
        write_body(spec, &mut g).unwrap();
        g.finish().unwrap();
    } else {
        write_body(spec, &mut count).unwrap();
    }
    count.0
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

type Data<'a> = &'a dyn Fn(&mut dyn Write) -> io::Result<()>;

/// Writes one body.
struct Gen<'a> {
    s: &'a Spec,
    /// The model, as a JSON string.
    model: String,
    eol: &'static str,
    out: &'a mut dyn Write,
    /// Events written.
    n: usize,
}

impl Gen<'_> {
    /// One stream event: an SSE event (`event:` line when named), or an element of the array.
    fn event(&mut self, name: Option<&str>, data: Data) -> io::Result<()> {
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
    fn done(&mut self) -> io::Result<()> {
        if self.s.mode == Mode::Sse {
            let eol = self.eol;
            write!(self.out, "data: [DONE]{eol}{eol}")?;
            self.out.flush()?;
        }
        Ok(())
    }

    /// Closes a JSON array stream.
    fn end(&mut self) -> io::Result<()> {
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

    // --- OpenAI chat completions

    fn chat_usage(s: &Spec, out: &mut dyn Write) -> io::Result<()> {
        let (i, o) = (s.input_tokens, s.output_tokens);
        let t = i + o;
        write!(
            out,
            r#"{{"prompt_tokens":{i},"completion_tokens":{o},"total_tokens":{t},"prompt_tokens_details":{{"cached_tokens":0,"audio_tokens":0}},"completion_tokens_details":{{"reasoning_tokens":0,"audio_tokens":0,"accepted_prediction_tokens":0,"rejected_prediction_tokens":0}}}}"#
        )
    }

    fn chat_json(&mut self) -> io::Result<()> {
        let (s, m) = (self.s, &self.model);
        write!(
            self.out,
            r#"{{"id":"{CHAT_ID}","object":"chat.completion","created":{CREATED},"model":{m},"choices":[{{"index":0,"message":{{"role":"assistant","content":""#
        )?;
        full_text(s, self.out)?;
        write!(
            self.out,
            r#"","refusal":null,"annotations":[]}},"logprobs":null,"finish_reason":"stop"}}]"#
        )?;
        if s.usage {
            self.out.write_all(br#","usage":"#)?;
            Gen::chat_usage(s, self.out)?;
        }
        write!(
            self.out,
            r#","service_tier":"default","system_fingerprint":"{FINGERPRINT}"}}"#
        )?;
        self.out.flush()
    }

    fn chat_stream(&mut self) -> io::Result<()> {
        let s = self.s;
        let m = self.model.clone();
        let with_usage = s.usage && s.include_usage;
        // One chunk: `choice` is the element of `choices` (None: empty, the usage chunk).
        let chunk = |out: &mut dyn Write, choice: Data, usage: bool| -> io::Result<()> {
            write!(
                out,
                r#"{{"id":"{CHAT_ID}","object":"chat.completion.chunk","created":{CREATED},"model":{m},"service_tier":"default","system_fingerprint":"{FINGERPRINT}","choices":["#
            )?;
            choice(out)?;
            out.write_all(b"]")?;
            if usage {
                out.write_all(br#","usage":"#)?;
                Gen::chat_usage(s, out)?;
            } else if with_usage {
                out.write_all(br#","usage":null"#)?;
            }
            out.write_all(b"}")
        };
        self.event(None, &|out| {
            chunk(
                out,
                &|out| {
                    out.write_all(
                        br#"{"index":0,"delta":{"role":"assistant","content":"","refusal":null},"logprobs":null,"finish_reason":null}"#,
                    )
                },
                false,
            )
        })?;
        for i in 0..s.events {
            self.event(None, &|out| {
                chunk(
                    out,
                    &|out| {
                        out.write_all(br#"{"index":0,"delta":{"content":""#)?;
                        out.write_all(delta_literal(s, i).as_bytes())?;
                        out.write_all(br#""},"logprobs":null,"finish_reason":null}"#)
                    },
                    false,
                )
            })?;
        }
        self.event(None, &|out| {
            chunk(
                out,
                &|out| {
                    out.write_all(
                        br#"{"index":0,"delta":{},"logprobs":null,"finish_reason":"stop"}"#,
                    )
                },
                false,
            )
        })?;
        if with_usage {
            self.event(None, &|out| chunk(out, &|_| Ok(()), true))?;
        }
        self.done()?;
        self.end()
    }

    // --- OpenAI Responses

    fn responses_usage(s: &Spec, out: &mut dyn Write) -> io::Result<()> {
        let (i, o) = (s.input_tokens, s.output_tokens);
        let t = i + o;
        write!(
            out,
            r#"{{"input_tokens":{i},"input_tokens_details":{{"cached_tokens":0}},"output_tokens":{o},"output_tokens_details":{{"reasoning_tokens":0}},"total_tokens":{t}}}"#
        )
    }

    /// The message item; its text is the whole text when `completed`.
    fn responses_item(s: &Spec, out: &mut dyn Write, completed: bool) -> io::Result<()> {
        if completed {
            write!(
                out,
                r#"{{"id":"{ITEM_ID}","type":"message","status":"completed","content":[{{"type":"output_text","annotations":[],"logprobs":[],"text":""#
            )?;
            full_text(s, out)?;
            out.write_all(br#""}],"role":"assistant"}"#)
        } else {
            write!(
                out,
                r#"{{"id":"{ITEM_ID}","type":"message","status":"in_progress","content":[],"role":"assistant"}}"#
            )
        }
    }

    /// The response object; with its output and usage when `completed`.
    fn responses_object(
        s: &Spec,
        model: &str,
        out: &mut dyn Write,
        completed: bool,
    ) -> io::Result<()> {
        let status = if completed {
            "completed"
        } else {
            "in_progress"
        };
        write!(
            out,
            r#"{{"id":"{RESP_ID}","object":"response","created_at":{CREATED},"status":"{status}","background":false,"error":null,"incomplete_details":null,"instructions":null,"max_output_tokens":null,"model":{model},"output":["#
        )?;
        if completed {
            Gen::responses_item(s, out, true)?;
        }
        out.write_all(
            br#"],"parallel_tool_calls":true,"previous_response_id":null,"reasoning":{"effort":null,"summary":null},"store":true,"temperature":1.0,"text":{"format":{"type":"text"},"verbosity":"medium"},"tool_choice":"auto","tools":[],"top_p":1.0,"truncation":"disabled""#,
        )?;
        if s.usage {
            out.write_all(br#","usage":"#)?;
            if completed {
                Gen::responses_usage(s, out)?;
            } else {
                out.write_all(b"null")?;
            }
        }
        out.write_all(br#","user":null,"metadata":{}}"#)
    }

    fn responses_json(&mut self) -> io::Result<()> {
        Gen::responses_object(self.s, &self.model, self.out, true)?;
        self.out.flush()
    }

    fn responses_stream(&mut self) -> io::Result<()> {
        let s = self.s;
        let m = self.model.clone();
        let mut seq = 0;
        for name in ["response.created", "response.in_progress"] {
            self.event(Some(name), &|out| {
                write!(
                    out,
                    r#"{{"type":"{name}","sequence_number":{seq},"response":"#
                )?;
                Gen::responses_object(s, &m, out, false)?;
                out.write_all(b"}")
            })?;
            seq += 1;
        }
        self.event(Some("response.output_item.added"), &|out| {
            write!(
                out,
                r#"{{"type":"response.output_item.added","sequence_number":{seq},"output_index":0,"item":"#
            )?;
            Gen::responses_item(s, out, false)?;
            out.write_all(b"}")
        })?;
        seq += 1;
        self.event(Some("response.content_part.added"), &|out| {
            write!(
                out,
                r#"{{"type":"response.content_part.added","sequence_number":{seq},"item_id":"{ITEM_ID}","output_index":0,"content_index":0,"part":{{"type":"output_text","annotations":[],"logprobs":[],"text":""}}}}"#
            )
        })?;
        seq += 1;
        for i in 0..s.events {
            self.event(Some("response.output_text.delta"), &|out| {
                write!(
                    out,
                    r#"{{"type":"response.output_text.delta","sequence_number":{seq},"item_id":"{ITEM_ID}","output_index":0,"content_index":0,"delta":""#
                )?;
                out.write_all(delta_literal(s, i).as_bytes())?;
                out.write_all(br#"","logprobs":[]}"#)
            })?;
            seq += 1;
        }
        self.event(Some("response.output_text.done"), &|out| {
            write!(
                out,
                r#"{{"type":"response.output_text.done","sequence_number":{seq},"item_id":"{ITEM_ID}","output_index":0,"content_index":0,"text":""#
            )?;
            full_text(s, out)?;
            out.write_all(br#"","logprobs":[]}"#)
        })?;
        seq += 1;
        self.event(Some("response.content_part.done"), &|out| {
            write!(
                out,
                r#"{{"type":"response.content_part.done","sequence_number":{seq},"item_id":"{ITEM_ID}","output_index":0,"content_index":0,"part":{{"type":"output_text","annotations":[],"logprobs":[],"text":""#
            )?;
            full_text(s, out)?;
            out.write_all(br#""}}"#)
        })?;
        seq += 1;
        self.event(Some("response.output_item.done"), &|out| {
            write!(
                out,
                r#"{{"type":"response.output_item.done","sequence_number":{seq},"output_index":0,"item":"#
            )?;
            Gen::responses_item(s, out, true)?;
            out.write_all(b"}")
        })?;
        seq += 1;
        self.event(Some("response.completed"), &|out| {
            write!(
                out,
                r#"{{"type":"response.completed","sequence_number":{seq},"response":"#
            )?;
            Gen::responses_object(s, &m, out, true)?;
            out.write_all(b"}")
        })?;
        self.end()
    }

    // --- Anthropic messages

    fn messages_usage(s: &Spec, out: &mut dyn Write, output_tokens: u64) -> io::Result<()> {
        let i = s.input_tokens;
        write!(
            out,
            r#"{{"input_tokens":{i},"cache_creation_input_tokens":0,"cache_read_input_tokens":0,"output_tokens":{output_tokens},"service_tier":"standard"}}"#
        )
    }

    fn messages_json(&mut self) -> io::Result<()> {
        let (s, m) = (self.s, &self.model);
        write!(
            self.out,
            r#"{{"id":"{MSG_ID}","type":"message","role":"assistant","model":{m},"content":[{{"type":"text","text":""#
        )?;
        full_text(s, self.out)?;
        self.out
            .write_all(br#""}],"stop_reason":"end_turn","stop_sequence":null"#)?;
        if s.usage {
            self.out.write_all(br#","usage":"#)?;
            Gen::messages_usage(s, self.out, s.output_tokens)?;
        }
        self.out.write_all(b"}")?;
        self.out.flush()
    }

    fn messages_stream(&mut self) -> io::Result<()> {
        let s = self.s;
        let m = self.model.clone();
        self.event(Some("message_start"), &|out| {
            write!(
                out,
                r#"{{"type":"message_start","message":{{"id":"{MSG_ID}","type":"message","role":"assistant","model":{m},"content":[],"stop_reason":null,"stop_sequence":null"#
            )?;
            if s.usage {
                out.write_all(br#","usage":"#)?;
                Gen::messages_usage(s, out, 1)?;
            }
            out.write_all(b"}}")
        })?;
        self.event(Some("content_block_start"), &|out| {
            out.write_all(
                br#"{"type":"content_block_start","index":0,"content_block":{"type":"text","text":""}}"#,
            )
        })?;
        // The real API writes this one with a space.
        self.event(Some("ping"), &|out| out.write_all(br#"{"type": "ping"}"#))?;
        for i in 0..s.events {
            self.event(Some("content_block_delta"), &|out| {
                out.write_all(
                    br#"{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":""#,
                )?;
                out.write_all(delta_literal(s, i).as_bytes())?;
                out.write_all(br#""}}"#)
            })?;
        }
        self.event(Some("content_block_stop"), &|out| {
            out.write_all(br#"{"type":"content_block_stop","index":0}"#)
        })?;
        self.event(Some("message_delta"), &|out| {
            out.write_all(
                br#"{"type":"message_delta","delta":{"stop_reason":"end_turn","stop_sequence":null}"#,
            )?;
            if s.usage {
                let o = s.output_tokens;
                write!(out, r#","usage":{{"output_tokens":{o}}}"#)?;
            }
            out.write_all(b"}")
        })?;
        self.event(Some("message_stop"), &|out| {
            out.write_all(br#"{"type":"message_stop"}"#)
        })?;
        self.end()
    }

    // --- Gemini

    /// Pretty-printed, as the real API answers.
    fn gemini_json(&mut self) -> io::Result<()> {
        let (s, m) = (self.s, &self.model);
        self.out.write_all(
            b"{\n  \"candidates\": [\n    {\n      \"content\": {\n        \"parts\": [\n          {\n            \"text\": \"",
        )?;
        full_text(s, self.out)?;
        self.out.write_all(
            b"\"\n          }\n        ],\n        \"role\": \"model\"\n      },\n      \"finishReason\": \"STOP\",\n      \"avgLogprobs\": -0.12345678901234\n    }\n  ],\n",
        )?;
        if s.usage {
            let (i, o) = (s.input_tokens, s.output_tokens);
            let t = i + o;
            write!(
                self.out,
                "  \"usageMetadata\": {{\n    \"promptTokenCount\": {i},\n    \"candidatesTokenCount\": {o},\n    \"totalTokenCount\": {t},\n    \"promptTokensDetails\": [\n      {{\n        \"modality\": \"TEXT\",\n        \"tokenCount\": {i}\n      }}\n    ],\n    \"candidatesTokensDetails\": [\n      {{\n        \"modality\": \"TEXT\",\n        \"tokenCount\": {o}\n      }}\n    ]\n  }},\n"
            )?;
        }
        write!(
            self.out,
            "  \"modelVersion\": {m},\n  \"responseId\": \"{GEMINI_ID}\"\n}}\n"
        )?;
        self.out.flush()
    }

    fn gemini_stream(&mut self) -> io::Result<()> {
        let s = self.s;
        let m = self.model.clone();
        // With no content event, one empty one still says how it ended, and the usage.
        let n = s.events.max(1);
        for i in 0..n {
            let last = i + 1 == n;
            self.event(None, &|out| {
                out.write_all(br#"{"candidates":[{"content":{"parts":[{"text":""#)?;
                if i < s.events {
                    out.write_all(delta_literal(s, i).as_bytes())?;
                }
                out.write_all(br#""}],"role":"model"}"#)?;
                if last {
                    out.write_all(br#","finishReason":"STOP""#)?;
                }
                out.write_all(br#","index":0}]"#)?;
                if s.usage {
                    let p = s.input_tokens;
                    // Cumulative: the output so far.
                    let c = s.output_tokens * (i as u64 + 1) / n as u64;
                    let t = p + c;
                    write!(
                        out,
                        r#","usageMetadata":{{"promptTokenCount":{p},"candidatesTokenCount":{c},"totalTokenCount":{t},"promptTokensDetails":[{{"modality":"TEXT","tokenCount":{p}}}]}}"#
                    )?;
                }
                write!(out, r#","modelVersion":{m},"responseId":"{GEMINI_ID}"}}"#)
            })?;
        }
        self.end()
    }
}

/// Writes the escaped text of every content event, one after the other.
fn full_text(s: &Spec, out: &mut dyn Write) -> io::Result<()> {
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

// ---------------------------------------------------------------------------------------------
// gzip, uncompressed: deflate "stored" blocks

const CRC_TABLE: [u32; 256] = {
    let mut t = [0u32; 256];
    let mut i = 0;
    while i < 256 {
        let mut c = i as u32;
        let mut k = 0;
        while k < 8 {
            c = if c & 1 != 0 {
                0xEDB8_8320 ^ (c >> 1)
            } else {
                c >> 1
            };
            k += 1;
        }
        t[i] = c;
        i += 1;
    }
    t
};

/// CRC-32 (gzip's), continued from `crc` (0 to start).
pub fn crc32(crc: u32, bytes: &[u8]) -> u32 {
    let mut c = !crc;
    for &b in bytes {
        c = CRC_TABLE[((c ^ b as u32) & 0xff) as usize] ^ (c >> 8);
    }
    !c
}

/// A gzip encoder that does not compress: what is written until a flush becomes stored
/// blocks, so each event can be decoded as soon as it arrives.
pub struct Gzip<W: Write> {
    inner: W,
    buf: Vec<u8>,
    crc: u32,
    size: u32,
    started: bool,
}

/// The most a stored block holds.
const STORED_MAX: usize = 65_535;

impl<W: Write> Gzip<W> {
    pub fn new(inner: W) -> Gzip<W> {
        Gzip {
            inner,
            buf: Vec::new(),
            crc: 0,
            size: 0,
            started: false,
        }
    }

    fn start(&mut self) -> io::Result<()> {
        if !self.started {
            // Magic, deflate, no flags, no mtime, no extra flags, OS unknown.
            self.inner
                .write_all(&[0x1f, 0x8b, 8, 0, 0, 0, 0, 0, 0, 255])?;
            self.started = true;
        }
        Ok(())
    }

    fn blocks(&mut self) -> io::Result<()> {
        self.start()?;
        for block in self.buf.chunks(STORED_MAX) {
            let len = block.len() as u16;
            let mut head = vec![0u8];
            head.extend_from_slice(&len.to_le_bytes());
            head.extend_from_slice(&(!len).to_le_bytes());
            let mut out = head;
            out.extend_from_slice(block);
            self.inner.write_all(&out)?;
        }
        self.buf.clear();
        Ok(())
    }

    /// Ends the stream (the final block, the CRC and the size); the inner writer back.
    pub fn finish(mut self) -> io::Result<W> {
        self.blocks()?;
        self.inner.write_all(&[1, 0, 0, 0xff, 0xff])?;
        self.inner.write_all(&self.crc.to_le_bytes())?;
        self.inner.write_all(&self.size.to_le_bytes())?;
        self.inner.flush()?;
        Ok(self.inner)
    }
}

impl<W: Write> Write for Gzip<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.crc = crc32(self.crc, buf);
        self.size = self.size.wrapping_add(buf.len() as u32);
        self.buf.extend_from_slice(buf);
        if self.buf.len() >= STORED_MAX {
            self.blocks()?;
        }
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        if !self.buf.is_empty() {
            self.blocks()?;
        }
        self.inner.flush()
    }
}

/// Decodes a gzip stream of stored blocks (what [`Gzip`] writes), checking its CRC and size;
/// None if it is anything else or broken.
pub fn gunzip_stored(bytes: &[u8]) -> Option<Vec<u8>> {
    if bytes.get(..4)? != [0x1f, 0x8b, 8, 0] {
        return None;
    }
    let mut at = 10;
    let mut out = Vec::new();
    loop {
        let head = *bytes.get(at)?;
        if head >> 1 != 0 {
            return None; // not a stored block
        }
        let len = u16::from_le_bytes([*bytes.get(at + 1)?, *bytes.get(at + 2)?]);
        let nlen = u16::from_le_bytes([*bytes.get(at + 3)?, *bytes.get(at + 4)?]);
        if len != !nlen {
            return None;
        }
        at += 5;
        out.extend_from_slice(bytes.get(at..at + len as usize)?);
        at += len as usize;
        if head & 1 == 1 {
            break;
        }
    }
    let tail = bytes.get(at..)?;
    if tail.len() != 8 {
        return None;
    }
    let crc = u32::from_le_bytes(tail[..4].try_into().ok()?);
    let size = u32::from_le_bytes(tail[4..].try_into().ok()?);
    (crc == crc32(0, &out) && size == out.len() as u32).then_some(out)
}

// ---------------------------------------------------------------------------------------------
// Hashing bodies

/// A 64-bit hash of a body, fed piece by piece: the same value however the bytes were cut.
/// SipHash-1-3 with fixed keys (std's `DefaultHasher::new()`, streaming over `write`): std is
/// built optimized, so even a debug build hashes 100 MB in a fraction of a second.
#[derive(Clone, Debug, Default)]
pub struct BodyHash(std::hash::DefaultHasher);

impl BodyHash {
    pub fn update(&mut self, bytes: &[u8]) {
        std::hash::Hasher::write(&mut self.0, bytes);
    }

    pub fn value(&self) -> u64 {
        std::hash::Hasher::finish(&self.0)
    }
}

/// The hash of a whole body.
pub fn hash(bytes: &[u8]) -> u64 {
    let mut h = BodyHash::default();
    h.update(bytes);
    h.value()
}

// ---------------------------------------------------------------------------------------------
// SSE, for tests

/// One server-sent event.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SseEvent {
    /// The `event:` field.
    pub event: Option<String>,
    /// The `data:` lines, joined with "\n".
    pub data: String,
    /// How many `data:` lines.
    pub data_lines: usize,
}

impl SseEvent {
    /// The data as JSON (None for `[DONE]` and other non-JSON data).
    pub fn json(&self) -> Option<Value> {
        serde_json::from_str(&self.data).ok()
    }
}

/// The events of a `text/event-stream` body (lines end with CRLF, LF or CR).
pub fn sse_events(body: &[u8]) -> Vec<SseEvent> {
    let text = String::from_utf8_lossy(body);
    let mut events = Vec::new();
    let mut event = None;
    let mut data: Option<String> = None;
    let mut lines = 0;
    let normalized = text.replace("\r\n", "\n").replace('\r', "\n");
    for line in normalized.split('\n') {
        if line.is_empty() {
            if data.is_some() || event.is_some() {
                events.push(SseEvent {
                    event: event.take(),
                    data: data.take().unwrap_or_default(),
                    data_lines: lines,
                });
                lines = 0;
            }
            continue;
        }
        if line.starts_with(':') {
            continue;
        }
        let (field, value) = line.split_once(':').unwrap_or((line, ""));
        let value = value.strip_prefix(' ').unwrap_or(value);
        match field {
            "event" => event = Some(value.to_string()),
            "data" => {
                lines += 1;
                match &mut data {
                    Some(d) => {
                        d.push('\n');
                        d.push_str(value);
                    }
                    None => data = Some(value.to_string()),
                }
            }
            _ => {}
        }
    }
    events
}

// ---------------------------------------------------------------------------------------------
// The transport

/// How the body is cut into writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Split {
    /// One piece per event (big events in [`MAX_CHUNK`] pieces).
    Event,
    /// Every byte its own piece.
    Every,
    /// Pieces of this many bytes.
    Size(usize),
    /// Pieces of random sizes, from this seed.
    Random(u64),
}

impl Split {
    pub fn parse(v: &str) -> Option<Split> {
        let v = v.trim();
        if v == "every" {
            return Some(Split::Every);
        }
        if let Some(seed) = v.strip_prefix("random:") {
            return seed.trim().parse().ok().map(Split::Random);
        }
        match v.parse::<usize>().ok()? {
            0 | 1 => Some(Split::Every),
            n => Some(Split::Size(n)),
        }
    }
}

/// How an answer travels, besides what it says.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Transport {
    pub split: Split,
    /// Between events.
    pub delay_ms: u64,
    /// Close after this many body bytes.
    pub reset_after: Option<u64>,
    pub gzip: bool,
    /// Chunked transfer-encoding (else a content-length).
    pub chunked: bool,
    /// One more header of the answer (name, value).
    pub extra: Option<(String, String)>,
}

impl Transport {
    pub fn from_headers(headers: &[(String, String)], spec: &Spec) -> Transport {
        let num = |name: &str| header(headers, name).and_then(|v| v.trim().parse::<u64>().ok());
        Transport {
            split: header(headers, "x-test-split")
                .and_then(Split::parse)
                .unwrap_or(Split::Event),
            delay_ms: num("x-test-delay-ms").unwrap_or(0),
            reset_after: num("x-test-reset-after"),
            gzip: header(headers, "x-test-encoding").is_some_and(|v| v.trim() == "gzip"),
            chunked: match header(headers, "x-test-framing").map(str::trim) {
                Some("length") => false,
                Some("chunked") => true,
                _ => spec.streams(),
            },
            extra: header(headers, "x-test-answer-header")
                .and_then(|v| v.trim().split_once('='))
                .map(|(k, v)| (k.to_string(), v.to_string())),
        }
    }
}

/// The body's way to the socket: cuts it into pieces as the [`Transport`] says, frames each
/// as a chunk (or not), flushes each, and hashes and counts what it sent.
struct Wire<'a> {
    out: &'a mut dyn Write,
    chunked: bool,
    split: Split,
    rng: Rng,
    /// The size of the next piece (split modes).
    next: usize,
    buf: Vec<u8>,
    delay: Duration,
    /// An event ended: wait before the next byte.
    pending_delay: bool,
    reset_after: Option<u64>,
    reset: bool,
    sent: u64,
    pieces: u64,
    hash: BodyHash,
    keep: usize,
    kept: Vec<u8>,
    peak: usize,
}

impl<'a> Wire<'a> {
    fn new(out: &'a mut dyn Write, t: &Transport, keep: usize) -> Wire<'a> {
        let seed = match t.split {
            Split::Random(s) => s,
            _ => 0,
        };
        let mut w = Wire {
            out,
            chunked: t.chunked,
            split: t.split,
            // xorshift is stuck at 0.
            rng: Rng(seed ^ 0x9e37_79b9_7f4a_7c15),
            next: 0,
            buf: Vec::new(),
            delay: Duration::from_millis(t.delay_ms),
            pending_delay: false,
            reset_after: t.reset_after,
            reset: false,
            sent: 0,
            pieces: 0,
            hash: BodyHash::default(),
            keep,
            kept: Vec::new(),
            peak: 0,
        };
        w.next = w.draw();
        w
    }

    fn draw(&mut self) -> usize {
        match self.split {
            Split::Event => MAX_CHUNK,
            Split::Every => 1,
            Split::Size(n) => n,
            Split::Random(_) => {
                if self.rng.below(16) == 0 {
                    1 + self.rng.below(256) as usize
                } else {
                    1 + self.rng.below(7) as usize
                }
            }
        }
    }

    /// Sends one piece; an error once the reset point is reached.
    fn emit(&mut self, piece: &[u8]) -> io::Result<()> {
        let mut piece = piece;
        if let Some(limit) = self.reset_after {
            let left = limit.saturating_sub(self.sent) as usize;
            if piece.len() >= left {
                piece = &piece[..left];
                self.reset = true;
            }
        }
        if !piece.is_empty() {
            if self.chunked {
                let mut frame = format!("{:x}\r\n", piece.len()).into_bytes();
                frame.extend_from_slice(piece);
                frame.extend_from_slice(b"\r\n");
                self.out.write_all(&frame)?;
            } else {
                self.out.write_all(piece)?;
            }
            self.out.flush()?;
            self.hash.update(piece);
            let room = self.keep.saturating_sub(self.kept.len());
            self.kept.extend_from_slice(&piece[..room.min(piece.len())]);
            self.sent += piece.len() as u64;
            self.pieces += 1;
        }
        if self.reset {
            return Err(io::Error::other("reset point reached"));
        }
        Ok(())
    }

    /// Sends what is buffered: whole pieces, and at an event's end without a split, the rest.
    fn drain(&mut self, event_end: bool) -> io::Result<()> {
        self.peak = self.peak.max(self.buf.capacity());
        let buf = std::mem::take(&mut self.buf);
        let mut at = 0;
        let result = (|| {
            if self.split == Split::Event {
                while buf.len() - at >= MAX_CHUNK || (event_end && at < buf.len()) {
                    let end = (at + MAX_CHUNK).min(buf.len());
                    self.emit(&buf[at..end])?;
                    at = end;
                }
            } else {
                while buf.len() - at >= self.next {
                    let end = at + self.next;
                    self.emit(&buf[at..end])?;
                    at = end;
                    self.next = self.draw();
                }
            }
            Ok(())
        })();
        self.buf = buf;
        self.buf.drain(..at);
        result
    }

    /// Sends the rest and ends the body.
    fn finish(&mut self) -> io::Result<()> {
        // The delay after the last event holds the body's end too.
        if self.pending_delay {
            self.pending_delay = false;
            std::thread::sleep(self.delay);
        }
        let rest = std::mem::take(&mut self.buf);
        if !rest.is_empty() {
            self.emit(&rest)?;
        }
        if self.chunked {
            self.out.write_all(b"0\r\n\r\n")?;
        }
        self.out.flush()
    }
}

impl Write for Wire<'_> {
    fn write(&mut self, data: &[u8]) -> io::Result<usize> {
        if self.pending_delay {
            self.pending_delay = false;
            std::thread::sleep(self.delay);
        }
        self.buf.extend_from_slice(data);
        self.drain(false)?;
        Ok(data.len())
    }

    /// An event ended.
    fn flush(&mut self) -> io::Result<()> {
        self.drain(true)?;
        self.pending_delay = !self.delay.is_zero();
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------------
// The server

/// One request the upstream got, and what it answered.
#[derive(Clone, Debug)]
pub struct Exchange {
    /// Its number (the answer's `x-llm-seq`), from 0.
    pub seq: u64,
    pub method: String,
    /// With the query.
    pub path: String,
    /// Names in lower case, in the order received.
    pub headers: Vec<(String, String)>,
    /// The request body (its first [`REQUEST_KEEP`] bytes).
    pub body: Vec<u8>,
    pub body_len: u64,
    pub body_hash: u64,
    /// The `max_tokens`-like field of the body.
    pub max_tokens: Option<u64>,
    /// What was answered; None for an unknown route.
    pub spec: Option<Spec>,
    pub transport: Option<Transport>,
    /// None while the answer is being sent.
    pub sent: Option<Sent>,
}

impl Exchange {
    pub fn header(&self, name: &str) -> Option<&str> {
        header(&self.headers, name)
    }
}

/// What the upstream sent as a response body.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Sent {
    pub status: u16,
    /// Body bytes (after content-encoding, without the chunk framing).
    pub bytes: u64,
    /// [`BodyHash`] of those bytes.
    pub hash: u64,
    /// Writes (chunks, when chunked).
    pub pieces: u64,
    /// The body was sent whole (no reset, no broken connection).
    pub complete: bool,
    /// Its first bytes (as many as [`LlmUpstream::keep_bodies`] says).
    pub body: Vec<u8>,
    /// The most body bytes held at once on the way to the socket.
    pub peak_buffer: usize,
}

/// A running LLM-like upstream; it stops accepting when dropped.
pub struct LlmUpstream {
    pub addr: SocketAddr,
    shared: Arc<Shared>,
}

struct Shared {
    stop: AtomicBool,
    keep: AtomicUsize,
    seq: AtomicU64,
    peak: AtomicUsize,
    log: Mutex<Vec<Exchange>>,
}

impl LlmUpstream {
    /// Listens on a free loopback port.
    pub fn start() -> LlmUpstream {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let shared = Arc::new(Shared {
            stop: AtomicBool::new(false),
            keep: AtomicUsize::new(DEFAULT_KEEP),
            seq: AtomicU64::new(0),
            peak: AtomicUsize::new(0),
            log: Mutex::new(Vec::new()),
        });
        let s = shared.clone();
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                if s.stop.load(Ordering::Relaxed) {
                    break;
                }
                let Ok(conn) = conn else { continue };
                let s = s.clone();
                std::thread::spawn(move || serve(conn, &s));
            }
        });
        LlmUpstream { addr, shared }
    }

    /// From now on, keep the first `bytes` of each response body in its [`Sent`] (all are
    /// hashed whatever this says).
    pub fn keep_bodies(&self, bytes: usize) {
        self.shared.keep.store(bytes, Ordering::SeqCst);
    }

    /// Every exchange so far, in the order the requests came.
    pub fn exchanges(&self) -> Vec<Exchange> {
        self.shared.log.lock().unwrap().clone()
    }

    /// The exchange numbered `seq` (as it is now).
    pub fn exchange(&self, seq: u64) -> Option<Exchange> {
        let log = self.shared.log.lock().unwrap();
        log.iter().find(|e| e.seq == seq).cloned()
    }

    /// The exchange numbered `seq` once its answer is sent (or broke), waiting up to
    /// `timeout`: a client may read the last byte before the upstream records it.
    pub fn wait_sent(&self, seq: u64, timeout: Duration) -> Option<Exchange> {
        let deadline = Instant::now() + timeout;
        loop {
            let e = self.exchange(seq);
            if e.as_ref().is_some_and(|e| e.sent.is_some()) || Instant::now() >= deadline {
                return e.filter(|e| e.sent.is_some());
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    /// Requests received so far.
    pub fn received(&self) -> usize {
        self.shared.log.lock().unwrap().len()
    }

    /// The most body bytes any answer held at once on the way to the socket.
    pub fn peak_buffer(&self) -> usize {
        self.shared.peak.load(Ordering::SeqCst)
    }
}

impl Drop for LlmUpstream {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Relaxed);
        let _ = TcpStream::connect(self.addr); // wakes the accept loop
    }
}

/// A request as read.
struct Incoming {
    method: String,
    path: String,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
    body_len: u64,
    body_hash: u64,
}

/// Reads one request; None at the end of the connection or on garbage.
fn read_request(reader: &mut BufReader<TcpStream>) -> Option<Incoming> {
    let mut line = String::new();
    if reader.read_line(&mut line).ok()? == 0 {
        return None;
    }
    let mut parts = line.split_whitespace();
    let method = parts.next()?.to_string();
    let path = parts.next()?.to_string();
    let headers = read_headers(reader)?;
    let mut body = Vec::new();
    let mut body_len = 0u64;
    let mut h = BodyHash::default();
    let mut take = |piece: &[u8]| {
        h.update(piece);
        body_len += piece.len() as u64;
        let room = REQUEST_KEEP.saturating_sub(body.len());
        body.extend_from_slice(&piece[..room.min(piece.len())]);
    };
    let chunked = header(&headers, "transfer-encoding")
        .is_some_and(|v| v.to_ascii_lowercase().contains("chunked"));
    if chunked {
        loop {
            line.clear();
            reader.read_line(&mut line).ok()?;
            let size_text = line.trim().split(';').next()?;
            let size = usize::from_str_radix(size_text, 16).ok()?;
            if size == 0 {
                read_headers(reader)?; // trailers
                break;
            }
            copy_exact(reader, size as u64, &mut take).ok()?;
            let mut crlf = [0u8; 2];
            reader.read_exact(&mut crlf).ok()?;
        }
    } else {
        let len = header(&headers, "content-length")
            .and_then(|v| v.trim().parse::<u64>().ok())
            .unwrap_or(0);
        copy_exact(reader, len, &mut take).ok()?;
    }
    Some(Incoming {
        method,
        path,
        headers,
        body,
        body_len,
        body_hash: h.value(),
    })
}

/// Header lines up to the blank line; names in lower case.
fn read_headers(reader: &mut impl BufRead) -> Option<Vec<(String, String)>> {
    let mut headers = Vec::new();
    let mut line = String::new();
    loop {
        line.clear();
        if reader.read_line(&mut line).ok()? == 0 {
            return None;
        }
        let l = line.trim_end();
        if l.is_empty() {
            return Some(headers);
        }
        if let Some((k, v)) = l.split_once(':') {
            headers.push((k.trim().to_ascii_lowercase(), v.trim().to_string()));
        }
    }
}

/// Reads exactly `n` bytes, handing them to `take` piece by piece.
fn copy_exact(reader: &mut impl Read, n: u64, take: &mut dyn FnMut(&[u8])) -> io::Result<()> {
    let mut left = n;
    let mut buf = vec![0u8; 64 * 1024];
    while left > 0 {
        let want = (left as usize).min(buf.len());
        let got = reader.read(&mut buf[..want])?;
        if got == 0 {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        take(&buf[..got]);
        left -= got as u64;
    }
    Ok(())
}

/// Serves one keep-alive connection.
fn serve(conn: TcpStream, s: &Shared) {
    let _ = conn.set_read_timeout(Some(Duration::from_secs(60)));
    // Each piece must leave at once: Nagle's algorithm would hold small ones back.
    let _ = conn.set_nodelay(true);
    let mut reader = BufReader::new(conn);
    while let Some(req) = read_request(&mut reader) {
        let close = header(&req.headers, "connection").is_some_and(|v| v == "close");
        if !answer(reader.get_mut(), req, s) || close {
            return;
        }
    }
}

fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        400 => "Bad Request",
        401 => "Unauthorized",
        404 => "Not Found",
        429 => "Too Many Requests",
        500 => "Internal Server Error",
        503 => "Service Unavailable",
        529 => "Overloaded",
        _ => "Status",
    }
}

/// Answers one request; false if the connection is to be closed (a reset, or it broke).
fn answer(out: &mut TcpStream, req: Incoming, s: &Shared) -> bool {
    let seq = s.seq.fetch_add(1, Ordering::SeqCst);
    let spec = Spec::from_request(&req.path, &req.headers, &req.body);
    let transport = spec
        .as_ref()
        .map(|spec| Transport::from_headers(&req.headers, spec));
    s.log.lock().unwrap().push(Exchange {
        seq,
        max_tokens: max_tokens_of(&req.path, &req.body),
        method: req.method,
        path: req.path,
        headers: req.headers,
        body: req.body,
        body_len: req.body_len,
        body_hash: req.body_hash,
        spec: spec.clone(),
        transport: transport.clone(),
        sent: None,
    });
    let record = |sent: Sent| {
        s.peak.fetch_max(sent.peak_buffer, Ordering::SeqCst);
        let mut log = s.log.lock().unwrap();
        if let Some(e) = log.iter_mut().find(|e| e.seq == seq) {
            e.sent = Some(sent);
        }
    };
    let (Some(spec), Some(t)) = (spec, transport) else {
        let body = br#"{"error":{"message":"no such route","type":"invalid_request_error","param":null,"code":null}}"#;
        let head = format!(
            "HTTP/1.1 404 Not Found\r\ncontent-type: application/json\r\nx-llm-seq: {seq}\r\ncontent-length: {}\r\n\r\n",
            body.len()
        );
        let ok = out
            .write_all(head.as_bytes())
            .and_then(|_| out.write_all(body))
            .and_then(|_| out.flush())
            .is_ok();
        record(Sent {
            status: 404,
            bytes: body.len() as u64,
            hash: hash(body),
            pieces: 1,
            complete: ok,
            body: body.to_vec(),
            peak_buffer: 0,
        });
        return ok;
    };
    let mut head = format!(
        "HTTP/1.1 {} {}\r\ncontent-type: {}\r\nx-llm-seq: {seq}\r\n",
        spec.status,
        reason(spec.status),
        spec.content_type()
    );
    if spec.streams() {
        head.push_str("cache-control: no-cache\r\n");
    }
    if t.gzip {
        head.push_str("content-encoding: gzip\r\n");
    }
    if let Some((name, value)) = &t.extra {
        head.push_str(&format!("{name}: {value}\r\n"));
    }
    if t.chunked {
        head.push_str("transfer-encoding: chunked\r\n");
    } else {
        head.push_str(&format!("content-length: {}\r\n", wire_len(&spec, t.gzip)));
    }
    head.push_str("\r\n");
    if out.write_all(head.as_bytes()).is_err() {
        record(Sent {
            status: spec.status,
            ..Sent::default()
        });
        return false;
    }
    let mut sock = &*out;
    let mut wire = Wire::new(&mut sock, &t, s.keep.load(Ordering::SeqCst));
    let result = if t.gzip {
        let mut g = Gzip::new(&mut wire);
        write_body(&spec, &mut g).and_then(|_| g.finish().map(|_| ()))
    } else {
        write_body(&spec, &mut wire)
    };
    let result = result.and_then(|_| wire.finish());
    let reset = wire.reset;
    record(Sent {
        status: spec.status,
        bytes: wire.sent,
        hash: wire.hash.value(),
        pieces: wire.pieces,
        complete: result.is_ok(),
        body: std::mem::take(&mut wire.kept),
        peak_buffer: wire.peak,
    });
    if reset {
        // Let the client read what was sent before the connection goes.
        std::thread::sleep(Duration::from_millis(50));
        let _ = out.shutdown(std::net::Shutdown::Both);
        return false;
    }
    result.is_ok()
}

// ---------------------------------------------------------------------------------------------
// A client

/// A response as a client read it.
#[derive(Clone, Debug)]
pub struct Reply {
    pub status: u16,
    /// Names in lower case.
    pub headers: Vec<(String, String)>,
    /// The body (de-chunked, not decoded); empty when a sink took it.
    pub body: Vec<u8>,
    /// Body bytes received.
    pub len: u64,
    /// [`BodyHash`] of the body bytes received.
    pub hash: u64,
    /// Chunks received (0 without chunked encoding).
    pub chunks: u64,
    /// The body ended as its framing says (false: the connection closed first).
    pub complete: bool,
}

impl Reply {
    pub fn header(&self, name: &str) -> Option<&str> {
        header(&self.headers, name)
    }

    /// The upstream's number for this exchange (`x-llm-seq`).
    pub fn seq(&self) -> Option<u64> {
        self.header("x-llm-seq")?.parse().ok()
    }

    /// The body as JSON.
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap()
    }

    /// The body's SSE events.
    pub fn events(&self) -> Vec<SseEvent> {
        sse_events(&self.body)
    }
}

/// Where a response body goes as it arrives.
pub type Sink<'a> = &'a mut dyn FnMut(&[u8]);

/// A keep-alive HTTP/1.1 connection that sends request bodies and reads any response body,
/// whole or as it comes.
pub struct LlmClient {
    reader: BufReader<TcpStream>,
}

impl LlmClient {
    pub fn connect(addr: SocketAddr) -> io::Result<LlmClient> {
        let stream = TcpStream::connect_timeout(&addr, Duration::from_secs(5))?;
        stream.set_read_timeout(Some(Duration::from_secs(20)))?;
        stream.set_nodelay(true)?;
        Ok(LlmClient {
            reader: BufReader::new(stream),
        })
    }

    /// POSTs `body` (with a content-length) and reads the whole response.
    pub fn post(&mut self, path: &str, headers: &[(&str, &str)], body: &[u8]) -> io::Result<Reply> {
        self.send("POST", path, headers, body, None)
    }

    /// Sends one request; the response body goes to `sink` as it arrives if given (and is
    /// then not kept), else into [`Reply::body`].
    pub fn send(
        &mut self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: &[u8],
        sink: Option<Sink>,
    ) -> io::Result<Reply> {
        self.send_pieces(method, path, headers, &[body], Duration::ZERO, sink)
    }

    /// Sends one request whose body (with a content-length, unless `headers` frame it) is
    /// written in `pieces`, the headers with the first, `gap` apart (so that the proxy sees
    /// each as its own body event); reads the response as [`LlmClient::send`] does.
    pub fn send_pieces(
        &mut self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        pieces: &[&[u8]],
        gap: Duration,
        mut sink: Option<Sink>,
    ) -> io::Result<Reply> {
        let mut req = format!("{method} {path} HTTP/1.1\r\nhost: localhost\r\n");
        let mut has_length = false;
        for (k, v) in headers {
            has_length |= k.eq_ignore_ascii_case("content-length")
                || k.eq_ignore_ascii_case("transfer-encoding");
            req.push_str(&format!("{k}: {v}\r\n"));
        }
        if !has_length {
            let len: usize = pieces.iter().map(|p| p.len()).sum();
            req.push_str(&format!("content-length: {len}\r\n"));
        }
        req.push_str("\r\n");
        let w = self.reader.get_mut();
        w.write_all(req.as_bytes())?;
        for (i, piece) in pieces.iter().enumerate() {
            if i > 0 {
                std::thread::sleep(gap);
            }
            w.write_all(piece)?;
            w.flush()?;
        }
        w.flush()?;
        let mut line = String::new();
        self.reader.read_line(&mut line)?;
        let status = line
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| io::Error::other(format!("bad status line {line:?}")))?;
        let headers = read_headers(&mut self.reader)
            .ok_or_else(|| io::Error::other("connection closed in the headers"))?;
        let mut reply = Reply {
            status,
            headers,
            body: Vec::new(),
            len: 0,
            hash: 0,
            chunks: 0,
            complete: false,
        };
        let mut h = BodyHash::default();
        let keep = sink.is_none();
        let mut kept = Vec::new();
        let mut len = 0u64;
        let mut take = |piece: &[u8]| {
            h.update(piece);
            len += piece.len() as u64;
            match &mut sink {
                Some(f) => f(piece),
                None if keep => kept.extend_from_slice(piece),
                None => {}
            }
        };
        let chunked = reply
            .header("transfer-encoding")
            .is_some_and(|v| v.eq_ignore_ascii_case("chunked"));
        let length = reply
            .header("content-length")
            .and_then(|v| v.parse::<u64>().ok());
        reply.complete = if chunked {
            let mut chunks = 0;
            let done = (|| -> io::Result<bool> {
                loop {
                    line.clear();
                    if self.reader.read_line(&mut line)? == 0 {
                        return Ok(false);
                    }
                    let size_text = line.trim().split(';').next().unwrap_or("");
                    let size = u64::from_str_radix(size_text, 16)
                        .map_err(|_| io::Error::other(format!("bad chunk size {line:?}")))?;
                    if size == 0 {
                        return Ok(read_headers(&mut self.reader).is_some());
                    }
                    chunks += 1;
                    copy_exact(&mut self.reader, size, &mut take)?;
                    let mut crlf = [0u8; 2];
                    self.reader.read_exact(&mut crlf)?;
                    if &crlf != b"\r\n" {
                        return Err(io::Error::other("chunk without its CRLF"));
                    }
                }
            })();
            reply.chunks = chunks;
            match done {
                Ok(d) => d,
                Err(e) if is_eof(&e) => false,
                Err(e) => return Err(e),
            }
        } else if let Some(n) = length {
            match copy_exact(&mut self.reader, n, &mut take) {
                Ok(()) => true,
                Err(e) if is_eof(&e) => false,
                Err(e) => return Err(e),
            }
        } else {
            // Delimited by the end of the connection.
            copy_exact(&mut self.reader, u64::MAX, &mut take)
                .err()
                .is_some_and(|e| e.kind() == io::ErrorKind::UnexpectedEof)
        };
        reply.len = len;
        reply.hash = h.value();
        reply.body = kept;
        Ok(reply)
    }
}

/// The peer closed (or reset) the connection.
fn is_eof(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::UnexpectedEof
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::BrokenPipe
    )
}

/// One POST on a fresh connection.
pub fn post(
    addr: SocketAddr,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> io::Result<Reply> {
    LlmClient::connect(addr)?.post(path, headers, body)
}
