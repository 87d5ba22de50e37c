//! Envoy access logs, line by line, into the requests replay runs: Envoy's default text
//! format (or any text format given as Envoy's format string) and JSON logs (`json_format`),
//! each line read on its own, with a bounded length.
//!
//! Replay needs a few [`Field`]s of each request: its start time, and whatever the rules match
//! and key on. A JSON line gives them by key (by default the key named like the field, or the
//! name Istio's JSON access log uses), a text line by the position of a format command (by
//! default `%START_TIME%`, `%DOWNSTREAM_REMOTE_ADDRESS%`, `%REQ(:METHOD)%`, `%REQ(NAME)%`, …);
//! `--field FIELD=KEY` maps a field to another JSON key or format command.

use ratelimit_core::config::{Config, Cost, KeyPart, Usage};
use ratelimit_core::key::PlainRequest;
use serde_json::Value;
use std::borrow::Cow;
use std::io::{self, BufRead};

/// Envoy's default access-log format (no `log_format`), as Envoy 1.40 writes it: checked
/// against the log of a real Envoy 1.40 (`tests/replay.rs`). It has no client address.
pub const ENVOY_DEFAULT_FORMAT: &str = "[%START_TIME%] \"%REQ(:METHOD)% \
    %REQ(X-ENVOY-ORIGINAL-PATH?:PATH)% %PROTOCOL%\" %RESPONSE_CODE% %RESPONSE_FLAGS% \
    %BYTES_RECEIVED% %BYTES_SENT% %DURATION% %RESP(X-ENVOY-UPSTREAM-SERVICE-TIME)% \
    \"%REQ(X-FORWARDED-FOR)%\" \"%REQ(USER-AGENT)%\" \"%REQ(X-REQUEST-ID)%\" \
    \"%REQ(:AUTHORITY)%\" \"%UPSTREAM_HOST%\"";

/// The longest line read; a longer one is skipped as a bad line (bounded memory whatever the
/// input).
pub const MAX_LINE: usize = 1 << 20;

/// Something replay reads from a log entry.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Field {
    /// When the request started (`%START_TIME%`): RFC 3339, or seconds, ms, µs or ns since
    /// the epoch.
    StartTime,
    /// The client address (`%DOWNSTREAM_REMOTE_ADDRESS%`, what `remote_address` keys on).
    RemoteAddress,
    /// `%REQ(:METHOD)%`.
    Method,
    /// `%REQ(X-ENVOY-ORIGINAL-PATH?:PATH)%`, with the query string.
    Path,
    /// `%REQ(:AUTHORITY)%`.
    Authority,
    /// `%DURATION%`, ms: the request's end is its start plus this.
    Duration,
    /// `%BYTES_SENT%`: the response body's bytes.
    BytesSent,
    /// A request header (lower-case name), `%REQ(NAME)%`.
    Header(String),
    /// A response header or trailer (lower-case name), `%RESP(NAME)%` or `%TRAILER(NAME)%`.
    Response(String),
    /// The usage the filter charged a rule (by name) for the request, as it reports it to the
    /// access log: `%DYNAMIC_METADATA(wasm_ratelimit:RULE)%` (native build) or
    /// `%FILTER_STATE(wasm.wasm_ratelimit.RULE:PLAIN)%` (wasm build).
    Usage(String),
    /// A request body field (its path, keys joined by `.`) that the filter read for a rule,
    /// as it reports it to the access log: `%DYNAMIC_METADATA(wasm_ratelimit:body.PATH)%`
    /// (native build) or `%FILTER_STATE(wasm.wasm_ratelimit.body.PATH:PLAIN)%` (wasm build).
    Body(String),
}

impl Field {
    /// Reads a field's name: `start_time`, `remote_address`, `method`, `path`, `authority`,
    /// `duration`, `bytes_sent`, `header:NAME`, `response:NAME`.
    pub fn parse(name: &str) -> Option<Field> {
        Some(match name {
            "start_time" => Field::StartTime,
            "remote_address" => Field::RemoteAddress,
            "method" => Field::Method,
            "path" => Field::Path,
            "authority" => Field::Authority,
            "duration" => Field::Duration,
            "bytes_sent" => Field::BytesSent,
            _ => {
                if let Some(h) = name.strip_prefix("header:").filter(|h| !h.is_empty()) {
                    Field::Header(h.to_ascii_lowercase())
                } else if let Some(h) = name.strip_prefix("response:").filter(|h| !h.is_empty()) {
                    Field::Response(h.to_ascii_lowercase())
                } else if let Some(r) = name.strip_prefix("usage:").filter(|r| !r.is_empty()) {
                    Field::Usage(r.to_string())
                } else if let Some(p) = name.strip_prefix("body:").filter(|p| !p.is_empty()) {
                    Field::Body(p.to_string())
                } else {
                    return None;
                }
            }
        })
    }

    /// The field's name, as [`Field::parse`] reads it.
    pub fn name(&self) -> String {
        match self {
            Field::StartTime => "start_time".into(),
            Field::RemoteAddress => "remote_address".into(),
            Field::Method => "method".into(),
            Field::Path => "path".into(),
            Field::Authority => "authority".into(),
            Field::Duration => "duration".into(),
            Field::BytesSent => "bytes_sent".into(),
            Field::Header(h) => format!("header:{h}"),
            Field::Response(h) => format!("response:{h}"),
            Field::Usage(r) => format!("usage:{r}"),
            Field::Body(p) => format!("body:{p}"),
        }
    }

    /// The JSON keys looked up by default: the field's own name, and the name in Istio's JSON
    /// access log; a header by its name, or with `_` for `-` (`x_forwarded_for`).
    fn json_keys(&self) -> Vec<String> {
        match self {
            Field::RemoteAddress => {
                vec!["downstream_remote_address".into(), "remote_address".into()]
            }
            Field::Header(h) | Field::Response(h) => {
                let underscored = h.replace('-', "_");
                if underscored == *h {
                    vec![h.clone()]
                } else {
                    vec![h.clone(), underscored]
                }
            }
            Field::Usage(r) => vec![r.clone(), format!("usage_{r}")],
            Field::Body(p) => vec![format!("body.{p}"), p.clone()],
            other => vec![other.name()],
        }
    }

    /// Whether a text format command gives this field by default.
    fn given_by(&self, command: &Command) -> bool {
        let arg = command.arg.as_deref().unwrap_or("");
        match (self, command.name.as_str()) {
            (Field::StartTime, "START_TIME") => true,
            (
                Field::RemoteAddress,
                "DOWNSTREAM_REMOTE_ADDRESS" | "DOWNSTREAM_REMOTE_ADDRESS_WITHOUT_PORT",
            ) => true,
            (Field::Duration, "DURATION") => true,
            (Field::BytesSent, "BYTES_SENT") => true,
            (Field::Method, "REQ") => arg == ":METHOD",
            (Field::Path, "REQ") => arg == "X-ENVOY-ORIGINAL-PATH?:PATH" || arg == ":PATH",
            (Field::Authority, "REQ") => arg == ":AUTHORITY" || arg == "HOST",
            (Field::Header(h), "REQ") => arg.split('?').next() == Some(&h.to_ascii_uppercase()),
            (Field::Response(h), "RESP" | "TRAILER") => {
                arg.split('?').next() == Some(&h.to_ascii_uppercase())
            }
            // Command arguments are upper-cased; rule names compare without case.
            (Field::Body(p), "DYNAMIC_METADATA") => {
                arg.split(':').collect::<Vec<_>>()
                    == [
                        "WASM_RATELIMIT",
                        &format!("BODY.{}", p.to_ascii_uppercase()),
                    ]
            }
            (Field::Body(p), "FILTER_STATE") => {
                arg.split(':').next()
                    == Some(&format!(
                        "WASM.WASM_RATELIMIT.BODY.{}",
                        p.to_ascii_uppercase()
                    ))
            }
            (Field::Usage(r), "DYNAMIC_METADATA") => {
                arg.split(':').collect::<Vec<_>>() == ["WASM_RATELIMIT", &r.to_ascii_uppercase()]
            }
            (Field::Usage(r), "FILTER_STATE") => {
                arg.split(':').next()
                    == Some(&format!("WASM.WASM_RATELIMIT.{}", r.to_ascii_uppercase()))
            }
            _ => false,
        }
    }
}

/// The fields a configuration's rules need, besides the start time and duration that replay
/// always reads.
pub fn needed(config: &Config) -> Vec<Field> {
    let mut out = vec![Field::StartTime, Field::Duration];
    let mut need = |f: Field| {
        if !out.contains(&f) {
            out.push(f);
        }
    };
    for rule in &config.rules {
        let m = &rule.matcher;
        if m.path.is_some() || m.path_prefix.is_some() {
            need(Field::Path);
        }
        if !m.methods.is_empty() {
            need(Field::Method);
        }
        if m.authority.is_some() {
            need(Field::Authority);
        }
        for h in &m.headers {
            need(Field::Header(h.name.clone()));
        }
        for b in &m.body {
            need(Field::Body(b.field.path.join(".")));
        }
        for part in &rule.key {
            for field in fields_of(part) {
                need(field);
            }
        }
        match &rule.cost {
            Cost::Header(h) => need(Field::Header(h.clone())),
            Cost::Response(c) => need(match &c.usage {
                Usage::Header(h) => Field::Response(h.clone()),
                Usage::BodyBytes => Field::BytesSent,
                Usage::Body(_) | Usage::Price(_) => Field::Usage(rule.name.clone()),
            }),
            Cost::Fixed(_) => {}
        }
    }
    out
}

/// Whether `field` (by [`Field::name`]) is read only as one of the parts of `first` key parts:
/// a log without it still keys those rules by their other parts.
pub fn only_an_alternative(config: &Config, field: &str) -> bool {
    let mut alone = config.clone();
    let mut in_first = false;
    for rule in &mut alone.rules {
        rule.key.retain(|part| match part {
            KeyPart::First(parts) => {
                in_first |= parts.iter().flat_map(fields_of).any(|f| f.name() == field);
                false
            }
            _ => true,
        });
    }
    in_first && !needed(&alone).iter().any(|f| f.name() == field)
}

/// The fields a key part reads (a `first` part: each of its parts').
fn fields_of(part: &KeyPart) -> Vec<Field> {
    match part {
        KeyPart::RemoteAddress(_) => vec![Field::RemoteAddress],
        KeyPart::Header(h) => vec![Field::Header(h.clone())],
        KeyPart::Bearer => vec![Field::Header("authorization".into())],
        KeyPart::Query(_) | KeyPart::Path => vec![Field::Path],
        KeyPart::Method => vec![Field::Method],
        KeyPart::Authority => vec![Field::Authority],
        KeyPart::First(parts) => parts.iter().flat_map(fields_of).collect(),
        // What the filter reported of the body (an access log holds no bodies).
        KeyPart::Body(f) => vec![Field::Body(f.path.join("."))],
    }
}

/// One request from the log.
#[derive(Clone, Debug, Default)]
pub struct Entry {
    /// When it started, ms since the epoch.
    pub start_ms: u64,
    /// How long it took, ms, if the log says.
    pub duration_ms: Option<u64>,
    /// The response body's bytes, if the log says.
    pub bytes_sent: Option<u64>,
    /// What the rules read of it.
    pub request: PlainRequest,
    /// The response header fields the rules charge from (lower-case names), and the usages
    /// the filter logged (`usage:RULE`).
    pub response: Vec<(String, Vec<u8>)>,
    /// The request body fields the filter logged: (path, value).
    pub body: Vec<(String, Vec<u8>)>,
}

impl Entry {
    /// When it ended (its start if the log has no duration).
    pub fn end_ms(&self) -> u64 {
        self.start_ms.saturating_add(self.duration_ms.unwrap_or(0))
    }
}

/// One `%COMMAND(ARG):LEN%` of a text format (upper-cased; the length is ignored).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Command {
    name: String,
    arg: Option<String>,
}

impl Command {
    /// Reads `NAME`, `NAME(ARG)` or `NAME(ARG):LEN`, with or without the `%` around it.
    fn parse(text: &str) -> Option<Command> {
        let text = text.trim().trim_matches('%');
        let name_len = text
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(text.len());
        let (name, rest) = text.split_at(name_len);
        if name.is_empty() {
            return None;
        }
        let (arg, rest) = match rest.strip_prefix('(') {
            Some(r) => {
                let (a, r) = r.split_once(')')?;
                (Some(a.to_ascii_uppercase()), r)
            }
            None => (None, rest),
        };
        let len_ok = rest.is_empty()
            || rest
                .strip_prefix(':')
                .is_some_and(|l| !l.is_empty() && l.bytes().all(|b| b.is_ascii_digit()));
        len_ok.then(|| Command {
            name: name.to_ascii_uppercase(),
            arg,
        })
    }
}

/// A text format: the literal text before the first command, then each command with the
/// literal text after it.
#[derive(Clone, Debug)]
pub struct Template {
    head: String,
    parts: Vec<(Command, String)>,
}

impl Template {
    /// Parses an Envoy format string (a trailing newline is ignored).
    pub fn parse(format: &str) -> Result<Template, String> {
        let format = format.strip_suffix('\n').unwrap_or(format);
        let format = format.strip_suffix("\\n").unwrap_or(format);
        let mut head = String::new();
        let mut parts: Vec<(Command, String)> = Vec::new();
        let mut rest = format;
        while let Some(at) = rest.find('%') {
            let (lit, from) = rest.split_at(at);
            match parts.last_mut() {
                Some((_, after)) => after.push_str(lit),
                None => head.push_str(lit),
            }
            // NAME, then (ARG) (which may hold '%': `%START_TIME(%s)%`), then :LEN, then '%'.
            let body = from.get(1..).unwrap_or("");
            let mut end = body
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .unwrap_or(body.len());
            if body.get(end..).is_some_and(|r| r.starts_with('(')) {
                let close = body.get(end..).and_then(|r| r.find(')'));
                end += close.ok_or_else(|| format!("format: unclosed ( in {from:?}"))? + 1;
            }
            if body.get(end..).is_some_and(|r| r.starts_with(':')) {
                end += 1 + body
                    .get(end + 1..)
                    .map_or(0, |r| r.bytes().take_while(u8::is_ascii_digit).count());
            }
            if !body.get(end..).is_some_and(|r| r.starts_with('%')) {
                return Err(format!("format: unterminated command at {from:?}"));
            }
            let text = body.get(..end).unwrap_or("");
            let command =
                Command::parse(text).ok_or_else(|| format!("format: bad command %{text}%"))?;
            if let Some((prev, after)) = parts.last() {
                if after.is_empty() {
                    return Err(format!(
                        "format: %{}% and %{text}% have no text between them to tell them apart",
                        prev.name
                    ));
                }
            }
            parts.push((command, String::new()));
            rest = body.get(end + 1..).unwrap_or("");
        }
        match parts.last_mut() {
            Some((_, after)) => after.push_str(rest),
            None => return Err("format: no %COMMAND% in it".into()),
        }
        Ok(Template { head, parts })
    }

    /// The index of the command `spec` names (`REQ(X-FORWARDED-FOR)`, `%DURATION%`), or of
    /// the first command that gives `field` by default.
    fn slot(&self, field: &Field, spec: Option<&str>) -> Result<Option<usize>, String> {
        if let Some(spec) = spec {
            let want = Command::parse(spec).ok_or_else(|| format!("bad format command {spec}"))?;
            return match self.parts.iter().position(|(c, _)| *c == want) {
                Some(i) => Ok(Some(i)),
                None => Err(format!(
                    "--field {}={spec}: the text format has no such command",
                    field.name()
                )),
            };
        }
        Ok(self.parts.iter().position(|(c, _)| field.given_by(c)))
    }

    /// Each command's value in `line`: each runs to the first occurrence of the text after it
    /// (the last, to the end of the line). `None` if the line does not fit the format.
    fn values<'l>(&self, line: &'l str) -> Option<Vec<&'l str>> {
        let mut rest = line.strip_prefix(self.head.as_str())?;
        let mut out = Vec::with_capacity(self.parts.len());
        for (_, after) in &self.parts {
            if after.is_empty() {
                out.push(rest);
                rest = "";
                continue;
            }
            let at = rest.find(after.as_str())?;
            let (value, next) = rest.split_at(at);
            out.push(value);
            rest = next.get(after.len()..).unwrap_or("");
        }
        rest.is_empty().then_some(out)
    }
}

/// Where each field comes from: JSON keys for JSON lines, format commands for text lines.
#[derive(Clone, Debug)]
pub struct Mapping {
    fields: Vec<Field>,
    json: Vec<Vec<String>>,
    template: Template,
    slots: Vec<Option<usize>>,
}

/// Why a line could not be read.
pub type BadLine = &'static str;

impl Mapping {
    /// A mapping for `fields`, with the text `format` (Envoy's) and `--field FIELD=KEY`
    /// overrides: a JSON key, or a text format command in `%…%`.
    pub fn new(
        fields: Vec<Field>,
        format: &str,
        overrides: &[(Field, String)],
    ) -> Result<Mapping, String> {
        let template = Template::parse(format)?;
        let mut fields = fields;
        for (f, _) in overrides {
            if !fields.contains(f) {
                fields.push(f.clone());
            }
        }
        let spec = |f: &Field| {
            overrides
                .iter()
                .rev()
                .find(|(o, _)| o == f)
                .map(|(_, k)| k.as_str())
        };
        // A value in %…% is a text format command; anything else is a JSON key.
        let command =
            |f: &Field| spec(f).filter(|s| s.len() > 1 && s.starts_with('%') && s.ends_with('%'));
        let json = fields
            .iter()
            .map(|f| match spec(f) {
                Some(k) if command(f).is_none() => vec![k.to_string()],
                _ => f.json_keys(),
            })
            .collect();
        let slots = fields
            .iter()
            .map(|f| template.slot(f, command(f)))
            .collect::<Result<_, String>>()?;
        Ok(Mapping {
            fields,
            json,
            template,
            slots,
        })
    }

    /// The fields read, in the order [`Mapping::parse`] reports which were found.
    pub fn fields(&self) -> &[Field] {
        &self.fields
    }

    /// Where a field is looked up, for messages: its JSON keys and its format command.
    pub fn source(&self, i: usize) -> String {
        let keys = self.json.get(i).map(|k| k.join(" or ")).unwrap_or_default();
        let command = self
            .slots
            .get(i)
            .copied()
            .flatten()
            .and_then(|s| self.template.parts.get(s))
            .map(|(c, _)| match &c.arg {
                Some(a) => format!("%{}({a})%", c.name),
                None => format!("%{}%", c.name),
            });
        match command {
            Some(c) => format!("JSON key {keys}, text {c}"),
            None => format!("JSON key {keys}, not in the text format"),
        }
    }

    /// Reads one line (JSON if it starts with `{`, else the text format); `found[i]` is set
    /// for each field present.
    pub fn parse(&self, line: &str, found: &mut [bool]) -> Result<Entry, BadLine> {
        let line = line.trim_end_matches(['\r', '\n']);
        if line.trim_start().starts_with('{') {
            let map: serde_json::Map<String, Value> =
                serde_json::from_str(line).map_err(|_| "not a JSON object")?;
            self.build(found, |i| {
                let keys = self.json.get(i)?;
                keys.iter().find_map(|k| match map.get(k)? {
                    Value::Null => None,
                    Value::String(s) => Some(Cow::Borrowed(s.as_str())),
                    other => Some(Cow::Owned(other.to_string())),
                })
            })
        } else {
            let values = self
                .template
                .values(line)
                .ok_or("does not match the text format")?;
            self.build(found, |i| {
                let slot = (*self.slots.get(i)?)?;
                values.get(slot).map(|v| Cow::Borrowed(*v))
            })
        }
    }

    fn build<'v>(
        &self,
        found: &mut [bool],
        value: impl Fn(usize) -> Option<Cow<'v, str>>,
    ) -> Result<Entry, BadLine> {
        let mut e = Entry::default();
        let mut start = None;
        for (i, field) in self.fields.iter().enumerate() {
            // Envoy writes `-` for what it does not have.
            let Some(v) = value(i).filter(|v| !v.is_empty() && v != "-") else {
                continue;
            };
            if let Some(f) = found.get_mut(i) {
                *f = true;
            }
            match field {
                Field::StartTime => {
                    start = Some(parse_time(&v).ok_or("start time not understood")?);
                }
                Field::RemoteAddress => {
                    // A list (X-Forwarded-For) gives its last address: the one Envoy takes
                    // as the client's by default (`xff_num_trusted_hops: 0`).
                    let last = v.rsplit(',').next().unwrap_or("").trim();
                    e.request.source_address = Some(last.to_string());
                }
                Field::Method => e.request.method = Some(v.into_owned()),
                Field::Path => e.request.path = Some(v.into_owned()),
                Field::Authority => e.request.authority = Some(v.into_owned()),
                Field::Duration => e.duration_ms = v.trim().parse().ok(),
                Field::BytesSent => e.bytes_sent = v.trim().parse().ok(),
                Field::Header(h) => e.request.headers.push((h.clone(), v.as_bytes().to_vec())),
                Field::Response(h) => e.response.push((h.clone(), v.as_bytes().to_vec())),
                Field::Usage(r) => e
                    .response
                    .push((format!("usage:{r}"), v.as_bytes().to_vec())),
                Field::Body(p) => e.body.push((p.clone(), v.as_bytes().to_vec())),
            }
        }
        e.start_ms = start.ok_or("no start time")?;
        Ok(e)
    }
}

/// A time as Envoy writes it, in ms since the epoch: RFC 3339 (`%START_TIME%`:
/// `2026-11-23T03:54:01.951Z`, any fraction, `Z` or an offset), or a number of seconds (with a
/// fraction), ms, µs or ns since the epoch, told apart by their size.
pub fn parse_time(text: &str) -> Option<u64> {
    let t = text.trim();
    if t.bytes().all(|b| b.is_ascii_digit() || b == b'.') {
        return parse_epoch(t);
    }
    let b = t.as_bytes();
    let num = |from: usize, len: usize| -> Option<i64> {
        let s = t.get(from..from + len)?;
        s.bytes()
            .all(|c| c.is_ascii_digit())
            .then(|| s.parse().ok())?
    };
    if b.get(4) != Some(&b'-') || b.get(7) != Some(&b'-') || b.get(13) != Some(&b':') {
        return None;
    }
    if !matches!(b.get(10), Some(b'T' | b't' | b' ')) || b.get(16) != Some(&b':') {
        return None;
    }
    let (year, month, day) = (num(0, 4)?, num(5, 2)?, num(8, 2)?);
    let (hour, minute, second) = (num(11, 2)?, num(14, 2)?, num(17, 2)?);
    if !(1..=12).contains(&month) || !(1..=31).contains(&day) || hour > 23 || minute > 59 {
        return None;
    }
    if second > 60 {
        return None;
    }
    let mut rest = t.get(19..)?;
    let mut ms = 0i64;
    if let Some(frac) = rest.strip_prefix('.') {
        let digits = frac.bytes().take_while(u8::is_ascii_digit).count();
        if digits == 0 {
            return None;
        }
        let (d, r) = frac.split_at(digits);
        let first3: String = d.chars().chain("000".chars()).take(3).collect();
        ms = first3.parse().ok()?;
        rest = r;
    }
    let offset_min = match rest {
        "" | "Z" | "z" => 0,
        _ => {
            let sign = match rest.as_bytes().first() {
                Some(b'+') => 1,
                Some(b'-') => -1,
                _ => return None,
            };
            let hm = rest.get(1..)?.replace(':', "");
            if hm.len() != 4 || !hm.bytes().all(|c| c.is_ascii_digit()) {
                return None;
            }
            let h: i64 = hm.get(..2)?.parse().ok()?;
            let m: i64 = hm.get(2..)?.parse().ok()?;
            sign * (h * 60 + m)
        }
    };
    let days = days_from_civil(year, month, day);
    let secs = days * 86_400 + hour * 3600 + minute * 60 + second - offset_min * 60;
    u64::try_from(secs * 1000 + ms).ok()
}

fn parse_epoch(t: &str) -> Option<u64> {
    let (int, frac) = t.split_once('.').unwrap_or((t, ""));
    let n: u64 = int.parse().ok()?;
    if !frac.is_empty() || int.len() <= 11 {
        // Seconds, perhaps with a fraction.
        let first3: String = frac.chars().chain("000".chars()).take(3).collect();
        let ms: u64 = first3.parse().ok()?;
        return n.checked_mul(1000)?.checked_add(ms);
    }
    Some(match int.len() {
        12..=14 => n,
        15..=17 => n / 1000,
        _ => n / 1_000_000,
    })
}

/// Days from 1970-01-01 to a proleptic Gregorian date (Howard Hinnant's algorithm).
fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// A UTC time, ms since the epoch, as RFC 3339 with ms (`2026-11-23T03:54:01.951Z`).
pub fn format_time(ms: u64) -> String {
    let secs = i64::try_from(ms / 1000).unwrap_or(i64::MAX);
    let days = secs.div_euclid(86_400);
    let sod = secs.rem_euclid(86_400);
    // Inverse of days_from_civil (Howard Hinnant's civil_from_days).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}.{:03}Z",
        sod / 3600,
        sod % 3600 / 60,
        sod % 60,
        ms % 1000
    )
}

/// Reads the next line of `reader` into `buf` (without its newline). `Ok(None)` at the end;
/// `Ok(Some(false))` for a line longer than [`MAX_LINE`], which is skipped whole (`buf` is left
/// empty) so a log without newlines cannot take unbounded memory.
pub fn read_line(reader: &mut impl BufRead, buf: &mut Vec<u8>) -> io::Result<Option<bool>> {
    buf.clear();
    let mut any = false;
    let mut too_long = false;
    loop {
        let available = reader.fill_buf()?;
        if available.is_empty() {
            return Ok(any.then_some(!too_long));
        }
        any = true;
        let newline = available.iter().position(|&b| b == b'\n');
        let chunk = available
            .get(..newline.unwrap_or(available.len()))
            .unwrap_or(available);
        if !too_long {
            if buf.len() + chunk.len() > MAX_LINE {
                too_long = true;
                buf.clear();
            } else {
                buf.extend_from_slice(chunk);
            }
        }
        let used = chunk.len() + usize::from(newline.is_some());
        reader.consume(used);
        if newline.is_some() {
            return Ok(Some(!too_long));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fields() -> Vec<Field> {
        vec![
            Field::StartTime,
            Field::Duration,
            Field::RemoteAddress,
            Field::Method,
            Field::Path,
            Field::Authority,
            Field::BytesSent,
            Field::Header("x-api-key".into()),
            Field::Header("x-forwarded-for".into()),
            Field::Response("x-usage-tokens".into()),
        ]
    }

    fn mapping(overrides: &[(&str, &str)]) -> Mapping {
        let o: Vec<(Field, String)> = overrides
            .iter()
            .map(|(f, k)| (Field::parse(f).unwrap(), k.to_string()))
            .collect();
        Mapping::new(fields(), ENVOY_DEFAULT_FORMAT, &o).unwrap()
    }

    fn parse(m: &Mapping, line: &str) -> Result<Entry, BadLine> {
        let mut found = vec![false; m.fields().len()];
        m.parse(line, &mut found)
    }

    #[test]
    fn times() {
        assert_eq!(
            parse_time("2026-11-23T03:54:01.951Z"),
            Some(1_795_406_041_951)
        );
        assert_eq!(parse_time("1970-01-01T00:00:00Z"), Some(0));
        assert_eq!(parse_time("2000-02-29T12:00:00.5Z"), Some(951_825_600_500));
        assert_eq!(
            parse_time("2026-11-23T04:54:01.951123+01:00"),
            Some(1_795_406_041_951)
        );
        assert_eq!(parse_time("1795406041"), Some(1_795_406_041_000));
        assert_eq!(parse_time("1795406041.25"), Some(1_795_406_041_250));
        assert_eq!(parse_time("1795406041951"), Some(1_795_406_041_951));
        assert_eq!(parse_time("1795406041951000"), Some(1_795_406_041_951));
        assert_eq!(parse_time("1795406041951000000"), Some(1_795_406_041_951));
        for bad in [
            "",
            "-",
            "yesterday",
            "2026-13-01T00:00:00Z",
            "2026-11-23T03:54:01.Z",
        ] {
            assert_eq!(parse_time(bad), None, "{bad}");
        }
        for ms in [0, 951_825_600_500, 1_795_406_041_951, 4_102_444_800_000] {
            assert_eq!(parse_time(&format_time(ms)), Some(ms));
        }
        assert_eq!(format_time(1_795_406_041_951), "2026-11-23T03:54:01.951Z");
    }

    #[test]
    fn envoys_default_text_format() {
        // Lines as Envoy 1.40 wrote them with no log_format (a user agent with quotes in it).
        let m = mapping(&[]);
        let e = parse(
            &m,
            r#"[2026-11-23T03:54:01.951Z] "GET /api/x?user=bob HTTP/1.1" 200 - 0 3 7 - "-" ""quoted" agent" "4d3f14b2" "localhost:38751" "-""#,
        )
        .unwrap();
        assert_eq!(e.start_ms, 1_795_406_041_951);
        assert_eq!(e.duration_ms, Some(7));
        assert_eq!(e.bytes_sent, Some(3));
        assert_eq!(e.end_ms(), 1_795_406_041_958);
        assert_eq!(e.request.method.as_deref(), Some("GET"));
        assert_eq!(e.request.path.as_deref(), Some("/api/x?user=bob"));
        assert_eq!(e.request.authority.as_deref(), Some("localhost:38751"));
        // The default format has no client address and no x-api-key.
        assert_eq!(e.request.source_address, None);
        assert!(e.request.headers.is_empty());
        let e = parse(
            &m,
            r#"[2026-11-23T03:54:01.975Z] "POST /p HTTP/1.1" 429 - 0 3 0 - "1.2.3.4, 10.0.0.1" "curl/7.88.1" "dbaf" "localhost" "-""#,
        )
        .unwrap();
        assert_eq!(
            e.request.headers,
            [("x-forwarded-for".to_string(), b"1.2.3.4, 10.0.0.1".to_vec())]
        );
        // Mapped to the address: the list's last entry, as Envoy reads it by default.
        let m = mapping(&[("remote_address", "%REQ(X-FORWARDED-FOR)%")]);
        let e = parse(
            &m,
            r#"[2026-11-23T03:54:01.975Z] "POST /p HTTP/1.1" 429 - 0 3 0 - "1.2.3.4, 10.0.0.1" "curl/7.88.1" "dbaf" "localhost" "-""#,
        )
        .unwrap();
        assert_eq!(e.request.source_address.as_deref(), Some("10.0.0.1"));
    }

    #[test]
    fn custom_text_formats() {
        let o = vec![(
            Field::Header("x-api-key".into()),
            "%REQ(X-KEY)%".to_string(),
        )];
        let m = Mapping::new(
            fields(),
            "%START_TIME(%s.%3f)% %DOWNSTREAM_REMOTE_ADDRESS% %REQ(:METHOD)% %REQ(:PATH):100% key=%REQ(X-KEY)% %RESP(X-USAGE-TOKENS)%\n",
            &o,
        )
        .unwrap();
        let mut found = vec![false; m.fields().len()];
        let e = m
            .parse("1795406041.951 [::1]:5000 GET /a key=k1 1200", &mut found)
            .unwrap();
        assert_eq!(e.start_ms, 1_795_406_041_951);
        assert_eq!(e.request.source_address.as_deref(), Some("[::1]:5000"));
        assert_eq!(e.request.path.as_deref(), Some("/a"));
        assert_eq!(e.request.headers, [("x-api-key".into(), b"k1".to_vec())]);
        assert_eq!(e.response, [("x-usage-tokens".into(), b"1200".to_vec())]);
        assert_eq!(e.duration_ms, None);
        let names: Vec<String> = m
            .fields()
            .iter()
            .zip(&found)
            .filter(|(_, f)| **f)
            .map(|(f, _)| f.name())
            .collect();
        assert_eq!(
            names,
            [
                "start_time",
                "remote_address",
                "method",
                "path",
                "header:x-api-key",
                "response:x-usage-tokens"
            ]
        );
        assert!(
            m.source(1).ends_with("not in the text format"),
            "{}",
            m.source(1)
        );
        // Formats replay cannot read, and commands that are not there.
        assert!(Template::parse("%START_TIME%%DURATION%").is_err());
        assert!(Template::parse("no commands").is_err());
        assert!(Template::parse("%START_TIME").is_err());
        let o = vec![(Field::RemoteAddress, "%REQ(X-REAL-IP)%".to_string())];
        assert!(Mapping::new(fields(), ENVOY_DEFAULT_FORMAT, &o).is_err());
    }

    #[test]
    fn json_lines_by_default_keys_and_mapped_keys() {
        let m = mapping(&[]);
        // As Envoy 1.40 writes json_format: numbers stay numbers, missing headers are null.
        let e = parse(
            &m,
            r#"{"authority":"localhost:38751","bytes_sent":3,"downstream_remote_address":"127.0.0.1:44676","duration":12,"method":"GET","path":"/api/x?user=bob","start_time":"2026-11-23T03:54:01.951Z","x-api-key":"k1","x_forwarded_for":null,"x-usage-tokens":"40"}"#,
        )
        .unwrap();
        assert_eq!(e.start_ms, 1_795_406_041_951);
        assert_eq!(e.duration_ms, Some(12));
        assert_eq!(e.bytes_sent, Some(3));
        assert_eq!(e.request.source_address.as_deref(), Some("127.0.0.1:44676"));
        assert_eq!(e.request.headers, [("x-api-key".into(), b"k1".to_vec())]);
        assert_eq!(e.response, [("x-usage-tokens".into(), b"40".to_vec())]);
        let m = mapping(&[("remote_address", "client"), ("start_time", "ts")]);
        let e = parse(
            &m,
            r#"{"client": "10.1.2.3", "ts": 1795406041951, "x_forwarded_for": "9.9.9.9"}"#,
        )
        .unwrap();
        assert_eq!(e.request.source_address.as_deref(), Some("10.1.2.3"));
        assert_eq!(e.start_ms, 1_795_406_041_951);
        assert_eq!(
            e.request.headers,
            [("x-forwarded-for".into(), b"9.9.9.9".to_vec())]
        );
    }

    #[test]
    fn the_usage_the_filter_logged_is_read_from_either_build() {
        let fields = vec![
            Field::StartTime,
            Field::Usage("tokens".into()),
            Field::Usage("other".into()),
        ];
        let usage = |e: &Entry| {
            e.response
                .iter()
                .map(|(k, v)| (k.clone(), String::from_utf8_lossy(v).into_owned()))
                .collect::<Vec<_>>()
        };
        // JSON: by the rule's name (or usage_RULE); a number as the native build logs it.
        let m = Mapping::new(fields.clone(), ENVOY_DEFAULT_FORMAT, &[]).unwrap();
        let mut found = vec![false; 3];
        let e = m
            .parse(
                r#"{"start_time": "1795406041", "tokens": 561, "usage_other": "7"}"#,
                &mut found,
            )
            .unwrap();
        assert_eq!(
            usage(&e),
            [
                ("usage:tokens".into(), "561".into()),
                ("usage:other".into(), "7".into())
            ]
        );
        // Text: the native build's metadata, the wasm build's filter state.
        let m = Mapping::new(
            fields,
            "%START_TIME(%s)% %DYNAMIC_METADATA(wasm_ratelimit:tokens)% %FILTER_STATE(wasm.wasm_ratelimit.other:PLAIN)%\n",
            &[],
        )
        .unwrap();
        let mut found = vec![false; 3];
        let e = m.parse("1795406041 561 7", &mut found).unwrap();
        assert_eq!(found, [true, true, true]);
        assert_eq!(
            usage(&e),
            [
                ("usage:tokens".into(), "561".into()),
                ("usage:other".into(), "7".into())
            ]
        );
    }

    #[test]
    fn the_body_fields_the_filter_logged_are_read_from_either_build() {
        let fields = vec![
            Field::StartTime,
            Field::Body("model".into()),
            Field::Body("metadata.user_id".into()),
        ];
        let body = |e: &Entry| {
            e.body
                .iter()
                .map(|(k, v)| (k.clone(), String::from_utf8_lossy(v).into_owned()))
                .collect::<Vec<_>>()
        };
        let want: [(String, String); 2] = [
            ("model".into(), "gpt-4o".into()),
            ("metadata.user_id".into(), "u1".into()),
        ];
        // JSON: body.PATH, or the path itself.
        let m = Mapping::new(fields.clone(), ENVOY_DEFAULT_FORMAT, &[]).unwrap();
        let mut found = vec![false; 3];
        let e = m
            .parse(
                r#"{"start_time": "1795406041", "body.model": "gpt-4o", "metadata.user_id": "u1"}"#,
                &mut found,
            )
            .unwrap();
        assert_eq!(body(&e), want);
        // Text: the native build's metadata, the wasm build's filter state.
        let m = Mapping::new(
            fields,
            "%START_TIME(%s)% %DYNAMIC_METADATA(wasm_ratelimit:body.model)% %FILTER_STATE(wasm.wasm_ratelimit.body.metadata.user_id:PLAIN)%\n",
            &[],
        )
        .unwrap();
        let mut found = vec![false; 3];
        let e = m.parse("1795406041 gpt-4o u1", &mut found).unwrap();
        assert_eq!(found, [true, true, true]);
        assert_eq!(body(&e), want);
        assert_eq!(
            Field::parse("body:model"),
            Some(Field::Body("model".into()))
        );
    }

    #[test]
    fn bad_lines_say_why() {
        let m = mapping(&[]);
        assert_eq!(parse(&m, "{not json").err(), Some("not a JSON object"));
        assert_eq!(parse(&m, r#"{"path": "/"}"#).err(), Some("no start time"));
        assert_eq!(
            parse(&m, r#"{"start_time": "last tuesday"}"#).err(),
            Some("start time not understood")
        );
        assert_eq!(
            parse(&m, "GET / 200").err(),
            Some("does not match the text format")
        );
        assert_eq!(
            parse(
                &m,
                r#"[-] "GET / HTTP/1.1" 200 - 0 3 0 - "-" "-" "-" "-" "-""#
            )
            .err(),
            Some("no start time")
        );
    }

    #[test]
    fn needed_fields_follow_the_rules() {
        let config = Config::parse(
            br#"{"rules": [
                {"name": "a", "match": {"path_prefix": "/api/", "headers": [{"name": "x-tier", "value": "free"}]},
                 "key": ["remote_address", "query:user"], "rate_limit": {"requests_per_unit": 5, "unit": "minute"}},
                {"name": "b", "key": ["header:x-api-key"], "rate_limit": {"requests_per_unit": 5000, "unit": "minute"},
                 "cost": {"response": "header:x-usage-tokens"}}]}"#,
        )
        .unwrap();
        let names: Vec<String> = needed(&config).iter().map(Field::name).collect();
        assert_eq!(
            names,
            [
                "start_time",
                "duration",
                "path",
                "header:x-tier",
                "remote_address",
                "header:x-api-key",
                "response:x-usage-tokens"
            ]
        );
        for f in needed(&config) {
            assert_eq!(Field::parse(&f.name()), Some(f));
        }
        assert_eq!(Field::parse("header:"), None);
        assert_eq!(Field::parse("client"), None);
    }

    #[test]
    fn long_lines_are_skipped_whole() {
        let mut input = Vec::new();
        input.extend_from_slice(b"first\r\n");
        input.extend(std::iter::repeat_n(b'x', MAX_LINE + 10));
        input.extend_from_slice(b"\nlast");
        let mut reader = io::BufReader::with_capacity(4096, input.as_slice());
        let mut buf = Vec::new();
        assert_eq!(read_line(&mut reader, &mut buf).unwrap(), Some(true));
        assert_eq!(buf, b"first\r");
        assert_eq!(read_line(&mut reader, &mut buf).unwrap(), Some(false));
        assert!(buf.is_empty());
        assert_eq!(read_line(&mut reader, &mut buf).unwrap(), Some(true));
        assert_eq!(buf, b"last");
        assert_eq!(read_line(&mut reader, &mut buf).unwrap(), None);
    }
}
