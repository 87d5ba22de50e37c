//! Usage read from bodies: the `cost.response` expressions (`json:PATH`, weighted sums,
//! alternatives) and the presets for the common LLM APIs, and the slots their fields take in
//! the scanners' [`Paths`].

use super::{Config, Cost, ModelFrom, Sized, Term, Tokens, Usage};
use crate::usage::{Paths, MAX_DEPTH, MAX_SLOTS};

/// What a preset of `cost.response` counts: all of an answer's tokens, its input (prompt,
/// cached or not) or its output. A rule's reservation follows it: the input estimate for
/// input, the output maximum for output.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Counts {
    /// Input and output.
    Total,
    /// Input tokens (prompt, cached, cache writes).
    Input,
    /// Output tokens (completion, reasoning included).
    Output,
}

/// A named usage expression.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Preset {
    /// Its name in the configuration.
    pub name: &'static str,
    /// The expression it stands for.
    pub expression: &'static str,
    /// What it counts.
    pub counts: Counts,
}

const fn preset(name: &'static str, expression: &'static str, counts: Counts) -> Preset {
    Preset {
        name,
        expression,
        counts,
    }
}

/// The presets of `cost.response`: the usage each API reports in its JSON answers and in its
/// event streams, in all, and its input, output and cached tokens apart. OpenAI: Chat
/// Completions, Completions and Embeddings (`usage`, also the last chunk of a stream with
/// `stream_options.include_usage`), the Responses API (`usage`, and the `response.completed`
/// event's `response.usage`). Anthropic Messages: `usage` in the answer; in a stream
/// `message_start` carries `message.usage`, `message_delta` the running `usage` (the last one is
/// the total). Gemini: `generateContent`, and every event of `streamGenerateContent` (running
/// totals).
pub const RESPONSE_PRESETS: [Preset; 13] = [
    preset(
        "openai",
        "json:usage.total_tokens | json:response.usage.total_tokens",
        Counts::Total,
    ),
    preset(
        "anthropic",
        "json:usage.input_tokens | json:message.usage.input_tokens + \
         json:usage.output_tokens | json:message.usage.output_tokens",
        Counts::Total,
    ),
    preset(
        "gemini",
        "json:usageMetadata.totalTokenCount",
        Counts::Total,
    ),
    // `prompt_tokens` (Chat Completions) or `input_tokens` (Responses): cached ones included.
    preset(
        "openai-input",
        "json:usage.prompt_tokens | json:usage.input_tokens | json:response.usage.input_tokens",
        Counts::Input,
    ),
    // `completion_tokens` or `output_tokens`: reasoning tokens included.
    preset(
        "openai-output",
        "json:usage.completion_tokens | json:usage.output_tokens | \
         json:response.usage.output_tokens",
        Counts::Output,
    ),
    // The part of the input read from the prompt cache.
    preset(
        "openai-cached",
        "json:usage.prompt_tokens_details.cached_tokens | \
         json:usage.input_tokens_details.cached_tokens | \
         json:response.usage.input_tokens_details.cached_tokens",
        Counts::Input,
    ),
    // Input not read from nor written to the cache: Anthropic reports those apart.
    preset(
        "anthropic-input",
        "json:usage.input_tokens | json:message.usage.input_tokens",
        Counts::Input,
    ),
    preset(
        "anthropic-output",
        "json:usage.output_tokens | json:message.usage.output_tokens",
        Counts::Output,
    ),
    preset(
        "anthropic-cache-read",
        "json:usage.cache_read_input_tokens | json:message.usage.cache_read_input_tokens",
        Counts::Input,
    ),
    preset(
        "anthropic-cache-write",
        "json:usage.cache_creation_input_tokens | \
         json:message.usage.cache_creation_input_tokens",
        Counts::Input,
    ),
    // The prompt, cached part included.
    preset(
        "gemini-input",
        "json:usageMetadata.promptTokenCount",
        Counts::Input,
    ),
    // The candidates and the thinking that led to them.
    preset(
        "gemini-output",
        "json:usageMetadata.candidatesTokenCount + json:usageMetadata.thoughtsTokenCount",
        Counts::Output,
    ),
    preset(
        "gemini-cached",
        "json:usageMetadata.cachedContentTokenCount",
        Counts::Input,
    ),
];

/// The presets of `cost.reserve.from`: where each API's request names its output maximum.
pub const REQUEST_PRESETS: [Preset; 3] = [
    preset(
        "openai",
        "json:max_completion_tokens | json:max_tokens | json:max_output_tokens",
        Counts::Output,
    ),
    preset("anthropic", "json:max_tokens", Counts::Output),
    preset(
        "gemini",
        "json:generationConfig.maxOutputTokens",
        Counts::Output,
    ),
];

/// The API whose answers a price reads (`price.usage`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PriceApi {
    /// OpenAI: input (cached included), cached input, output.
    OpenAi,
    /// Anthropic: input (neither read from nor written to the cache), cache reads, cache
    /// writes, output.
    Anthropic,
    /// Gemini: input (cached included), cached input, output.
    Gemini,
}

impl PriceApi {
    /// The names in the configuration.
    pub const NAMES: [(&'static str, PriceApi); 3] = [
        ("openai", PriceApi::OpenAi),
        ("anthropic", PriceApi::Anthropic),
        ("gemini", PriceApi::Gemini),
    ];

    /// Its name in the configuration.
    pub fn name(self) -> &'static str {
        match self {
            PriceApi::OpenAi => "openai",
            PriceApi::Anthropic => "anthropic",
            PriceApi::Gemini => "gemini",
        }
    }

    /// The presets it prices, with the kind of tokens each counts.
    pub fn presets(self) -> &'static [(Tokens, &'static str)] {
        match self {
            PriceApi::OpenAi => &[
                (Tokens::Input, "openai-input"),
                (Tokens::Cached, "openai-cached"),
                (Tokens::Output, "openai-output"),
            ],
            PriceApi::Anthropic => &[
                (Tokens::Input, "anthropic-input"),
                (Tokens::Cached, "anthropic-cache-read"),
                (Tokens::CacheWrite, "anthropic-cache-write"),
                (Tokens::Output, "anthropic-output"),
            ],
            PriceApi::Gemini => &[
                (Tokens::Input, "gemini-input"),
                (Tokens::Cached, "gemini-cached"),
                (Tokens::Output, "gemini-output"),
            ],
        }
    }

    /// Where its answers name their model: the answer's `model` (OpenAI's Responses stream:
    /// `response.model`; Anthropic's stream: `message.model`), Gemini's `modelVersion`.
    pub fn model_field(self) -> &'static str {
        match self {
            PriceApi::OpenAi => "json:model | json:response.model",
            PriceApi::Anthropic => "json:model | json:message.model",
            PriceApi::Gemini => "json:modelVersion",
        }
    }

    /// Whether its answers report cache writes.
    pub fn writes_cache(self) -> bool {
        self == PriceApi::Anthropic
    }
}

/// The terms of a price for `api`: every field of its presets, each with its kind.
pub(super) fn price_terms(api: PriceApi) -> Vec<(Tokens, Term)> {
    let mut terms = Vec::new();
    for &(kind, name) in api.presets() {
        // The presets are fixed and valid: tested below.
        for t in expression(name, &RESPONSE_PRESETS).unwrap_or_default() {
            terms.push((kind, term(t)));
        }
    }
    terms
}

/// The term naming the model in `api`'s answers.
pub(super) fn model_term(api: PriceApi) -> Term {
    let mut terms = expression(api.model_field(), &[]).unwrap_or_default();
    term(terms.pop().unwrap_or((1, Vec::new())))
}

/// The names of `presets`, joined by `, `.
pub fn names(presets: &[Preset]) -> String {
    presets
        .iter()
        .map(|p| p.name)
        .collect::<Vec<_>>()
        .join(", ")
}

/// What a usage expression counts, if it is made of presets alone (`None` for one with
/// `json:` fields: who knows); a sum of input and output presets counts the total.
pub fn counts(s: &str, presets: &[Preset]) -> Option<Counts> {
    let mut all: Option<Counts> = None;
    for term in s.split('+') {
        let name = term.split_once('*').map_or(term, |(_, rest)| rest).trim();
        let c = presets.iter().find(|p| p.name == name)?.counts;
        all = Some(match all {
            None => c,
            Some(a) if a == c => a,
            Some(_) => Counts::Total,
        });
    }
    all
}

/// A parsed expression's terms: (weight, alternative paths, each a list of keys).
pub type Terms = Vec<(u32, Vec<Vec<String>>)>;

/// The longest expression accepted, bytes.
const MAX_EXPRESSION: usize = 1024;

/// Parses a usage expression (or a preset's name): terms joined by `+`, each an optional
/// integer weight and `*`, then one or more `json:PATH` joined by `|` (alternatives: the last
/// one found counts), or a preset's name (its terms, times the weight). A path is keys joined
/// by `.` from the document's root.
pub fn expression(s: &str, presets: &[Preset]) -> Result<Terms, String> {
    let s = presets
        .iter()
        .find(|p| p.name == s)
        .map_or(s, |p| p.expression);
    if s.len() > MAX_EXPRESSION {
        return Err(format!("longer than {MAX_EXPRESSION} bytes"));
    }
    let mut terms = Vec::new();
    for term in s.split('+') {
        let term = term.trim();
        let (weight, alternatives) = match term.split_once('*') {
            Some((w, rest)) => {
                let w = w.trim();
                let n = w.parse::<u32>().ok().filter(|n| *n >= 1).ok_or_else(|| {
                    format!("weight {w:?} is not an integer from 1 to {}", u32::MAX)
                })?;
                (n, rest)
            }
            None => (1, term),
        };
        if let Some(p) = presets.iter().find(|p| p.name == alternatives.trim()) {
            // A preset's own expression holds fields only: this cannot recurse.
            for (w, paths) in expression(p.expression, &[])? {
                terms.push((w.saturating_mul(weight), paths));
            }
            continue;
        }
        let mut paths = Vec::new();
        for alt in alternatives.split('|') {
            let alt = alt.trim();
            let Some(path) = alt.strip_prefix("json:") else {
                return Err(format!(
                    "{alt:?} is not a field (expected json:PATH, e.g. json:usage.total_tokens)"
                ));
            };
            let segments: Vec<String> = path.split('.').map(str::to_string).collect();
            if segments.iter().any(String::is_empty) {
                return Err(format!("{alt:?} has an empty key"));
            }
            if segments.len() > MAX_DEPTH {
                return Err(format!("{alt:?} has more than {MAX_DEPTH} keys"));
            }
            paths.push(segments);
        }
        terms.push((weight, paths));
    }
    Ok(terms)
}

/// Gives every body field of the rules its slot and compiles the scanners' paths: (response,
/// request). Rules reading the same fields share their slots. `Err` names the side with too
/// many distinct fields.
pub(super) fn assign(config: &mut Config) -> Result<(), String> {
    let mut response: Vec<Vec<Vec<String>>> = Vec::new();
    let mut request: Vec<Vec<Vec<String>>> = Vec::new();
    for rule in &mut config.rules {
        for m in &mut rule.matcher.body {
            m.field.slot = slot_of(&mut request, std::slice::from_ref(&m.field.path));
        }
        for part in &mut rule.key {
            for field in part.body_fields_mut() {
                field.slot = slot_of(&mut request, std::slice::from_ref(&field.path));
            }
        }
        let Cost::Response(charge) = &mut rule.cost else {
            continue;
        };
        match &mut charge.usage {
            Usage::Body(body) => {
                for term in &mut body.terms {
                    term.slot = slot_of(&mut response, &term.paths);
                }
            }
            Usage::Price(price) => {
                for (_, term) in &mut price.terms {
                    term.slot = slot_of(&mut response, &term.paths);
                }
                match &mut price.model {
                    ModelFrom::Body(field) => {
                        field.slot = slot_of(&mut request, std::slice::from_ref(&field.path));
                    }
                    ModelFrom::Answer(term) => term.slot = slot_of(&mut response, &term.paths),
                }
            }
            Usage::Header(_) | Usage::BodyBytes => {}
        }
        if let Some(sized) = &mut charge.sized {
            if let Some(from) = &sized.from {
                sized.slot = slot_of(&mut request, from);
            }
        }
    }
    config.usage_paths = compile(&response, "response")?;
    config.request_paths = compile(&request, "request")?;
    Ok(())
}

fn slot_of(slots: &mut Vec<Vec<Vec<String>>>, paths: &[Vec<String>]) -> usize {
    match slots.iter().position(|s| s.as_slice() == paths) {
        Some(i) => i,
        None => {
            slots.push(paths.to_vec());
            slots.len() - 1
        }
    }
}

fn compile(slots: &[Vec<Vec<String>>], side: &str) -> Result<Paths, String> {
    if slots.len() > MAX_SLOTS {
        return Err(format!(
            "the rules read {} distinct {side} body values (at most {MAX_SLOTS})",
            slots.len()
        ));
    }
    let flat: Vec<(Vec<String>, usize)> = slots
        .iter()
        .enumerate()
        .flat_map(|(slot, paths)| paths.iter().map(move |p| (p.clone(), slot)))
        .collect();
    Paths::new(&flat)
}

/// A term of `paths` alternatives weighing `weight`, its slot assigned later.
pub(super) fn term((weight, paths): (u32, Vec<Vec<String>>)) -> Term {
    Term {
        weight,
        paths,
        slot: 0,
    }
}

/// A sized reservation, its slot assigned later.
pub(super) fn sized(from: Option<Vec<Vec<String>>>, input: super::Input, max_body: u32) -> Sized {
    Sized {
        from,
        slot: 0,
        input,
        max_body,
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn p(s: &str) -> Vec<String> {
        s.split('.').map(str::to_string).collect()
    }

    #[test]
    fn expressions_and_presets() {
        assert_eq!(
            expression("json:usage.total_tokens", &RESPONSE_PRESETS).unwrap(),
            [(1, vec![p("usage.total_tokens")])]
        );
        assert_eq!(
            expression("json:a.b + 3*json:c | json:d.e", &RESPONSE_PRESETS).unwrap(),
            [(1, vec![p("a.b")]), (3, vec![p("c"), p("d.e")])]
        );
        assert_eq!(
            expression("anthropic", &RESPONSE_PRESETS).unwrap(),
            [
                (
                    1,
                    vec![p("usage.input_tokens"), p("message.usage.input_tokens")]
                ),
                (
                    1,
                    vec![p("usage.output_tokens"), p("message.usage.output_tokens")]
                ),
            ]
        );
        assert_eq!(
            expression("gemini", &REQUEST_PRESETS).unwrap(),
            [(1, vec![p("generationConfig.maxOutputTokens")])]
        );
        // A preset as a term: its terms, times the weight.
        assert_eq!(
            expression("json:a + 2*gemini-output", &RESPONSE_PRESETS).unwrap(),
            [
                (1, vec![p("a")]),
                (2, vec![p("usageMetadata.candidatesTokenCount")]),
                (2, vec![p("usageMetadata.thoughtsTokenCount")]),
            ]
        );
        assert_eq!(
            expression("anthropic-input + anthropic-output", &RESPONSE_PRESETS).unwrap(),
            expression("anthropic", &RESPONSE_PRESETS).unwrap()
        );
        for bad in [
            "openai-input | json:a",
            "openai | openai-input",
            "usage.total",
            "json:",
            "json:a..b",
            "0*json:a",
            "x*json:a",
            "json:a+",
            "openai2",
        ] {
            assert!(expression(bad, &RESPONSE_PRESETS).is_err(), "{bad}");
        }
        let deep = format!("json:{}", ["k"; MAX_DEPTH + 1].join("."));
        assert!(expression(&deep, &RESPONSE_PRESETS).is_err());
    }
}
