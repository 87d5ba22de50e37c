//! How a configuration reads to a person: the summary `ratelimit-config check` prints, and the
//! rule descriptions of `ratelimit-config replay`. Native only, never in the `.wasm`.

use ratelimit_core::config::{
    Algorithm, Config, Cost, Dialect, FailureMode, FromRequest, GlobalMode, HeaderCondition, Limit,
    Match, MissingKey, ModelFrom, Rule, Usage,
};
use ratelimit_core::limiter::calendar;

/// The summary of a valid configuration: its settings, then each rule on a line.
pub fn summary(c: &Config) -> String {
    let mut out = format!(
        "  capacity {} keys, failure_mode {}, headers {}{}{}, limited status {}\n",
        c.capacity,
        match c.failure_mode {
            FailureMode::Allow => "allow",
            FailureMode::Deny => "deny",
        },
        c.response.headers.name(),
        match c.response.dialect {
            Dialect::Default => String::new(),
            d => format!(" and {}'s", d.name()),
        },
        if c.response.on_allowed {
            " (also on allowed responses)"
        } else {
            ""
        },
        c.response.status,
    );
    if c.key_seed.is_some() {
        out.push_str(
            "  key_seed set: every Envoy with this configuration logs the same key for a client\n",
        );
    }
    if let Some(o) = &c.operator {
        out.push_str(&format!(
            "  operator route (wasm build) at {}, from {} network(s), with a token\n",
            o.path_prefix,
            o.allow_from.len()
        ));
    }
    for r in &c.rules {
        out.push_str(&format!(
            "  rule {}{}: {}, key {}, match {}{}\n",
            r.name,
            if r.shadow { " (shadow)" } else { "" },
            limit(r),
            key(r),
            matcher(&r.matcher),
            match &r.cost {
                Cost::Fixed(1) => String::new(),
                Cost::Fixed(n) => format!(", cost {n}"),
                Cost::Header(h) => format!(", cost from header {h}"),
                Cost::Response(c) => format!(
                    ", charged after the response from {} (reserve {}{}{})",
                    match &c.usage {
                        Usage::Header(h) => format!("header or trailer {h}"),
                        Usage::BodyBytes => "its body bytes".into(),
                        Usage::Body(_) => "its body's usage fields".into(),
                        Usage::Price(p) => format!(
                            "its {} tokens at the prices of {} model{} (the model from {})",
                            p.api.name(),
                            p.models.len(),
                            if p.models.len() == 1 { "" } else { "s" },
                            match &p.model {
                                ModelFrom::Body(f) => f.to_string(),
                                ModelFrom::Answer(_) => "the answer".into(),
                            }
                        ),
                    },
                    match &c.sized {
                        Some(_) => format!("sized by the request body, else {}", c.reserve),
                        None => c.reserve.to_string(),
                    },
                    match (&c.usage, c.default) {
                        (Usage::BodyBytes, _) => String::new(),
                        (_, Some(d)) => format!(", default {d}"),
                        (_, None) if c.true_up => ", default the reservation".into(),
                        (_, None) => format!(", default {}", c.admission()),
                    },
                    if c.true_up { ", trued up" } else { "" }
                ),
            },
        ));
        if let Some(e) = &r.elastic {
            out.push_str(&format!(
                "    elastic: up to {}x while healthy, {}x when {}% of responses are bad{} over {} s, ramp {} s\n",
                f64::from(e.ceiling) / 1000.0,
                f64::from(e.floor) / 1000.0,
                f64::from(e.max_bad) / 10.0,
                e.latency_ms
                    .map_or(String::new(), |l| format!(" (5xx, 429 or over {l} ms)")),
                e.window_ms / 1000,
                e.ramp_ms / 1000,
            ));
        }
        if let Some(g) = &r.global {
            out.push_str(&format!(
                "    global {}: cluster {}, domain {}, timeout {} ms{}\n",
                global_mode(g.mode),
                g.cluster,
                g.domain,
                g.timeout_ms,
                match g.mode {
                    GlobalMode::Async => format!(", flush every {} ms", g.flush_ms),
                    GlobalMode::Lease => format!(
                        ", blocks of at most {}, claims ahead every {} ms",
                        g.max_block, g.flush_ms
                    ),
                    GlobalMode::Sync => String::new(),
                }
            ));
        }
    }
    out
}

/// A global rule's mode, as configured.
pub fn global_mode(mode: GlobalMode) -> &'static str {
    mode.name()
}

/// A rule's key parts: `[remote_address, header:x-api-key]`.
pub fn key(r: &Rule) -> String {
    let parts = r
        .key
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(", ");
    match r.on_missing_key {
        MissingKey::Skip => format!("[{parts}]"),
        MissingKey::Shared => format!("[{parts}] (one shared key without it)"),
        MissingKey::Refuse => format!("[{parts}] (refused without it)"),
    }
}

/// A number of a limit: `100`, or `from header:x-plan-rpm (default 60, max 1000)` when each
/// request carries it.
fn number(n: u32, from: Option<&FromRequest>) -> String {
    match from {
        Some(f) => format!("from {} (default {}, max {})", f.source, f.default, f.max),
        None => n.to_string(),
    }
}

/// A rule's limit: `100 per minute (sliding_window)`, `20 in flight (lease 300 s)`.
pub fn limit(r: &Rule) -> String {
    let from = &r.per_request;
    let (quota, algorithm) = match r.limit {
        Limit::Rate { quota, algorithm } => (quota, algorithm),
        Limit::InFlight { max, lease_ms } => {
            return format!(
                "{} in flight (lease {} s)",
                number(max, from.limit.as_ref()),
                lease_ms / 1000
            )
        }
    };
    let burst = |b: u32| match (&from.burst, from.burst_is_limit) {
        (Some(f), _) => number(b, Some(f)),
        (None, true) => "the limit".to_string(),
        (None, false) => b.to_string(),
    };
    let algorithm = match algorithm {
        Algorithm::TokenBucket { burst: b } => format!("token_bucket, burst {}", burst(b)),
        Algorithm::LeakyBucket {
            burst: b,
            max_delay_ms: Some(d),
        } => format!("leaky_bucket, burst {}, delay up to {d} ms", burst(b)),
        Algorithm::LeakyBucket { burst: b, .. } => format!("leaky_bucket, burst {}", burst(b)),
        other => other.name().to_string(),
    };
    format!(
        "{} {}per {}{} ({algorithm})",
        number(quota.requests_per_unit, from.limit.as_ref()),
        r.quota_unit
            .as_deref()
            .map_or(String::new(), |u| format!("{u} ")),
        quota.unit.name(),
        match quota.utc_offset_min {
            0 => String::new(),
            m => format!(" at UTC{}", calendar::offset_text(i64::from(m))),
        },
    )
}

/// A rule's match conditions: `path_prefix /api/, methods GET|POST`, or `every request`.
pub fn matcher(m: &Match) -> String {
    let mut parts = Vec::new();
    if let Some(p) = &m.path_prefix {
        parts.push(format!("path_prefix {p}"));
    }
    if let Some(p) = &m.path {
        parts.push(format!("path {p}"));
    }
    if !m.methods.is_empty() {
        parts.push(format!("methods {}", m.methods.join("|")));
    }
    if let Some(a) = &m.authority {
        parts.push(format!("authority {a}"));
    }
    for h in &m.headers {
        parts.push(match &h.condition {
            HeaderCondition::Equals(v) => format!("{}={v}", h.name),
            HeaderCondition::Present(true) => format!("{} present", h.name),
            HeaderCondition::Present(false) => format!("{} absent", h.name),
        });
    }
    if parts.is_empty() {
        "every request".into()
    } else {
        parts.join(", ")
    }
}
