//! The core's errors, typed: each says what failed in the words operators read in Envoy's log
//! (`Display`), and each is a `std::error::Error`.

use std::fmt;

/// Why a store could not be used (a [`crate::store::StoreError::Unavailable`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StoreFault {
    /// A host call returned a status other than success.
    Host {
        /// The call, e.g. `get_shared_data`.
        call: &'static str,
        /// The status it returned.
        status: u32,
    },
    /// No such slot in the store (a table of another size).
    NoSlot(u64),
    /// A value of the wrong size for a bucket.
    BadLength(usize),
    /// A bucket's bytes no longer decode.
    Undecodable,
}

impl fmt::Display for StoreFault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StoreFault::Host { call, status } => write!(f, "{call} returned status {status}"),
            StoreFault::NoSlot(slot) => write!(f, "no slot {slot}"),
            StoreFault::BadLength(n) => write!(f, "a value of {n} bytes for a bucket"),
            StoreFault::Undecodable => f.write_str("a bucket that no longer decodes"),
        }
    }
}

impl std::error::Error for StoreFault {}

/// Why a rate limit service gave no verdict for a request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ServiceError {
    /// The call could not be started (an unknown cluster, or the host refused).
    NotSent {
        /// The rule's cluster.
        cluster: String,
        /// The host's status, as the host reports it.
        status: String,
    },
    /// The rule has no service (not a global rule).
    NotGlobal,
    /// A gRPC status other than OK: also how a timeout (4) and an unreachable service (14)
    /// arrive.
    Grpc(u32),
    /// An HTTP status other than 200.
    Http(u32),
    /// The answer carried no gRPC status.
    NoStatus,
    /// The call's stream was reset, for this reason.
    Reset(u32),
    /// The answer could not be read from the host (its status).
    NotRead(u32),
    /// The answer could not be decoded.
    Undecodable,
    /// The service answered `UNKNOWN`.
    Unknown,
    /// No answer was recorded.
    NoAnswer,
}

impl fmt::Display for ServiceError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ServiceError::NotSent { cluster, status } => {
                write!(f, "cannot call cluster {cluster:?} (status {status})")
            }
            ServiceError::NotGlobal => f.write_str("not a global rule"),
            ServiceError::Grpc(code) => write!(f, "gRPC status {code}"),
            ServiceError::Http(code) => write!(f, "HTTP status {code}"),
            ServiceError::NoStatus => f.write_str("no gRPC status"),
            ServiceError::Reset(reason) => write!(f, "stream reset (reason {reason})"),
            ServiceError::NotRead(status) => write!(f, "cannot read the answer (status {status})"),
            ServiceError::Undecodable => f.write_str("undecodable answer"),
            ServiceError::Unknown => f.write_str("the service answered UNKNOWN"),
            ServiceError::NoAnswer => f.write_str("no answer"),
        }
    }
}

impl std::error::Error for ServiceError {}
