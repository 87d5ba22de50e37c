//! A cost in money (`cost.response.price`): the tokens an LLM API's answer reports, at the
//! prices of its model, summed exactly in integers; the price table, and which row a model
//! takes.
//!
//! Uses the configuration's body fields and terms, and the APIs of [`body`](super::body).

use super::body;
use super::{BodyField, Term};

/// A usage in money: the input, cached input, cache writes and output tokens an LLM API's
/// answer reports, each times its price for the answer's model, summed exactly in integers and
/// divided by [`Price::per`] (rounded up, once per answer).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Price {
    /// The API whose answers are read (`price.usage`).
    pub api: body::PriceApi,
    /// The fields read, each with the kind of tokens it counts (a kind may take several terms:
    /// Gemini's output is its candidates plus its thoughts).
    pub terms: Vec<(Tokens, Term)>,
    /// Where the model comes from.
    pub model: ModelFrom,
    /// How many tokens a price is for: 1, 1,000 or 1,000,000.
    pub per: u32,
    /// The price table, by model name: an exact name, or a prefix (a name ending in `*`).
    pub models: Vec<ModelPrice>,
    /// The price of a model not in the table; `None`: such a request is refused.
    pub default: Option<Rates>,
    /// The highest price of each kind, over the table and the default: what a reservation is
    /// priced at while the model is not known (it comes with the answer).
    pub dearest: Rates,
}

/// The kinds of tokens an answer is priced by.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Tokens {
    /// The input; for OpenAI and Gemini the cached part included (it is taken off).
    Input,
    /// The input read from the prompt cache.
    Cached,
    /// The input written to the cache (Anthropic).
    CacheWrite,
    /// The output.
    Output,
}

/// Where a priced rule's model comes from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ModelFrom {
    /// A field of the request's body (`body:model`): known at admission.
    Body(BodyField),
    /// The answer's own `model` field (`response`), read with its usage.
    Answer(Term),
}

/// One row of a price table.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModelPrice {
    /// The model's name, without the `*` of a prefix.
    pub name: String,
    /// Whether the name is a prefix (`gpt-4o*`); the longest matching prefix wins, and an
    /// exact name wins over any prefix.
    pub prefix: bool,
    /// Its prices.
    pub rates: Rates,
}

/// The prices of one model, in the rule's unit per [`Price::per`] tokens.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Rates {
    /// Input tokens not read from the cache.
    pub input: u32,
    /// Input tokens read from the cache (default: `input`).
    pub cached_input: u32,
    /// Input tokens written to the cache (Anthropic; default: `input`).
    pub cache_write: u32,
    /// Output tokens.
    pub output: u32,
}

/// Which prices a request is charged at.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Priced {
    /// The row at this index of [`Price::models`].
    Model(u16),
    /// The default price.
    Default,
    /// The answer names the model: known when its usage is (the dearest prices until then).
    Answer,
    /// No price for the model named: the dearest of each kind (a shadow rule's charge for
    /// what it would have refused).
    Dearest,
}

impl Rates {
    /// The price of `kind`.
    pub fn of(&self, kind: Tokens) -> u32 {
        match kind {
            Tokens::Input => self.input,
            Tokens::Cached => self.cached_input,
            Tokens::CacheWrite => self.cache_write,
            Tokens::Output => self.output,
        }
    }

    /// The highest of each price of `self` and `other`.
    pub fn max(self, other: Rates) -> Rates {
        Rates {
            input: self.input.max(other.input),
            cached_input: self.cached_input.max(other.cached_input),
            cache_write: self.cache_write.max(other.cache_write),
            output: self.output.max(other.output),
        }
    }
}

impl Price {
    /// The prices of the model named `model` (a string, as a body scan keeps it); `None` for
    /// a model neither in the table nor covered by a default (refused).
    pub fn lookup(&self, model: Option<&[u8]>) -> Option<Priced> {
        let Some(name) = model else {
            return self.default.map(|_| Priced::Default);
        };
        let mut best: Option<(usize, usize)> = None; // (index, length matched)
        for (i, row) in self.models.iter().enumerate() {
            let fits = if row.prefix {
                name.starts_with(row.name.as_bytes())
            } else {
                name == row.name.as_bytes()
            };
            // An exact name counts as longer than any prefix.
            let length = if row.prefix {
                row.name.len()
            } else {
                usize::MAX
            };
            if fits && best.is_none_or(|(_, l)| length > l) {
                best = Some((i, length));
            }
        }
        match best.and_then(|(i, _)| u16::try_from(i).ok()) {
            Some(i) => Some(Priced::Model(i)),
            None => self.default.map(|_| Priced::Default),
        }
    }

    /// The prices `priced` stands for (`Priced::Answer`: the dearest, the model being unknown
    /// yet).
    pub fn rates(&self, priced: Priced) -> Rates {
        match priced {
            Priced::Model(i) => self
                .models
                .get(usize::from(i))
                .map_or(self.dearest, |m| m.rates),
            Priced::Default => self.default.unwrap_or(self.dearest),
            Priced::Answer | Priced::Dearest => self.dearest,
        }
    }

    /// The money for `tokens` of each kind at `rates`: exact in integers, divided by
    /// [`Price::per`] and rounded up (a charge is never below what the tokens cost).
    pub fn cost(&self, rates: Rates, tokens: impl Fn(Tokens) -> u64) -> u64 {
        let input = match self.api {
            // Their input counts the cached part, priced apart.
            body::PriceApi::OpenAi | body::PriceApi::Gemini => {
                tokens(Tokens::Input).saturating_sub(tokens(Tokens::Cached))
            }
            body::PriceApi::Anthropic => tokens(Tokens::Input),
        };
        let total: u128 = [
            (input, rates.input),
            (tokens(Tokens::Cached), rates.cached_input),
            (tokens(Tokens::CacheWrite), rates.cache_write),
            (tokens(Tokens::Output), rates.output),
        ]
        .iter()
        .map(|&(n, rate)| u128::from(n) * u128::from(rate))
        .sum();
        let per = u128::from(self.per.max(1));
        u64::try_from(total.div_ceil(per)).unwrap_or(u64::MAX)
    }

    /// The money an answer reported, a scan having found `value` in each slot, at `priced`
    /// (`Priced::Answer`: the model the scan found, by `text`); `None` if the answer reported
    /// none of the tokens.
    pub fn total<'t>(
        &self,
        priced: Priced,
        value: impl Fn(usize) -> Option<u64>,
        text: impl Fn(usize) -> Option<&'t [u8]>,
    ) -> Option<u64> {
        let mut found = false;
        let mut sums = [0u64; 4];
        for (kind, t) in &self.terms {
            if let Some(v) = value(t.slot) {
                found = true;
                if let Some(s) = sums.get_mut(kind_index(*kind)) {
                    *s = s.saturating_add(v.saturating_mul(u64::from(t.weight)));
                }
            }
        }
        if !found {
            return None;
        }
        let priced = match (&self.model, priced) {
            (ModelFrom::Answer(t), _) => {
                // A model from the answer always has a default (checked at load).
                self.lookup(text(t.slot)).unwrap_or(Priced::Dearest)
            }
            (ModelFrom::Body(_), p) => p,
        };
        let rates = self.rates(priced);
        Some(self.cost(rates, |k| sums.get(kind_index(k)).copied().unwrap_or(0)))
    }

    /// The reservation for a request naming `maximum` output tokens with an input estimated at
    /// `input` tokens, at `priced`.
    pub fn reservation(&self, priced: Priced, maximum: u64, input: u64) -> u64 {
        let rates = self.rates(priced);
        self.cost(rates, |k| match k {
            Tokens::Input => input,
            Tokens::Output => maximum,
            Tokens::Cached | Tokens::CacheWrite => 0,
        })
    }
}

fn kind_index(kind: Tokens) -> usize {
    match kind {
        Tokens::Input => 0,
        Tokens::Cached => 1,
        Tokens::CacheWrite => 2,
        Tokens::Output => 3,
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::panic)]
mod tests {
    use super::*;
    use crate::config::Config;

    fn price(per: &str, default: &str) -> Price {
        let json = format!(
            r#"{{"rules": [{{"name": "usd", "rate_limit": {{"requests_per_unit": 1000000, "unit": "day"}},
            "cost": {{"response": {{"price": {{"usage": "anthropic", "model": "body:model", "per": "{per}",
              "models": {{"claude-*": {{"input": 1, "output": 5}}, "claude-opus-*": {{"input": 15, "output": 75}},
                         "claude-opus-4": {{"input": 20, "output": 80, "cached_input": 2, "cache_write": 25}}}},
              "default": {default}}}}}}}}}]}}"#
        );
        let config = Config::parse(json.as_bytes()).unwrap();
        config.rules[0].price().unwrap().clone()
    }

    #[test]
    fn an_exact_name_beats_the_longest_prefix_which_beats_a_shorter_one() {
        let p = price("token", r#""refuse""#);
        let rates = |m: &str| p.lookup(Some(m.as_bytes())).map(|x| p.rates(x).input);
        assert_eq!(rates("claude-opus-4"), Some(20));
        assert_eq!(rates("claude-opus-4-1"), Some(15));
        assert_eq!(rates("claude-haiku"), Some(1));
        assert_eq!(rates("claude-"), Some(1));
        assert_eq!(rates("claude"), None, "refused");
        assert_eq!(p.lookup(None), None, "no model: refused too");
        // Unset cached and cache-write prices are the input's.
        let haiku = p.rates(p.lookup(Some(b"claude-haiku")).unwrap());
        assert_eq!((haiku.cached_input, haiku.cache_write), (1, 1));
        // The dearest of each kind, for a reservation before the model is known.
        assert_eq!(
            p.dearest,
            Rates {
                input: 20,
                cached_input: 15,
                cache_write: 25,
                output: 80
            }
        );
    }

    #[test]
    fn a_cost_is_exact_per_token_and_rounded_up_once_per_larger_unit() {
        let tokens = |k| match k {
            Tokens::Input => 3,
            Tokens::Cached => 1000,
            Tokens::CacheWrite => 10,
            Tokens::Output => 7,
        };
        let opus4 = Rates {
            input: 20,
            cached_input: 2,
            cache_write: 25,
            output: 80,
        };
        // Anthropic's input excludes the cache: every kind counts in full.
        assert_eq!(
            price("token", "{\"input\": 1, \"output\": 1}").cost(opus4, tokens),
            60 + 2000 + 250 + 560
        );
        assert_eq!(price("1K tokens", "\"refuse\"").cost(opus4, tokens), 3);
        assert_eq!(price("1M tokens", "\"refuse\"").cost(opus4, tokens), 1);
        assert_eq!(price("1M tokens", "\"refuse\"").cost(opus4, |_| 0), 0);
        // No overflow: the most of every kind at the highest price.
        let max = Rates {
            input: u32::MAX,
            cached_input: u32::MAX,
            cache_write: u32::MAX,
            output: u32::MAX,
        };
        assert_eq!(
            price("token", "\"refuse\"").cost(max, |_| u64::MAX),
            u64::MAX
        );
        // A reservation: the output maximum and the input estimate.
        let p = price("token", "\"refuse\"");
        let opus = p.lookup(Some(b"claude-opus-4")).unwrap();
        assert_eq!(p.reservation(opus, 100, 40), 100 * 80 + 40 * 20);
    }
}
