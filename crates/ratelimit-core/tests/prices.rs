//! Money: `cost.response.price` against answers and streams recorded in each API's format
//! (`tests/fixtures/llm/`), the model read from the answer itself: the exact charge of each,
//! whole and one byte at a time, cached input and cache writes priced apart, a dated model
//! name priced by the longest prefix that names it.
#![allow(clippy::unwrap_used, clippy::panic, clippy::indexing_slicing)]

use ratelimit_core::config::{Config, Cost, Price, Priced, Usage};
use ratelimit_core::usage::{Format, Scanner};

/// Prices are per million tokens: a charge is the sum divided by this, rounded up.
const M: u64 = 1_000_000;

/// One rule per API, each pricing the model its answers name, at list prices (micro-dollars
/// per million tokens).
fn config() -> Config {
    Config::parse(
        br#"{"rules": [
      {"name": "openai", "rate_limit": {"requests_per_unit": 100000000, "unit": "month"},
       "algorithm": "fixed_window",
       "cost": {"response": {"price": {"usage": "openai", "model": "response", "models": {
          "gpt-4o-mini*": {"input": 150000, "cached_input": 75000, "output": 600000},
          "o4-mini*": {"input": 1100000, "cached_input": 275000, "output": 4400000},
          "gpt-5-mini*": {"input": 250000, "cached_input": 25000, "output": 2000000},
          "gpt-4.1-mini*": {"input": 400000, "cached_input": 100000, "output": 1600000}},
          "default": {"input": 10000000, "output": 30000000}}}}},
      {"name": "anthropic", "rate_limit": {"requests_per_unit": 100000000, "unit": "month"},
       "algorithm": "fixed_window",
       "cost": {"response": {"price": {"usage": "anthropic", "model": "response", "models": {
          "claude-sonnet-4-*": {"input": 3000000, "cached_input": 300000, "cache_write": 3750000, "output": 15000000},
          "claude-sonnet-4-5*": {"input": 3300000, "cached_input": 330000, "cache_write": 4125000, "output": 16500000}},
          "default": {"input": 15000000, "output": 75000000}}}}},
      {"name": "gemini", "rate_limit": {"requests_per_unit": 100000000, "unit": "month"},
       "algorithm": "fixed_window",
       "cost": {"response": {"price": {"usage": "gemini", "model": "response", "models": {
          "gemini-2.0-flash": {"input": 100000, "cached_input": 25000, "output": 400000},
          "gemini-2.5-flash": {"input": 300000, "cached_input": 75000, "output": 2500000}},
          "default": {"input": 1250000, "output": 10000000}}}}}
    ]}"#,
    )
    .unwrap()
}

fn price(config: &Config, rule: usize) -> &Price {
    match &config.rules[rule].cost {
        Cost::Response(c) => match &c.usage {
            Usage::Price(p) => p,
            other => panic!("{other:?}"),
        },
        other => panic!("{other:?}"),
    }
}

/// Rule `rule`'s charge for `body`, fed in `piece`-byte pieces (`None`: not reported).
fn charge(config: &Config, rule: usize, format: Format, body: &[u8], piece: usize) -> Option<u64> {
    let mut scanner = Scanner::with_texts(format);
    for chunk in body.chunks(piece) {
        scanner.feed(&config.usage_paths, chunk);
    }
    scanner.finish(&config.usage_paths);
    price(config, rule).total(Priced::Answer, |s| scanner.value(s), |s| scanner.text(s))
}

fn fixture(name: &str) -> Vec<u8> {
    let path = format!("{}/tests/fixtures/llm/{name}", env!("CARGO_MANIFEST_DIR"));
    std::fs::read(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// (fixture, format, rule, the exact charge in micro-dollars).
#[rustfmt::skip]
fn answers() -> Vec<(&'static str, Format, usize, u64)> {
    vec![
        // gpt-4o-mini: 27 in, 52 out.
        ("openai_chat.json", Format::Json, 0, (27 * 150_000 + 52 * 600_000u64).div_ceil(M)),
        // o4-mini: 2,006 in of which 1,920 cached, 300 out.
        ("openai_chat_cached.json", Format::Json, 0,
         (86 * 1_100_000 + 1920 * 275_000 + 300 * 4_400_000u64).div_ceil(M)),
        // The stream's last chunk: 27 in, 14 out.
        ("openai_chat_stream.sse", Format::Sse, 0, (27 * 150_000 + 14 * 600_000u64).div_ceil(M)),
        // Responses, gpt-5-mini: 1,536 in (1,024 cached), 420 out.
        ("openai_responses.json", Format::Json, 0,
         (512 * 250_000 + 1024 * 25_000 + 420 * 2_000_000u64).div_ceil(M)),
        // Its stream, gpt-4.1-mini (`response.model`): 36 in, 7 out.
        ("openai_responses_stream.sse", Format::Sse, 0, (36 * 400_000 + 7 * 1_600_000u64).div_ceil(M)),
        // claude-sonnet-4-20250514: 21 in, 29 out.
        ("anthropic_messages.json", Format::Json, 1, (21 * 3_000_000 + 29 * 15_000_000u64).div_ceil(M)),
        // claude-sonnet-4-5 (the longer prefix): 18 in, 3,000 read, 1,500 written, 240 out.
        ("anthropic_messages_cached.json", Format::Json, 1,
         (18 * 3_300_000 + 3000 * 330_000 + 1500 * 4_125_000 + 240 * 16_500_000u64).div_ceil(M)),
        // The stream (`message.model`): 472 in, 89 out.
        ("anthropic_stream.sse", Format::Sse, 1, (472 * 3_000_000 + 89 * 15_000_000u64).div_ceil(M)),
        // 9 in, 2,048 read from the cache, 150 out.
        ("anthropic_stream_cached.sse", Format::Sse, 1,
         (9 * 3_300_000 + 2048 * 330_000 + 150 * 16_500_000u64).div_ceil(M)),
        // gemini-2.0-flash: 9 in, 24 out.
        ("gemini_generate.json", Format::Json, 2, (9 * 100_000 + 24 * 400_000u64).div_ceil(M)),
        // gemini-2.5-flash: 1,200 in (1,024 cached), 80 + 350 thinking out.
        ("gemini_thinking.json", Format::Json, 2,
         (176 * 300_000 + 1024 * 75_000 + 430 * 2_500_000u64).div_ceil(M)),
        ("gemini_stream.sse", Format::Sse, 2, (9 * 100_000 + 24 * 400_000u64).div_ceil(M)),
    ]
}

#[test]
fn each_answer_is_charged_its_exact_price() {
    let config = config();
    for (name, format, rule, expected) in answers() {
        let body = fixture(name);
        assert_eq!(
            charge(&config, rule, format, &body, body.len()),
            Some(expected),
            "{name}, whole"
        );
        assert_eq!(
            charge(&config, rule, format, &body, 1),
            Some(expected),
            "{name}, one byte at a time"
        );
    }
    // The figures themselves, for a reader: 35.25 µ$ rounds up to 36; a cached o4-mini call
    // costs $0.001943, a Sonnet 4.5 call writing 1,500 tokens to the cache $0.011197.
    assert_eq!(answers()[0].3, 36);
    assert_eq!(answers()[1].3, 1943);
    assert_eq!(answers()[6].3, 11_197);
}

#[test]
fn an_unknown_model_is_priced_at_the_default_and_no_usage_is_not_reported() {
    let config = config();
    let body = br#"{"model": "gpt-9", "usage": {"prompt_tokens": 1000, "completion_tokens": 100}}"#;
    assert_eq!(
        charge(&config, 0, Format::Json, body, body.len()),
        Some((1000 * 10_000_000 + 100 * 30_000_000u64).div_ceil(M))
    );
    // No model named at all: the default too.
    let body = br#"{"usage": {"prompt_tokens": 1000, "completion_tokens": 100}}"#;
    assert_eq!(charge(&config, 0, Format::Json, body, 7), Some(13_000));
    // An error answer reports no tokens: the rule's `default` is charged instead.
    let body = br#"{"model": "gpt-4o-mini", "error": {"message": "overloaded"}}"#;
    assert_eq!(charge(&config, 0, Format::Json, body, body.len()), None);
}

#[test]
fn money_rules_count_micro_dollars_which_are_not_tokens() {
    let config = config();
    for rule in &config.rules {
        assert_eq!(rule.quota_unit.as_deref(), Some("usd-micros"));
        assert_eq!(ratelimit_core::config::Kind::of(rule), None);
    }
}

/// examples/llm-gateway/README.md: its stand-in's answer (27 input, 52 output tokens) costs the
/// team 36 µ$ for gpt-4o-mini (35.25 rounded up) and 470 µ$ for o3, as the README says.
#[test]
fn the_gateway_examples_answers_cost_what_its_readme_says() {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../examples/llm-gateway/openai.json"
    );
    let config = Config::parse(&std::fs::read(path).unwrap()).unwrap();
    let rule = config
        .rules
        .iter()
        .position(|r| r.name == "team-usd")
        .unwrap();
    let body = fixture("openai_chat.json");
    let mut scanner = Scanner::with_texts(Format::Json);
    scanner.feed(&config.usage_paths, &body);
    scanner.finish(&config.usage_paths);
    let p = price(&config, rule);
    let cost = |model: &str| {
        let priced = p.lookup(Some(model.as_bytes())).unwrap();
        p.total(priced, |s| scanner.value(s), |s| scanner.text(s))
    };
    assert_eq!(cost("gpt-4o-mini"), Some(36));
    assert_eq!(cost("o3"), Some(470));
    assert_eq!(
        p.lookup(Some(b"llama-3")),
        None,
        "refused: not in the table"
    );
}
