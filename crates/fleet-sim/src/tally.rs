//! What a run admitted, measured against what an exact limiter would have admitted, window by
//! window of the service.
//!
//! Each key's requests are counted in the service's windows for the key. The service decides
//! a call half a round trip after it is sent, so a window of the service from `s` to `e` holds
//! the requests that arrived from `s` to `e`, each less half a round trip: a sync request is
//! decided by the service in the window its arrival falls in, and quota a lease holds lapses
//! half a round trip before its window ends (the reset is counted from the claim's sending).
//! A request in no window (before a key's first, in a gap between two: an async proxy reports
//! its hits there in the next flush, which starts the next window) counts in the next one, or
//! in the last. A key the service never saw (local mode) is counted in windows of the same
//! kind, started by its own requests: each at the first request after the last one ended.

/// One request's fate.
#[derive(Clone, Copy, Debug)]
struct Fate {
    arrival_us: u64,
    admitted: bool,
}

/// How a run's requests fared against the limit, summed over keys and windows.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Accuracy {
    /// Windows counted (a key's windows, summed over keys).
    pub windows: u64,
    /// What an exact limiter admits: per window, the requests or the limit, whichever is less.
    pub exact: u64,
    /// Admitted beyond the limit, summed over windows.
    pub over: u64,
    /// Refused while the window had room (the exact count less what was admitted, where
    /// positive), summed over windows.
    pub under: u64,
    /// The largest excess of one window.
    pub worst_over: u64,
}

/// Every request's fate, by key.
#[derive(Debug, Default)]
pub struct Tally {
    keys: Vec<Vec<Fate>>,
}

impl Tally {
    /// A tally of `keys` keys.
    pub fn new(keys: u32) -> Tally {
        Tally {
            keys: (0..keys).map(|_| Vec::new()).collect(),
        }
    }

    /// A request for `key` that arrived at `arrival_us` was admitted or refused.
    pub fn record(&mut self, key: u32, arrival_us: u64, admitted: bool) {
        if let Some(k) = self.keys.get_mut(key as usize) {
            k.push(Fate {
                arrival_us,
                admitted,
            });
        }
    }

    /// The accuracy of the run: `limit` per window of `window_us`; `starts(key)`: the
    /// service's window starts for the key (empty if it never saw it), counted from
    /// `shift_us` earlier.
    pub fn accuracy<'a>(
        &mut self,
        limit: u64,
        window_us: u64,
        shift_us: u64,
        starts: impl Fn(u32) -> &'a [u64],
    ) -> Accuracy {
        let mut acc = Accuracy::default();
        for (key, fates) in self.keys.iter_mut().enumerate() {
            if fates.is_empty() {
                continue;
            }
            fates.sort_by_key(|f| f.arrival_us);
            let served = starts(u32::try_from(key).unwrap_or(u32::MAX));
            let starts: Vec<u64> = if served.is_empty() {
                own_windows(fates, window_us)
            } else {
                served.iter().map(|s| s.saturating_sub(shift_us)).collect()
            };
            // (requests, admitted) per window: a request counts in the first window that
            // ends after it came, the last if none does.
            let mut counts = vec![(0u64, 0u64); starts.len().max(1)];
            for f in fates.iter() {
                let w = starts.partition_point(|&s| s.saturating_add(window_us) <= f.arrival_us);
                if let Some(c) = counts.get_mut(w.min(starts.len().saturating_sub(1))) {
                    c.0 += 1;
                    c.1 += u64::from(f.admitted);
                }
            }
            for (requests, admitted) in counts {
                let exact = requests.min(limit);
                let over = admitted.saturating_sub(limit);
                acc.windows += 1;
                acc.exact += exact;
                acc.over += over;
                acc.under += exact.saturating_sub(admitted);
                acc.worst_over = acc.worst_over.max(over);
            }
        }
        acc
    }
}

/// Windows started by the requests themselves (sorted by arrival): each at the first request
/// at or after the end of the last.
fn own_windows(fates: &[Fate], window_us: u64) -> Vec<u64> {
    let mut starts: Vec<u64> = Vec::new();
    for f in fates {
        match starts.last() {
            Some(&s) if f.arrival_us < s.saturating_add(window_us) => {}
            _ => starts.push(f.arrival_us),
        }
    }
    starts
}

/// The `q` quantile (0 to 1) of `values` (0 for none).
pub fn quantile(values: &mut [u64], q: f64) -> u64 {
    if values.is_empty() {
        return 0;
    }
    let i = ((values.len() - 1) as f64 * q).round() as usize;
    let i = i.min(values.len() - 1);
    let (_, v, _) = values.select_nth_unstable(i);
    *v
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn counts_over_and_under_per_window() {
        let mut t = Tally::new(2);
        // Key 0: service windows at 1 s and 61 s (limit 3). Window one: 5 requests, 4
        // admitted (1 over); window two: 2 requests, 1 admitted (1 under).
        for (at, ok) in [(1, true), (2, true), (3, true), (4, true), (5, false)] {
            t.record(0, at * 1_000_000, ok);
        }
        t.record(0, 62_000_000, true);
        t.record(0, 63_000_000, false);
        // Key 1: never seen by the service: its own windows, from its first request.
        t.record(1, 10_000_000, true);
        t.record(1, 69_999_999, true);
        t.record(1, 70_000_000, true);
        let starts: Vec<u64> = vec![1_000_100, 61_000_100];
        let acc = t.accuracy(3, 60_000_000, 100, |k| if k == 0 { &starts } else { &[] });
        assert_eq!(
            acc,
            Accuracy {
                windows: 4,
                exact: 3 + 2 + 2 + 1,
                over: 1,
                under: 1,
                worst_over: 1
            }
        );
        let mut v = vec![5, 1, 4, 2, 3];
        assert_eq!(quantile(&mut v, 0.5), 3);
        assert_eq!(quantile(&mut [], 0.99), 0);
    }
}
