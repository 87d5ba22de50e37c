//! `ratelimit-config explain`: what each rule of a configuration makes of one request, told by
//! the filter's own code ([`Runtime::explain`]): whether it applies, the client key as the
//! filter logs it, the cost and the limit in force; or the condition or key part that keeps it
//! from applying.

use ratelimit_core::config::{Carried, Config, Priced, Rates, Resolved, Rule};
use ratelimit_core::key::{self, Attributes, Meta, PlainRequest, Seed};
use ratelimit_core::limiter::Policy;
use ratelimit_core::runtime::explain::{
    escaped, limit_text, resolved_text, window_text, Absence, Applies, CostFrom, Explained,
    NotApplying, PricedAs, Shared, Value,
};
use ratelimit_core::runtime::{Host, Runtime};
use ratelimit_core::store::MemoryStore;
use ratelimit_core::usage::{Format, Scanner};
use serde_json::{json, Map, Value as Json};
use std::fmt::{self, Write as _};

/// How to use the subcommand (printed on a usage error).
pub const USAGE: &str = "\
usage: ratelimit-config explain [OPTIONS] CONFIG
  Shows what each rule of CONFIG makes of one request, with the filter's own code: whether it
  applies, its client key as the filter logs it, its cost and the limit in force; or why not.
  CONFIG  the plugin configuration: JSON, YAML, Istio WasmPlugin manifests or an Envoy
          configuration's filters (as check reads it); - for stdin
the request:
  --method M                the method (default GET)
  --path P                  the path, query string included (default /)
  --authority H             the authority (default localhost)
  --header 'NAME: VALUE'    a request header; repeatable
  --source ADDR             the client address, with or without a port: 10.0.0.7, 10.0.0.7:5000,
                            2001:db8::7, [2001:db8::7]:5000 (default 127.0.0.1)
  --metadata NS:KEY=VALUE   a key of dynamic metadata: a number if VALUE reads as one, else a
                            string; repeatable
  --filter-state KEY=VALUE  a filter state object; repeatable
  --body JSON               the request's body, for rules keyed on or matching its fields
                            (body:PATH, match.body)
the report:
  --seed HEX                the key seed (32 hex digits) if the configuration sets no key_seed:
                            without either, keys are shown raw and not hashed
  --raw-keys                also show each key's raw parts (they may hold an API key)
  --json                    one JSON object per rule, one per line";

/// Whether `text` is a client address as Envoy gives `source.address`: an IP address, or one
/// with a port (`10.0.0.7:5000`, `[2001:db8::7]:5000`). A typo must not explain another request.
fn is_address(text: &str) -> bool {
    use std::net::{IpAddr, SocketAddr};
    text.parse::<IpAddr>().is_ok() || text.parse::<SocketAddr>().is_ok()
}

/// What the command line asks for.
#[derive(Clone, Debug)]
pub struct Options {
    /// The configuration file.
    pub config: String,
    /// The request.
    pub request: Request,
    /// `--seed`.
    pub seed: Option<Seed>,
    /// `--raw-keys`.
    pub raw_keys: bool,
    /// `--json`.
    pub json: bool,
}

impl Options {
    /// Reads the arguments after `explain`; `Err` says what is wrong.
    pub fn parse(args: &[String]) -> Result<Options, String> {
        let mut request = Request {
            plain: PlainRequest {
                source_address: Some("127.0.0.1".into()),
                path: Some("/".into()),
                method: Some("GET".into()),
                authority: Some("localhost".into()),
                ..PlainRequest::default()
            },
            body: None,
            fields: None,
        };
        let mut config = None;
        let (mut seed, mut raw_keys, mut json) = (None, false, false);
        let mut flags = crate::flags::Flags::new(args);
        while let Some((flag, inline)) = flags.next_arg() {
            match flag {
                "--method" => request.plain.method = Some(flags.value(flag, inline)?),
                "--path" => request.plain.path = Some(flags.value(flag, inline)?),
                "--authority" => request.plain.authority = Some(flags.value(flag, inline)?),
                "--source" => {
                    let v = flags.value(flag, inline)?;
                    if !is_address(&v) {
                        return Err(format!(
                            "--source {v}: expected an IP address, with or without a port \
                             (10.0.0.7, 10.0.0.7:5000, 2001:db8::7, [2001:db8::7]:5000)"
                        ));
                    }
                    request.plain.source_address = Some(v);
                }
                "--header" => {
                    let v = flags.value(flag, inline)?;
                    let (name, val) = v
                        .split_once(':')
                        .filter(|(n, _)| !n.trim().is_empty())
                        .ok_or_else(|| format!("--header {v}: expected 'NAME: VALUE'"))?;
                    request.plain.headers.push((
                        name.trim().to_ascii_lowercase(),
                        val.trim().as_bytes().to_vec(),
                    ));
                }
                "--metadata" => {
                    let v = flags.value(flag, inline)?;
                    let parsed = v.split_once('=').and_then(|(at, val)| {
                        let (ns, key) = at.split_once(':')?;
                        (!ns.is_empty() && !key.is_empty()).then_some((ns, key, val))
                    });
                    let Some((ns, key, val)) = parsed else {
                        return Err(format!("--metadata {v}: expected NAMESPACE:KEY=VALUE"));
                    };
                    let val = match val.trim().parse::<f64>() {
                        Ok(n) if n.is_finite() => Meta::Number(n),
                        _ => Meta::Text(val.to_string()),
                    };
                    request.plain.metadata.push((ns.into(), key.into(), val));
                }
                "--body" => request.body = Some(flags.value(flag, inline)?.into_bytes()),
                "--filter-state" => {
                    let v = flags.value(flag, inline)?;
                    let (k, val) = v
                        .split_once('=')
                        .filter(|(k, _)| !k.is_empty())
                        .ok_or_else(|| format!("--filter-state {v}: expected KEY=VALUE"))?;
                    request
                        .plain
                        .filter_state
                        .push((k.into(), val.as_bytes().to_vec()));
                }
                "--seed" => {
                    let v = flags.value(flag, inline)?;
                    seed =
                        Some(Seed::parse_hex(&v).ok_or_else(|| {
                            format!("--seed {v}: expected 32 hexadecimal digits")
                        })?);
                }
                "--raw-keys" | "--json" if inline.is_some() => {
                    return Err(format!("{flag} takes no value"))
                }
                "--raw-keys" => raw_keys = true,
                "--json" => json = true,
                f if f.starts_with("--") => return Err(format!("unknown option {f}")),
                _ if config.is_none() => config = Some(flag.to_string()),
                _ => return Err(format!("one CONFIG only (also given {flag})")),
            }
        }
        Ok(Options {
            config: config.ok_or("CONFIG is missing")?,
            request,
            seed,
            raw_keys,
            json,
        })
    }
}

/// The request to explain: what the filter reads of one.
#[derive(Clone, Debug)]
pub struct Request {
    /// Its attributes, headers, dynamic metadata and filter state.
    pub plain: PlainRequest,
    /// Its body (`--body`), if any.
    pub body: Option<Vec<u8>>,
    /// The body's fields, read as the filter reads them ([`Request::read_body`]).
    fields: Option<Scanner>,
}

impl Request {
    /// Reads the body's fields that `config`'s rules need, as the filter does: the first
    /// `max_body` bytes (the most of the rules' bounds).
    fn read_body(&mut self, config: &Config) {
        let Some(body) = &self.body else {
            return;
        };
        let bound = config
            .rules
            .iter()
            .filter_map(|r| r.charge()?.sized.as_ref().map(|s| s.max_body));
        let bound = bound.fold(config.max_body, u32::max);
        let bound = usize::try_from(bound).unwrap_or(usize::MAX);
        let mut scanner = Scanner::with_texts(Format::Json);
        let paths = &config.request_paths;
        scanner.feed(paths, body.get(..bound).unwrap_or(body));
        if body.len() <= bound {
            scanner.finish(paths);
        }
        self.fields = Some(scanner);
    }
}

impl Attributes for Request {
    fn source_address(&mut self) -> Option<&str> {
        self.plain.source_address()
    }
    fn path(&mut self) -> Option<&str> {
        self.plain.path()
    }
    fn method(&mut self) -> Option<&str> {
        self.plain.method()
    }
    fn authority(&mut self) -> Option<&str> {
        self.plain.authority()
    }
    fn header(&mut self, name: &str) -> Option<&[u8]> {
        self.plain.header(name)
    }
    fn metadata(&mut self, namespace: &str, key: &str) -> Option<Carried<'_>> {
        self.plain.metadata(namespace, key)
    }
    fn filter_state(&mut self, key: &str) -> Option<&[u8]> {
        self.plain.filter_state(key)
    }
    fn body_field(&mut self, slot: usize) -> Option<&[u8]> {
        self.fields.as_ref()?.text(slot)
    }
}

/// Explaining decides nothing: no clock, no held requests, no log.
impl Host for Request {
    fn now_ms(&mut self) -> u64 {
        0
    }
    fn held(&self) -> usize {
        0
    }
    fn log(&mut self, _: log::Level, _: fmt::Arguments<'_>) {}
}

/// The configuration compiled to explain with, and the seed keys are hashed under: the
/// configuration's `key_seed`, else `--seed` (`None`: keys are shown raw).
fn runtime(config: &Config, options: &Options) -> (Runtime<MemoryStore>, Option<Seed>) {
    let seed = config.key_seed.or(options.seed);
    let rt = Runtime::new(
        config.clone(),
        seed.unwrap_or(Seed([0, 0])),
        MemoryStore::new(),
    );
    (rt, seed)
}

/// The report for one configuration, called `name`, as text.
pub fn text(name: &str, config: &Config, options: &Options) -> String {
    let (rt, seed) = runtime(config, options);
    let mut req = options.request.clone();
    req.read_body(config);
    let p = &req.plain;
    let mut out = format!(
        "{name}: {} {} (authority {}, from {})\n",
        p.method.as_deref().unwrap_or(""),
        p.path.as_deref().unwrap_or(""),
        p.authority.as_deref().unwrap_or(""),
        p.source_address.as_deref().unwrap_or(""),
    );
    match (config.key_seed, options.seed) {
        (Some(c), Some(o)) if c != o => {
            out.push_str("  --seed ignored: the configuration sets key_seed\n");
        }
        (None, None) => out.push_str(
            "  keys shown raw: the hashed key the filter logs needs key_seed in the \
             configuration, or --seed with the seed of the Envoy you compare with\n",
        ),
        _ => {}
    }
    let explained = rt.explain(&mut req);
    let width = explained
        .iter()
        .map(|e| e.rule.name.len() + 1)
        .max()
        .unwrap_or(0);
    for e in &explained {
        let label = format!("{}:", e.rule.name);
        match &e.outcome {
            Err(why) => {
                let _ = writeln!(out, "  {label:width$} does not apply: {why}");
            }
            Ok(a) => {
                let _ = writeln!(out, "  {label:width$} applies");
                let pad = " ".repeat(width + 3);
                let _ = writeln!(out, "{pad}key {}", key_text(a, seed.is_some(), options));
                let _ = writeln!(out, "{pad}cost {}", cost_text(&a.cost, e.rule));
                let _ = writeln!(out, "{pad}limit {}", limit_line(e, a));
                for c in a
                    .carried
                    .iter()
                    .chain(a.share.iter().flat_map(|s| &s.weight_from))
                {
                    let value = c.value.as_ref().map_or("nothing".into(), Value::to_string);
                    let _ = writeln!(
                        out,
                        "{pad}{} from {} = {value}: {}",
                        c.number,
                        c.source,
                        resolved_text(c.resolved)
                    );
                }
                if let Some(s) = &a.share {
                    let leased = e.rule.lease_policy().is_some();
                    let _ = writeln!(out, "{pad}{}", share_text(s, leased));
                }
            }
        }
    }
    out
}

/// The key as the filter logs it, with its raw parts where asked for or where there is no
/// seed to hash it.
fn key_text(a: &Applies<'_>, seeded: bool, options: &Options) -> String {
    let raw = raw_parts(a);
    match (seeded, options.raw_keys || !seeded) {
        (true, false) => format!("{}", key::logged(a.hash)),
        (true, true) if raw.is_empty() => {
            format!("{} (no parts: one counter)", key::logged(a.hash))
        }
        (true, true) => format!("{} ({raw})", key::logged(a.hash)),
        (false, _) if raw.is_empty() => "[] (no parts: one counter)".into(),
        (false, _) => raw,
    }
}

/// `remote_address=10.0.0.7, header:x-api-key=abc`, with notes.
fn raw_parts(a: &Applies<'_>) -> String {
    a.parts
        .iter()
        .map(|p| {
            let note = p.note.map(|n| format!(" ({n})")).unwrap_or_default();
            format!("{}={}{note}", p.part.descriptor_key(), escaped(&p.value))
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// The prices a request's model takes under `rule`, charged in money.
fn priced_text(p: &PricedAs, rule: &Rule) -> String {
    let Some(price) = rule.price() else {
        return String::new();
    };
    let per = match price.per {
        1 => "token",
        1_000 => "1K tokens",
        _ => "1M tokens",
    };
    let model = |m: &Option<Vec<u8>>| {
        m.as_ref().map_or("no model named".into(), |m| {
            format!("model \"{}\"", escaped(m))
        })
    };
    let rates = |r: Rates| {
        format!(
            "input {}, cached input {}, {}output {} {} per {per}",
            r.input,
            r.cached_input,
            if price.api.writes_cache() {
                format!("cache write {}, ", r.cache_write)
            } else {
                String::new()
            },
            r.output,
            rule.quota_unit.as_deref().unwrap_or("units"),
        )
    };
    match p {
        PricedAs::Answer => "; priced by the model the answer names".into(),
        PricedAs::Body(m, Priced::Model(i)) => format!(
            "; {} priced as \"{}{}\": {}",
            model(m),
            price
                .models
                .get(usize::from(*i))
                .map_or("", |r| r.name.as_str()),
            if price.models.get(usize::from(*i)).is_some_and(|r| r.prefix) {
                "*"
            } else {
                ""
            },
            rates(price.rates(Priced::Model(*i)))
        ),
        PricedAs::Body(m, priced) => format!(
            "; {}: the default prices, {}",
            model(m),
            rates(price.rates(*priced))
        ),
        PricedAs::Unpriced(m) => format!(
            "; {}: no price, refused with a 400 (price.default: \"refuse\")",
            model(m)
        ),
    }
}

fn cost_text(c: &CostFrom<'_>, rule: &Rule) -> String {
    match c {
        CostFrom::Fixed(n) => format!("{n}"),
        CostFrom::Header {
            name,
            value: Some(v),
            cost,
        } => format!("{cost} (from header {name}: \"{}\")", escaped(v)),
        CostFrom::Header {
            name, value: None, ..
        } => format!("1 (from header {name}, missing: 1)"),
        CostFrom::Reservation {
            cost,
            sized: false,
            priced,
        } => format!(
            "{cost} reserved (charged what the response reports){}",
            priced
                .as_ref()
                .map_or(String::new(), |p| priced_text(p, rule))
        ),
        CostFrom::Reservation {
            cost,
            sized: true,
            priced,
        } => {
            format!(
            "{cost} reserved if the request body names no maximum (the filter sizes it from the \
             body; charged what the response reports){}",
            priced.as_ref().map_or(String::new(), |p| priced_text(p, rule))
        )
        }
    }
}

/// `100 per minute (sliding_window), shadow, global sync`.
/// A shared rule's tenant, as a sentence.
fn share_text(s: &Shared<'_>, leased: bool) -> String {
    let mut out = format!("shared: this tenant weighs {}", s.weight);
    match &s.band_from {
        Some((source, value)) => {
            let value = value.as_ref().map_or("nothing".into(), Value::to_string);
            let _ = write!(out, ", band {} (from {source} = {value})", s.band);
        }
        None => {
            let _ = write!(out, ", one band");
        }
    }
    let base = if s.band_from.is_some() {
        format!("its band's budget (at most {})", s.handed_out)
    } else {
        s.handed_out.to_string()
    };
    let _ = write!(
        out,
        "; alone it may use the whole limit; while the limit is contended, its share is at \
         least {base} x {} / the weights of the tenants active then",
        s.weight,
    );
    if leased {
        out.push_str(
            "; leased for the whole fleet: each Envoy shares its part of the limit, learned \
             from the service's answers, among the tenants it sees",
        );
    }
    out
}

fn limit_line(e: &Explained<'_>, a: &Applies<'_>) -> String {
    let r = e.rule;
    let mut out = limit_text(&a.policy);
    let _ = write!(out, " ({})", r.limit.algorithm_name());
    if let Policy::Gcra(g) = a.policy {
        if let Some(d) = g.max_delay_ms {
            let _ = write!(out, ", delay up to {d} ms");
        }
    }
    if r.shadow {
        out.push_str(", shadow: counted, never refused");
    }
    if let Some(g) = &r.global {
        let _ = write!(
            out,
            ", global {} (cluster {}, domain {})",
            g.mode.name(),
            g.cluster,
            g.domain
        );
    }
    if r.elastic.is_some() {
        out.push_str(", elastic: the base limit, scaled by the backend's health");
    }
    out
}

/// The report for one configuration as JSON objects, one per rule.
pub fn json(name: &str, config: &Config, options: &Options) -> Vec<Json> {
    let (rt, seed) = runtime(config, options);
    let mut req = options.request.clone();
    req.read_body(config);
    rt.explain(&mut req)
        .iter()
        .map(|e| {
            let mut o = Map::new();
            o.insert("config".into(), name.into());
            o.insert("rule".into(), e.rule.name.clone().into());
            o.insert("applies".into(), e.outcome.is_ok().into());
            match &e.outcome {
                Ok(a) => applies_json(&mut o, e, a, seed.is_some(), options),
                Err(why) => not_applying_json(&mut o, why),
            }
            Json::Object(o)
        })
        .collect()
}

fn applies_json(
    o: &mut Map<String, Json>,
    e: &Explained<'_>,
    a: &Applies<'_>,
    seeded: bool,
    options: &Options,
) {
    let key = seeded.then(|| key::logged(a.hash).to_string());
    o.insert("key".into(), key.into());
    if options.raw_keys || !seeded {
        let parts: Vec<Json> = a
            .parts
            .iter()
            .map(|p| {
                json!({
                    "part": p.part.descriptor_key(),
                    "value": escaped(&p.value),
                    "note": p.note.map(|n| n.to_string()),
                })
            })
            .collect();
        o.insert("parts".into(), parts.into());
    }
    let cost = match &a.cost {
        CostFrom::Fixed(n) => json!({"from": "fixed", "value": n}),
        CostFrom::Header { name, value, cost } => json!({
            "from": "header", "header": name, "value": cost,
            "header_value": value.as_ref().map(|v| escaped(v)),
        }),
        CostFrom::Reservation {
            cost,
            sized,
            priced,
        } => {
            let mut c = json!({"from": "reservation", "value": cost, "sized_from_body": sized});
            if let (Some(p), Some(o)) = (priced, c.as_object_mut()) {
                let (model, price) = match p {
                    PricedAs::Answer => (None, json!("answer")),
                    PricedAs::Body(m, Priced::Model(i)) => (
                        m.as_ref(),
                        json!(e
                            .rule
                            .price()
                            .and_then(|x| x.models.get(usize::from(*i)))
                            .map(|r| r.name.clone())),
                    ),
                    PricedAs::Body(m, _) => (m.as_ref(), json!("default")),
                    PricedAs::Unpriced(m) => (m.as_ref(), json!("refused")),
                };
                o.insert("model".into(), json!(model.map(|m| escaped(m))));
                o.insert("priced_as".into(), price);
            }
            c
        }
    };
    o.insert("cost".into(), cost);
    let mut limit = Map::new();
    limit.insert("algorithm".into(), e.rule.limit.algorithm_name().into());
    match a.policy {
        Policy::InFlight { max, .. } => {
            limit.insert("in_flight".into(), max.into());
        }
        p => {
            let (n, window_ms) = p.limit_and_window();
            limit.insert("requests_per_unit".into(), n.into());
            limit.insert("window_s".into(), (window_ms / 1000).into());
            limit.insert("window".into(), window_text(&p).into());
            if let Some(b) = p.burst() {
                limit.insert("burst".into(), b.into());
            }
        }
    }
    o.insert("limit".into(), limit.into());
    let carried: Vec<Json> = a
        .carried
        .iter()
        .map(|c| {
            let (what, n) = match c.resolved {
                Resolved::Taken(n) => ("taken", n),
                Resolved::Missing(n) => ("missing", n),
                Resolved::Invalid(n) => ("invalid", n),
                Resolved::Capped(n) => ("capped", n),
            };
            let value = match &c.value {
                None => Json::Null,
                Some(Value::Number(x)) => json!(x),
                Some(Value::Text(t)) => escaped(t).into(),
            };
            json!({
                "number": c.number.to_string(), "from": c.source.to_string(),
                "value": value, "resolved": what, "in_force": n,
            })
        })
        .collect();
    o.insert("carried".into(), carried.into());
    if let Some(s) = &a.share {
        let (band_from, band_value) = match &s.band_from {
            Some((source, value)) => (
                Json::from(source.to_string()),
                match value {
                    None => Json::Null,
                    Some(Value::Number(x)) => json!(x),
                    Some(Value::Text(t)) => escaped(t).into(),
                },
            ),
            None => (Json::Null, Json::Null),
        };
        o.insert(
            "share".into(),
            json!({
                "weight": s.weight,
                "weight_from": s.weight_from.as_ref().map(|c| c.source.to_string()),
                "band": s.band, "band_from": band_from, "band_value": band_value,
                "handed_out": s.handed_out,
            }),
        );
    }
    o.insert("shadow".into(), e.rule.shadow.into());
    o.insert(
        "global".into(),
        e.rule.global.as_ref().map(|g| g.mode.name()).into(),
    );
    o.insert("elastic".into(), e.rule.elastic.is_some().into());
}

fn not_applying_json(o: &mut Map<String, Json>, why: &NotApplying<'_>) {
    o.insert("reason".into(), why.to_string().into());
    match why {
        NotApplying::NoMatch { condition, found } => {
            o.insert("condition".into(), condition.to_string().into());
            o.insert("found".into(), found.as_ref().map(|f| escaped(f)).into());
        }
        NotApplying::MissingPart { part, why, refused } => {
            o.insert("part".into(), part.to_string().into());
            let why = match why {
                Absence::Absent => "absent",
                Absence::Empty => "empty",
                Absence::NotBearer => "not_bearer",
                Absence::NotInBody => "not_in_body",
            };
            o.insert("missing".into(), why.into());
            o.insert("refused".into(), (*refused).into());
        }
        NotApplying::Unexplained => {}
    }
}
