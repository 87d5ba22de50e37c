//! Reading `cost.response.price`: a rule charged in money for the tokens an LLM API's answer
//! reports. The API, where the model's name comes from, the price table by model (exact names
//! and prefixes), its `per` and the price of a model not in it.
//!
//! Uses the reader's helpers and the configuration's types (`super`), the price fields of
//! `config::body`, and the bounds of the body scanner (`crate::usage`).

use super::*;

impl Validator {
    /// `cost.response` as a price: `{"price": {"usage", "model", "per", "models", "default"}}`.
    pub(super) fn price(&mut self, v: &Value, path: &str) -> Option<Price> {
        let map = self.object(v, path, &["price"])?;
        let path = join(path, "price");
        let Some(v) = map.get("price") else {
            self.error(
                &path,
                "required field is missing (an object response is a price)",
            );
            return None;
        };
        let map = self.object(v, &path, &["usage", "model", "per", "models", "default"])?;
        let up = join(&path, "usage");
        let api = match map.get("usage") {
            Some(u) => self.choice(u, &up, "API", &body::PriceApi::NAMES),
            None => {
                self.error(&up, "required field is missing (the API whose answers are priced: openai, anthropic, gemini)");
                None
            }
        };
        let mp = join(&path, "model");
        let model = match (map.get("model").map(|m| self.string(m, &mp)), api) {
            (Some(Some("response")), Some(api)) => Some(ModelFrom::Answer(body::model_term(api))),
            (Some(Some("response")), None) => None,
            (Some(Some(s)), _) => match s.strip_prefix("body:") {
                Some(field) => self.body_field(field, &mp).map(ModelFrom::Body),
                None => {
                    self.error(&mp, format!("unknown model source {s:?} (expected body:PATH, e.g. body:model, or response)"));
                    None
                }
            },
            (Some(None), _) => None,
            (None, _) => {
                self.error(
                    &mp,
                    "required field is missing (body:PATH, e.g. body:model, or response)",
                );
                None
            }
        };
        let per = match map.get("per") {
            Some(p) => self.choice(
                p,
                &join(&path, "per"),
                "price unit",
                &[("token", 1), ("1K tokens", 1_000), ("1M tokens", 1_000_000)],
            ),
            None => Some(1_000_000),
        };
        let writes = api.is_none_or(body::PriceApi::writes_cache);
        let tp = join(&path, "models");
        let models = match map.get("models") {
            Some(Value::Object(table)) if !table.is_empty() => {
                let mut rows = Vec::new();
                for (name, v) in table {
                    let rp = join(&tp, name);
                    let (bare, prefix) = match name.strip_suffix('*') {
                        Some(bare) => (bare, true),
                        None => (name.as_str(), false),
                    };
                    if bare.is_empty() || bare.contains('*') || name.len() > crate::usage::MAX_TEXT
                    {
                        self.error(&rp, format!("invalid model name (expected a model's name, or a prefix ending in *, at most {} bytes: \"default\" prices the others)", crate::usage::MAX_TEXT));
                        continue;
                    }
                    if let Some(rates) = self.rates(v, &rp, writes) {
                        rows.push(ModelPrice {
                            name: bare.to_string(),
                            prefix,
                            rates,
                        });
                    }
                }
                (rows.len() == table.len()).then_some(rows)
            }
            Some(Value::Object(_)) => {
                self.error(
                    &tp,
                    "no model (at least one model and its prices: \"default\" prices the others)",
                );
                None
            }
            Some(v) => {
                self.error(
                    &tp,
                    format!(
                        "expected an object of models and their prices, found {}",
                        describe(v)
                    ),
                );
                None
            }
            None => {
                self.error(&tp, "required field is missing (each model and its prices)");
                None
            }
        };
        let dp = join(&path, "default");
        let default = match map.get("default") {
            Some(Value::String(s)) if s == "refuse" => match model {
                Some(ModelFrom::Answer(_)) => {
                    self.error(&dp, "a model named by the answer is known only once the request has passed: it cannot be refused (give a price)");
                    None
                }
                _ => Some(None),
            },
            Some(v @ Value::Object(_)) => self.rates(v, &dp, writes).map(Some),
            Some(v) => {
                self.error(
                    &dp,
                    format!(
                        "expected \"refuse\" or the prices of a model not in \"models\", found {}",
                        describe(v)
                    ),
                );
                None
            }
            None => {
                self.error(&dp, "required field is missing (the prices of a model not in \"models\", or \"refuse\")");
                None
            }
        };
        let (api, model, per, models, default) = (api?, model?, per?, models?, default?);
        let dearest = models
            .iter()
            .map(|m| m.rates)
            .chain(default)
            .fold(Rates::default(), Rates::max);
        Some(Price {
            api,
            terms: body::price_terms(api),
            model,
            per,
            models,
            default,
            dearest,
        })
    }

    /// A model's prices: `input` and `output` required, `cached_input` and (where the answers
    /// report them: `writes`) `cache_write` defaulting to `input`.
    fn rates(&mut self, v: &Value, path: &str, writes: bool) -> Option<Rates> {
        let fields: &[&str] = if writes {
            &["input", "cached_input", "cache_write", "output"]
        } else {
            &["input", "cached_input", "output"]
        };
        let map = self.object(v, path, fields)?;
        let mut get = |name: &str, required: bool| match map.get(name) {
            Some(n) => self
                .integer(n, &join(path, name), 0, u64::from(u32::MAX))
                .and_then(|n| u32::try_from(n).ok())
                .map(Some),
            None if required => {
                self.error(&join(path, name), "required field is missing");
                None
            }
            None => Some(None),
        };
        let input = get("input", true);
        let output = get("output", true);
        let cached = get("cached_input", false);
        let write = get("cache_write", false);
        let input = input??;
        Some(Rates {
            input,
            output: output??,
            cached_input: cached?.unwrap_or(input),
            cache_write: write?.unwrap_or(input),
        })
    }
}
