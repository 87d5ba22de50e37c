//! Server-sent events as a client reads them, for tests.

use serde_json::Value;

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
