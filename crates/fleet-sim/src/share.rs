//! A shared capacity split statically over a fleet: each proxy counts the shared rule on its
//! own, with `C / P` of the rule's capacity `C` and only the tenants it sees, and nothing passes
//! between proxies. Measured on a virtual clock over the core's own decision
//! ([`ratelimit_core::share::decide`]), against the fleet-wide weighted max-min (water-filling)
//! allocation of `C`, under three load balancers.
//!
//! Each run: `P` proxies, each with its own share [`Record`] and tenant entries, its capacity a
//! token bucket of `C / P` a second holding 90 % of a second's worth (`burst_p`); one band,
//! the default sharing parameters (active 10 s, saturation 800 ‰, target 970 ‰, no ramp);
//! `T` tenants, each a Poisson stream of requests of cost 1, its next arrival in a heap (the
//! work is per request, never per tenant and millisecond). Requests come for
//! [`Study::duration_ms`]; the figures are over the part after [`Study::warmup_ms`].
//!
//! Exact by construction: in any interval of `L` ms a proxy admits at most
//! `burst_p + ⌈C/P · L / 1000⌉`, so the fleet at most `C·L/1000 + P·(burst_p + 1)`: over a
//! second, `1 + P·burst_p / C` (1.9) times the capacity at worst, and `C` on average over any
//! long stretch. [`Figures::peak`] measures it.
//!
//! Two things bound what a split can use and how fairly: the split itself (a proxy admits at
//! most `C / P` and at most what it is sent: [`Figures::split_bound`], whatever the limiter),
//! and each proxy's shares, which are those of one record of `C / P` over the tenants it sees
//! (behind a random balancer, all of them: a `P`-th of their global share).
//!
//! The same runs with the capacity leased for the whole fleet instead ([`Split::Leased`]) are
//! [`crate::leased`]'s: the loop is this one, each admission then covered by the proxy's lease.

use crate::fair_model::{FairFigures, FairFleet};
use crate::lease_model::{LeaseFigures, Leases};
use crate::traffic::{exponential_us, unit};
use ratelimit_core::limiter::{gcra, Policy};
use ratelimit_core::share::{decide, refund, Asker, Record, Share, Tenant, MAX_BANDS};
use ratelimit_core::testkit::fair::{jain, water_fill};
use ratelimit_core::testkit::Rng;
use serde_json::{json, Value};
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::fmt::Write as _;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

/// How the load balancer in front of the fleet sends each request to a proxy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Balancer {
    /// Each request to a proxy drawn uniformly.
    Random,
    /// Each tenant pinned to one proxy by a hash of its id.
    Sticky,
    /// Each request to proxy `i` with a probability proportional to `1 / (i + 1)`.
    Skewed,
    /// Each request to proxy 0 with a probability of 80 %, else to another drawn uniformly.
    Hot,
}

impl Balancer {
    /// The three, in table order.
    pub const ALL: [Balancer; 3] = [Balancer::Random, Balancer::Sticky, Balancer::Skewed];

    /// Its name in the tables and the JSON.
    pub fn label(&self) -> &'static str {
        match self {
            Balancer::Random => "random",
            Balancer::Sticky => "sticky",
            Balancer::Skewed => "skewed",
            Balancer::Hot => "hot 80 %",
        }
    }
}

/// What the tenants ask.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mix {
    /// Tenant 0 asks 10 times its plain share `C / T`, every other one half of its own; all of
    /// weight 1.
    HeavyLights,
    /// Every tenant asks 3 times its share `C·w / W`, its weight `w` drawn from {1, 2, 4}.
    Backlogged,
}

impl Mix {
    /// Both, in table order.
    pub const ALL: [Mix; 2] = [Mix::Backlogged, Mix::HeavyLights];

    /// Its name in the JSON.
    pub fn label(&self) -> &'static str {
        match self {
            Mix::HeavyLights => "heavy+lights",
            Mix::Backlogged => "backlogged",
        }
    }
}

/// How the capacity is divided among the proxies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Split {
    /// `C / P` each, counted alone (this module).
    Static,
    /// Leased for the whole fleet from a rate limit service ([`crate::leased`]): each proxy
    /// decides over the whole `C`, its tenants sharing the part it learned from the service's
    /// answers, and each admission is covered by quota claimed from the service in blocks of
    /// at most this.
    Leased(BlockCap),
    /// Leased as above, and fair across the fleet ([`crate::fair`]): each admission also
    /// within the tenant's allowance on its proxy, from the fleet's counters in the service;
    /// blocks of at most this until a proxy knows its part.
    Fair(BlockCap),
    /// Fair across the fleet as the filter itself does it ([`crate::fair_runtime`]): every
    /// proxy the core's own `Runtime` with a rule of `share.fleet: "fair"`, driven as the hosts
    /// drive it, against a service counting as limitador does; `global.max_block` this.
    Runtime(BlockCap),
}

/// The largest block a proxy claims of a leased capacity `C`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BlockCap {
    /// `C / n`, whatever the fleet's size.
    OfCapacity(u64),
    /// `C / (n·P)`: the fleet's `P` proxies' blocks together `C / n`.
    PerProxy(u64),
}

impl BlockCap {
    /// Its name in the tables: `C/40`, `C/(40·P)`.
    pub fn label(&self) -> String {
        match self {
            BlockCap::OfCapacity(n) => format!("C/{n}"),
            BlockCap::PerProxy(n) => format!("C/({n}·P)"),
        }
    }
}

/// One run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Study {
    /// Proxies in the fleet (1: one record for everyone, the reference).
    pub proxies: usize,
    /// Tenants.
    pub tenants: usize,
    /// How requests reach the proxies.
    pub balancer: Balancer,
    /// What the tenants ask.
    pub mix: Mix,
    /// The rule's capacity `C`, requests a second, fleet-wide.
    pub capacity: u64,
    /// How long requests come, ms.
    pub duration_ms: u64,
    /// The start left out of the figures, ms.
    pub warmup_ms: u64,
    /// The seed of every draw.
    pub seed: u64,
    /// How the capacity is divided.
    pub split: Split,
}

/// Fair across the fleet: the part of the capacity the fleet's levels hand out, permille (the
/// lease keeps the fleet within the whole; the allowances of tenants that ask less than their
/// share on a proxy in a window are not used).
pub const FAIR_TARGET_PM: u64 = 970;

/// The default run length, ms: a minute, the first 10 s left out.
pub const DURATION_MS: u64 = 60_000;
/// The default warm-up, ms (an active interval).
pub const WARMUP_MS: u64 = 10_000;

impl Study {
    /// A run of the default length, of capacity [`fleet_capacity`], seed 1.
    pub fn new(proxies: usize, tenants: usize, balancer: Balancer, mix: Mix) -> Study {
        Study {
            proxies,
            tenants,
            balancer,
            mix,
            capacity: fleet_capacity(tenants),
            duration_ms: DURATION_MS,
            warmup_ms: WARMUP_MS,
            seed: 1,
            split: Split::Static,
        }
    }

    /// Each proxy's capacity, requests a second: `C / P` (rounded down).
    pub fn per_proxy(&self) -> u64 {
        self.capacity / self.proxies.max(1) as u64
    }

    /// Each proxy's bucket: 90 % of a second's worth.
    pub fn burst_per_proxy(&self) -> u64 {
        self.per_proxy() * 9 / 10
    }

    /// The most the fleet can admit in any interval of `window_ms`, by construction: split
    /// statically, `C·L/1000 + P·(burst_p + 1)`; leased, `C` in each service window the
    /// interval meets.
    pub fn bound(&self, window_ms: u64) -> u64 {
        match self.split {
            Split::Static => {
                let p = self.proxies.max(1) as u64;
                (self.per_proxy() * p * window_ms).div_ceil(1000) + p * (self.burst_per_proxy() + 1)
            }
            Split::Leased(_) | Split::Fair(_) | Split::Runtime(_) => {
                let windows = window_ms.div_ceil(crate::lease_model::WINDOW_MS) + 1;
                self.capacity.saturating_mul(windows)
            }
        }
    }

    /// Leased: the largest block a proxy claims (at least 1; 0 split statically).
    pub fn max_block(&self) -> u64 {
        let n = match self.split {
            Split::Static => return 0,
            Split::Leased(BlockCap::OfCapacity(n))
            | Split::Fair(BlockCap::OfCapacity(n))
            | Split::Runtime(BlockCap::OfCapacity(n)) => n,
            Split::Leased(BlockCap::PerProxy(n))
            | Split::Fair(BlockCap::PerProxy(n))
            | Split::Runtime(BlockCap::PerProxy(n)) => n.saturating_mul(self.proxies.max(1) as u64),
        };
        (self.capacity / n.max(1)).max(1)
    }

    /// The sharing parameters: the defaults, one band.
    pub fn share(&self) -> Share {
        Share {
            active_ms: 10_000,
            saturation_pm: 800,
            target_pm: 970,
            bands: 1,
            min_share_pm: [0; MAX_BANDS],
            ramp_ms: 0,
        }
    }

    /// The rule's policy each proxy decides with: its capacity `C / P` (split statically),
    /// or the whole `C` (leased: its part is applied from the record), a bucket of 0.9 s.
    pub fn policy(&self) -> Policy {
        let limit = match self.split {
            Split::Static => self.per_proxy(),
            Split::Leased(_) | Split::Fair(_) | Split::Runtime(_) => self.capacity,
        };
        Policy::Gcra(gcra::Params {
            limit,
            window_ms: 1000,
            burst: limit * 9 / 10,
            max_delay_ms: None,
        })
    }
}

/// The capacity of a rule of `tenants` tenants: 20 requests a second per tenant, at least 1,000,
/// rounded up to a multiple of 300 so that every fleet size of the sweep (3, 10, 30, 100)
/// divides it.
pub fn fleet_capacity(tenants: usize) -> u64 {
    (20 * tenants as u64).max(1000).div_ceil(300) * 300
}

/// What a run measured, per second over the measured part.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Figures {
    /// Each tenant's weight.
    pub weights: Vec<f64>,
    /// Each tenant's requests.
    pub offered: Vec<f64>,
    /// Each tenant's admitted requests.
    pub admitted: Vec<f64>,
    /// Each tenant's water-filling allocation of `C` for what it offered.
    pub ideal: Vec<f64>,
    /// Each proxy's admitted requests ÷ its capacity `C / P`.
    pub proxy_use: Vec<f64>,
    /// The requests each proxy was sent ÷ its capacity `C / P`.
    pub proxy_demand: Vec<f64>,
    /// Proxies no tenant was pinned to (sticky; 0 otherwise).
    pub idle_proxies: usize,
    /// The fleet's admissions by millisecond, the whole run.
    pub per_ms: Vec<u32>,
    /// Decisions taken (requests), the whole run.
    pub decisions: u64,
    /// The capacity, a second.
    pub capacity: f64,
    /// Where the measured part starts, ms.
    pub warmup_ms: u64,
    /// Leased: what the lease did.
    pub lease: Option<LeaseFigures>,
    /// Fair across the fleet: what the fleet's shares did.
    pub fair: Option<FairFigures>,
    /// Requests over the measured part (every balancer's, all tenants).
    pub requests: u64,
}

impl Figures {
    /// The fleet's admitted requests a second ÷ `C`.
    pub fn used(&self) -> f64 {
        self.admitted.iter().sum::<f64>() / self.capacity.max(1.0)
    }

    /// The most any limiter counting on each proxy alone could admit ÷ `C`: each proxy at most
    /// `C / P` and at most what it was sent, `Σ_p min(C/P, d_p) / C`. What the split itself
    /// wastes is `min(1, D/C)` less this.
    pub fn split_bound(&self) -> f64 {
        let p = self.proxy_demand.len().max(1) as f64;
        self.proxy_demand.iter().map(|d| d.min(1.0)).sum::<f64>() / p
    }

    /// The fleet's admitted requests ÷ what water-filling hands out (`C`, or all the demand
    /// when it fits).
    pub fn of_ideal(&self) -> f64 {
        ratio(self.admitted.iter().sum(), self.ideal.iter().sum())
    }

    /// The most the fleet admitted in an interval of `window_ms` (from `from_ms`).
    pub fn peak(&self, from_ms: u64, window_ms: u64) -> u64 {
        let from = usize::try_from(from_ms).unwrap_or(usize::MAX);
        let window = usize::try_from(window_ms.max(1)).unwrap_or(usize::MAX);
        let series = self.per_ms.get(from..).unwrap_or(&[]);
        let (mut sum, mut best) = (0u64, 0u64);
        for (k, &n) in series.iter().enumerate() {
            sum += u64::from(n);
            if let Some(&gone) = k.checked_sub(window).and_then(|j| series.get(j)) {
                sum -= u64::from(gone);
            }
            best = best.max(sum);
        }
        best
    }

    /// The most admitted in one second of the measured part ÷ `C`.
    pub fn peak_1s(&self) -> f64 {
        self.peak(self.warmup_ms, 1000) as f64 / self.capacity.max(1.0)
    }

    /// The same over the whole run (the buckets start full).
    pub fn peak_1s_whole_run(&self) -> f64 {
        self.peak(0, 1000) as f64 / self.capacity.max(1.0)
    }

    /// Jain's index of each tenant's admitted requests per unit of weight.
    pub fn jain(&self) -> f64 {
        let per_weight: Vec<f64> = self
            .admitted
            .iter()
            .zip(&self.weights)
            .map(|(a, w)| a / w.max(1.0))
            .collect();
        jain(&per_weight)
    }

    /// The worst tenant's admitted requests ÷ its water-filling allocation.
    pub fn worst_of_ideal(&self) -> f64 {
        self.admitted
            .iter()
            .zip(&self.ideal)
            .filter(|(_, &i)| i > 0.0)
            .map(|(a, i)| a / i)
            .fold(f64::INFINITY, f64::min)
            .min(1e9)
    }

    /// The part of the light tenants (all but tenant 0) given 99 % of what they asked or more.
    pub fn lights_served(&self) -> f64 {
        let lights: Vec<bool> = self
            .admitted
            .iter()
            .zip(&self.offered)
            .skip(1)
            .map(|(a, o)| *a >= 0.99 * o)
            .collect();
        ratio(
            lights.iter().filter(|&&s| s).count() as f64,
            lights.len() as f64,
        )
    }

    /// The worst served light tenant's admitted requests ÷ its demand.
    pub fn worst_light(&self) -> f64 {
        self.admitted
            .iter()
            .zip(&self.offered)
            .skip(1)
            .map(|(a, o)| ratio(*a, *o))
            .fold(1.0, f64::min)
    }

    /// Tenant 0's admitted requests ÷ its water-filling allocation.
    pub fn heavy_of_ideal(&self) -> f64 {
        ratio(
            self.admitted.first().copied().unwrap_or(0.0),
            self.ideal.first().copied().unwrap_or(0.0),
        )
    }

    /// The least and the most used proxy (÷ `C / P`).
    pub fn proxy_use_range(&self) -> (f64, f64) {
        let lo = self.proxy_use.iter().copied().fold(f64::INFINITY, f64::min);
        let hi = self.proxy_use.iter().copied().fold(0.0, f64::max);
        (if lo.is_finite() { lo } else { 0.0 }, hi)
    }
}

pub(crate) fn ratio(a: f64, b: f64) -> f64 {
    if b > 0.0 {
        a / b
    } else {
        1.0
    }
}

/// A hash for tenant ids (a multiply: ids are small integers).
#[derive(Default)]
struct IdHasher(u64);

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(b)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        }
    }

    fn write_u32(&mut self, n: u32) {
        self.0 = u64::from(n).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
}

/// One proxy: its record of the shared rule, its tenants' entries, what it admitted (measured).
struct Proxy {
    record: Record,
    tenants: HashMap<u32, Tenant, BuildHasherDefault<IdHasher>>,
}

/// SplitMix64: the sticky balancer's hash and the seed's spreading.
pub(crate) fn splitmix(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Where the balancer sends each request: `study`'s balancer over its proxies.
pub(crate) struct Placer {
    balancer: Balancer,
    proxies: usize,
    /// Each tenant's proxy when pinned.
    home: Vec<usize>,
    /// The skewed balancer's cumulative weights, and their sum.
    cdf: Vec<f64>,
    total: f64,
}

impl Placer {
    /// The placement of `tenants` tenants under `study`.
    pub(crate) fn new(study: &Study, tenants: usize) -> Placer {
        let p = study.proxies.max(1);
        let home = (0..tenants)
            .map(|i| (splitmix(i as u64 ^ study.seed.rotate_left(32)) % p as u64) as usize)
            .collect();
        let mut cdf: Vec<f64> = Vec::with_capacity(p);
        let mut total = 0.0;
        for i in 0..p {
            total += 1.0 / (i + 1) as f64;
            cdf.push(total);
        }
        Placer {
            balancer: study.balancer,
            proxies: p,
            home,
            cdf,
            total,
        }
    }

    /// The proxy tenant `i`'s next request goes to.
    pub(crate) fn proxy(&self, i: usize, rng: &mut Rng) -> usize {
        let p = self.proxies;
        match self.balancer {
            Balancer::Random => rng.below(p as u64) as usize,
            Balancer::Sticky => self.home.get(i).copied().unwrap_or(0),
            Balancer::Skewed => {
                let u = unit(rng) * self.total;
                self.cdf.partition_point(|&c| c <= u).min(p - 1)
            }
            Balancer::Hot => {
                if p == 1 || rng.below(10) < 8 {
                    0
                } else {
                    1 + rng.below(p as u64 - 1) as usize
                }
            }
        }
    }

    /// Proxies no tenant is pinned to (sticky; 0 otherwise).
    pub(crate) fn idle(&self) -> usize {
        match self.balancer {
            Balancer::Sticky => (0..self.proxies).filter(|q| !self.home.contains(q)).count(),
            _ => 0,
        }
    }
}

/// What a run counts request by request: each tenant's and each proxy's requests and
/// admissions over the measured part, and the fleet's admissions by millisecond over the whole
/// run.
pub(crate) struct Counts {
    offered: Vec<u64>,
    admitted: Vec<u64>,
    proxy_offered: Vec<u64>,
    proxy_admitted: Vec<u64>,
    /// The fleet's admissions by millisecond, the whole run.
    pub(crate) per_ms: Vec<u32>,
    decisions: u64,
    requests: u64,
}

impl Counts {
    /// Nothing counted yet, for `tenants` tenants, `proxies` proxies and a run of `duration_ms`.
    pub(crate) fn new(tenants: usize, proxies: usize, duration_ms: u64) -> Counts {
        Counts {
            offered: vec![0; tenants],
            admitted: vec![0; tenants],
            proxy_offered: vec![0; proxies],
            proxy_admitted: vec![0; proxies],
            per_ms: vec![0; usize::try_from(duration_ms).unwrap_or(0)],
            decisions: 0,
            requests: 0,
        }
    }

    /// Tenant `tenant`'s request at `at_us` decided by proxy `proxy`: `admits` or not,
    /// `measured` (past the warm-up) or not.
    pub(crate) fn count(
        &mut self,
        (tenant, proxy): (usize, usize),
        at_us: u64,
        measured: bool,
        admits: bool,
    ) {
        self.decisions += 1;
        if admits {
            if let Some(slot) = self.per_ms.get_mut((at_us / 1000) as usize) {
                *slot += 1;
            }
        }
        if !measured {
            return;
        }
        self.requests += 1;
        let add = |v: &mut Vec<u64>, i: usize| {
            if let Some(x) = v.get_mut(i) {
                *x += 1;
            }
        };
        add(&mut self.offered, tenant);
        add(&mut self.proxy_offered, proxy);
        if admits {
            add(&mut self.admitted, tenant);
            add(&mut self.proxy_admitted, proxy);
        }
    }

    /// The run's figures: `study`'s, of tenants of `weights`, `idle_proxies` of its proxies
    /// pinned no tenant, with what its lease and fair shares did.
    pub(crate) fn figures(
        self,
        study: &Study,
        weights: &[u16],
        idle_proxies: usize,
        (lease, fair): (Option<LeaseFigures>, Option<FairFigures>),
    ) -> Figures {
        let warmup_ms = study.warmup_ms.min(study.duration_ms);
        let seconds = study.duration_ms.saturating_sub(warmup_ms) as f64 / 1e3;
        let per_s = |v: &[u64]| -> Vec<f64> {
            v.iter()
                .map(|&x| x as f64 / seconds.max(f64::MIN_POSITIVE))
                .collect()
        };
        let offered = per_s(&self.offered);
        let weights: Vec<f64> = weights
            .iter()
            .take(self.offered.len())
            .map(|&w| f64::from(w))
            .collect();
        let capacity = study.capacity as f64;
        let ideal = water_fill(capacity, &offered, &weights);
        let proxy_cap = study.per_proxy() as f64 * seconds;
        let of_cap = |v: &[u64]| v.iter().map(|&x| ratio(x as f64, proxy_cap)).collect();
        Figures {
            weights,
            offered,
            admitted: per_s(&self.admitted),
            ideal,
            proxy_use: of_cap(&self.proxy_admitted),
            proxy_demand: of_cap(&self.proxy_offered),
            idle_proxies,
            per_ms: self.per_ms,
            decisions: self.decisions,
            capacity,
            warmup_ms,
            lease,
            fair,
            requests: self.requests,
        }
    }
}

/// Each tenant's weight and request rate (a second) under `study`'s mix.
pub fn demands(study: &Study, rng: &mut Rng) -> (Vec<u16>, Vec<f64>) {
    let t = study.tenants.max(1);
    let c = study.capacity as f64;
    match study.mix {
        Mix::HeavyLights => {
            let plain = c / t as f64;
            let rates = (0..t)
                .map(|i| if i == 0 { 10.0 * plain } else { 0.5 * plain })
                .collect();
            (vec![1; t], rates)
        }
        Mix::Backlogged => {
            let weights: Vec<u16> = (0..t).map(|_| 1 << rng.below(3)).collect();
            let total: f64 = weights.iter().map(|&w| f64::from(w)).sum();
            let rates = weights
                .iter()
                .map(|&w| 3.0 * c * f64::from(w) / total)
                .collect();
            (weights, rates)
        }
    }
}

/// Each tenant's weight and request rate under `study`'s mix, drawn from its seed (every
/// split of a study draws the same).
pub fn seeded_demands(study: &Study) -> (Vec<u16>, Vec<f64>) {
    demands(study, &mut Rng(splitmix(study.seed) | 1))
}

/// Runs `study`: every request decided by the proxy the balancer sends it to.
pub fn run(study: &Study) -> Figures {
    let (weights, rates) = seeded_demands(study);
    run_with(study, &weights, &rates)
}

/// Runs `study` with these tenants' weights and rates (requests a second).
pub fn run_with(study: &Study, weights: &[u16], rates: &[f64]) -> Figures {
    let p = study.proxies.max(1);
    let n = weights.len().min(rates.len());
    let share = study.share();
    let policy = study.policy();
    let mut rng = Rng(splitmix(study.seed ^ 0x5eed) | 1);
    let start_ms = 1_800_000_000_000u64;
    let end_us = study.duration_ms.saturating_mul(1000);
    let warmup_us = study.warmup_ms.min(study.duration_ms).saturating_mul(1000);

    let placer = Placer::new(study, n);
    let mut proxies: Vec<Proxy> = (0..p)
        .map(|_| Proxy {
            record: Record::new(1),
            tenants: HashMap::default(),
        })
        .collect();
    let mut counts = Counts::new(n, p, study.duration_ms);
    let from_ms = start_ms + warmup_us / 1000;
    let mut leases = match study.split {
        Split::Static | Split::Runtime(_) => None,
        Split::Leased(_) => Some(Leases::new(study.capacity, study.max_block(), p, from_ms)),
        Split::Fair(_) => Some(Leases::fair(study.capacity, study.max_block(), p, from_ms)),
    };
    let mut fair = matches!(study.split, Split::Fair(_)).then(|| {
        FairFleet::new(
            share,
            (
                study.capacity,
                crate::lease_model::WINDOW_MS,
                FAIR_TARGET_PM,
            ),
            study.max_block(),
            p,
            from_ms,
        )
    });

    // Each tenant's next arrival, µs (ties: the lower id first).
    let mut heap: BinaryHeap<Reverse<(u64, u32)>> = rates
        .iter()
        .take(n)
        .enumerate()
        .filter(|(_, &r)| r > 0.0)
        .map(|(i, &r)| Reverse((exponential_us(&mut rng, r), i as u32)))
        .collect();
    while let Some(Reverse((at_us, id))) = heap.pop() {
        if at_us >= end_us {
            break;
        }
        let i = id as usize;
        let (Some(&rate), Some(&weight)) = (rates.get(i), weights.get(i)) else {
            continue;
        };
        heap.push(Reverse((at_us + exponential_us(&mut rng, rate), id)));
        let q = placer.proxy(i, &mut rng);
        let Some(proxy) = proxies.get_mut(q) else {
            continue;
        };
        let entry = proxy.tenants.entry(id).or_default();
        let now_ms = start_ms + at_us / 1000;
        // Fair: the proxy's first request of an epoch reports and reads the fleet's counters;
        // the tenant's ask is counted whatever becomes of it.
        let calls_before = leases.as_ref().map_or(0, Leases::calls);
        let reported = fair.as_mut().is_some_and(|f| {
            f.ask(q, id, weight, now_ms, 1);
            f.turn(q, now_ms)
        });
        let d = decide(
            &share,
            &policy,
            &mut proxy.record,
            Some(&*entry),
            Asker {
                weight,
                band: 0,
                again: false,
                wait_ms: 0,
            },
            now_ms,
            1,
        );
        *entry = d.tenant;
        let measured = at_us >= warmup_us;
        // Fair: admitted only within the tenant's allowance on this proxy, else given back.
        let within = d.refused.is_none()
            && fair.as_mut().is_none_or(|f| {
                let ok = f.take(q, id, now_ms, 1);
                if !ok {
                    refund(&policy, &mut proxy.record, entry, now_ms, now_ms, 1);
                    if measured {
                        f.tally.refused += 1;
                    }
                }
                ok
            });
        // Leased: admitted only if the proxy's lease covers it, else given back.
        let left = leases.as_ref().and_then(|l| l.told(q));
        let cap = fair.as_ref().map(|f| f.block_cap(q, now_ms, left));
        let admits = within
            && leases.as_mut().is_none_or(|l| {
                let covered = l.cover_capped(q, &mut proxy.record, now_ms, cap);
                if !covered {
                    refund(&policy, &mut proxy.record, entry, now_ms, now_ms, 1);
                    if let Some(f) = fair.as_mut() {
                        f.give_back(q, id, 1);
                    }
                }
                covered
            });
        if reported && measured {
            let claimed = leases.as_ref().map_or(0, Leases::calls) > calls_before;
            if let (true, Some(f)) = (claimed, fair.as_mut()) {
                f.tally.piggybacked += 1;
            }
        }
        counts.count((i, q), at_us, measured, admits);
    }

    let idle_proxies = placer.idle();
    let lease = leases.map(|l| {
        let records: Vec<&Record> = proxies.iter().map(|x| &x.record).collect();
        l.figures(&records, &counts.per_ms, (end_us - warmup_us) / 1000)
    });
    counts.figures(study, weights, idle_proxies, (lease, fair.map(|f| f.tally)))
}

/// A sweep of the study: every combination of its lists, and for each tenant count and mix one
/// reference run with a single proxy of the whole capacity (what one shared record gives).
#[derive(Clone, Debug, PartialEq)]
pub struct ShareSweep {
    /// Fleet sizes.
    pub proxies: Vec<usize>,
    /// Tenant counts.
    pub tenants: Vec<usize>,
    /// Load balancers.
    pub balancers: Vec<Balancer>,
    /// Demand mixes.
    pub mixes: Vec<Mix>,
    /// How long requests come, ms.
    pub duration_ms: u64,
    /// The start left out of the figures, ms.
    pub warmup_ms: u64,
    /// The seed of every run.
    pub seed: u64,
}

impl ShareSweep {
    /// The whole study: 3 to 100 proxies, 10 to 10,000 tenants, every balancer and mix.
    pub fn standard() -> ShareSweep {
        ShareSweep {
            proxies: vec![3, 10, 30, 100],
            tenants: vec![10, 100, 1000, 10_000],
            balancers: Balancer::ALL.to_vec(),
            mixes: Mix::ALL.to_vec(),
            duration_ms: DURATION_MS,
            warmup_ms: WARMUP_MS,
            seed: 1,
        }
    }

    /// The small one (`--share --quick`): 3 and 10 proxies, 10 and 100 tenants.
    pub fn quick() -> ShareSweep {
        ShareSweep {
            proxies: vec![3, 10],
            tenants: vec![10, 100],
            ..ShareSweep::standard()
        }
    }

    /// The leased comparison's small one (`--share --lease --quick`): every fleet size, 10 to
    /// 1,000 tenants, the random and sticky balancers.
    pub fn lease_quick() -> ShareSweep {
        ShareSweep {
            tenants: vec![10, 100, 1000],
            balancers: vec![Balancer::Random, Balancer::Sticky],
            ..ShareSweep::standard()
        }
    }

    /// Every run, in table order: by mix, tenants, then the reference, then proxies and
    /// balancers.
    pub fn studies(&self) -> Vec<Study> {
        let mut out = Vec::new();
        for &mix in &self.mixes {
            for &tenants in &self.tenants {
                let mut one = |proxies: usize, balancer: Balancer| {
                    out.push(Study {
                        duration_ms: self.duration_ms,
                        warmup_ms: self.warmup_ms.min(self.duration_ms / 2),
                        seed: self.seed,
                        ..Study::new(proxies, tenants, balancer, mix)
                    });
                };
                one(1, Balancer::Random);
                for &proxies in &self.proxies {
                    for &balancer in &self.balancers {
                        one(proxies, balancer);
                    }
                }
            }
        }
        out
    }
}

/// Runs `studies` on `threads` threads; each with its figures, in the studies' order.
pub fn run_all(studies: &[Study], threads: usize) -> Vec<(Study, Figures)> {
    run_all_with(studies, threads, run)
}

/// [`run_all`], each study run by `run` (the runtime's studies by [`crate::fair::run`]).
pub fn run_all_with(
    studies: &[Study],
    threads: usize,
    run: fn(&Study) -> Figures,
) -> Vec<(Study, Figures)> {
    let next = AtomicUsize::new(0);
    let results: Mutex<Vec<Option<Figures>>> = Mutex::new(vec![None; studies.len()]);
    std::thread::scope(|scope| {
        for _ in 0..threads.max(1) {
            scope.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(s) = studies.get(i) else {
                    return;
                };
                let figures = run(s);
                let mut r = results
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
                if let Some(slot) = r.get_mut(i) {
                    *slot = Some(figures);
                }
            });
        }
    });
    let results = results
        .into_inner()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    studies
        .iter()
        .zip(results)
        .filter_map(|(s, f)| Some((s.clone(), f?)))
        .collect()
}

fn fleet(s: &Study) -> String {
    if s.proxies == 1 {
        "1 (one record)".into()
    } else {
        s.proxies.to_string()
    }
}

fn balancer(s: &Study) -> &'static str {
    if s.proxies == 1 {
        "—"
    } else {
        s.balancer.label()
    }
}

fn range((lo, hi): (f64, f64)) -> String {
    format!("{lo:.2}–{hi:.2}")
}

/// The study's tables: one per mix, a row per tenant count, fleet size and balancer.
pub fn markdown(runs: &[(Study, Figures)]) -> String {
    let mut out = String::new();
    for mix in Mix::ALL {
        let these: Vec<&(Study, Figures)> = runs.iter().filter(|(s, _)| s.mix == mix).collect();
        let Some((first, _)) = these.first() else {
            continue;
        };
        let measured = format!(
            "seconds {}–{} measured",
            first.warmup_ms / 1000,
            first.duration_ms / 1000
        );
        match mix {
            Mix::Backlogged => {
                let _ = writeln!(
                    out,
                    "**Backlogged**: every tenant asks 3× its share, weights drawn from {{1, 2, 4}}; \
                     each proxy C/P a second, bucket 0.9 s of it; {measured}. used: admitted ÷ C; \
                     split bound: Σ_p min(C/P, requests sent to p) ÷ C, the most any limiter \
                     counting on each proxy alone could admit; peak: the most admitted in 1 s ÷ C \
                     (bound 1 + P·burst_p/C = 1.9); Jain of \
                     admitted ÷ weight; worst: the worst tenant's admitted ÷ its water-filling share \
                     of C; proxy use: admitted ÷ C/P, least–most\n"
                );
                out.push_str(
                    "| tenants | C /s | proxies | LB | used | split bound | peak 1 s | Jain | worst ÷ ideal | proxy use |\n\
                     |---|---|---|---|---|---|---|---|---|---|\n",
                );
                for (s, f) in &these {
                    let _ = writeln!(
                        out,
                        "| {} | {} | {} | {} | {:.3} | {:.3} | {:.3} | {:.4} | {:.3} | {} |",
                        s.tenants,
                        s.capacity,
                        fleet(s),
                        balancer(s),
                        f.used(),
                        f.split_bound(),
                        f.peak_1s(),
                        f.jain(),
                        f.worst_of_ideal(),
                        range(f.proxy_use_range()),
                    );
                }
            }
            Mix::HeavyLights => {
                let _ = writeln!(
                    out,
                    "**One heavy tenant, the others light**: tenant 0 asks 10× C/T, the others ½ C/T \
                     each, all of weight 1; {measured}. used: admitted ÷ C; split bound: as above; \
                     of ideal: admitted ÷ the water-filling total (C, or the demand when it fits); \
                     peak: the most admitted in 1 s ÷ C (bound 1.9); lights served: the part of the \
                     light tenants given ≥ 99 % of their demand (the worst one's admitted ÷ demand); \
                     heavy: its admitted ÷ its water-filling share\n"
                );
                out.push_str(
                    "| tenants | C /s | proxies | LB | used | split bound | of ideal | peak 1 s | lights served (worst) | heavy ÷ ideal | proxy use |\n\
                     |---|---|---|---|---|---|---|---|---|---|---|\n",
                );
                for (s, f) in &these {
                    let _ = writeln!(
                        out,
                        "| {} | {} | {} | {} | {:.3} | {:.3} | {:.3} | {:.3} | {:.3} ({:.3}) | {:.3} | {} |",
                        s.tenants,
                        s.capacity,
                        fleet(s),
                        balancer(s),
                        f.used(),
                        f.split_bound(),
                        f.of_ideal(),
                        f.peak_1s(),
                        f.lights_served(),
                        f.worst_light(),
                        f.heavy_of_ideal(),
                        range(f.proxy_use_range()),
                    );
                }
            }
        }
        out.push('\n');
    }
    out
}

/// A run's figures as JSON (a mix's figures only: `null` for the other mix's).
pub fn row_json(s: &Study, f: &Figures) -> Value {
    let (lo, hi) = f.proxy_use_range();
    let backlogged = s.mix == Mix::Backlogged;
    let only = |yes: bool, x: f64| if yes { json!(x) } else { Value::Null };
    json!({
        "proxies": s.proxies,
        "tenants": s.tenants,
        "balancer": s.balancer.label(),
        "mix": s.mix.label(),
        "capacity": s.capacity,
        "per_proxy": s.per_proxy(),
        "burst_per_proxy": s.burst_per_proxy(),
        "duration_ms": s.duration_ms,
        "warmup_ms": s.warmup_ms,
        "seed": s.seed,
        "decisions": f.decisions,
        "offered_per_s": f.offered.iter().sum::<f64>(),
        "admitted_per_s": f.admitted.iter().sum::<f64>(),
        "used": f.used(),
        "split_bound": f.split_bound(),
        "of_ideal": f.of_ideal(),
        "peak_1s": f.peak_1s(),
        "peak_1s_whole_run": f.peak_1s_whole_run(),
        "bound_1s": s.bound(1000) as f64 / s.capacity.max(1) as f64,
        "jain": only(backlogged, f.jain()),
        "worst_of_ideal": f.worst_of_ideal(),
        "lights_served": only(!backlogged, f.lights_served()),
        "worst_light": only(!backlogged, f.worst_light()),
        "heavy_of_ideal": only(!backlogged, f.heavy_of_ideal()),
        "proxy_use_min": lo,
        "proxy_use_max": hi,
        "idle_proxies": f.idle_proxies,
    })
}

#[cfg(test)]
#[allow(clippy::indexing_slicing)]
mod tests {
    use super::*;

    #[test]
    fn the_capacity_divides_by_every_fleet_size() {
        for t in [10, 100, 1000, 10_000] {
            let c = fleet_capacity(t);
            assert!(c >= 20 * t as u64 && c >= 1000);
            for p in [3, 10, 30, 100] {
                assert_eq!(c % p, 0, "{c} by {p}");
            }
        }
    }

    #[test]
    fn a_peak_is_the_most_in_any_window() {
        let f = Figures {
            per_ms: vec![1, 0, 5, 0, 0, 3, 2, 0],
            ..Figures::default()
        };
        assert_eq!(f.peak(0, 1), 5);
        assert_eq!(f.peak(0, 3), 6);
        assert_eq!(f.peak(0, 4), 8);
        assert_eq!(f.peak(3, 3), 5);
        assert_eq!(f.peak(0, 100), 11);
    }

    #[test]
    fn the_mixes_ask_what_they_say() {
        let mut rng = Rng(3);
        let s = Study::new(3, 100, Balancer::Random, Mix::Backlogged);
        let c = s.capacity as f64;
        let (w, r) = demands(&s, &mut rng);
        assert!(w.iter().all(|w| [1, 2, 4].contains(w)));
        assert!((1..=4).all(|k| w.contains(&k) || k == 3));
        assert!((r.iter().sum::<f64>() - 3.0 * c).abs() < 1e-6 * c);
        let total: f64 = w.iter().map(|&x| f64::from(x)).sum();
        assert!((r[7] - 3.0 * c * f64::from(w[7]) / total).abs() < 1e-9 * c);
        let s = Study {
            mix: Mix::HeavyLights,
            ..s
        };
        let (w, r) = demands(&s, &mut rng);
        assert!(w.iter().all(|&w| w == 1));
        assert_eq!((r[0], r[1], r[99]), (c / 10.0, c / 200.0, c / 200.0));
    }

    #[test]
    fn a_run_is_a_function_of_its_study() {
        let s = Study {
            duration_ms: 12_000,
            warmup_ms: 2_000,
            ..Study::new(3, 10, Balancer::Skewed, Mix::Backlogged)
        };
        let (a, b) = (run(&s), run(&s));
        assert_eq!(a, b);
        assert!(a.decisions > 0 && a.used() > 0.5);
        let other = run(&Study { seed: 2, ..s });
        assert_ne!(a.admitted, other.admitted);
    }
}
