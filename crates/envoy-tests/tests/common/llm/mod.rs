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

mod anthropic;
mod body;
mod client;
mod gemini;
mod gzip;
mod openai;
mod server;
mod sse;
mod wire;

pub use super::http::{hash, header, BodyHash, REQUEST_KEEP};
pub use body::{body_bytes, delta_literal, text, wire_body, wire_len, write_body, write_encoded};
pub use client::{post, LlmClient, Reply, Sink};
pub use gzip::{crc32, gunzip_stored, Gzip};
pub use server::{Exchange, LlmUpstream, Sent};
pub use sse::{sse_events, SseEvent};
pub use wire::{Split, Transport};

use serde_json::Value;

/// Usage reported when the request does not say.
pub const DEFAULT_INPUT_TOKENS: u64 = 12;
pub const DEFAULT_OUTPUT_TOKENS: u64 = 34;
/// Content events in a stream when the request does not say.
pub const DEFAULT_EVENTS: usize = 5;
/// Without a split, an event bigger than this goes out in chunks of this size.
pub const MAX_CHUNK: usize = 256 * 1024;
/// Response body bytes an [`Exchange`] keeps by default (all are hashed).
pub const DEFAULT_KEEP: usize = 1 << 20;

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
