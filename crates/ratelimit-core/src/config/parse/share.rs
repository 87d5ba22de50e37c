//! Reading `share`: one capacity shared among a rule's tenants. What a shared rule cannot be
//! combined with, the tenants' weights, the bands and each request's band, how the capacity is
//! shared, the line refused requests may wait in, and `share.learn` (the capacity held to what a
//! provider says of its own).
//!
//! Uses the reader's helpers and the configuration's types (`super`), and below the
//! configuration: the shared capacity's parameters (`crate::share`) and what a provider's
//! answers state (`crate::provider`).

use super::*;
use crate::elastic;

impl Validator {
    /// What a shared rule cannot be combined with (each refused at its own field).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn share_rules(
        &mut self,
        path: &str,
        key: &Option<Vec<KeyPart>>,
        limit: Option<Limit>,
        cost: &Option<Cost>,
        per_request: &Option<PerRequest>,
        global: &Option<Option<Global>>,
        elastic: &Option<Option<elastic::Params>>,
    ) {
        if matches!(key, Some(k) if k.is_empty()) {
            self.error(
                &join(path, "key"),
                "a shared capacity is divided among the rule's keys (its tenants): give it a \"key\"",
            );
        }
        match limit {
            Some(Limit::InFlight { .. }) => self.error(
                &join(path, "in_flight"),
                "a shared capacity is a rate: not \"in_flight\"",
            ),
            Some(Limit::Rate {
                algorithm: a @ (Algorithm::SlidingLog | Algorithm::FixedWindow),
                ..
            }) => self.error(
                &join(path, "algorithm"),
                format!(
                    "a shared capacity uses \"sliding_window\", \"token_bucket\" or \"leaky_bucket\", not {:?}",
                    a.name()
                ),
            ),
            Some(Limit::Rate {
                algorithm:
                    Algorithm::LeakyBucket {
                        max_delay_ms: Some(_),
                        ..
                    },
                ..
            }) => self.error(
                &join(path, "on_limit"),
                "a shared capacity refuses: \"delay\" is not supported with \"share\"",
            ),
            _ => {}
        }
        if matches!(cost, Some(Cost::Response(c)) if !c.true_up) {
            self.error(
                &join(path, "cost"),
                "a shared capacity counts what a request costs when it arrives: charge it from the response with a reservation trued up (\"reserve\" and \"true_up\": true)",
            );
        }
        if matches!(per_request, Some(p) if p.any()) {
            self.error(
                &join(path, "rate_limit"),
                "a shared capacity is one number for all tenants: it cannot come from the request (weigh tenants with \"share.weight\")",
            );
        }
        if matches!(global, Some(Some(g)) if g.mode != GlobalMode::Lease) {
            self.error(
                &join(&join(path, "global"), "mode"),
                "a shared capacity across Envoys is leased from the service: \"mode\": \"lease\"",
            );
        }
        if matches!(elastic, Some(Some(_))) {
            self.error(
                &join(path, "elastic"),
                "a shared capacity cannot be elastic",
            );
        }
    }

    /// `share`: the tenants' weights, the bands, and how the capacity is shared.
    /// `quota_unit`: the rule's (`None`: it did not parse; `Some(None)`: requests).
    pub(super) fn share(
        &mut self,
        v: &Value,
        path: &str,
        quota_unit: Option<Option<&str>>,
    ) -> Option<ShareConfig> {
        let map = self.object(
            v,
            path,
            &[
                "weight",
                "bands",
                "band",
                "active_s",
                "saturation",
                "target",
                "learn",
                "max_wait_ms",
                "max_queued",
                "max_queued_per_tenant",
                "fleet",
            ],
        )?;
        let learn = match map.get("learn") {
            Some(l) => self.learn(l, &join(path, "learn"), quota_unit).map(Some),
            None => Some(None),
        };
        let (weight, weight_from) = match map.get("weight") {
            Some(w) => {
                let p = join(path, "weight");
                match self.amount(w, &p) {
                    Some((n, from)) => {
                        let most = from.as_ref().map_or(n, |f| f.max);
                        if most > u32::from(u16::MAX) {
                            self.error(&p, format!("a weight is at most 65535, found {most}"));
                            (None, None)
                        } else {
                            (u16::try_from(n).ok(), Some(from))
                        }
                    }
                    None => (None, None),
                }
            }
            None => (Some(1), Some(None)),
        };
        let bands = match map.get("bands") {
            Some(b) => self.bands(b, &join(path, "bands")),
            None => Some(vec![("default".to_string(), 0)]),
        };
        let (band_from, band_default) = match (map.get("band"), &bands) {
            (Some(b), Some(bands)) if bands.len() > 1 => self.band(b, &join(path, "band"), bands),
            (Some(_), Some(_)) => {
                self.error(
                    &join(path, "band"),
                    "one band only: there is no band to choose",
                );
                (None, None)
            }
            (None, Some(bands)) if bands.len() > 1 => {
                self.error(
                    &join(path, "band"),
                    "required with more than one band (where each request's band is read)",
                );
                (None, None)
            }
            (_, _) => (Some(None), Some(0)),
        };
        let active_s = match map.get("active_s") {
            Some(a) => self.integer(a, &join(path, "active_s"), 1, 3_600),
            None => Some(DEFAULT_ACTIVE_S),
        };
        let mut fraction = |field: &str, default: u64| match map.get(field) {
            Some(n) => self
                .number(n, &join(path, field), (0.5, 1.0, "0.5 to 1"))
                .map(|n| (n * 1000.0).round() as u64),
            None => Some(default),
        };
        let saturation = fraction("saturation", DEFAULT_SATURATION);
        let target = fraction("target", DEFAULT_TARGET);
        let bands = bands?;
        let mut min_share_pm = [0; crate::share::MAX_BANDS];
        for (slot, (_, pm)) in min_share_pm.iter_mut().zip(&bands) {
            *slot = *pm;
        }
        let max_wait_ms = match map.get("max_wait_ms") {
            Some(n) => self.integer(n, &join(path, "max_wait_ms"), 0, 60_000),
            None => Some(0),
        };
        let max_queued = match map.get("max_queued") {
            Some(n) => self.integer(n, &join(path, "max_queued"), 1, 4_096),
            None => Some(256),
        };
        let max_queued_per_tenant = match map.get("max_queued_per_tenant") {
            Some(n) => self.integer(n, &join(path, "max_queued_per_tenant"), 1, 256),
            None => Some(8),
        };
        let fleet_fair = match map.get("fleet") {
            Some(f) => self.choice(
                f,
                &join(path, "fleet"),
                "way of sharing across Envoys",
                &[("local", false), ("fair", true)],
            ),
            None => Some(false),
        };
        let learn = learn?;
        Some(ShareConfig {
            fleet_fair: fleet_fair?,
            learn,
            max_wait_ms: max_wait_ms?,
            max_queued: max_queued? as usize,
            max_queued_per_tenant: max_queued_per_tenant? as usize,
            weight: weight?,
            weight_from: weight_from?,
            band_from: band_from?,
            band_default: band_default?,
            params: crate::share::Share {
                active_ms: active_s? * 1000,
                saturation_pm: saturation?,
                target_pm: target?,
                bands: bands.len(),
                min_share_pm,
                ramp_ms: learn.map_or(0, |l| l.ramp_ms),
            },
            bands: bands.into_iter().map(|(name, _)| name).collect(),
        })
    }

    /// `share.learn`: whose fields hold the capacity to the provider's, and for how long.
    fn learn(
        &mut self,
        v: &Value,
        path: &str,
        quota_unit: Option<Option<&str>>,
    ) -> Option<crate::share::learn::Learn> {
        use crate::provider::{Api, Measure};
        let map = self.object(
            v,
            path,
            &["from", "unit", "hold_s", "ramp_s", "max_block_s", "strip"],
        )?;
        let api = match map.get("from") {
            Some(f) => self.choice(
                f,
                &join(path, "from"),
                "provider",
                &[("openai", Api::OpenAi), ("anthropic", Api::Anthropic)],
            ),
            None => {
                self.error(&join(path, "from"), "required field is missing");
                None
            }
        };
        let measure = match (api, quota_unit) {
            (Some(api), Some(unit)) => {
                let measure = match Kind::of_unit(unit) {
                    Some(Kind::Requests) => Some(Measure::Requests),
                    Some(Kind::Tokens) => Some(Measure::Tokens),
                    Some(Kind::InputTokens) => Some(Measure::InputTokens),
                    Some(Kind::OutputTokens) => Some(Measure::OutputTokens),
                    None => None,
                }
                .filter(|&m| crate::provider::field_names(api, m).is_some());
                if measure.is_none() {
                    self.error(
                        &join(path, "from"),
                        format!(
                            "the provider states no limit in {:?} (the rule's quota_unit): it states requests and tokens{}",
                            unit.unwrap_or("requests"),
                            if api == Api::Anthropic {
                                ", input-tokens and output-tokens"
                            } else {
                                ""
                            }
                        ),
                    );
                }
                measure
            }
            _ => None,
        };
        let unit = match map.get("unit") {
            Some(u) => self.unit(
                u,
                &join(path, "unit"),
                &[Unit::Second, Unit::Minute, Unit::Hour, Unit::Day],
            ),
            None => Some(Unit::Minute),
        };
        let mut seconds = |field: &str, default: u64, min: u64| match map.get(field) {
            Some(n) => self.integer(n, &join(path, field), min, 3_600),
            None => Some(default),
        };
        let hold_s = seconds("hold_s", 60, 1);
        let ramp_s = seconds("ramp_s", 30, 0);
        let max_block_s = seconds("max_block_s", 60, 1);
        let strip = match map.get("strip") {
            Some(b) => self.boolean(b, &join(path, "strip")),
            None => Some(true),
        };
        Some(crate::share::learn::Learn {
            api: api?,
            measure: measure?,
            window_ms: unit?.seconds() * 1000,
            hold_ms: hold_s? * 1000,
            ramp_ms: ramp_s? * 1000,
            max_block_ms: max_block_s? * 1000,
            strip: strip?,
        })
    }

    /// `share.bands`: 1 to 4 named bands, highest priority first, each with its reserved share.
    fn bands(&mut self, v: &Value, path: &str) -> Option<Vec<(String, u64)>> {
        let Some(items) = v.as_array() else {
            self.error(
                path,
                format!("expected an array of bands, found {}", describe(v)),
            );
            return None;
        };
        if !(1..=crate::share::MAX_BANDS).contains(&items.len()) {
            self.error(
                path,
                format!(
                    "1 to {} bands, found {}",
                    crate::share::MAX_BANDS,
                    items.len()
                ),
            );
            return None;
        }
        let mut bands: Vec<(String, u64)> = Vec::new();
        let mut ok = true;
        for (i, item) in items.iter().enumerate() {
            let p = format!("{path}[{i}]");
            let Some(m) = self.object(item, &p, &["name", "min_share"]) else {
                ok = false;
                continue;
            };
            let name = match m.get("name") {
                Some(n) => self.name(n, &join(&p, "name"), "band"),
                None => {
                    self.error(&join(&p, "name"), "required field is missing");
                    None
                }
            };
            let min_share = match m.get("min_share") {
                Some(n) => self
                    .number(n, &join(&p, "min_share"), (0.0, 1.0, "0 to 1"))
                    .map(|n| (n * 1000.0).round() as u64),
                None => Some(0),
            };
            match (name, min_share) {
                (Some(name), Some(pm)) => {
                    if bands.iter().any(|(b, _)| *b == name) {
                        self.error(&join(&p, "name"), format!("{name:?} is already a band"));
                        ok = false;
                    }
                    bands.push((name, pm));
                }
                _ => ok = false,
            }
        }
        let reserved: u64 = bands.iter().map(|(_, pm)| pm).sum();
        if reserved > 1000 {
            self.error(
                path,
                format!(
                    "the bands' min_share add up to {}.{:03}, more than 1",
                    reserved / 1000,
                    reserved % 1000
                ),
            );
            ok = false;
        }
        ok.then_some(bands)
    }

    /// `share.band`: `{"from": SOURCE, "default": NAME}`.
    fn band(
        &mut self,
        v: &Value,
        path: &str,
        bands: &[(String, u64)],
    ) -> (Option<Option<Source>>, Option<u8>) {
        let Some(map) = self.object(v, path, &["from", "default"]) else {
            return (None, None);
        };
        let source = match map.get("from") {
            Some(f) => {
                let p = join(path, "from");
                self.string(f, &p).and_then(|s| self.source(s, &p))
            }
            None => {
                self.error(&join(path, "from"), "required field is missing");
                None
            }
        };
        let default = match map.get("default") {
            Some(d) => {
                let p = join(path, "default");
                self.string(d, &p).and_then(|name| {
                    let found = bands.iter().position(|(b, _)| b == name);
                    if found.is_none() {
                        self.error(&p, format!("{name:?} is not a band"));
                    }
                    found.and_then(|i| u8::try_from(i).ok())
                })
            }
            None => {
                self.error(
                    &join(path, "default"),
                    "required field is missing (the band of a request that names none)",
                );
                None
            }
        };
        (source.map(Some), default)
    }
}
