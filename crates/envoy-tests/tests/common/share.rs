//! The load of the shared-capacity tests: a paced sender for them all;
//! the tenants of share.rs and share_fleet.rs, each a client thread sending its requests at its
//! own pace to one or more Envoys, and what it saw; Jain's index.
use super::provider::Provider;
use super::Client;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Calls `send(k)` for k = 0, 1, ..., each at its time (k / `rate` seconds after the first, or
/// at once when late), as long as that time is within `run` and `send` returns true: every
/// request of the run is sent, however late, unless `send` stops it.
pub fn paced(rate: f64, run: Duration, mut send: impl FnMut(u64) -> bool) {
    let start = Instant::now();
    for k in 0u64.. {
        let at = Duration::from_secs_f64(k as f64 / rate);
        if at >= run {
            return;
        }
        if let Some(wait) = at.checked_sub(start.elapsed()) {
            std::thread::sleep(wait);
        }
        if !send(k) {
            return;
        }
    }
}

/// `send` on `client`; if that fails (Envoy closed the idle connection), once more on a new
/// connection from `connect`.
pub fn or_reconnect<C, R>(
    client: &mut C,
    connect: impl Fn() -> C,
    send: impl Fn(&mut C) -> std::io::Result<R>,
) -> R {
    match send(client) {
        Ok(r) => r,
        Err(_) => {
            *client = connect();
            send(client).unwrap()
        }
    }
}

/// One client: a tenant (`x-tenant`) sending `rate` requests a second to `path`, with more
/// headers.
#[derive(Clone)]
pub struct Tenant {
    pub path: &'static str,
    pub name: String,
    pub rate: f64,
    pub headers: Vec<(&'static str, String)>,
}

/// A [`Tenant`].
pub fn tenant(
    path: &'static str,
    name: &str,
    rate: f64,
    headers: &[(&'static str, &str)],
) -> Tenant {
    Tenant {
        path,
        name: name.into(),
        rate,
        headers: headers.iter().map(|(k, v)| (*k, v.to_string())).collect(),
    }
}

/// What one client saw over the measured seconds: requests sent, and answered 200 / 429 by
/// Envoy / 429 by the provider / anything else.
#[derive(Clone, Copy, Debug, Default)]
pub struct Seen {
    pub sent: u64,
    pub ok: u64,
    pub refused: u64,
    pub by_provider: u64,
    pub other: u64,
}

impl Seen {
    /// Counts one answer of `status` (`by_provider`: a 429 the provider gave).
    pub fn count(&mut self, status: u16, by_provider: bool) {
        let refused = status == 429;
        self.sent += 1;
        self.ok += u64::from(status == 200);
        self.refused += u64::from(refused && !by_provider);
        self.by_provider += u64::from(refused && by_provider);
        self.other += u64::from(status != 200 && !refused);
    }

    /// Every 429, Envoy's or the provider's.
    pub fn refusals(&self) -> u64 {
        self.refused + self.by_provider
    }
}

/// What a run saw: each tenant's answers once the traffic had run its warm-up, and the first
/// whole second measured on the provider's clock (the provider counts by its seconds).
pub struct Driven {
    pub seen: Vec<Seen>,
    pub from_s: u64,
}

/// Each tenant on its own thread, paced at its rate for `run_s` seconds, its requests sent to
/// `addrs` in turn (one keep-alive connection to each); what each saw once the traffic had run
/// `warmup_s` seconds (from the first whole second of the provider's after that), in `tenants`'
/// order. The warm-up counts from the traffic's start, not the provider's: Envoys starting
/// slowly (a busy machine compiling the wasm filter) would otherwise eat into it.
pub fn drive(
    addrs: &[SocketAddr],
    provider: &Arc<Provider>,
    tenants: &[Tenant],
    run_s: u64,
    warmup_s: u64,
) -> Driven {
    drive_to(|_| addrs.to_vec(), provider, tenants, run_s, warmup_s)
}

/// [`drive`], tenant `n`'s requests sent in turn to the Envoys `to(n)` gives.
pub fn drive_to(
    to: impl Fn(usize) -> Vec<SocketAddr>,
    provider: &Arc<Provider>,
    tenants: &[Tenant],
    run_s: u64,
    warmup_s: u64,
) -> Driven {
    let (from_s, _) = provider.window(warmup_s as f64, run_s);
    let threads: Vec<_> = tenants
        .iter()
        .cloned()
        .enumerate()
        .map(|(n, t)| {
            let provider = provider.clone();
            let addrs = to(n);
            std::thread::spawn(move || {
                let mut seen = Seen::default();
                let mut clients: Vec<Client> =
                    addrs.iter().map(|a| Client::connect(*a).unwrap()).collect();
                let mut headers: Vec<(&str, &str)> = vec![("x-tenant", &t.name)];
                headers.extend(t.headers.iter().map(|(k, v)| (*k, v.as_str())));
                paced(t.rate, Duration::from_secs(run_s), |k| {
                    let i = (k as usize + n) % addrs.len();
                    let measured = provider.elapsed_s() >= from_s as f64;
                    let status = or_reconnect(
                        &mut clients[i],
                        || Client::connect(addrs[i]).unwrap(),
                        |c| c.send("GET", t.path, &headers),
                    )
                    .status;
                    if measured {
                        // Every 429 counts as Envoy's: the provider's are counted on its side.
                        seen.count(status, false);
                    }
                    true
                });
                seen
            })
        })
        .collect();
    let seen = threads.into_iter().map(|t| t.join().unwrap()).collect();
    Driven { seen, from_s }
}

/// Jain's fairness index of `xs`: 1 when all are equal, 1/n when one has everything.
pub fn jain(xs: &[f64]) -> f64 {
    let sum: f64 = xs.iter().sum();
    let squares: f64 = xs.iter().map(|x| x * x).sum();
    sum * sum / (xs.len() as f64 * squares)
}

/// The provider's limit per organisation in the four cases, and so each case's capacity,
/// requests a second. Shares of tens of requests a window: a tenant's share is enforced on a
/// count of whole requests over its window, so each held tenant may land a request either side
/// of its share in a window, which is 1 % of a share here (10 % of one at 50 a second).
pub const RATE: f64 = 200.0;
/// Seconds of a run before the measure starts.
pub const WARMUP_S: u64 = 10;

/// The configuration of [`CASES`]: each a rule of [`RATE`] a second on its own path, keyed by
/// `x-tenant`, with the rule's fields `more` beside its `share`.
pub fn cases_config(more: &str) -> String {
    let rules: Vec<String> = CASES
        .iter()
        .map(|(name, share)| {
            format!(
                r#"{{"name": "{name}", "match": {{"path_prefix": "/{name}/"}},
                    "key": ["header:x-tenant"],
                    "rate_limit": {{"requests_per_unit": {RATE}, "unit": "second"}},
                    {more}, "share": {share}}}"#
            )
        })
        .collect();
    format!(r#"{{"rules": [{}]}}"#, rules.join(", "))
}

/// The four cases both tests run, each a shared rule on its own path and organisation: its
/// name and its `share` object.
pub const CASES: [(&str, &str); 4] = [
    ("p1", "{}"),
    ("p2", "{}"),
    (
        "p3",
        r#"{"weight": {"from": "header:x-weight", "default": 1, "max": 10}}"#,
    ),
    (
        "p4",
        r#"{"bands": [{"name": "interactive", "min_share": 0.2}, {"name": "batch", "min_share": 0.05}],
            "band": {"from": "header:x-band", "default": "batch"}}"#,
    ),
];

/// The tenants of [`CASES`] in front of a capacity of `rate` a second: `/p1`, one tenant at ten
/// times its share and nine at half of theirs; `/p2`, five equal tenants at three times theirs;
/// `/p3`, weights 1, 2 and 4, each asking for the whole capacity; `/p4`, three interactive
/// tenants (30 % of the capacity in all) beside three batch ones asking for it all each.
pub fn four_cases(rate: f64) -> Vec<Tenant> {
    let share = rate / 10.0;
    let mut tenants = vec![tenant("/p1/x", "heavy", 10.0 * share, &[])];
    for i in 0..9 {
        tenants.push(tenant("/p1/x", &format!("light{i}"), share / 2.0, &[]));
    }
    for i in 0..5 {
        tenants.push(tenant("/p2/x", &format!("equal{i}"), 3.0 * rate / 5.0, &[]));
    }
    for w in ["1", "2", "4"] {
        tenants.push(tenant("/p3/x", &format!("w{w}"), rate, &[("x-weight", w)]));
    }
    for i in 0..3 {
        let band = [("x-band", "interactive")];
        tenants.push(tenant(
            "/p4/x",
            &format!("interactive{i}"),
            0.1 * rate,
            &band,
        ));
    }
    for i in 0..3 {
        let band = [("x-band", "batch")];
        tenants.push(tenant("/p4/x", &format!("batch{i}"), rate, &band));
    }
    tenants
}

/// A run's outcome: what each client saw, and what the provider admitted over the measured
/// seconds.
pub struct Outcome<'a> {
    provider: &'a Provider,
    /// By tenant.
    pub seen: std::collections::HashMap<String, Seen>,
    from_s: u64,
    end_s: u64,
    rate: f64,
}

impl<'a> Outcome<'a> {
    /// After [`drive`] returned `driven` for `tenants`.
    pub fn new(
        provider: &'a Provider,
        tenants: &[Tenant],
        driven: Driven,
        rate: f64,
    ) -> Outcome<'a> {
        Outcome {
            provider,
            seen: tenants
                .iter()
                .map(|t| t.name.clone())
                .zip(driven.seen)
                .collect(),
            from_s: driven.from_s,
            end_s: provider.elapsed_s() as u64,
            rate,
        }
    }

    /// Each tenant of organisation `org`: what the provider admitted, a second.
    pub fn admitted(&self, org: &str) -> std::collections::HashMap<String, f64> {
        let measured_s = self.end_s.saturating_sub(self.from_s).max(1) as f64;
        self.provider
            .tally(org, self.from_s, self.end_s)
            .into_iter()
            .map(|(t, (a, _))| (t, a as f64 / measured_s))
            .collect()
    }

    /// Prints `org`'s tenants (`got`: [`Outcome::admitted`]) and its total.
    pub fn report(&self, org: &str, got: &std::collections::HashMap<String, f64>) {
        let mut names: Vec<_> = got.keys().collect();
        names.sort();
        for n in names {
            eprintln!(
                "{org} {n}: provider admitted {:.2}/s; client {:?}",
                got[n],
                self.seen.get(n.as_str())
            );
        }
        let total: f64 = got.values().sum();
        let rate = self.rate;
        eprintln!(
            "{org}: {total:.2}/s of {rate}/s ({:.1} %)",
            100.0 * total / rate
        );
    }
}

/// Prints, for each of `rules`, the fleet's lease and refusal counters (summed over
/// `proxies`), then why requests were refused ([`refusal_reasons`]).
pub fn print_counters(proxies: &[super::Envoy], rules: &[&str]) {
    let fleet = |rule: &str, name: &str| -> u64 {
        proxies
            .iter()
            .map(|p| p.stat(&super::metric(Some(rule), name)).unwrap_or(0))
            .sum()
    };
    for &rule in rules {
        eprintln!(
            "{rule}: lease_claims {} lease_granted {} lease_lapsed {} lease_refused {} \
             share_refused {} limited {} global_errors {} failed_open {} failed_closed {}",
            fleet(rule, "lease_claims"),
            fleet(rule, "lease_granted"),
            fleet(rule, "lease_lapsed"),
            fleet(rule, "lease_refused"),
            fleet(rule, "share_refused"),
            fleet(rule, "limited"),
            fleet(rule, "global_errors"),
            fleet(rule, "failed_open"),
            fleet(rule, "failed_closed"),
        );
    }
    // Every call to the service (claims, and the fleet-fair reports alone), per request
    // decided by the rules.
    let calls: u64 = proxies
        .iter()
        .map(|p| p.stat("cluster.ratelimit.upstream_rq_total").unwrap_or(0))
        .sum();
    let requests: u64 = rules
        .iter()
        .map(|r| fleet(r, "allowed") + fleet(r, "limited"))
        .sum();
    eprintln!(
        "figure: service calls {calls} for {requests} requests ({:.2} per 100)",
        100.0 * calls as f64 / requests.max(1) as f64
    );
    eprintln!(
        "refusals by rule, band and reason: {:?}",
        refusal_reasons(proxies)
    );
}

/// Why requests were refused, from the `shared` lines of the Envoys' logs: how many by rule,
/// band and reason.
pub fn refusal_reasons(proxies: &[super::Envoy]) -> std::collections::BTreeMap<String, u64> {
    let mut why = std::collections::BTreeMap::new();
    for p in proxies {
        let log = std::fs::read_to_string(&p.log).unwrap_or_default();
        for line in log.lines().filter_map(|l| l.split("shared rule=").nth(1)) {
            let field = |name: &str| {
                line.split_whitespace()
                    .find_map(|w| w.strip_prefix(name))
                    .unwrap_or("?")
                    .to_string()
            };
            let rule = line.split_whitespace().next().unwrap_or("?");
            let key = format!("{rule} {} {}", field("band="), field("reason="));
            *why.entry(key).or_default() += 1;
        }
    }
    why
}
