//! Reading `match` and `key`: which requests a rule applies to (path, method, authority,
//! headers, fields of the body) and which client each one is (the key's parts: address,
//! headers, query parameters, the bearer token, body fields, `first` of several).
//!
//! Uses the reader's helpers and the configuration's types (`super`), and below the
//! configuration: what HTTP allows in a name (`crate::http`) and the bounds of the body
//! scanner (`crate::usage`).

use super::*;

impl Validator {
    pub(super) fn header_name(&mut self, s: &str, path: &str) -> Option<String> {
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

    pub(super) fn matcher(&mut self, v: &Value, path: &str) -> Option<Match> {
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

    pub(super) fn key(&mut self, v: &Value, path: &str) -> Option<Vec<KeyPart>> {
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
    pub(super) fn body_field(&mut self, field: &str, p: &str) -> Option<BodyField> {
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
}
