//! The fair model's moving parts (`--share --fair`): what each proxy keeps of the fleet's
//! shares ([`ratelimit_core::share::fair`]'s [`View`] and a [`Local`] per tenant), and the
//! rate limit service's counters they write and read, one call a proxy and epoch (the
//! service's window), as that module's design says. [`crate::fair`] runs and reports them
//! beside the leased mode.
//!
//! Left out, as in [`crate::lease_model`]: the service answers at once and never fails; its
//! counters are exact sums (every write lands before the next epoch's reads).

use ratelimit_core::share::fair::{self, BandCounts, Local, View};
use ratelimit_core::share::{Share, MAX_BANDS};
use std::collections::HashMap;

/// What one proxy keeps of the fleet's shares.
struct Replica {
    /// The epoch of its last report (`None`: never reported).
    epoch: Option<u64>,
    view: View,
    /// Each tenant it serves: what it keeps of it, and its weight.
    tenants: HashMap<u32, (Local, u16)>,
    /// What it expects to admit a window (cost units × `LEVEL_ONE`), from its last report
    /// (`None`: it never reported).
    part: Option<u64>,
    /// What the fleet is expected to admit a window under its view ([`fair::fleet_use`]).
    fleet_use: u64,
    /// What it added to the band sums in its last two reports, and for which epochs.
    wrote: [(u64, BandCounts); 2],
}

/// What the fair shares did over a run's measured part.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct FairFigures {
    /// Reports made (one call each: a proxy and an epoch).
    pub reports: u64,
    /// Reports that rode on a lease claim (no call of their own): made by the same request in
    /// the model, sent with a claim ahead of need by the runtime.
    pub piggybacked: u64,
    /// Descriptors written and read, over all reports.
    pub descriptors: u64,
    /// Requests `decide` admitted that the fleet's allowance refused.
    pub refused: u64,
}

/// The fleet's shares: every proxy's, and the service's counters.
pub struct FairFleet {
    share: Share,
    limit: u64,
    target_pm: u64,
    window_ms: u64,
    max_block: u64,
    replicas: Vec<Replica>,
    /// The service's counters: each tenant's asks and each band's sums, by epoch.
    asked: HashMap<(u64, u32), u64>,
    bands: HashMap<u64, [BandCounts; MAX_BANDS]>,
    from_ms: u64,
    /// The figures so far.
    pub tally: FairFigures,
}

impl FairFleet {
    /// The shares of a capacity of `limit` a window of `window_ms`, `target_pm` permille of
    /// it handed out, for `proxies` proxies whose blocks are at most `max_block`, measured
    /// from `from_ms`.
    pub fn new(
        share: Share,
        (limit, window_ms, target_pm): (u64, u64, u64),
        max_block: u64,
        proxies: usize,
        from_ms: u64,
    ) -> FairFleet {
        FairFleet {
            share,
            limit,
            target_pm,
            window_ms: window_ms.max(1),
            max_block,
            replicas: (0..proxies)
                .map(|_| Replica {
                    epoch: None,
                    view: View::new(share.bands),
                    tenants: HashMap::new(),
                    part: None,
                    fleet_use: 0,
                    wrote: [(u64::MAX, BandCounts::default()); 2],
                })
                .collect(),
            asked: HashMap::new(),
            bands: HashMap::new(),
            from_ms,
            tally: FairFigures::default(),
        }
    }

    fn epoch(&self, now_ms: u64) -> u64 {
        now_ms / self.window_ms
    }

    /// Proxy `q`'s first request of an epoch reports the epoch before and reads the one
    /// before that (if it serves anyone); returns whether it called the service.
    pub fn turn(&mut self, q: usize, now_ms: u64) -> bool {
        let k = self.epoch(now_ms);
        let Some(r) = self.replicas.get_mut(q) else {
            return false;
        };
        if r.epoch.is_some_and(|e| e >= k) {
            return false;
        }
        r.epoch = Some(k);
        r.tenants.retain(|_, (l, _)| l.active(k));
        if r.tenants.is_empty() {
            return false;
        }
        // Write epoch k − 1: each tenant's asks, this proxy's part of the band sums (as its
        // view of now classifies them).
        let mut sums = [BandCounts::default(); MAX_BANDS];
        let mut written = 0u64;
        for (&id, (l, w)) in &r.tenants {
            let level = r.view.level(0, k);
            if let Some(c) = fair::contribution(level, *w, l, k.saturating_sub(1)) {
                if let Some(s) = sums.first_mut() {
                    *s = s.plus(c);
                }
                *self.asked.entry((k.saturating_sub(1), id)).or_insert(0) +=
                    l.asked_in(k.saturating_sub(1));
                written += 1;
            }
        }
        let store = self
            .bands
            .entry(k.saturating_sub(1))
            .or_insert([BandCounts::default(); MAX_BANDS]);
        for (s, c) in store.iter_mut().zip(sums) {
            *s = s.plus(c);
        }
        r.wrote = [r.wrote[1], (k.saturating_sub(1), sums[0])];
        // Read epoch k − 2, whole (believed only if it holds what this proxy added to it).
        let read = k.saturating_sub(fair::READ_LAG);
        let own = r.wrote.iter().find(|(e, _)| *e == read).map(|(_, c)| *c);
        if let Some(counts) = self.bands.get(&read) {
            let bands = self.share.bands.clamp(1, MAX_BANDS);
            let counts = counts.get(..bands).unwrap_or(&[]);
            let whole = match (own, counts.first()) {
                (Some(own), Some(read)) => fair::believable(read, &own),
                _ => true,
            };
            if whole {
                r.view = fair::view(&self.share, self.limit, self.target_pm, read, counts);
                r.fleet_use = fair::fleet_use(&r.view, counts);
            }
        }
        let mut part = 0u64;
        for (&id, (l, w)) in r.tenants.iter_mut() {
            let fleet = self.asked.get(&(read, id)).copied().unwrap_or(0);
            l.told(read, fleet);
            part = part.saturating_add(fair::expected(r.view.level(0, k), *w, l, k));
        }
        r.part = Some(part);
        if now_ms >= self.from_ms {
            self.tally.reports += 1;
            let bands = self.share.bands.clamp(1, MAX_BANDS) as u64;
            self.tally.descriptors += written + r.tenants.len() as u64 + 2 * 4 * bands;
        }
        // The counters of epochs no one reads again lapse.
        if k % 16 == 0 {
            let keep = k.saturating_sub(4);
            self.asked.retain(|&(e, _), _| e >= keep);
            self.bands.retain(|&e, _| e >= keep);
        }
        true
    }

    /// Tenant `id` (weight `weight`) asks `cost` of proxy `q` at `now_ms`.
    pub fn ask(&mut self, q: usize, id: u32, weight: u16, now_ms: u64, cost: u64) {
        let k = self.epoch(now_ms);
        if let Some(r) = self.replicas.get_mut(q) {
            let e = r.tenants.entry(id).or_insert((Local::default(), weight));
            e.1 = weight;
            e.0.ask(k, cost);
        }
    }

    /// Whether proxy `q` admits a request of `cost` from tenant `id` now under its allowance
    /// ([`Local::take`]).
    pub fn take(&mut self, q: usize, id: u32, now_ms: u64, cost: u64) -> bool {
        let k = self.epoch(now_ms);
        let window_ms = self.window_ms;
        let Some(r) = self.replicas.get_mut(q) else {
            return true;
        };
        let level = r.view.level(0, k);
        r.tenants.get_mut(&id).is_none_or(|(l, w)| {
            let allowance = fair::allowance(level, *w, l);
            l.take(allowance, now_ms, window_ms, cost)
        })
    }

    /// Gives back to proxy `q`'s credit for tenant `id` a request the lease refused.
    pub fn give_back(&mut self, q: usize, id: u32, cost: u64) {
        let window_ms = self.window_ms;
        if let Some((l, _)) = self
            .replicas
            .get_mut(q)
            .and_then(|r| r.tenants.get_mut(&id))
        {
            l.give_back(cost, window_ms);
        }
    }

    /// The largest block proxy `q` claims now: the configured cap until it knows its part,
    /// then its part's ([`fair::block_cap`], within the capacity), larger while the window is
    /// expected to leave quota unused ([`fair::spare`], of what the service last told it is
    /// `left`, and when its claim went).
    pub fn block_cap(&self, q: usize, now_ms: u64, left: Option<(fair::Left, u64)>) -> u64 {
        let part = self.replicas.get(q).and_then(|r| r.part);
        let fleet_use = self.replicas.get(q).map_or(0, |r| r.fleet_use);
        let end = (self.epoch(now_ms) + 1) * self.window_ms;
        let cap = if part.is_none() {
            self.max_block
        } else {
            self.limit
        };
        let spare = match (part, left) {
            (Some(part), Some(told)) => fair::spare(
                told,
                (self.limit, fleet_use, part),
                (now_ms, self.window_ms),
            ),
            _ => 0,
        };
        fair::block_cap((part, spare), (now_ms, end, self.window_ms), cap)
    }
}
