//! The sliding window log: the exact time of every admitted request in the last window.
//!
//! Exact by definition: a request at `now` is admitted when fewer than `limit` requests (counting
//! costs) were admitted in `(now − window, now]`. The price is memory: 4 bytes per remembered
//! request, so a key costs `24 + 4 × limit` bytes, and `requests_per_unit` is capped at
//! [`MAX_LIMIT`] for this algorithm.

use super::Verdict;

/// The largest `requests_per_unit` accepted for a sliding log.
pub const MAX_LIMIT: u32 = 1_000;

/// The stored state of one key: admitted request times, oldest first.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct State {
    /// The window the log was written with, ms.
    pub window_ms: u32,
    /// Admission times, ms since the epoch, ascending.
    pub times: Vec<u64>,
}

impl State {
    /// Encoding: window (u32), count (u32), base time (u64), then each time as a u32 offset
    /// from the base. Offsets fit: every time lies within one window (≤ 1 day) of the base.
    pub fn encode(&self, out: &mut Vec<u8>) {
        let base = self.times.first().copied().unwrap_or(0);
        out.extend_from_slice(&self.window_ms.to_le_bytes());
        out.extend_from_slice(&u32::try_from(self.times.len()).unwrap_or(0).to_le_bytes());
        out.extend_from_slice(&base.to_le_bytes());
        for t in &self.times {
            let off = u32::try_from(t.saturating_sub(base)).unwrap_or(u32::MAX);
            out.extend_from_slice(&off.to_le_bytes());
        }
    }

    /// Decodes [`State::encode`]'s output; `None` if the bytes do not add up.
    pub fn decode(bytes: &[u8]) -> Option<State> {
        let (w, rest) = bytes.split_first_chunk::<4>()?;
        let (n, rest) = rest.split_first_chunk::<4>()?;
        let (base, rest) = rest.split_first_chunk::<8>()?;
        let n = usize::try_from(u32::from_le_bytes(*n)).ok()?;
        if rest.len() != n.checked_mul(4)? || n > MAX_LIMIT as usize {
            return None;
        }
        let base = u64::from_le_bytes(*base);
        let times = rest
            .chunks_exact(4)
            .map(|c| {
                let mut off = [0u8; 4];
                off.copy_from_slice(c);
                base.saturating_add(u64::from(u32::from_le_bytes(off)))
            })
            .collect();
        Some(State {
            window_ms: u32::from_le_bytes(*w),
            times,
        })
    }

    /// Requests still in the window at `now_ms` (`None`: none).
    pub fn weight(&self, now_ms: u64) -> Option<u64> {
        let w = u64::from(self.window_ms);
        let live = self.times.iter().filter(|&&t| t + w > now_ms).count() as u64;
        (live > 0).then_some(live)
    }
}

/// Decides one request of `cost` at `now_ms` for `limit` per `window_ms`.
pub fn decide(
    state: Option<&State>,
    now_ms: u64,
    limit: u64,
    window_ms: u64,
    cost: u64,
) -> (Verdict, Option<State>) {
    let w = window_ms.max(1);
    let mut times: Vec<u64> = state.map(|s| s.times.clone()).unwrap_or_default();
    let now = times.last().map_or(now_ms, |&last| now_ms.max(last));
    times.retain(|&t| t + w > now);
    let used = times.len() as u64;
    let allowed = used + cost <= limit;
    // The i-th oldest time (0-based) leaves the window at times[i] + w.
    let leaves = |i: u64| -> u64 {
        usize::try_from(i)
            .ok()
            .and_then(|i| times.get(i))
            .map_or(0, |&t| t + w - now)
    };
    let verdict = Verdict {
        allowed,
        limit,
        window_s: w / 1000,
        remaining: limit.saturating_sub(used + if allowed { cost } else { 0 }),
        // More quota arrives when the oldest remembered request leaves the window.
        reset_ms: if used == 0 && !(allowed && cost > 0) {
            0 // nothing remembered: the quota is whole
        } else if used == 0 {
            w // only this request is remembered: it leaves one window from now
        } else {
            leaves(0)
        },
        retry_after_ms: if allowed {
            0
        } else if cost > limit {
            u64::MAX
        } else {
            leaves(used + cost - limit - 1)
        },
        delay_ms: 0,
    };
    if !allowed {
        return (verdict, None);
    }
    for _ in 0..cost {
        times.push(now);
    }
    let next = State {
        window_ms: u32::try_from(w).unwrap_or(u32::MAX),
        times,
    };
    (verdict, Some(next))
}

/// Takes back `cost` admissions made at `counted_at` (the latest such times go first).
pub fn refund(mut state: State, counted_at: u64, cost: u64) -> State {
    for _ in 0..cost {
        if let Some(i) = state.times.iter().rposition(|&t| t == counted_at) {
            state.times.remove(i);
        }
    }
    state
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exact_window_and_retry() {
        let (limit, w) = (3, 1_000);
        let mut state: Option<State> = None;
        let mut out = Vec::new();
        for t in [0, 100, 200, 300, 999, 1_000, 1_050, 1_100] {
            let (v, s) = decide(state.as_ref(), t, limit, w, 1);
            if s.is_some() {
                state = s;
            }
            out.push((t, v.allowed, v.retry_after_ms));
        }
        assert_eq!(
            out,
            [
                (0, true, 0),
                (100, true, 0),
                (200, true, 0),
                (300, false, 700),
                (999, false, 1),
                (1_000, true, 0),
                (1_050, false, 50),
                (1_100, true, 0),
            ]
        );
        let s = state.unwrap();
        let mut bytes = Vec::new();
        s.encode(&mut bytes);
        assert_eq!(bytes.len(), 16 + 4 * 3);
        assert_eq!(State::decode(&bytes), Some(s.clone()));
        assert_eq!(State::decode(&bytes[..bytes.len() - 1]), None);
        assert_eq!(s.weight(1_100), Some(3));
        assert_eq!(s.weight(2_200), None);
        assert_eq!(refund(s, 1_100, 1).times, [200, 1_000]);
    }
}
