//! JSON in, typed rules out. The JSON is walked by hand rather than through serde derive so that
//! every error names the field path it is about (`rules[0].rate_limit.unit: ...`) in words a user
//! can act on, and so that all errors are reported at once, not just the first.

use super::*;
use crate::elastic;
use crate::limiter::{calendar, sliding_log};
use crate::seed::Seed;
use crate::usage::Paths;
use serde_json::{Map, Value};

impl Config {
    /// Parses and validates a plugin configuration. All errors are returned, each naming its
    /// field; the function never panics, whatever the bytes.
    pub fn parse(bytes: &[u8]) -> Result<Config, ConfigErrors> {
        if bytes.iter().all(u8::is_ascii_whitespace) {
            return Err(ConfigErrors(vec![ConfigError {
                path: "config".into(),
                reason: "the plugin configuration is empty (expected a JSON object with \"rules\")"
                    .into(),
            }]));
        }
        let value: Value = serde_json::from_slice(bytes).map_err(|e| {
            ConfigErrors(vec![ConfigError {
                path: "config".into(),
                reason: format!("invalid JSON: {e}"),
            }])
        })?;
        let mut v = Validator::default();
        let config = v.config(&value);
        match config {
            Some(c) if v.errors.is_empty() => Ok(c),
            _ => Err(ConfigErrors(v.errors)),
        }
    }
}

/// Collects errors while walking the JSON tree.
#[derive(Default)]
struct Validator {
    errors: Vec<ConfigError>,
}

fn join(path: &str, field: &str) -> String {
    if path.is_empty() {
        field.to_string()
    } else {
        format!("{path}.{field}")
    }
}

/// Describes a JSON value for an error message: its type, and the value itself if short.
fn describe(v: &Value) -> String {
    match v {
        Value::Null => "null".into(),
        Value::Bool(b) => format!("boolean {b}"),
        Value::Number(n) => format!("number {n}"),
        Value::String(s) if s.chars().count() <= 40 => format!("string {s:?}"),
        Value::String(_) => "a string".into(),
        Value::Array(_) => "an array".into(),
        Value::Object(_) => "an object".into(),
    }
}

/// Why a cost (or reserve) of `n` can never pass a rule admitting at most `capacity` at once.
fn too_much(n: u64, capacity: u32) -> String {
    format!(
        "{n} exceeds the most the rule can ever admit at once ({capacity}): no request would pass"
    )
}

impl Validator {
    fn error(&mut self, path: &str, reason: impl Into<String>) {
        self.errors.push(ConfigError {
            path: if path.is_empty() {
                "config".into()
            } else {
                path.into()
            },
            reason: reason.into(),
        });
    }

    /// Checks that `v` is an object with only `allowed` fields.
    fn object<'a>(
        &mut self,
        v: &'a Value,
        path: &str,
        allowed: &[&str],
    ) -> Option<&'a Map<String, Value>> {
        let Value::Object(map) = v else {
            self.error(path, format!("expected an object, found {}", describe(v)));
            return None;
        };
        for field in map.keys() {
            if !allowed.contains(&field.as_str()) {
                self.error(
                    &join(path, field),
                    format!("unknown field (expected one of {})", allowed.join(", ")),
                );
            }
        }
        Some(map)
    }

    fn string<'a>(&mut self, v: &'a Value, path: &str) -> Option<&'a str> {
        match v {
            Value::String(s) => Some(s),
            other => {
                self.error(
                    path,
                    format!("expected a string, found {}", describe(other)),
                );
                None
            }
        }
    }

    fn boolean(&mut self, v: &Value, path: &str) -> Option<bool> {
        match v {
            Value::Bool(b) => Some(*b),
            other => {
                self.error(
                    path,
                    format!("expected true or false, found {}", describe(other)),
                );
                None
            }
        }
    }

    /// An integer in `min..=max`.
    fn integer(&mut self, v: &Value, path: &str, min: u64, max: u64) -> Option<u64> {
        match v.as_u64() {
            Some(n) if (min..=max).contains(&n) => Some(n),
            _ => {
                self.error(
                    path,
                    format!(
                        "expected an integer from {min} to {max}, found {}",
                        describe(v)
                    ),
                );
                None
            }
        }
    }

    fn array<'a>(&mut self, v: &'a Value, path: &str) -> Option<&'a [Value]> {
        match v {
            Value::Array(items) => Some(items),
            other => {
                self.error(
                    path,
                    format!("expected an array, found {}", describe(other)),
                );
                None
            }
        }
    }

    /// One of `choices`, by name.
    /// One of `units`, by its name.
    fn unit(&mut self, v: &Value, path: &str, units: &[Unit]) -> Option<Unit> {
        let choices: Vec<(&str, Unit)> = units.iter().map(|&u| (u.name(), u)).collect();
        self.choice(v, path, "unit", &choices)
    }

    fn choice<T: Copy>(
        &mut self,
        v: &Value,
        path: &str,
        what: &str,
        choices: &[(&str, T)],
    ) -> Option<T> {
        let s = self.string(v, path)?;
        let found = choices.iter().find(|(name, _)| *name == s).map(|(_, t)| *t);
        if found.is_none() {
            let names: Vec<&str> = choices.iter().map(|(n, _)| *n).collect();
            self.error(
                path,
                format!("unknown {what} {s:?} (expected {})", names.join(", ")),
            );
        }
        found
    }

    fn config(&mut self, v: &Value) -> Option<Config> {
        let map = self.object(
            v,
            "",
            &[
                "rules",
                "response",
                "failure_mode",
                "capacity",
                "shadow",
                "log_limited",
                "key_seed",
                "operator",
                "max_body",
                "log_body_fields",
            ],
        )?;
        let shadow = match map.get("shadow") {
            Some(b) => self.boolean(b, "shadow"),
            None => Some(false),
        };
        let log_limited = match map.get("log_limited") {
            Some(l) => self.choice(
                l,
                "log_limited",
                "log level",
                &[
                    ("off", LogLevel::Off),
                    ("debug", LogLevel::Debug),
                    ("info", LogLevel::Info),
                    ("warn", LogLevel::Warn),
                ],
            ),
            None => Some(LogLevel::Debug),
        };
        let rules = match map.get("rules") {
            Some(r) => self.rules(r, "rules", shadow.unwrap_or(false)),
            None => {
                self.error("rules", "required field is missing");
                None
            }
        };
        let response = match map.get("response") {
            Some(r) => self.response(r, "response"),
            None => Some(ResponseConfig::default()),
        };
        let failure_mode = match map.get("failure_mode") {
            Some(f) => self.choice(
                f,
                "failure_mode",
                "failure mode",
                &[("allow", FailureMode::Allow), ("deny", FailureMode::Deny)],
            ),
            None => Some(FailureMode::Allow),
        };
        let capacity = match map.get("capacity") {
            Some(c) => self
                .integer(c, "capacity", 1, u64::from(MAX_CAPACITY))
                .and_then(|n| u32::try_from(n).ok()),
            None => Some(DEFAULT_CAPACITY),
        };
        let key_seed = match map.get("key_seed") {
            Some(k) => self
                .string(k, "key_seed")
                .and_then(|s| match Seed::parse_hex(s) {
                    Some(seed) => Some(Some(seed)),
                    None => {
                        self.error(
                            "key_seed",
                            "expected 32 hexadecimal digits (16 random bytes)",
                        );
                        None
                    }
                }),
            None => Some(None),
        };
        let operator = match map.get("operator") {
            Some(o) => self.operator(o, "operator").map(Some),
            None => Some(None),
        };
        let max_body = match map.get("max_body") {
            Some(m) => self
                .integer(m, "max_body", 1, u64::from(MAX_BODY_HELD))
                .and_then(|n| u32::try_from(n).ok()),
            None => Some(DEFAULT_BODY_HELD),
        };
        let log_body_fields = match map.get("log_body_fields") {
            Some(b) => self.boolean(b, "log_body_fields"),
            None => Some(true),
        };
        shadow?;
        let mut config = Config {
            rules: rules?,
            response: response?,
            failure_mode: failure_mode?,
            capacity: capacity?,
            log_limited: log_limited?,
            key_seed: key_seed?,
            usage_paths: Paths::default(),
            request_paths: Paths::default(),
            max_body: max_body?,
            log_body_fields: log_body_fields?,
            operator: operator?,
        };
        if let Err(why) = body::assign(&mut config) {
            self.error("rules", why);
            return None;
        }
        Some(config)
    }

    /// The wasm build's operator route.
    fn operator(&mut self, v: &Value, path: &str) -> Option<OperatorRoute> {
        let map = self.object(v, path, &["path_prefix", "allow_from", "token"])?;
        let field = |name: &str| join(path, name);
        let path_prefix = match map.get("path_prefix") {
            Some(p) => self.string(p, &field("path_prefix")).and_then(|s| {
                let ok = s.starts_with('/')
                    && s.ends_with('/')
                    && s.bytes().all(|b| b.is_ascii_graphic() && b != b'?' && b != b'#');
                if !ok {
                    self.error(
                        &field("path_prefix"),
                        format!("must start and end with \"/\" and hold only visible ASCII other than ? and #, found {s:?}"),
                    );
                }
                ok.then(|| s.to_string())
            }),
            None => {
                self.error(&field("path_prefix"), "required field is missing");
                None
            }
        };
        let allow_from = match map.get("allow_from") {
            Some(a) => self.array(a, &field("allow_from")).and_then(|items| {
                if items.is_empty() {
                    self.error(
                        &field("allow_from"),
                        "at least one network is required (such as \"127.0.0.1/32\")",
                    );
                    return None;
                }
                let mut nets = Vec::with_capacity(items.len());
                for (i, item) in items.iter().enumerate() {
                    let p = format!("{}[{i}]", field("allow_from"));
                    match self.string(item, &p).map(Cidr::parse) {
                        Some(Ok(net)) => nets.push(net),
                        Some(Err(why)) => self.error(&p, why),
                        None => {}
                    }
                }
                (nets.len() == items.len()).then_some(nets)
            }),
            None => {
                self.error(&field("allow_from"), "required field is missing");
                None
            }
        };
        let token = match map.get("token") {
            Some(t) => self.string(t, &field("token")).and_then(|s| {
                let secret = Secret::new(s);
                if secret.is_none() {
                    self.error(
                        &field("token"),
                        format!(
                            "expected a secret of at least {} characters of visible ASCII (! to ~, no spaces), found {} characters",
                            Secret::MIN_LEN,
                            s.chars().count(),
                        ),
                    );
                }
                secret
            }),
            None => {
                self.error(&field("token"), "required field is missing");
                None
            }
        };
        Some(OperatorRoute {
            path_prefix: path_prefix?,
            allow_from: allow_from?,
            token: token?,
        })
    }

    fn rules(&mut self, v: &Value, path: &str, shadow: bool) -> Option<Vec<Rule>> {
        let items = self.array(v, path)?;
        if items.is_empty() {
            self.error(path, "at least one rule is required");
            return None;
        }
        let mut rules = Vec::with_capacity(items.len());
        let mut names = std::collections::HashSet::with_capacity(items.len());
        let mut ok = true;
        for (i, item) in items.iter().enumerate() {
            let p = format!("{path}[{i}]");
            match self.rule(item, &p, shadow) {
                Some(rule) => {
                    if !names.insert(rule.name.clone()) {
                        self.error(
                            &join(&p, "name"),
                            format!("duplicate rule name {:?}", rule.name),
                        );
                        ok = false;
                    }
                    rules.push(rule);
                }
                None => ok = false,
            }
        }
        ok.then_some(rules)
    }

    fn rule(&mut self, v: &Value, path: &str, default_shadow: bool) -> Option<Rule> {
        let map = self.object(
            v,
            path,
            &[
                "name",
                "match",
                "key",
                "on_missing_key",
                "rate_limit",
                "in_flight",
                "algorithm",
                "burst",
                "on_limit",
                "max_delay_ms",
                "cost",
                "quota_unit",
                "shadow",
                "global",
                "elastic",
                "share",
            ],
        )?;
        let name = match map.get("name") {
            Some(n) => self.rule_name(n, &join(path, "name")),
            None => {
                self.error(&join(path, "name"), "required field is missing");
                None
            }
        };
        let matcher = match map.get("match") {
            Some(m) => self.matcher(m, &join(path, "match")),
            None => Some(Match::default()),
        };
        let key = match map.get("key") {
            Some(k) => self.key(k, &join(path, "key")),
            None => Some(Vec::new()),
        };
        let (limit, per_request) = match self.limit(map, path) {
            Some((l, p)) => (Some(l), Some(p)),
            None => (None, None),
        };
        let cost = match (map.get("cost"), limit, &per_request) {
            (None, _, _) => Some(Cost::Fixed(1)),
            (Some(c), Some(l), Some(p)) => self.cost(c, &join(path, "cost"), l, l.capacity_with(p)),
            (Some(_), _, _) => None,
        };
        let quota_unit = match map.get("quota_unit") {
            Some(u) => self
                .quota_unit(u, &join(path, "quota_unit"), limit)
                .map(Some),
            None => Some(match (&cost, limit) {
                (_, Some(Limit::InFlight { .. })) => Some(CONCURRENT_REQUESTS.to_string()),
                (Some(Cost::Response(c)), _) => Some(
                    match c.usage {
                        Usage::BodyBytes => CONTENT_BYTES,
                        Usage::Header(_) | Usage::Body(_) => DEFAULT_USAGE_UNIT,
                        Usage::Price(_) => DEFAULT_MONEY_UNIT,
                    }
                    .to_string(),
                ),
                _ => None,
            }),
        };
        let shadow = match map.get("shadow") {
            Some(b) => self.boolean(b, &join(path, "shadow")),
            None => Some(default_shadow),
        };
        let on_missing_key = match map.get("on_missing_key") {
            Some(m) => self.choice(
                m,
                &join(path, "on_missing_key"),
                "missing-key policy",
                &[
                    ("skip", MissingKey::Skip),
                    ("shared", MissingKey::Shared),
                    ("refuse", MissingKey::Refuse),
                ],
            ),
            None => Some(MissingKey::Skip),
        };
        if let (Some(MissingKey::Shared | MissingKey::Refuse), Some(key)) = (on_missing_key, &key) {
            if key.is_empty() {
                self.error(
                    &join(path, "on_missing_key"),
                    "a rule without a \"key\" has no key to miss",
                );
            }
        }
        let global = match map.get("global") {
            Some(g) => self.global(g, &join(path, "global")).map(Some),
            None => Some(None),
        };
        let elastic = match map.get("elastic") {
            Some(e) => self.elastic(e, &join(path, "elastic"), limit).map(Some),
            None => Some(None),
        };
        if let (Some(Some(_)), Some(Some(_))) = (&elastic, &global) {
            self.error(
                &join(path, "elastic"),
                "a global rule's limit is the service's: it cannot be elastic",
            );
        }
        if let (Some(Some(_)), Some(true)) = (&global, per_request.as_ref().map(PerRequest::any)) {
            self.error(
                &join(path, "global"),
                "a global rule's limit is the rate limit service's: it cannot come from the request",
            );
        }
        if let Some(Some(g)) = &global {
            let p = join(path, "global");
            match (limit, &cost) {
                (
                    Some(Limit::Rate {
                        algorithm: Algorithm::SlidingLog,
                        ..
                    }),
                    _,
                ) => self.error(
                    &join(path, "algorithm"),
                    "sliding_log cannot be combined with \"global\"",
                ),
                (Some(Limit::InFlight { .. }), _) => self.error(
                    &p,
                    "an \"in_flight\" rule cannot be global (the rate limit service protocol counts requests, it cannot give them back)",
                ),
                _ => {}
            }
            if g.mode.service_decides() {
                // The service decides a sync rule: local algorithm settings would be silently
                // ignored.
                for field in ["algorithm", "burst", "on_limit", "max_delay_ms"] {
                    if map.contains_key(field) {
                        self.error(
                            &join(path, field),
                            format!(
                                "not used by a rule with \"global\" mode {:?} (the service decides)",
                                g.mode.name()
                            ),
                        );
                    }
                }
            }
        }
        let share = match map.get("share") {
            Some(v) => {
                let p = join(path, "share");
                self.share_rules(path, &key, limit, &cost, &per_request, &global, &elastic);
                let unit = quota_unit.as_ref().map(|u| u.as_deref());
                let share = self.share(v, &p, unit);
                let leased = matches!(&global, Some(Some(g)) if g.mode == GlobalMode::Lease);
                if leased && share.as_ref().is_some_and(|s| s.max_wait_ms > 0) {
                    self.error(
                        &join(&p, "max_wait_ms"),
                        "a leased shared capacity refuses at once in this version: no \"max_wait_ms\" with \"global\"",
                    );
                }
                share.map(Some)
            }
            None => Some(None),
        };
        let sync = matches!(&global, Some(Some(g)) if g.mode.service_decides());
        let limit = self.calendar(limit, map.get("rate_limit"), sync, path);
        let mut global = global;
        if let (Some(Some(g)), Some(Limit::Rate { quota, .. })) = (&mut global, &limit) {
            if g.mode == GlobalMode::Lease && g.max_block == 0 {
                g.max_block = u64::from(quota.requests_per_unit / 10).max(1);
            }
        }
        Some(Rule {
            name: name?,
            matcher: matcher?,
            key: key?,
            limit: limit?,
            cost: cost?,
            quota_unit: quota_unit?,
            shadow: shadow?,
            global: global?,
            elastic: elastic?,
            per_request: per_request?,
            on_missing_key: on_missing_key?,
            share: share?,
        })
    }

    /// What a shared rule cannot be combined with (each refused at its own field).
    #[allow(clippy::too_many_arguments)]
    fn share_rules(
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
    fn share(
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
        let learn = learn?;
        Some(ShareConfig {
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

    /// A number (integer or decimal) in `range`, whose bounds come as text too: formatting a
    /// float would cost the .wasm 11 KB of code.
    fn number(&mut self, v: &Value, path: &str, range: (f64, f64, &str)) -> Option<f64> {
        let (min, max, text) = range;
        match v.as_f64() {
            Some(n) if (min..=max).contains(&n) => Some(n),
            _ => {
                self.error(
                    path,
                    format!("expected a number from {text}, found {}", describe(v)),
                );
                None
            }
        }
    }

    /// `elastic`: the ceiling and floor of the limit, and how the backend's health is judged.
    fn elastic(&mut self, v: &Value, path: &str, limit: Option<Limit>) -> Option<elastic::Params> {
        let map = self.object(
            v,
            path,
            &[
                "ceiling",
                "floor",
                "max_bad_share",
                "latency_ms",
                "window_s",
                "ramp_s",
            ],
        )?;
        let permille = |n: f64| (n * 1000.0).round() as u32;
        let ceiling = match map.get("ceiling") {
            Some(c) => self
                .number(c, &join(path, "ceiling"), (1.0, 100.0, "1 to 100"))
                .map(permille),
            None => {
                self.error(&join(path, "ceiling"), "required field is missing");
                None
            }
        };
        let floor = match map.get("floor") {
            Some(f) => self
                .number(f, &join(path, "floor"), (0.01, 1.0, "0.01 to 1"))
                .map(permille),
            None => Some(elastic::BASE),
        };
        let max_bad = match map.get("max_bad_share") {
            Some(b) => self
                .number(
                    b,
                    &join(path, "max_bad_share"),
                    (0.002, 0.999, "0.002 to 0.999"),
                )
                .map(permille),
            None => Some(DEFAULT_MAX_BAD),
        };
        let latency_ms = match map.get("latency_ms") {
            Some(l) => self
                .integer(l, &join(path, "latency_ms"), 1, 600_000)
                .and_then(|n| u32::try_from(n).ok())
                .map(Some),
            None => Some(None),
        };
        let mut seconds = |field: &str, min: u64, default: u64| match map.get(field) {
            Some(n) => self
                .integer(n, &join(path, field), min, 3_600)
                .and_then(|n| u32::try_from(n * 1000).ok()),
            None => u32::try_from(default * 1000).ok(),
        };
        let window_ms = seconds("window_s", 2, DEFAULT_HEALTH_WINDOW_S);
        let ramp_ms = seconds("ramp_s", 1, DEFAULT_RAMP_S);
        if let (
            Some(c),
            Some(Limit::Rate {
                quota,
                algorithm: Algorithm::SlidingLog,
            }),
        ) = (ceiling, limit)
        {
            let most = crate::limiter::scale(u64::from(quota.requests_per_unit), c);
            if most > u64::from(sliding_log::MAX_LIMIT) {
                self.error(
                    &join(path, "ceiling"),
                    format!(
                        "sliding_log holds at most {} requests: the ceiling would allow {most}",
                        sliding_log::MAX_LIMIT
                    ),
                );
                return None;
            }
        }
        Some(elastic::Params {
            ceiling: ceiling?,
            floor: floor?,
            max_bad: max_bad?,
            latency_ms: latency_ms?,
            window_ms: window_ms?,
            ramp_ms: ramp_ms?,
        })
    }

    /// `rate_limit` with its algorithm, or `in_flight`: exactly one.
    /// With the numbers read from each request, where configured.
    fn limit(&mut self, map: &Map<String, Value>, path: &str) -> Option<(Limit, PerRequest)> {
        match (map.get("rate_limit"), map.get("in_flight")) {
            (Some(q), None) => {
                let (quota, limit) = self.quota(q, &join(path, "rate_limit"))?;
                let (algorithm, burst, burst_is_limit) =
                    self.algorithm(map, path, quota, limit.as_ref())?;
                let per_request = PerRequest {
                    burst_is_limit: burst_is_limit && limit.is_some(),
                    limit,
                    burst,
                };
                Some((Limit::Rate { quota, algorithm }, per_request))
            }
            (None, Some(f)) => {
                let mut ok = true;
                for field in ["algorithm", "burst", "on_limit", "max_delay_ms", "cost"] {
                    if map.contains_key(field) {
                        self.error(
                            &join(path, field),
                            "not used by an \"in_flight\" rule (each request takes one slot)",
                        );
                        ok = false;
                    }
                }
                let limit = self.in_flight(f, &join(path, "in_flight"));
                limit.filter(|_| ok)
            }
            (Some(_), Some(_)) => {
                self.error(
                    path,
                    "a rule has either \"rate_limit\" or \"in_flight\", not both (make two rules)",
                );
                None
            }
            (None, None) => {
                self.error(
                    &join(path, "rate_limit"),
                    "required field is missing (or \"in_flight\" to limit requests in flight)",
                );
                None
            }
        }
    }

    fn in_flight(&mut self, v: &Value, path: &str) -> Option<(Limit, PerRequest)> {
        let map = self.object(v, path, &["max", "lease_s"])?;
        let max = match map.get("max") {
            Some(n) => self.amount(n, &join(path, "max")),
            None => {
                self.error(&join(path, "max"), "required field is missing");
                None
            }
        };
        let lease_s = match map.get("lease_s") {
            Some(n) => self.integer(n, &join(path, "lease_s"), 1, 86_400),
            None => Some(DEFAULT_LEASE_S),
        };
        let (max, max_from) = max?;
        let limit = Limit::InFlight {
            max,
            lease_ms: u32::try_from(lease_s? * 1000).ok()?,
        };
        let per_request = PerRequest {
            limit: max_from,
            ..PerRequest::default()
        };
        Some((limit, per_request))
    }

    /// A number of a limit: an integer, or `{"from", "default", "max"}`, read from each
    /// request.
    fn amount(&mut self, v: &Value, path: &str) -> Option<(u32, Option<FromRequest>)> {
        if !v.is_object() {
            let n = self.integer(v, path, 1, u64::from(u32::MAX))?;
            return u32::try_from(n).ok().map(|n| (n, None));
        }
        let map = self.object(v, path, &["from", "default", "max"])?;
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
        let mut number = |field: &str, what: &str| match map.get(field) {
            Some(n) => self
                .integer(n, &join(path, field), 1, u64::from(u32::MAX))
                .and_then(|n| u32::try_from(n).ok()),
            None => {
                self.error(
                    &join(path, field),
                    format!("required field is missing ({what})"),
                );
                None
            }
        };
        let default = number("default", "what a request that carries no value gets");
        let max = number("max", "the most a request may get");
        let (default, max) = (default?, max?);
        if default > max {
            self.error(
                &join(path, "default"),
                format!("{default} is above \"max\" ({max})"),
            );
            return None;
        }
        Some((
            default,
            Some(FromRequest {
                source: source?,
                default,
                max,
            }),
        ))
    }

    /// Where a number of a request's limit is read.
    fn source(&mut self, s: &str, path: &str) -> Option<Source> {
        if let Some(name) = s.strip_prefix("header:") {
            return self.header_name(name, path).map(Source::Header);
        }
        if let Some(rest) = s.strip_prefix("metadata:") {
            return match rest.split_once(':') {
                Some((namespace, key)) if !namespace.is_empty() && !key.is_empty() => {
                    Some(Source::Metadata {
                        namespace: namespace.to_string(),
                        key: key.to_string(),
                    })
                }
                _ => {
                    self.error(
                        path,
                        format!("invalid metadata source {s:?} (expected metadata:NAMESPACE:KEY)"),
                    );
                    None
                }
            };
        }
        if let Some(key) = s.strip_prefix("filter_state:") {
            if key.is_empty() {
                self.error(
                    path,
                    "invalid filter state source \"filter_state:\" (expected filter_state:KEY)",
                );
                return None;
            }
            return Some(Source::FilterState(key.to_string()));
        }
        self.error(
            path,
            format!("unknown source {s:?} (expected header:NAME, metadata:NAMESPACE:KEY or filter_state:KEY)"),
        );
        None
    }

    fn quota_unit(&mut self, v: &Value, path: &str, limit: Option<Limit>) -> Option<String> {
        let s = self.string(v, path)?;
        let valid = !s.is_empty()
            && s.len() <= 32
            && s.bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
        if !valid {
            self.error(
                path,
                format!("invalid quota unit {s:?} (expected 1 to 32 of a-z 0-9 -)"),
            );
            return None;
        }
        let in_flight = matches!(limit, Some(Limit::InFlight { .. }));
        if in_flight != (s == CONCURRENT_REQUESTS) {
            self.error(
                path,
                format!(
                    "{CONCURRENT_REQUESTS:?} is the unit of \"in_flight\" rules, and theirs only"
                ),
            );
            return None;
        }
        Some(s.to_string())
    }

    fn global(&mut self, v: &Value, path: &str) -> Option<Global> {
        let map = self.object(
            v,
            path,
            &[
                "cluster",
                "domain",
                "mode",
                "timeout_ms",
                "flush_ms",
                "max_block",
            ],
        )?;
        let mut text = |field: &str| match map.get(field) {
            Some(t) => match self.string(t, &join(path, field)) {
                Some("") => {
                    self.error(&join(path, field), "must not be empty");
                    None
                }
                other => other.map(str::to_string),
            },
            None => {
                self.error(&join(path, field), "required field is missing");
                None
            }
        };
        let cluster = text("cluster");
        let domain = text("domain");
        let mode = match map.get("mode") {
            Some(m) => self.choice(
                m,
                &join(path, "mode"),
                "mode",
                &[
                    ("sync", GlobalMode::Sync),
                    ("async", GlobalMode::Async),
                    ("lease", GlobalMode::Lease),
                ],
            ),
            None => Some(GlobalMode::Sync),
        };
        let mut millis = |field: &str, default: u64| match map.get(field) {
            Some(n) => self
                .integer(n, &join(path, field), 1, 60_000)
                .and_then(|n| u32::try_from(n).ok()),
            None => u32::try_from(default).ok(),
        };
        let timeout_ms = millis("timeout_ms", DEFAULT_GLOBAL_TIMEOUT_MS);
        let flush_ms = millis("flush_ms", DEFAULT_FLUSH_MS);
        if mode == Some(GlobalMode::Sync) && map.contains_key("flush_ms") {
            self.error(
                &join(path, "flush_ms"),
                "only used with \"mode\": \"async\" or \"lease\"",
            );
            return None;
        }
        let max_block = match map.get("max_block") {
            Some(_) if mode != Some(GlobalMode::Lease) => {
                self.error(
                    &join(path, "max_block"),
                    "only used with \"mode\": \"lease\"",
                );
                return None;
            }
            Some(n) => Some(self.integer(n, &join(path, "max_block"), 1, u64::from(u32::MAX))?),
            None => Some(0), // a tenth of the limit, set with the rule's limit
        };
        Some(Global {
            cluster: cluster?,
            domain: domain?,
            mode: mode?,
            timeout_ms: timeout_ms?,
            flush_ms: flush_ms?,
            max_block: max_block?,
        })
    }

    /// The algorithm and the fields that belong to it.
    /// The algorithm, with its burst read from each request (if so configured) and whether
    /// the burst is the limit's (not configured).
    fn algorithm(
        &mut self,
        map: &Map<String, Value>,
        path: &str,
        q: Quota,
        limit: Option<&FromRequest>,
    ) -> Option<(Algorithm, Option<FromRequest>, bool)> {
        let name = match map.get("algorithm") {
            Some(a) => self.choice(
                a,
                &join(path, "algorithm"),
                "algorithm",
                &[
                    ("sliding_window", "sliding_window"),
                    ("fixed_window", "fixed_window"),
                    ("token_bucket", "token_bucket"),
                    ("leaky_bucket", "leaky_bucket"),
                    ("sliding_log", "sliding_log"),
                ],
            )?,
            None => "sliding_window",
        };
        let bucket = matches!(name, "token_bucket" | "leaky_bucket");
        let mut ok = true;
        // Fields that only some algorithms take.
        for (field, allowed) in [
            ("burst", bucket),
            ("on_limit", name == "leaky_bucket"),
            ("max_delay_ms", name == "leaky_bucket"),
        ] {
            if map.contains_key(field) && !allowed {
                self.error(
                    &join(path, field),
                    format!("not used by algorithm {name:?}"),
                );
                ok = false;
            }
        }
        let burst = match map.get("burst") {
            Some(b) => self.amount(b, &join(path, "burst")),
            None => Some((q.requests_per_unit, None)),
        };
        let burst_from = burst.as_ref().and_then(|(_, f)| f.clone());
        let burst = burst.map(|(n, _)| n);
        let delay = match map.get("on_limit") {
            None => Some(false),
            Some(_) if name != "leaky_bucket" => Some(false), // reported above
            Some(o) => self.choice(
                o,
                &join(path, "on_limit"),
                "on_limit",
                &[("reject", false), ("delay", true)],
            ),
        };
        let max_delay = match (delay, map.get("max_delay_ms")) {
            (Some(true), Some(m)) => self
                .integer(m, &join(path, "max_delay_ms"), 1, MAX_DELAY_MS)
                .and_then(|n| u32::try_from(n).ok())
                .map(Some),
            (Some(true), None) => {
                self.error(
                    &join(path, "max_delay_ms"),
                    "required with \"on_limit\": \"delay\"",
                );
                None
            }
            (Some(false), Some(_)) if name == "leaky_bucket" => {
                self.error(
                    &join(path, "max_delay_ms"),
                    "only used with \"on_limit\": \"delay\"",
                );
                None
            }
            (_, _) => Some(None),
        };
        let most = limit.map_or(q.requests_per_unit, |f| f.max);
        if name == "sliding_log" && most > sliding_log::MAX_LIMIT {
            let field = match limit {
                Some(_) => "rate_limit.requests_per_unit.max",
                None => "rate_limit.requests_per_unit",
            };
            self.error(
                &join(path, field),
                format!(
                    "{most} is too many for sliding_log, which stores every request's time (at most {}: use sliding_window for more)",
                    sliding_log::MAX_LIMIT
                ),
            );
            ok = false;
        }
        let algorithm = match name {
            "fixed_window" => Algorithm::FixedWindow,
            "token_bucket" => Algorithm::TokenBucket { burst: burst? },
            "leaky_bucket" => Algorithm::LeakyBucket {
                burst: burst?,
                max_delay_ms: max_delay?,
            },
            "sliding_log" => Algorithm::SlidingLog,
            _ => Algorithm::SlidingWindow,
        };
        ok.then_some((algorithm, burst_from, bucket && !map.contains_key("burst")))
    }

    /// `capacity`: the most one request can ever be admitted for.
    fn cost(&mut self, v: &Value, path: &str, limit: Limit, capacity: u32) -> Option<Cost> {
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

    /// `cost.response` as a price: `{"price": {"usage", "model", "per", "models", "default"}}`.
    fn price(&mut self, v: &Value, path: &str) -> Option<Price> {
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

    fn rule_name(&mut self, v: &Value, path: &str) -> Option<String> {
        self.name(v, path, "rule")
    }

    /// A name of `what` (a rule, a band): as a rule's name is checked.
    fn name(&mut self, v: &Value, path: &str, what: &str) -> Option<String> {
        let s = self.string(v, path)?;
        let valid = !s.is_empty()
            && s.len() <= MAX_NAME_LEN
            && s.chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-'));
        if !valid {
            self.error(
                path,
                format!(
                    "invalid {what} name {s:?} (expected 1 to {MAX_NAME_LEN} of A-Z a-z 0-9 _ . -)"
                ),
            );
            return None;
        }
        if s.ends_with('.') {
            // Envoy drops a trailing dot from a tag value: "a." would be counted as rule "a".
            self.error(
                path,
                format!("invalid {what} name {s:?} (must not end with \".\")"),
            );
            return None;
        }
        Some(s.to_string())
    }

    fn header_name(&mut self, s: &str, path: &str) -> Option<String> {
        if s.is_empty() || !s.chars().all(crate::http::is_tchar) {
            self.error(path, format!("invalid header name {s:?}"));
            return None;
        }
        Some(s.to_ascii_lowercase())
    }

    fn http_path(&mut self, v: &Value, path: &str) -> Option<String> {
        let s = self.string(v, path)?;
        if !s.starts_with('/') {
            self.error(path, format!("must start with \"/\", found {s:?}"));
            return None;
        }
        Some(s.to_string())
    }

    fn matcher(&mut self, v: &Value, path: &str) -> Option<Match> {
        let map = self.object(
            v,
            path,
            &[
                "path_prefix",
                "path",
                "methods",
                "authority",
                "headers",
                "body",
            ],
        )?;
        let mut m = Match::default();
        let mut ok = true;
        if let Some(p) = map.get("path_prefix") {
            m.path_prefix = self.http_path(p, &join(path, "path_prefix"));
            ok &= m.path_prefix.is_some();
        }
        if let Some(p) = map.get("path") {
            m.path = self.http_path(p, &join(path, "path"));
            ok &= m.path.is_some();
        }
        if let Some(a) = map.get("authority") {
            let p = join(path, "authority");
            match self.string(a, &p) {
                Some("") => {
                    self.error(&p, "must not be empty");
                    ok = false;
                }
                Some(s) => m.authority = Some(s.to_ascii_lowercase()),
                None => ok = false,
            }
        }
        if let Some(methods) = map.get("methods") {
            let p = join(path, "methods");
            match self.array(methods, &p) {
                Some(items) => {
                    for (i, item) in items.iter().enumerate() {
                        let ip = format!("{p}[{i}]");
                        match self.string(item, &ip) {
                            Some(s)
                                if !s.is_empty()
                                    && s.chars().all(crate::http::is_tchar)
                                    && !s.chars().any(|c| c.is_ascii_lowercase()) =>
                            {
                                m.methods.push(s.to_string())
                            }
                            Some(s) => {
                                self.error(
                                    &ip,
                                    format!("invalid method {s:?} (expected an upper-case method such as GET)"),
                                );
                                ok = false;
                            }
                            None => ok = false,
                        }
                    }
                }
                None => ok = false,
            }
        }
        if let Some(headers) = map.get("headers") {
            let p = join(path, "headers");
            match self.array(headers, &p) {
                Some(items) => {
                    for (i, item) in items.iter().enumerate() {
                        match self.header_match(item, &format!("{p}[{i}]")) {
                            Some(h) => m.headers.push(h),
                            None => ok = false,
                        }
                    }
                }
                None => ok = false,
            }
        }
        if let Some(body) = map.get("body") {
            let p = join(path, "body");
            match self.array(body, &p) {
                Some(items) => {
                    for (i, item) in items.iter().enumerate() {
                        match self.body_match(item, &format!("{p}[{i}]")) {
                            Some(b) => m.body.push(b),
                            None => ok = false,
                        }
                    }
                }
                None => ok = false,
            }
        }
        ok.then_some(m)
    }

    fn header_match(&mut self, v: &Value, path: &str) -> Option<HeaderMatch> {
        let map = self.object(v, path, &["name", "value", "present"])?;
        let name = match map.get("name") {
            Some(n) => {
                let p = join(path, "name");
                self.string(n, &p).and_then(|s| self.header_name(s, &p))
            }
            None => {
                self.error(&join(path, "name"), "required field is missing");
                None
            }
        };
        let condition = match (map.get("value"), map.get("present")) {
            (Some(value), None) => {
                let p = join(path, "value");
                match self.string(value, &p) {
                    Some(s) if s.trim().is_empty() => {
                        self.error(
                            &p,
                            "an empty value can never match: a header with an empty value counts as absent (use \"present\": false)",
                        );
                        None
                    }
                    Some(s) if s.trim() != s => {
                        self.error(
                            &p,
                            format!("{s:?} can never match: Envoy strips the whitespace around header values"),
                        );
                        None
                    }
                    other => other.map(|s| HeaderCondition::Equals(s.to_string())),
                }
            }
            (None, Some(present)) => self
                .boolean(present, &join(path, "present"))
                .map(HeaderCondition::Present),
            _ => {
                self.error(path, "exactly one of \"value\" or \"present\" is required");
                None
            }
        };
        Some(HeaderMatch {
            name: name?,
            condition: condition?,
        })
    }

    fn key(&mut self, v: &Value, path: &str) -> Option<Vec<KeyPart>> {
        let items = self.array(v, path)?;
        let mut parts: Vec<KeyPart> = Vec::with_capacity(items.len());
        let mut ok = true;
        for (i, item) in items.iter().enumerate() {
            let p = format!("{path}[{i}]");
            let (part, s) = match item {
                Value::Object(m) if m.contains_key("first") => (self.first(item, &p), "first"),
                Value::Object(_) => (self.remote_address(item, &p), "remote_address"),
                _ => {
                    let Some(s) = self.string(item, &p) else {
                        ok = false;
                        continue;
                    };
                    (self.key_part(s, &p), s)
                }
            };
            match part {
                Some(part) if parts.iter().any(|q| q.same_part(&part)) => {
                    self.error(&p, format!("duplicate key part {s:?}"));
                    ok = false;
                }
                Some(part) => parts.push(part),
                None => ok = false,
            }
        }
        ok.then_some(parts)
    }

    /// A key part written as a string.
    fn key_part(&mut self, s: &str, p: &str) -> Option<KeyPart> {
        match s {
            "remote_address" => Some(KeyPart::RemoteAddress(DEFAULT_PREFIXES)),
            "path" => Some(KeyPart::Path),
            "method" => Some(KeyPart::Method),
            "authority" => Some(KeyPart::Authority),
            "bearer" => Some(KeyPart::Bearer),
            _ => {
                if let Some(field) = s.strip_prefix("body:") {
                    self.body_field(field, p).map(KeyPart::Body)
                } else if let Some(name) = s.strip_prefix("header:") {
                    self.header_name(name, p).map(KeyPart::Header)
                } else if let Some(name) = s.strip_prefix("query:") {
                    if name.is_empty() {
                        self.error(p, "empty query parameter name in \"query:\"");
                        None
                    } else {
                        Some(KeyPart::Query(name.to_string()))
                    }
                } else {
                    self.error(
                            p,
                            format!("unknown key part {s:?} (expected remote_address, header:NAME, query:NAME, path, method, authority, bearer, body:PATH, {{\"first\": [PARTS]}}, or {{\"remote_address\": {{\"ipv4_prefix\": N, \"ipv6_prefix\": M}}}})"),
                        );
                    None
                }
            }
        }
    }

    /// A request body field's path: keys joined by `.` from the document's root.
    fn body_field(&mut self, field: &str, p: &str) -> Option<BodyField> {
        let path: Vec<String> = field.split('.').map(str::to_string).collect();
        if path.iter().any(String::is_empty) {
            self.error(p, format!("body field {field:?} has an empty key (expected keys joined by '.', e.g. body:metadata.user_id)"));
            return None;
        }
        if path.len() > crate::usage::MAX_DEPTH {
            self.error(
                p,
                format!(
                    "body field {field:?} has more than {} keys",
                    crate::usage::MAX_DEPTH
                ),
            );
            return None;
        }
        Some(BodyField { path, slot: 0 })
    }

    /// `match.body[i]`: `{"field": PATH, "equals": V}`, `{"field": PATH, "one_of": [V, …]}` or
    /// `{"field": PATH, "prefix": P}`.
    fn body_match(&mut self, v: &Value, path: &str) -> Option<BodyMatch> {
        let map = self.object(v, path, &["field", "equals", "one_of", "prefix"])?;
        let field = match map.get("field") {
            Some(f) => {
                let fp = join(path, "field");
                self.string(f, &fp).and_then(|s| self.body_field(s, &fp))
            }
            None => {
                self.error(&join(path, "field"), "required field is missing");
                None
            }
        };
        let text = |this: &mut Self, v: &Value, p: &str| match this.string(v, p) {
            Some("") => {
                this.error(p, "must not be empty");
                None
            }
            Some(s) => Some(s.to_string()),
            None => None,
        };
        let given: Vec<&str> = ["equals", "one_of", "prefix"]
            .into_iter()
            .filter(|k| map.contains_key(*k))
            .collect();
        let condition = match (
            given.as_slice(),
            map.get(given.first().copied().unwrap_or("")),
        ) {
            (["equals"], Some(v)) => {
                text(self, v, &join(path, "equals")).map(BodyCondition::Equals)
            }
            (["prefix"], Some(v)) => {
                text(self, v, &join(path, "prefix")).map(BodyCondition::Prefix)
            }
            (["one_of"], Some(v)) => {
                let p = join(path, "one_of");
                let items = self.array(v, &p)?;
                if items.is_empty() {
                    self.error(&p, "must not be empty");
                    return None;
                }
                let values: Vec<Option<String>> = items
                    .iter()
                    .enumerate()
                    .map(|(i, item)| text(self, item, &format!("{p}[{i}]")))
                    .collect();
                values
                    .into_iter()
                    .collect::<Option<Vec<_>>>()
                    .map(BodyCondition::OneOf)
            }
            _ => {
                self.error(
                    path,
                    "expected exactly one of \"equals\", \"one_of\", \"prefix\"",
                );
                None
            }
        };
        Some(BodyMatch {
            field: field?,
            condition: condition?,
        })
    }

    /// `{"first": [PART, PART, …]}`: two or more parts, none of them `first`, no two reading
    /// the same attribute.
    fn first(&mut self, v: &Value, path: &str) -> Option<KeyPart> {
        let map = self.object(v, path, &["first"])?;
        let p = join(path, "first");
        let inner = map.get("first")?;
        let parts = self.key(inner, &p)?;
        if parts.len() < 2 {
            self.error(
                &p,
                "needs two or more key parts (one part alone needs no \"first\")",
            );
            return None;
        }
        if let Some(i) = parts.iter().position(|q| matches!(q, KeyPart::First(_))) {
            self.error(
                &format!("{p}[{i}]"),
                "a \"first\" cannot hold another \"first\"",
            );
            return None;
        }
        Some(KeyPart::First(parts))
    }

    /// `{"remote_address": {"ipv4_prefix": N, "ipv6_prefix": M}}`.
    fn remote_address(&mut self, v: &Value, path: &str) -> Option<KeyPart> {
        let map = self.object(v, path, &["remote_address"])?;
        let p = join(path, "remote_address");
        let Some(inner) = map.get("remote_address") else {
            self.error(&p, "required field is missing");
            return None;
        };
        let map = self.object(inner, &p, &["ipv4_prefix", "ipv6_prefix"])?;
        let mut prefix = |field: &str, max: u64, default: u8| match map.get(field) {
            Some(n) => self
                .integer(n, &join(&p, field), 1, max)
                .and_then(|n| u8::try_from(n).ok()),
            None => Some(default),
        };
        let v4 = prefix("ipv4_prefix", 32, DEFAULT_PREFIXES.v4);
        let v6 = prefix("ipv6_prefix", 128, DEFAULT_PREFIXES.v6);
        Some(KeyPart::RemoteAddress(Prefixes { v4: v4?, v6: v6? }))
    }

    /// With `requests_per_unit` read from each request, if so configured.
    fn quota(&mut self, v: &Value, path: &str) -> Option<(Quota, Option<FromRequest>)> {
        let map = self.object(v, path, &["requests_per_unit", "unit", "utc_offset"])?;
        let rpu = match map.get("requests_per_unit") {
            Some(n) => self.amount(n, &join(path, "requests_per_unit")),
            None => {
                self.error(
                    &join(path, "requests_per_unit"),
                    "required field is missing",
                );
                None
            }
        };
        let unit = match map.get("unit") {
            Some(u) => self.unit(u, &join(path, "unit"), &Unit::ALL),
            None => {
                self.error(&join(path, "unit"), "required field is missing");
                None
            }
        };
        let utc_offset_min = match map.get("utc_offset") {
            Some(o) => self.utc_offset(o, &join(path, "utc_offset")),
            None => Some(0),
        };
        let (requests_per_unit, from) = rpu?;
        Some((
            Quota {
                requests_per_unit,
                unit: unit?,
                utc_offset_min: utc_offset_min?,
            },
            from,
        ))
    }

    /// A UTC offset, `+HH:MM` or `-HH:MM`, in minutes.
    fn utc_offset(&mut self, v: &Value, path: &str) -> Option<i32> {
        let s = self.string(v, path)?;
        let b = s.as_bytes();
        let digits = |r: std::ops::Range<usize>| {
            let d = b.get(r)?;
            d.iter()
                .all(u8::is_ascii_digit)
                .then(|| d.iter().fold(0i32, |n, c| n * 10 + i32::from(c - b'0')))
        };
        let sign = match b.first() {
            Some(b'+') => Some(1),
            Some(b'-') => Some(-1),
            _ => None,
        };
        let minutes = match (sign, digits(1..3), b.get(3), digits(4..6), b.len()) {
            (Some(sign), Some(h), Some(b':'), Some(m), 6) if m < 60 => Some(sign * (h * 60 + m)),
            _ => None,
        }
        .filter(|m| m.abs() <= calendar::MAX_OFFSET_MIN);
        if minutes.is_none() {
            self.error(
                path,
                format!("expected an offset from UTC as \"+HH:MM\" or \"-HH:MM\", from -14:00 to +14:00 (\"+02:00\" for UTC+2), found {s:?}"),
            );
        }
        minutes
    }

    /// A rule's limit with the calendar's constraints: a month counts only in fixed windows
    /// (a sync global rule's service decides, and its local windows become calendar months),
    /// and only fixed windows begin at a time of day (`utc_offset`).
    fn calendar(
        &mut self,
        limit: Option<Limit>,
        rate_limit: Option<&Value>,
        sync: bool,
        path: &str,
    ) -> Option<Limit> {
        let Some(Limit::Rate { quota, algorithm }) = limit else {
            return limit;
        };
        if sync {
            let calendar = matches!(quota.unit, Unit::Week | Unit::Month);
            let algorithm = match calendar || quota.utc_offset_min != 0 {
                true => Algorithm::FixedWindow,
                false => algorithm,
            };
            return Some(Limit::Rate { quota, algorithm });
        }
        let mut ok = true;
        if algorithm != Algorithm::FixedWindow {
            let name = algorithm.name();
            if quota.unit == Unit::Month {
                self.error(
                    &join(path, "rate_limit.unit"),
                    format!("\"month\" needs \"algorithm\": \"fixed_window\": a calendar month has 28 to 31 days, and {name} needs a window of one length (use \"week\", or fixed_window)"),
                );
                ok = false;
            }
            if rate_limit.and_then(|q| q.get("utc_offset")).is_some() {
                self.error(
                    &join(path, "rate_limit.utc_offset"),
                    format!("only fixed_window's windows begin at a time of day: {name} has none to move"),
                );
                ok = false;
            }
        }
        limit.filter(|_| ok)
    }

    fn response(&mut self, v: &Value, path: &str) -> Option<ResponseConfig> {
        let map = self.object(v, path, &["status", "headers", "on_allowed", "dialect"])?;
        let mut r = ResponseConfig::default();
        let mut ok = true;
        if let Some(s) = map.get("status") {
            match self.integer(s, &join(path, "status"), 400, 599) {
                Some(n) => r.status = u16::try_from(n).unwrap_or(429),
                None => ok = false,
            }
        }
        if let Some(h) = map.get("headers") {
            match self.choice(
                h,
                &join(path, "headers"),
                "header style",
                &[
                    ("ietf", HeaderStyle::Ietf),
                    ("x-ratelimit", HeaderStyle::XRateLimit),
                    ("both", HeaderStyle::Both),
                    ("none", HeaderStyle::None),
                ],
            ) {
                Some(style) => r.headers = style,
                None => ok = false,
            }
        }
        if let Some(b) = map.get("on_allowed") {
            match self.boolean(b, &join(path, "on_allowed")) {
                Some(b) => r.on_allowed = b,
                None => ok = false,
            }
        }
        if let Some(d) = map.get("dialect") {
            let dialects = [Dialect::Default, Dialect::OpenAi, Dialect::Anthropic];
            match self.choice(
                d,
                &join(path, "dialect"),
                "dialect",
                &dialects.map(|d| (d.name(), d)),
            ) {
                Some(d) => r.dialect = d,
                None => ok = false,
            }
        }
        ok.then_some(r)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn issue_example_parses_with_defaults() {
        let c = Config::parse(
            br#"{"rules":[{"name":"per-client",
                "match":{"path_prefix":"/api/","methods":["GET","POST"],
                         "headers":[{"name":"X-Tier","value":"free"},{"name":"x-api-key","present":true}]},
                "key":["remote_address","header:X-Api-Key"],
                "rate_limit":{"requests_per_unit":100,"unit":"minute"}}]}"#,
        )
        .unwrap();
        assert_eq!(c.capacity, DEFAULT_CAPACITY);
        assert_eq!(c.failure_mode, FailureMode::Allow);
        assert_eq!(c.response, ResponseConfig::default());
        let r = &c.rules[0];
        assert_eq!(r.name, "per-client");
        assert_eq!(
            r.key,
            vec![
                KeyPart::RemoteAddress(DEFAULT_PREFIXES),
                KeyPart::Header("x-api-key".into())
            ]
        );
        assert_eq!(r.matcher.headers[0].name, "x-tier");
        assert!(matches!(r.limit, Limit::Rate { quota, .. } if quota.window_ms() == 60_000));
    }

    /// A rejecting leaky bucket is the token bucket's admission rule (both are one GCRA, which
    /// tests/accuracy.rs checks against a token-bucket reference).
    #[test]
    fn rejecting_leaky_bucket_is_the_token_bucket_policy() {
        let rule = |algorithm: &str| {
            let json = format!(
                r#"{{"rules": [{{"name": "a", "algorithm": "{algorithm}", "burst": 7,
                    "rate_limit": {{"requests_per_unit": 3, "unit": "second"}}}}]}}"#
            );
            Config::parse(json.as_bytes()).unwrap().rules[0].policy()
        };
        assert_eq!(rule("leaky_bucket"), rule("token_bucket"));
    }

    #[test]
    fn networks_hold_their_addresses() {
        let net = |s: &str| Cidr::parse(s).unwrap();
        let ip = |s: &str| s.parse::<std::net::IpAddr>().unwrap();
        assert!(net("0.0.0.0/0").contains(ip("203.0.113.9")));
        assert!(!net("0.0.0.0/0").contains(ip("2001:db8::1")));
        assert!(net("10.20.0.0/16").contains(ip("10.20.255.1")));
        assert!(!net("10.20.0.0/16").contains(ip("10.21.0.1")));
        assert!(net("10.20.0.0/16").contains(ip("::ffff:10.20.0.1")));
        assert!(net("fd00::/8").contains(ip("fd12:3456::1")));
        assert!(!net("fd00::/8").contains(ip("fe80::1")));
        assert!(net("::1/128").contains(ip("::1")));
        assert!(!net("::1/128").contains(ip("::2")));
        assert_eq!(net("::/0").to_string(), "::/0");
        for bad in [
            "10.0.0.0",
            "10.0.0.0/33",
            "10.0.0.0/+8",
            "10.0.0.1/8",
            "::1/0",
            "x/8",
        ] {
            assert!(Cidr::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn all_errors_are_reported_together() {
        let err = Config::parse(
            br#"{"rules":[{"name":"a","rate_limit":{"requests_per_unit":0,"unit":"fortnight"}}],"capacity":0}"#,
        )
        .unwrap_err();
        assert_eq!(err.0.len(), 3, "{err}");
        assert_eq!(
            err.to_string(),
            "rules[0].rate_limit.requests_per_unit: expected an integer from 1 to 4294967295, found number 0; \
             rules[0].rate_limit.unit: unknown unit \"fortnight\" (expected second, minute, hour, day, week, month); \
             capacity: expected an integer from 1 to 1048576, found number 0"
        );
    }

    #[test]
    fn arbitrary_bytes_never_panic() {
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        for len in 0..400usize {
            let bytes: Vec<u8> = (0..len)
                .map(|_| {
                    seed ^= seed << 13;
                    seed ^= seed >> 7;
                    seed ^= seed << 17;
                    let alphabet = b"{}[]\":,0123 aeflnrstu\\-";
                    alphabet[(seed % alphabet.len() as u64) as usize]
                })
                .collect();
            let _ = Config::parse(&bytes);
        }
    }
}
