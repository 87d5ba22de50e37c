//! The tenants of the shared-capacity tests (share.rs, share_fleet.rs): each a client thread
//! sending its requests at its own pace to one or more Envoys, and what it saw; Jain's index.
use super::provider::Provider;
use super::Client;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long the tests run, seconds: SHARE_SECONDS, 60 by default.
pub fn seconds() -> u64 {
    std::env::var("SHARE_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(60)
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

/// What one client saw over the measured seconds: requests sent, and answered 200 / 429.
#[derive(Clone, Copy, Debug, Default)]
pub struct Seen {
    pub sent: u64,
    pub ok: u64,
    pub refused: u64,
}

/// Each tenant on its own thread, paced at its rate for `run_s` seconds, its requests sent to
/// `addrs` in turn (one keep-alive connection to each); what each saw once the provider had run
/// `warmup_s` seconds, in `tenants`' order.
pub fn drive(
    addrs: &[SocketAddr],
    provider: &Arc<Provider>,
    tenants: &[Tenant],
    run_s: u64,
    warmup_s: u64,
) -> Vec<Seen> {
    let threads: Vec<_> = tenants
        .iter()
        .cloned()
        .enumerate()
        .map(|(n, t)| {
            let provider = provider.clone();
            let addrs = addrs.to_vec();
            std::thread::spawn(move || {
                let mut seen = Seen::default();
                let mut clients: Vec<Client> =
                    addrs.iter().map(|a| Client::connect(*a).unwrap()).collect();
                let start = Instant::now();
                let mut headers: Vec<(&str, &str)> = vec![("x-tenant", &t.name)];
                headers.extend(t.headers.iter().map(|(k, v)| (*k, v.as_str())));
                for k in 0u64.. {
                    let at = Duration::from_secs_f64(k as f64 / t.rate);
                    if at >= Duration::from_secs(run_s) {
                        break;
                    }
                    if let Some(wait) = at.checked_sub(start.elapsed()) {
                        std::thread::sleep(wait);
                    }
                    let i = (k as usize + n) % addrs.len();
                    let measured = provider.elapsed_s() >= warmup_s as f64;
                    let status = match clients[i].send("GET", t.path, &headers) {
                        Ok(r) => r.status,
                        Err(_) => {
                            clients[i] = Client::connect(addrs[i]).unwrap();
                            clients[i].send("GET", t.path, &headers).unwrap().status
                        }
                    };
                    if measured {
                        seen.sent += 1;
                        seen.ok += u64::from(status == 200);
                        seen.refused += u64::from(status == 429);
                    }
                }
                seen
            })
        })
        .collect();
    threads.into_iter().map(|t| t.join().unwrap()).collect()
}

/// Jain's fairness index of `xs`: 1 when all are equal, 1/n when one has everything.
pub fn jain(xs: &[f64]) -> f64 {
    let sum: f64 = xs.iter().sum();
    let squares: f64 = xs.iter().map(|x| x * x).sum();
    sum * sum / (xs.len() as f64 * squares)
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
    warmup_s: u64,
    end_s: u64,
    rate: f64,
}

impl<'a> Outcome<'a> {
    /// After [`drive`] returned `seen` for `tenants`.
    pub fn new(
        provider: &'a Provider,
        tenants: &[Tenant],
        seen: Vec<Seen>,
        warmup_s: u64,
        rate: f64,
    ) -> Outcome<'a> {
        Outcome {
            provider,
            seen: tenants.iter().map(|t| t.name.clone()).zip(seen).collect(),
            warmup_s,
            end_s: provider.elapsed_s() as u64,
            rate,
        }
    }

    /// Each tenant of organisation `org`: what the provider admitted, a second.
    pub fn admitted(&self, org: &str) -> std::collections::HashMap<String, f64> {
        let measured_s = self.end_s.saturating_sub(self.warmup_s).max(1) as f64;
        self.provider
            .tally(org, self.warmup_s, self.end_s)
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
