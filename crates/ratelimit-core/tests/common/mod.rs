//! What the property tests share: how a run is configured.

use proptest::test_runner::{Config, FailurePersistence, FileFailurePersistence};

/// `cases` per property in a default run (`PROPTEST_CASES` overrides it, as proptest's own
/// default), failing seeds saved to and replayed from `regressions` (nowhere when
/// `PROPTEST_DISABLE_FAILURE_PERSISTENCE` is set).
pub fn config(cases: u32, regressions: &'static str) -> Config {
    let defaults = Config::default();
    let persistence = defaults.failure_persistence.as_ref().map(|_| {
        Box::new(FileFailurePersistence::Direct(regressions)) as Box<dyn FailurePersistence>
    });
    Config {
        cases: match std::env::var_os("PROPTEST_CASES") {
            Some(_) => defaults.cases,
            None => cases,
        },
        failure_persistence: persistence,
        ..defaults
    }
}
