//! A rule's rate limit service (`global`) and how the rule uses it: asking first, reporting
//! afterwards, or leasing blocks of its quota.
//!
//! Uses nothing else of the crate.

/// A rule's global backend: Envoy's rate limit service protocol over a gRPC cluster.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Global {
    /// The Envoy cluster of the service (HTTP/2).
    pub cluster: String,
    /// The rate limit domain sent to the service.
    pub domain: String,
    /// Ask before deciding, or decide locally and report afterwards.
    pub mode: GlobalMode,
    /// How long to wait for the service, ms.
    pub timeout_ms: u32,
    /// Async mode: how often each worker reports its hits, ms; lease mode: how often claims
    /// ahead of need go out; both, and a sync rule charged by its responses: how often usage
    /// is reported.
    pub flush_ms: u32,
    /// Lease mode: the largest block claimed at once (by default a tenth of the limit).
    pub max_block: u64,
}

/// How a global rule uses its service.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GlobalMode {
    /// Each request waits for the service's answer.
    Sync,
    /// Local-first: decided at once from this proxy's view, hits reported in batches.
    Async,
    /// Quota claimed from the service in blocks ahead of need, admitted locally from what is
    /// held: never over the service's limit, at local speed.
    Lease,
}

impl GlobalMode {
    /// The name in the configuration.
    pub fn name(self) -> &'static str {
        match self {
            GlobalMode::Sync => "sync",
            GlobalMode::Async => "async",
            GlobalMode::Lease => "lease",
        }
    }

    /// Whether the service decides the rule's limit (the local algorithm is not used).
    pub fn service_decides(self) -> bool {
        matches!(self, GlobalMode::Sync | GlobalMode::Lease)
    }
}

/// Default wait for a rate limit service, ms.
pub const DEFAULT_GLOBAL_TIMEOUT_MS: u64 = 20;

/// Default async flush interval, ms.
pub const DEFAULT_FLUSH_MS: u64 = 100;
