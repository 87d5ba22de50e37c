//! What the fleet is asked: which key each request is for, and when requests come.

use ratelimit_core::testkit::Rng;

/// How requests spread over the keys of the rule (one key per client address).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Traffic {
    /// Every request is for one key.
    Hot,
    /// Each request is for one of `keys` keys, each as likely.
    Uniform {
        /// How many keys.
        keys: u32,
    },
    /// Each request is for one of `keys` keys, the key of rank r with a weight 1/r^s.
    Zipf {
        /// How many keys.
        keys: u32,
        /// The exponent.
        s: f64,
    },
}

impl Traffic {
    /// How many keys the traffic has.
    pub fn keys(&self) -> u32 {
        match *self {
            Traffic::Hot => 1,
            Traffic::Uniform { keys } | Traffic::Zipf { keys, .. } => keys.max(1),
        }
    }

    /// A short name for tables: `hot`, `uniform/20`, `zipf(1.0)/100`.
    pub fn label(&self) -> String {
        match *self {
            Traffic::Hot => "hot".to_string(),
            Traffic::Uniform { keys } => format!("uniform/{keys}"),
            Traffic::Zipf { keys, s } => format!("zipf({s:.1})/{keys}"),
        }
    }

    /// Each key's share of the requests, by key index (rank 1 first).
    pub fn shares(&self) -> Vec<f64> {
        match *self {
            Traffic::Hot => vec![1.0],
            Traffic::Uniform { keys } => vec![1.0 / f64::from(keys.max(1)); keys.max(1) as usize],
            Traffic::Zipf { keys, s } => {
                let w: Vec<f64> = (1..=keys.max(1)).map(|r| f64::from(r).powf(-s)).collect();
                let total: f64 = w.iter().sum();
                w.into_iter().map(|x| x / total).collect()
            }
        }
    }
}

/// Draws keys for a [`Traffic`] from a seeded RNG.
#[derive(Debug)]
pub struct Keys {
    /// The cumulative shares, by key index.
    cdf: Vec<f64>,
}

impl Keys {
    /// The key sampler of `traffic`.
    pub fn new(traffic: &Traffic) -> Keys {
        let mut acc = 0.0;
        let cdf = traffic
            .shares()
            .into_iter()
            .map(|p| {
                acc += p;
                acc
            })
            .collect();
        Keys { cdf }
    }

    /// The next request's key index.
    pub fn draw(&self, rng: &mut Rng) -> u32 {
        let u = unit(rng) * self.cdf.last().copied().unwrap_or(1.0);
        let i = self.cdf.partition_point(|&c| c <= u);
        u32::try_from(i.min(self.cdf.len().saturating_sub(1))).unwrap_or(0)
    }
}

/// The client address of key `i`: the rule is keyed on it.
pub fn address(i: u32) -> String {
    format!("10.{}.{}.{}", (i >> 16) & 0xff, (i >> 8) & 0xff, i & 0xff)
}

/// A uniform draw in [0, 1).
pub fn unit(rng: &mut Rng) -> f64 {
    (rng.next() >> 11) as f64 / (1u64 << 53) as f64
}

/// The time to the next arrival of a Poisson process of `per_s` arrivals a second, µs (at
/// least 1).
pub fn exponential_us(rng: &mut Rng, per_s: f64) -> u64 {
    let u = 1.0 - unit(rng); // (0, 1]
    ((-u.ln() / per_s * 1e6) as u64).max(1)
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::indexing_slicing)]
mod tests {
    use super::*;

    #[test]
    fn zipf_keys_are_drawn_by_their_shares() {
        let t = Traffic::Zipf { keys: 100, s: 1.0 };
        let shares = t.shares();
        assert!((shares.iter().sum::<f64>() - 1.0).abs() < 1e-9);
        assert!((shares[0] / shares[9] - 10.0).abs() < 1e-9);
        let keys = Keys::new(&t);
        let mut rng = Rng(7);
        let mut counts = [0u32; 100];
        for _ in 0..100_000 {
            counts[keys.draw(&mut rng) as usize] += 1;
        }
        let top = f64::from(counts[0]) / 100_000.0;
        assert!((top - shares[0]).abs() < 0.01, "{top} vs {}", shares[0]);
        assert_eq!(Keys::new(&Traffic::Hot).draw(&mut rng), 0);
    }

    #[test]
    fn poisson_gaps_average_the_rate() {
        let mut rng = Rng(11);
        let n = 20_000;
        let total: u64 = (0..n).map(|_| exponential_us(&mut rng, 100.0)).sum();
        let mean = total as f64 / f64::from(n);
        assert!((mean - 10_000.0).abs() < 300.0, "{mean}");
        assert_eq!(address(258), "10.0.1.2");
    }
}
