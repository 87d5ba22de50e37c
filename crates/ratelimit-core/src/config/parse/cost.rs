//! Reading `cost`: what a request costs under a rule. A fixed amount, a request header's value,
//! or what the response reports (`cost.response`: a header, the body's bytes, or fields of the
//! body by expression or preset), with its `reserve` (a number, or sized from the request's
//! body), its `default` and `true_up`. A cost in money is read by `price.rs`.
//!
//! Uses the reader's helpers and the configuration's types (`super`), and the expressions and
//! presets of `config::body`.

use super::*;

impl Validator {
    /// `capacity`: the most one request can ever be admitted for.
    pub(super) fn cost(
        &mut self,
        v: &Value,
        path: &str,
        limit: Limit,
        capacity: u32,
    ) -> Option<Cost> {
        match v {
            Value::Object(map) if map.contains_key("response") => {
                let map = self.object(v, path, &["response", "reserve", "default", "true_up"])?;
                let charge = self.charge(map, path, capacity);
                if let (Some(_), Limit::Rate { algorithm, .. }) = (&charge, limit) {
                    let why = match algorithm {
                        Algorithm::SlidingLog => Some("sliding_log stores one time per unit counted and cannot take a usage known only afterwards (use sliding_window)"),
                        Algorithm::LeakyBucket { max_delay_ms: Some(_), .. } => Some("a request charged by its response cannot be delayed: its cost is not known when it would be held"),
                        _ => None,
                    };
                    if let Some(why) = why {
                        self.error(&join(path, "response"), why);
                        return None;
                    }
                }
                charge.map(Cost::Response)
            }
            Value::Object(_) => {
                let map = self.object(v, path, &["header"])?;
                let p = join(path, "header");
                match map.get("header") {
                    Some(h) => {
                        let name = self.string(h, &p)?;
                        self.header_name(name, &p).map(Cost::Header)
                    }
                    None => {
                        self.error(
                            &p,
                            "required field is missing (or \"response\" for a cost the response reports)",
                        );
                        None
                    }
                }
            }
            _ => {
                let n = self.integer(v, path, 1, u64::from(u32::MAX))?;
                if n > u64::from(capacity) {
                    self.error(path, too_much(n, capacity));
                    return None;
                }
                u32::try_from(n).ok().map(Cost::Fixed)
            }
        }
    }

    /// A cost charged from the response: `response` (`header:NAME`, `body_bytes`, a body
    /// expression or a preset), its `reserve` (a number, or sized from the request's body),
    /// its `default` and `true_up`.
    fn charge(&mut self, map: &Map<String, Value>, path: &str, capacity: u32) -> Option<Charge> {
        let p = join(path, "response");
        let usage = match map.get("response").map(|r| (r, r.as_str())) {
            Some((r @ Value::Object(_), _)) => self.price(r, &p).map(|x| Usage::Price(Box::new(x))),
            Some((r, None)) => {
                self.error(
                    &p,
                    format!(
                        "expected a string (a usage) or an object (a price), found {}",
                        describe(r)
                    ),
                );
                None
            }
            Some((_, Some("body_bytes"))) => Some(Usage::BodyBytes),
            Some((_, Some(s))) if s.starts_with("header:") => {
                let name = s.trim_start_matches("header:");
                self.header_name(name, &p).map(Usage::Header)
            }
            Some((_, Some(s))) => match body::expression(s, &body::RESPONSE_PRESETS) {
                Ok(terms) => Some(Usage::Body(BodyUsage {
                    terms: terms.into_iter().map(body::term).collect(),
                })),
                Err(why) => {
                    let reason = if s.contains("json:") {
                        format!("usage {s:?}: {why}")
                    } else {
                        format!(
                            "unknown usage {s:?} (expected header:NAME, body_bytes, a preset ({}), \
                             or json:PATH fields, e.g. json:usage.total_tokens)",
                            body::names(&body::RESPONSE_PRESETS)
                        )
                    };
                    self.error(&p, reason);
                    None
                }
            },
            _ => None,
        };
        let rp = join(path, "reserve");
        let (reserve, sized) = match map.get("reserve") {
            Some(r @ Value::Object(_)) => match self.sized(r, &rp, capacity) {
                Some((reserve, sized)) => (Some(reserve), Some(Some(sized))),
                None => (None, None),
            },
            Some(r) => match self.integer(r, &rp, 0, u64::from(u32::MAX)) {
                Some(n) if n > u64::from(capacity) => {
                    self.error(&rp, too_much(n, capacity));
                    (None, Some(None))
                }
                n => (n, Some(None)),
            },
            None => (Some(0), Some(None)),
        };
        let default = match (map.get("default"), &usage) {
            (Some(_), Some(Usage::BodyBytes)) => {
                self.error(
                    &join(path, "default"),
                    "not used with \"body_bytes\" (the bytes that passed are always known)",
                );
                None
            }
            (Some(d), _) => self
                .integer(d, &join(path, "default"), 0, u64::from(u32::MAX))
                .map(Some),
            (None, _) => Some(None),
        };
        let true_up = match map.get("true_up") {
            Some(t) => self.boolean(t, &join(path, "true_up")),
            None => Some(false),
        };
        // The reservation follows what the rule charges.
        let counts = map
            .get("response")
            .and_then(Value::as_str)
            .and_then(|s| body::counts(s, &body::RESPONSE_PRESETS).map(|c| (s, c)));
        match (counts, &sized) {
            (Some((s, body::Counts::Input)), Some(Some(z))) if z.from.is_some() => self.error(
                &join(&rp, "from"),
                format!("{s:?} charges input tokens: its reservation is the input estimate (\"input\"), not the output maximum the request names (that is an output rule's)"),
            ),
            (Some((s, body::Counts::Output)), Some(Some(z))) if z.input != Input::Fixed(0) => self.error(
                &join(&rp, "input"),
                format!("{s:?} charges output tokens: its reservation is the output maximum the request names (\"from\"), not an input estimate (that is an input rule's)"),
            ),
            _ => {}
        }
        Some(Charge {
            usage: usage?,
            reserve: u32::try_from(reserve?).ok()?,
            sized: sized?,
            default: match default? {
                Some(d) => Some(u32::try_from(d).ok()?),
                None => None,
            },
            true_up: true_up?,
        })
    }

    /// A reservation sized from the request's body: `from` (a preset or `json:PATH`
    /// alternatives), `input` (`N` or `"bytes/N"`), `default` (required: what a body naming no
    /// maximum reserves) and `max_body`. Gives (the default, the sizing).
    fn sized(&mut self, v: &Value, path: &str, capacity: u32) -> Option<(u64, Sized)> {
        let map = self.object(v, path, &["from", "input", "default", "max_body"])?;
        let fp = join(path, "from");
        let from = match map.get("from") {
            Some(f) => self.string(f, &fp).and_then(|s| {
                match body::expression(s, &body::REQUEST_PRESETS) {
                    Ok(mut terms) if terms.len() == 1 && terms.first().is_some_and(|t| t.0 == 1) => {
                        terms.pop().map(|t| Some(t.1))
                    }
                    Ok(_) => {
                        self.error(&fp, "expected one field (json:PATH alternatives joined by |), not a sum");
                        None
                    }
                    Err(why) => {
                        let reason = if s.contains("json:") {
                            format!("field {s:?}: {why}")
                        } else {
                            format!("unknown field {s:?} (expected openai, anthropic, gemini, or json:PATH alternatives joined by |)")
                        };
                        self.error(&fp, reason);
                        None
                    }
                }
            }),
            None => Some(None),
        };
        let ip = join(path, "input");
        let input = match map.get("input") {
            Some(Value::String(s)) => match s.strip_prefix("bytes/").map(str::parse::<u32>) {
                Some(Ok(d)) if d >= 1 => Some(Input::PerBytes(d)),
                _ => {
                    self.error(&ip, format!("{s:?} is not \"bytes/N\" with N from 1"));
                    None
                }
            },
            Some(n) => self
                .integer(n, &ip, 0, u64::from(capacity))
                .and_then(|n| u32::try_from(n).ok())
                .map(Input::Fixed),
            None => Some(Input::Fixed(0)),
        };
        let dp = join(path, "default");
        let default = match map.get("default") {
            Some(d) => match self.integer(d, &dp, 1, u64::from(u32::MAX)) {
                Some(n) if n > u64::from(capacity) => {
                    self.error(&dp, too_much(n, capacity));
                    None
                }
                n => n,
            },
            None => {
                self.error(&dp, "required field is missing (what a request whose body names no maximum reserves)");
                None
            }
        };
        let max_body = match map.get("max_body") {
            Some(m) => self
                .integer(m, &join(path, "max_body"), 1, u64::from(MAX_BODY_HELD))
                .and_then(|n| u32::try_from(n).ok()),
            None => Some(DEFAULT_BODY_HELD),
        };
        if let (Some(None), Some(Input::Fixed(_))) = (&from, &input) {
            self.error(
                path,
                "expected \"from\" (the output maximum the request names), \"input\": \"bytes/N\" (an estimate from its size), or both (a reservation of a fixed figure is a number)",
            );
            return None;
        }
        Some((default?, body::sized(from?, input?, max_body?)))
    }
}
