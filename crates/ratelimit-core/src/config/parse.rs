//! JSON in, typed rules out. The JSON is walked by hand rather than through serde derive so that
//! every error names the field path it is about (`rules[0].rate_limit.unit: ...`) in words a user
//! can act on, and so that all errors are reported at once, not just the first.
//!
//! This file holds the reader (`Validator`) and its helpers, the top level (`rules`,
//! `response`, `operator`, `capacity`, ...) and what a rule is made of, checked together (the
//! combinations a rule cannot have). Each section of a rule is read in its own file, as
//! `impl Validator` blocks: `matching` (`match`, `key`), `limit` (`rate_limit`, `in_flight`,
//! the algorithm, `quota_unit`, `elastic`), `global`, `cost`, `price` (`cost.response.price`)
//! and `share`. They use the configuration's types (`super`), and modules below the
//! configuration only.

use super::*;
use crate::seed::Seed;
use crate::usage::Paths;
use serde_json::{Map, Value};

mod cost;
mod global;
mod limit;
mod matching;
mod price;
mod share;

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

    /// One of `units`, by its name.
    fn unit(&mut self, v: &Value, path: &str, units: &[Unit]) -> Option<Unit> {
        let choices: Vec<(&str, Unit)> = units.iter().map(|&u| (u.name(), u)).collect();
        self.choice(v, path, "unit", &choices)
    }

    /// One of `choices`, by name.
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
                if share.as_ref().is_some_and(|s| s.fleet_fair)
                    && !matches!(&global, Some(Some(g)) if g.mode == GlobalMode::Lease)
                {
                    self.error(
                        &join(&p, "fleet"),
                        "\"fair\" shares the capacity across Envoys through the rate limit service: give the rule \"global\" with \"mode\": \"lease\"",
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
mod tests;
