//! Every preset of `cost.response`, as the configuration compiles it, against answers and
//! streams recorded in each API's format (`tests/fixtures/llm/`): the total, the input, the
//! output and the cached tokens each one charges, whole and one byte at a time; and sums of
//! presets with weights.
#![allow(clippy::unwrap_used, clippy::panic, clippy::indexing_slicing)]

use ratelimit_core::config::{body, Config, Cost, Usage};
use ratelimit_core::usage::{Format, Scanner};

/// One rule per preset, in `body::RESPONSE_PRESETS` order, plus two sums.
fn config() -> Config {
    let mut costs: Vec<String> = body::RESPONSE_PRESETS
        .iter()
        .map(|p| p.name.to_string())
        .collect();
    costs.push("anthropic-input + anthropic-cache-write".into());
    costs.push("openai-input + 4*openai-output".into());
    let rules: Vec<String> = costs
        .iter()
        .enumerate()
        .map(|(i, c)| {
            format!(
                r#"{{"name": "r{i}", "rate_limit": {{"requests_per_unit": 1000000, "unit": "hour"}},
                    "cost": {{"response": "{c}"}}}}"#
            )
        })
        .collect();
    Config::parse(format!(r#"{{"rules": [{}]}}"#, rules.join(",")).as_bytes()).unwrap()
}

/// Each rule's charge for `body`, fed in `piece`-byte pieces (`None`: not reported).
fn charges(config: &Config, format: Format, body: &[u8], piece: usize) -> Vec<Option<u64>> {
    let mut scanner = Scanner::new(format);
    for chunk in body.chunks(piece) {
        scanner.feed(&config.usage_paths, chunk);
    }
    scanner.finish(&config.usage_paths);
    config
        .rules
        .iter()
        .map(|r| match &r.cost {
            Cost::Response(c) => match &c.usage {
                Usage::Body(b) => b.total(|slot| scanner.value(slot)),
                other => panic!("{other:?}"),
            },
            other => panic!("{other:?}"),
        })
        .collect()
}

fn fixture(name: &str) -> Vec<u8> {
    let path = format!("{}/tests/fixtures/llm/{name}", env!("CARGO_MANIFEST_DIR"));
    std::fs::read(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
}

const N: Option<u64> = None;

/// (fixture, format, the charge of each rule of [`config`]): openai, anthropic, gemini,
/// openai-input, -output, -cached, anthropic-input, -output, -cache-read, -cache-write,
/// gemini-input, -output, -cached, anthropic input + cache writes, openai input + 4 × output.
#[rustfmt::skip]
const ANSWERS: &[(&str, Format, [Option<u64>; 15])] = &[
    // Chat Completions: prompt 27, completion 52, total 79, nothing cached.
    ("openai_chat.json", Format::Json,
     [Some(79), N, N, Some(27), Some(52), Some(0), N, N, N, N, N, N, N, N, Some(27 + 4 * 52)]),
    // A prompt of 2,006 tokens, 1,920 of them from the cache; 300 out, 128 of them reasoning.
    ("openai_chat_cached.json", Format::Json,
     [Some(2306), N, N, Some(2006), Some(300), Some(1920), N, N, N, N, N, N, N, N, Some(2006 + 1200)]),
    // The last chunk (`stream_options.include_usage`): 27 in, 14 out.
    ("openai_chat_stream.sse", Format::Sse,
     [Some(41), N, N, Some(27), Some(14), Some(0), N, N, N, N, N, N, N, N, Some(27 + 56)]),
    // The Responses API: input 1,536 (1,024 cached), output 420.
    ("openai_responses.json", Format::Json,
     [Some(1956), Some(1956), N, Some(1536), Some(420), Some(1024), Some(1536), Some(420), N, N, N, N, N,
      Some(1536), Some(1536 + 1680)]),
    // Its stream's `response.completed`: 36 in, 7 out (`usage: null` before it).
    ("openai_responses_stream.sse", Format::Sse,
     [Some(43), N, N, Some(36), Some(7), Some(0), N, N, N, N, N, N, N, N, Some(36 + 28)]),
    // Messages: 21 in, 29 out, no cache.
    ("anthropic_messages.json", Format::Json,
     [N, Some(50), N, Some(21), Some(29), N, Some(21), Some(29), Some(0), Some(0), N, N, N, Some(21),
      Some(21 + 116)]),
    // 18 in, 1,500 written to the cache, 3,000 read from it, 240 out.
    ("anthropic_messages_cached.json", Format::Json,
     [N, Some(258), N, Some(18), Some(240), N, Some(18), Some(240), Some(3000), Some(1500), N, N, N,
      Some(1518), Some(18 + 960)]),
    // message_start: 472 in; message_delta: 89 out in all (its `usage.output_tokens` is also
    // where the Responses API puts its output, so openai-output reads it too).
    ("anthropic_stream.sse", Format::Sse,
     [N, Some(561), N, N, Some(89), N, Some(472), Some(89), Some(0), Some(0), N, N, N, Some(472), Some(356)]),
    // A stream whose message_delta repeats the input figures: 9 in, 2,048 from the cache, 150 out.
    ("anthropic_stream_cached.sse", Format::Sse,
     [N, Some(159), N, Some(9), Some(150), N, Some(9), Some(150), Some(2048), Some(0), N, N, N, Some(9),
      Some(9 + 600)]),
    // generateContent: prompt 9, candidates 24, no thinking.
    ("gemini_generate.json", Format::Json,
     [N, N, Some(33), N, N, N, N, N, N, N, Some(9), Some(24), N, N, N]),
    // A thinking model: prompt 1,200 (1,024 cached), candidates 80, thoughts 350.
    ("gemini_thinking.json", Format::Json,
     [N, N, Some(1630), N, N, N, N, N, N, N, Some(1200), Some(430), Some(1024), N, N]),
    // streamGenerateContent: running totals, the last one counts.
    ("gemini_stream.sse", Format::Sse,
     [N, N, Some(33), N, N, N, N, N, N, N, Some(9), Some(24), N, N, N]),
];

#[test]
fn each_preset_charges_its_part_of_each_answer() {
    let config = config();
    assert_eq!(config.rules.len(), 15);
    for &(name, format, expected) in ANSWERS {
        let body = fixture(name);
        assert_eq!(
            charges(&config, format, &body, body.len()),
            expected,
            "{name}, whole"
        );
        assert_eq!(
            charges(&config, format, &body, 1),
            expected,
            "{name}, one byte at a time"
        );
    }
}

#[test]
fn what_each_preset_counts() {
    use body::Counts::{Input, Output, Total};
    let counts = |s| body::counts(s, &body::RESPONSE_PRESETS);
    assert_eq!(counts("openai"), Some(Total));
    assert_eq!(counts("openai-cached"), Some(Input));
    assert_eq!(
        counts("anthropic-input + 2*anthropic-cache-write"),
        Some(Input)
    );
    assert_eq!(counts("gemini-output"), Some(Output));
    assert_eq!(counts("openai-input + 4*openai-output"), Some(Total));
    assert_eq!(
        counts("json:usage.output_tokens"),
        None,
        "fields: who knows"
    );
    assert_eq!(counts("openai-output + json:x"), None);
}
