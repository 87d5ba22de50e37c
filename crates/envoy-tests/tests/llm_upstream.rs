//! The LLM-like test upstream (`common::llm`) speaks as the real APIs do: these tests talk to it
//! over TCP, without Envoy, and check each API's JSON and stream shapes, where the usage is
//! (and is not), and every transport the tests of the filter will lean on: split bodies, CRLF,
//! multi-line data, resets, slow streams, gzip, error statuses, and a 100 MB stream served in
//! bounded memory.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod common;

use common::llm::{
    body_bytes, delta_literal, gunzip_stored, sse_events, text, wire_body, Api, BodyHash, Exchange,
    LlmClient, LlmUpstream, Mode, Reply, Spec, MAX_CHUNK,
};
use serde_json::Value;
use std::time::{Duration, Instant};

const MAX_TOKENS: u64 = 256;

/// POSTs the API's usual request for `mode` with `headers`; the reply, the spec the upstream
/// answered, and its record. Checks the reply against [`wire_body`] and the record.
fn ask(up: &LlmUpstream, api: Api, mode: Mode, headers: &[(&str, &str)]) -> (Reply, Spec) {
    let (reply, spec, _) = ask_full(up, api, mode, true, headers);
    (reply, spec)
}

fn ask_full(
    up: &LlmUpstream,
    api: Api,
    mode: Mode,
    include_usage: bool,
    headers: &[(&str, &str)],
) -> (Reply, Spec, Exchange) {
    let path = api.path(mode);
    let body = api.request_body(mode, include_usage, MAX_TOKENS);
    let reply = common::llm::post(up.addr, &path, headers, body.as_bytes()).unwrap();
    let owned: Vec<(String, String)> = headers
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    let spec = Spec::from_request(&path, &owned, body.as_bytes()).unwrap();
    let ex = up
        .wait_sent(reply.seq().unwrap(), Duration::from_secs(5))
        .unwrap();
    assert_eq!(ex.spec.as_ref(), Some(&spec));
    assert_eq!(ex.request.path, path);
    assert_eq!(ex.request.body, body.as_bytes());
    assert_eq!(ex.request.body_len, body.len() as u64);
    assert_eq!(ex.max_tokens, Some(MAX_TOKENS), "{api:?}");
    let sent = ex.sent.as_ref().unwrap();
    assert_eq!(sent.status, reply.status);
    assert_eq!(sent.bytes, reply.len);
    assert_eq!(sent.hash, reply.hash);
    if reply.complete {
        assert!(sent.complete);
        let gzip = ex.header("x-test-encoding") == Some("gzip");
        assert_eq!(
            reply.body,
            wire_body(&spec, gzip),
            "{api:?} {mode:?} {headers:?}"
        );
        assert_eq!(sent.body, reply.body);
    }
    (reply, spec, ex)
}

/// The JSON documents of a reply (stream events' data, or the one document).
fn documents(reply: &Reply, spec: &Spec) -> Vec<Value> {
    match spec.mode {
        Mode::Json => vec![reply.json()],
        Mode::Sse => reply.events().iter().filter_map(|e| e.json()).collect(),
        Mode::JsonArray => reply.json().as_array().unwrap().clone(),
    }
}

/// Every key in a JSON value, at any depth.
fn keys(v: &Value, out: &mut Vec<String>) {
    match v {
        Value::Object(m) => {
            for (k, v) in m {
                out.push(k.clone());
                keys(v, out);
            }
        }
        Value::Array(a) => a.iter().for_each(|v| keys(v, out)),
        _ => {}
    }
}

fn str_at<'a>(v: &'a Value, pointer: &str) -> &'a str {
    v.pointer(pointer)
        .and_then(Value::as_str)
        .unwrap_or_else(|| panic!("no string at {pointer} in {v}"))
}

fn u64_at(v: &Value, pointer: &str) -> u64 {
    v.pointer(pointer)
        .and_then(Value::as_u64)
        .unwrap_or_else(|| panic!("no number at {pointer} in {v}"))
}

#[test]
fn the_text_has_multibyte_utf8_and_escapes() {
    let spec = Spec::new(Api::Chat, Mode::Sse);
    let all: String = (0..spec.events).map(|i| delta_literal(&spec, i)).collect();
    for escape in [
        "\\u00e9",
        "\\ud83d\\ude00",
        "\\\"",
        "\\\\",
        "\\n",
        "\\t",
        "\\/",
    ] {
        assert!(all.contains(escape), "{escape}");
    }
    let t = text(&spec);
    for c in ['é', 'ö', '✓', '😀', '"', '\\', '\n', '\t', '/'] {
        assert!(t.contains(c), "{c:?} in {t:?}");
    }
    // Padding is exact, and always a valid JSON string.
    for pad in 0..80 {
        let spec = Spec {
            pad: Some(pad),
            ..Spec::new(Api::Messages, Mode::Sse)
        };
        for i in 0..15 {
            let lit = delta_literal(&spec, i);
            assert_eq!(lit.len(), pad);
            serde_json::from_str::<String>(&format!("\"{lit}\"")).unwrap();
        }
    }
    // A body's hash does not depend on how it was cut.
    let bytes = body_bytes(&Spec::new(Api::Gemini, Mode::Json));
    let whole = common::llm::hash(&bytes);
    for cut in [1, 3, 7, 8, 9, 100] {
        let mut h = BodyHash::default();
        bytes.chunks(cut).for_each(|c| h.update(c));
        assert_eq!(h.value(), whole, "{cut}");
    }
    assert_ne!(common::llm::hash(&bytes[1..]), whole);
    assert_ne!(common::llm::hash(b"a"), common::llm::hash(b"a\0"));
    // The same spec gives the same bytes.
    for api in Api::ALL {
        for mode in [Mode::Json, Mode::Sse, Mode::JsonArray] {
            let spec = Spec::new(api, mode);
            assert_eq!(body_bytes(&spec), body_bytes(&spec));
        }
    }
}

#[test]
fn json_answers_carry_the_usage_where_each_api_puts_it() {
    let up = LlmUpstream::start();
    let figures = [
        ("x-test-input-tokens", "100"),
        ("x-test-output-tokens", "23"),
    ];
    for api in Api::ALL {
        let (reply, spec) = ask(&up, api, Mode::Json, &figures);
        assert_eq!(reply.status, 200);
        assert_eq!(reply.header("content-type"), Some("application/json"));
        assert_eq!(
            reply.header("content-length"),
            Some(&*reply.len.to_string())
        );
        assert_eq!(reply.chunks, 0);
        let v = reply.json();
        let t = text(&spec);
        match api {
            Api::Chat => {
                assert_eq!(str_at(&v, "/object"), "chat.completion");
                assert_eq!(str_at(&v, "/choices/0/message/content"), t);
                assert_eq!(u64_at(&v, "/usage/prompt_tokens"), 100);
                assert_eq!(u64_at(&v, "/usage/completion_tokens"), 23);
                assert_eq!(u64_at(&v, "/usage/total_tokens"), 123);
            }
            Api::Responses => {
                assert_eq!(str_at(&v, "/object"), "response");
                assert_eq!(str_at(&v, "/output/0/content/0/text"), t);
                assert_eq!(u64_at(&v, "/usage/input_tokens"), 100);
                assert_eq!(u64_at(&v, "/usage/output_tokens"), 23);
                assert_eq!(u64_at(&v, "/usage/total_tokens"), 123);
            }
            Api::Messages => {
                assert_eq!(str_at(&v, "/type"), "message");
                assert_eq!(str_at(&v, "/model"), "claude-sonnet-4-20250514");
                assert_eq!(str_at(&v, "/content/0/text"), t);
                assert_eq!(u64_at(&v, "/usage/input_tokens"), 100);
                assert_eq!(u64_at(&v, "/usage/output_tokens"), 23);
            }
            Api::Gemini => {
                assert!(reply.body.starts_with(b"{\n  \"candidates\": ["));
                assert_eq!(str_at(&v, "/candidates/0/content/parts/0/text"), t);
                assert_eq!(u64_at(&v, "/usageMetadata/promptTokenCount"), 100);
                assert_eq!(u64_at(&v, "/usageMetadata/candidatesTokenCount"), 23);
                assert_eq!(u64_at(&v, "/usageMetadata/totalTokenCount"), 123);
            }
        }
    }
}

#[test]
fn chat_streams_carry_usage_only_when_asked() {
    let up = LlmUpstream::start();
    let headers = [
        ("x-test-input-tokens", "40"),
        ("x-test-output-tokens", "2"),
        ("x-test-events", "4"),
    ];
    let (reply, spec, _) = ask_full(&up, Api::Chat, Mode::Sse, true, &headers);
    assert_eq!(reply.header("content-type"), Some("text/event-stream"));
    assert_eq!(reply.header("transfer-encoding"), Some("chunked"));
    let events = reply.events();
    // Role, 4 contents, finish, usage, [DONE]: one chunk each.
    assert_eq!(events.len(), 8);
    assert_eq!(reply.chunks, 8);
    assert!(events.iter().all(|e| e.event.is_none()));
    assert_eq!(events[7].data, "[DONE]");
    let docs: Vec<Value> = events[..7].iter().map(|e| e.json().unwrap()).collect();
    assert!(docs
        .iter()
        .all(|d| str_at(d, "/object") == "chat.completion.chunk"));
    assert_eq!(str_at(&docs[0], "/choices/0/delta/role"), "assistant");
    let content: String = docs[1..5]
        .iter()
        .map(|d| str_at(d, "/choices/0/delta/content"))
        .collect();
    assert_eq!(content, text(&spec));
    assert_eq!(str_at(&docs[5], "/choices/0/finish_reason"), "stop");
    for d in &docs[..6] {
        assert_eq!(d.get("usage"), Some(&Value::Null), "{d}");
    }
    let last = &docs[6];
    assert_eq!(last["choices"], Value::Array(vec![]));
    assert_eq!(u64_at(last, "/usage/prompt_tokens"), 40);
    assert_eq!(u64_at(last, "/usage/completion_tokens"), 2);
    assert_eq!(u64_at(last, "/usage/total_tokens"), 42);

    // Without include_usage: no usage key anywhere, and no usage chunk.
    let (reply, _, _) = ask_full(&up, Api::Chat, Mode::Sse, false, &headers);
    let events = reply.events();
    assert_eq!(events.len(), 7);
    assert_eq!(events[6].data, "[DONE]");
    for e in &events[..6] {
        assert!(e.json().unwrap().get("usage").is_none());
    }
}

#[test]
fn responses_streams_end_with_the_usage_in_response_completed() {
    let up = LlmUpstream::start();
    let headers = [("x-test-input-tokens", "7"), ("x-test-output-tokens", "9")];
    let (reply, spec) = ask(&up, Api::Responses, Mode::Sse, &headers);
    let events = reply.events();
    let names: Vec<&str> = events.iter().map(|e| e.event.as_deref().unwrap()).collect();
    let mut expected = vec![
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ];
    expected.extend(["response.output_text.delta"; 5]);
    expected.extend([
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]);
    assert_eq!(names, expected);
    let docs: Vec<Value> = events.iter().map(|e| e.json().unwrap()).collect();
    for (n, (d, name)) in docs.iter().zip(&names).enumerate() {
        assert_eq!(str_at(d, "/type"), *name);
        assert_eq!(u64_at(d, "/sequence_number"), n as u64);
    }
    assert_eq!(docs[0].pointer("/response/usage"), Some(&Value::Null));
    let deltas: String = docs[4..9].iter().map(|d| str_at(d, "/delta")).collect();
    assert_eq!(deltas, text(&spec));
    assert_eq!(str_at(&docs[9], "/text"), text(&spec));
    let done = &docs[12];
    assert_eq!(str_at(done, "/response/status"), "completed");
    assert_eq!(
        str_at(done, "/response/output/0/content/0/text"),
        text(&spec)
    );
    assert_eq!(u64_at(done, "/response/usage/input_tokens"), 7);
    assert_eq!(u64_at(done, "/response/usage/output_tokens"), 9);
    assert_eq!(u64_at(done, "/response/usage/total_tokens"), 16);
}

#[test]
fn anthropic_streams_split_the_usage_between_start_and_delta() {
    let up = LlmUpstream::start();
    let headers = [
        ("x-test-input-tokens", "25"),
        ("x-test-output-tokens", "15"),
        ("x-test-events", "3"),
    ];
    let (reply, spec) = ask(&up, Api::Messages, Mode::Sse, &headers);
    let events = reply.events();
    let names: Vec<&str> = events.iter().map(|e| e.event.as_deref().unwrap()).collect();
    assert_eq!(
        names,
        [
            "message_start",
            "content_block_start",
            "ping",
            "content_block_delta",
            "content_block_delta",
            "content_block_delta",
            "content_block_stop",
            "message_delta",
            "message_stop"
        ]
    );
    let docs: Vec<Value> = events.iter().map(|e| e.json().unwrap()).collect();
    for (d, name) in docs.iter().zip(&names) {
        assert_eq!(str_at(d, "/type"), *name);
    }
    assert_eq!(u64_at(&docs[0], "/message/usage/input_tokens"), 25);
    assert_eq!(u64_at(&docs[0], "/message/usage/output_tokens"), 1);
    let deltas: String = docs[3..6]
        .iter()
        .map(|d| str_at(d, "/delta/text"))
        .collect();
    assert_eq!(deltas, text(&spec));
    assert_eq!(u64_at(&docs[7], "/usage/output_tokens"), 15);
    assert!(docs[7].pointer("/usage/input_tokens").is_none());
}

#[test]
fn gemini_streams_repeat_cumulative_usage() {
    let up = LlmUpstream::start();
    let headers = [
        ("x-test-input-tokens", "8"),
        ("x-test-output-tokens", "30"),
        ("x-test-events", "4"),
    ];
    for mode in [Mode::Sse, Mode::JsonArray] {
        let (reply, spec) = ask(&up, Api::Gemini, mode, &headers);
        let expected_type = if mode == Mode::Sse {
            "text/event-stream"
        } else {
            "application/json"
        };
        assert_eq!(reply.header("content-type"), Some(expected_type));
        let docs = documents(&reply, &spec);
        assert_eq!(docs.len(), 4);
        let mut before = 0;
        for d in &docs {
            let c = u64_at(d, "/usageMetadata/candidatesTokenCount");
            assert!(c >= before);
            before = c;
            assert_eq!(u64_at(d, "/usageMetadata/promptTokenCount"), 8);
            assert_eq!(u64_at(d, "/usageMetadata/totalTokenCount"), 8 + c);
        }
        assert_eq!(before, 30);
        assert_eq!(str_at(&docs[3], "/candidates/0/finishReason"), "STOP");
        let t: String = docs
            .iter()
            .map(|d| str_at(d, "/candidates/0/content/parts/0/text"))
            .collect();
        assert_eq!(t, text(&spec));
    }
}

#[test]
fn no_usage_means_no_usage_key_anywhere() {
    let up = LlmUpstream::start();
    for api in Api::ALL {
        for mode in [Mode::Json, Mode::Sse] {
            let (reply, spec) = ask(&up, api, mode, &[("x-test-no-usage", "1")]);
            assert_eq!(reply.status, 200);
            let docs = documents(&reply, &spec);
            assert!(!docs.is_empty());
            let mut all = Vec::new();
            docs.iter().for_each(|d| keys(d, &mut all));
            assert!(
                all.iter().all(|k| !k.to_lowercase().contains("usage")),
                "{api:?} {mode:?}: {all:?}"
            );
            // The text still says "usage" and "total_tokens": scanners must look at keys.
            assert!(String::from_utf8_lossy(&reply.body).contains("total_tokens"));
        }
    }
}

#[test]
fn splits_cut_the_body_anywhere_and_keep_its_bytes() {
    let up = LlmUpstream::start();
    for (api, mode) in [
        (Api::Messages, Mode::Sse),
        (Api::Chat, Mode::Sse),
        (Api::Gemini, Mode::Json),
    ] {
        for split in ["every", "7", "random:42", "random:7"] {
            let (reply, _, ex) = ask_full(&up, api, mode, true, &[("x-test-split", split)]);
            assert!(reply.complete);
            let pieces = ex.sent.unwrap().pieces;
            let n = reply.len;
            match (split, mode) {
                ("every", _) => assert_eq!(pieces, n),
                ("7", _) => assert_eq!(pieces, n.div_ceil(7)),
                _ => assert!(pieces > n / 16, "{pieces} pieces for {n} bytes"),
            }
            let chunked = mode == Mode::Sse;
            assert_eq!(reply.chunks, if chunked { pieces } else { 0 });
        }
    }
    // A JSON answer can be chunked too.
    let (reply, _) = ask(
        &up,
        Api::Chat,
        Mode::Json,
        &[("x-test-split", "every"), ("x-test-framing", "chunked")],
    );
    assert_eq!(reply.chunks, reply.len);
    assert!(reply.header("content-length").is_none());
    // And a stream can have a content-length.
    let (reply, _) = ask(
        &up,
        Api::Messages,
        Mode::Sse,
        &[("x-test-framing", "length")],
    );
    assert_eq!(
        reply.header("content-length"),
        Some(&*reply.len.to_string())
    );
}

#[test]
fn crlf_and_multiline_data_give_the_same_events() {
    let up = LlmUpstream::start();
    for api in Api::ALL {
        let (plain, _) = ask(&up, api, Mode::Sse, &[]);
        let (crlf, _) = ask(&up, api, Mode::Sse, &[("x-test-crlf", "1")]);
        let bare_lf = crlf
            .body
            .windows(2)
            .filter(|w| w[1] == b'\n' && w[0] != b'\r')
            .count();
        assert_eq!(bare_lf, 0);
        assert!(crlf.body.windows(4).any(|w| w == b"\r\n\r\n"));
        assert_eq!(sse_events(&crlf.body), sse_events(&plain.body), "{api:?}");

        let (multi, _) = ask(
            &up,
            api,
            Mode::Sse,
            &[("x-test-multiline", "1"), ("x-test-crlf", "1")],
        );
        let (a, b) = (plain.events(), multi.events());
        assert_eq!(a.len(), b.len());
        assert!(b.iter().any(|e| e.data_lines > 3));
        for (a, b) in a.iter().zip(&b) {
            assert_eq!(a.event, b.event);
            assert_eq!(a.json(), b.json());
            if a.json().is_some() && a.data.contains(",\"") {
                assert!(b.data_lines > 1, "{}", b.data);
            }
        }
    }
}

#[test]
fn a_reset_stops_the_body_midway() {
    let up = LlmUpstream::start();
    for (mode, at) in [(Mode::Sse, 100), (Mode::Json, 10), (Mode::Sse, 0)] {
        let at_text = at.to_string();
        let mut client = LlmClient::connect(up.addr).unwrap();
        let path = Api::Chat.path(mode);
        let body = Api::Chat.request_body(mode, true, MAX_TOKENS);
        let reply = client
            .post(
                &path,
                &[("x-test-reset-after", &at_text), ("x-test-split", "3")],
                body.as_bytes(),
            )
            .unwrap();
        assert!(!reply.complete);
        assert_eq!(reply.len, at);
        let spec = Spec::new(Api::Chat, mode);
        assert_eq!(reply.body, body_bytes(&spec)[..at as usize]);
        let ex = up
            .wait_sent(reply.seq().unwrap(), Duration::from_secs(5))
            .unwrap();
        let sent = ex.sent.unwrap();
        assert!(!sent.complete);
        assert_eq!(sent.bytes, at);
        assert_eq!(sent.hash, reply.hash);
        // The connection is gone.
        assert!(client.post(&path, &[], body.as_bytes()).is_err());
    }
}

#[test]
fn slow_streams_send_each_event_as_it_comes() {
    let up = LlmUpstream::start();
    let path = Api::Messages.path(Mode::Sse);
    let body = Api::Messages.request_body(Mode::Sse, true, MAX_TOKENS);
    let start = Instant::now();
    let mut arrivals = Vec::new();
    let mut sink = |piece: &[u8]| arrivals.push((start.elapsed(), piece.len()));
    let reply = LlmClient::connect(up.addr)
        .unwrap()
        .send(
            "POST",
            &path,
            &[("x-test-delay-ms", "40"), ("x-test-events", "3")],
            body.as_bytes(),
            Some(&mut sink),
        )
        .unwrap();
    let total = start.elapsed();
    assert!(reply.complete);
    assert!(reply.body.is_empty(), "the sink took the body");
    // 9 events, 8 pauses.
    assert_eq!(reply.chunks, 9);
    assert!(total >= Duration::from_millis(8 * 40), "{total:?}");
    let first = arrivals[0].0;
    let last = arrivals.last().unwrap().0;
    assert!(
        last - first >= Duration::from_millis(7 * 40),
        "{arrivals:?}"
    );
}

#[test]
fn gzip_answers_are_real_gzip() {
    let up = LlmUpstream::start();
    for api in Api::ALL {
        for mode in [Mode::Json, Mode::Sse] {
            let (reply, spec) = ask(&up, api, mode, &[("x-test-encoding", "gzip")]);
            assert_eq!(reply.header("content-encoding"), Some("gzip"));
            assert_eq!(gunzip_stored(&reply.body).unwrap(), body_bytes(&spec));
        }
    }
    let (reply, spec) = ask(
        &up,
        Api::Chat,
        Mode::Sse,
        &[("x-test-encoding", "gzip"), ("x-test-pad", "100000")],
    );
    assert_eq!(gunzip_stored(&reply.body).unwrap(), body_bytes(&spec));
}

#[test]
fn error_statuses_answer_in_the_api_error_shape() {
    let up = LlmUpstream::start();
    for api in Api::ALL {
        for mode in [Mode::Json, Mode::Sse] {
            let (reply, _) = ask(&up, api, mode, &[("x-test-status", "429")]);
            assert_eq!(reply.status, 429);
            assert_eq!(reply.header("content-type"), Some("application/json"));
            let v = reply.json();
            match api {
                Api::Chat | Api::Responses => assert!(v.pointer("/error/message").is_some()),
                Api::Messages => assert_eq!(str_at(&v, "/type"), "error"),
                Api::Gemini => assert_eq!(u64_at(&v, "/error/code"), 429),
            }
        }
    }
}

#[test]
fn requests_are_recorded_on_a_keep_alive_connection() {
    let up = LlmUpstream::start();
    up.keep_bodies(64);
    let mut client = LlmClient::connect(up.addr).unwrap();
    let mut seqs = Vec::new();
    for api in Api::ALL {
        let body = api.request_body(Mode::Sse, true, 77);
        let reply = client
            .post(
                &api.path(Mode::Sse),
                &[("authorization", "Bearer sk-test"), ("x-test-events", "2")],
                body.as_bytes(),
            )
            .unwrap();
        assert!(reply.complete);
        seqs.push(reply.seq().unwrap());
        let ex = up
            .wait_sent(reply.seq().unwrap(), Duration::from_secs(5))
            .unwrap();
        assert_eq!(ex.request.method, "POST");
        assert_eq!(ex.header("authorization"), Some("Bearer sk-test"));
        assert_eq!(ex.max_tokens, Some(77));
        assert_eq!(ex.request.body, body.as_bytes());
        let sent = ex.sent.unwrap();
        assert_eq!(sent.body, reply.body[..64]);
        assert_eq!(sent.hash, reply.hash);
    }
    assert_eq!(seqs, [0, 1, 2, 3]);

    // A chunked request body.
    let body = Api::Messages.request_body(Mode::Json, false, 5);
    let (a, b) = body.split_at(10);
    let chunked = format!("{:x}\r\n{a}\r\n{:x}\r\n{b}\r\n0\r\n\r\n", a.len(), b.len());
    let reply = client
        .post(
            "/v1/messages",
            &[("transfer-encoding", "chunked")],
            chunked.as_bytes(),
        )
        .unwrap();
    assert_eq!(reply.status, 200);
    let ex = up
        .wait_sent(reply.seq().unwrap(), Duration::from_secs(5))
        .unwrap();
    assert_eq!(ex.request.body, body.as_bytes());
    assert_eq!(ex.max_tokens, Some(5));

    // An unknown route.
    let reply = client.post("/v1/nothing", &[], b"{}").unwrap();
    assert_eq!(reply.status, 404);
    assert_eq!(up.received(), 6);
}

/// Peak resident memory of this process, in bytes.
fn peak_rss() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find(|l| l.starts_with("VmHWM:")).unwrap();
    let kb: u64 = line.split_whitespace().nth(1).unwrap().parse().unwrap();
    kb * 1024
}

#[test]
fn a_100_mb_stream_takes_bounded_memory() {
    let up = LlmUpstream::start();
    up.keep_bodies(0);
    // Resets the peak to the current size (where the kernel allows it).
    let _ = std::fs::write("/proc/self/clear_refs", "5");
    let before = peak_rss();
    let path = Api::Chat.path(Mode::Sse);
    let body = Api::Chat.request_body(Mode::Sse, true, MAX_TOKENS);
    let pad = 64 * 1024;
    let events = 1600;
    let mut received = 0u64;
    let mut sink = |piece: &[u8]| received += piece.len() as u64;
    let reply = LlmClient::connect(up.addr)
        .unwrap()
        .send(
            "POST",
            &path,
            &[
                ("x-test-pad", &pad.to_string()),
                ("x-test-events", &events.to_string()),
            ],
            body.as_bytes(),
            Some(&mut sink),
        )
        .unwrap();
    assert!(reply.complete);
    assert!(reply.len >= 100 * 1000 * 1000, "{}", reply.len);
    let ex = up
        .wait_sent(reply.seq().unwrap(), Duration::from_secs(5))
        .unwrap();
    let sent = ex.sent.unwrap();
    assert_eq!(sent.bytes, reply.len);
    assert_eq!(sent.hash, reply.hash);
    assert_eq!(received, reply.len);
    // One chunk per event: role, contents, finish, usage, [DONE].
    assert_eq!(reply.chunks, events + 4);
    assert!(up.peak_buffer() <= MAX_CHUNK + pad, "{}", up.peak_buffer());
    let grown = peak_rss().saturating_sub(before);
    assert!(grown < 64 << 20, "peak memory grew by {grown} bytes");
}
