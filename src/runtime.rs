//! A configuration ready to serve: the rules compiled once (fingerprints, policies), the store
//! their keys live in, and the metrics not yet published. A host builds one per configuration
//! and hands every request to [`crate::pipeline`].

use crate::config::{Config, Rule};
use crate::global::{self, Answer, Flush, Hits, Target};
use crate::key::{self, Seed};
use crate::limiter::Policy;
use crate::metrics::{Counter, Metrics};
use crate::rls;
use crate::store::Store;
use crate::table;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};

/// A rule with what is computed from it once.
#[derive(Debug)]
pub(crate) struct Compiled {
    /// Mixed into every key hash of the rule; stable across reloads while the rule's name, key
    /// parts and algorithm stay the same.
    pub fingerprint: u64,
    /// The algorithm and its numbers.
    pub policy: Policy,
}

/// Everything a request needs, built once per configuration.
#[derive(Debug)]
pub struct Runtime<S> {
    pub(crate) config: Config,
    pub(crate) compiled: Vec<Compiled>,
    pub(crate) seed: Seed,
    pub(crate) buckets: u32,
    pub(crate) store: S,
    pub(crate) metrics: Metrics,
    /// Hits of async global rules since the last flush.
    pub(crate) hits: Mutex<Hits>,
    /// When a failure was last logged (ms), to log at most one a second.
    pub(crate) last_failure_log: AtomicU64,
}

impl<S: Store> Runtime<S> {
    /// Compiles `config` with the table's `seed` over `store`.
    pub fn new(config: Config, seed: Seed, store: S) -> Runtime<S> {
        let compiled = config
            .rules
            .iter()
            .map(|rule| Compiled {
                fingerprint: key::rule_fingerprint(
                    seed,
                    &rule.name,
                    &rule.key,
                    rule.limit.algorithm_name(),
                ),
                policy: rule.policy(),
            })
            .collect();
        Runtime {
            metrics: Metrics::new(config.rules.len()),
            buckets: table::buckets_for(config.capacity),
            compiled,
            config,
            seed,
            store,
            hits: Mutex::default(),
            last_failure_log: AtomicU64::new(0),
        }
    }

    /// The configuration.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// The rules, in configuration order (metric `rule` indices refer to this order).
    pub fn rules(&self) -> &[Rule] {
        &self.config.rules
    }

    /// Where the keys' state lives.
    pub fn store(&self) -> &S {
        &self.store
    }

    /// The counts waiting to be published.
    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    /// How many keys the table tracks at once (the capacity rounded up to whole buckets).
    pub fn capacity(&self) -> usize {
        self.buckets as usize * table::WAYS
    }

    /// The table's bucket count.
    pub fn buckets(&self) -> u32 {
        self.buckets
    }

    /// How often the host must call [`Runtime::flush`] (ms), if any rule reports to its service
    /// asynchronously.
    pub fn flush_period(&self) -> Option<u32> {
        global::flush_period(&self.config.rules)
    }

    /// The reports of async global rules' hits since the last flush, to send to each rule's
    /// service ([`Runtime::global_of`]); their answers go to [`Runtime::flushed`].
    pub fn flush(&self) -> Vec<Flush> {
        self.hits
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .drain(&self.config.rules)
    }

    /// A flush's answer: counts an error, or blocks the key if the service says it is over its
    /// limit (shadow rules never block).
    pub fn flushed(&self, target: &Target, answer: Answer, now_ms: u64) {
        let (Some(rule), Some(compiled)) = (
            self.config.rules.get(target.rule),
            self.compiled.get(target.rule),
        ) else {
            return;
        };
        let answer = match answer {
            Ok(a) => a,
            Err(_) => {
                self.metrics.add(target.rule, Counter::GlobalErrors, 1);
                return;
            }
        };
        if answer.overall_code != rls::Code::OverLimit || rule.shadow {
            return;
        }
        let wait = global::block_ms(&answer, &compiled.policy, now_ms);
        global::block(&self.store, target, now_ms, now_ms.saturating_add(wait));
    }

    /// The service of a global rule, by the rule's index.
    pub fn global_of(&self, rule: usize) -> Option<&crate::config::Global> {
        self.config.rules.get(rule)?.global.as_ref()
    }

    /// Counts a failed call to a rule's service (one that could not even be sent).
    pub fn global_error(&self, rule: usize) {
        self.metrics.add(rule, Counter::GlobalErrors, 1);
    }

    /// Whether a failure may be logged now (at most one line a second).
    pub(crate) fn may_log_failure(&self, now_ms: u64) -> bool {
        let last = self.last_failure_log.load(Ordering::Relaxed);
        now_ms >= last.saturating_add(1000)
            && self
                .last_failure_log
                .compare_exchange(last, now_ms, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
    }
}
