//! The dynamic-module floor probe: per request, read `source.address`, hash the client IP into
//! a process-global table of 65,536 `AtomicU64` and do one atomic add; in response_headers add
//! `x-ratelimit-limit` and `x-ratelimit-remaining`. Every hook catches panics. See README.md.

use envoy_dm_abi::sys::*;
use std::os::raw::c_char;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, Ordering};

const SLOTS: usize = 65_536;

/// One process-global table shared by every worker thread (a `static` in a dynamic module is a
/// single object in the Envoy process).
static TABLE: [AtomicU64; SLOTS] = [const { AtomicU64::new(0) }; SLOTS];

struct Config {
    limit: u64,
}

struct Filter {
    limit: u64,
    hits: u64,
}

/// Run a hook body; a panic is caught here (it must never unwind into Envoy) and the hook
/// returns `fallback` instead.
#[inline(always)]
fn guard<R>(fallback: R, f: impl FnOnce() -> R) -> R {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or(fallback)
}

/// FNV-1a over the address without its port ("1.2.3.4:5678" -> "1.2.3.4", "[::1]:5" -> "[::1]").
#[inline(always)]
fn slot(addr: &[u8]) -> usize {
    let ip = match addr.iter().rposition(|&b| b == b':') {
        Some(i) if !addr.ends_with(b"]") => &addr[..i],
        _ => addr,
    };
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in ip {
        h ^= b as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    (h ^ (h >> 32)) as usize & (SLOTS - 1)
}

/// Bytes lent to Envoy for one call.
#[inline(always)]
fn buf(b: &[u8]) -> ModuleBuffer {
    ModuleBuffer { ptr: b.as_ptr() as *const c_char, length: b.len() }
}

/// Decimal digits of `v` into `buf`, without allocating.
fn fmt_u64(mut v: u64, buf: &mut [u8; 20]) -> &[u8] {
    let mut i = buf.len();
    loop {
        i -= 1;
        buf[i] = b'0' + (v % 10) as u8;
        v /= 10;
        if v == 0 {
            break;
        }
    }
    &buf[i..]
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_program_init() -> AbiVersionPtr {
    guard(std::ptr::null(), || match envoy_dm_abi::unsupported_envoy("floor-native") {
        // An Envoy older than the build's ABI (ENVOY_VERSION, default 1.40.0): refuse.
        Some(why) => {
            eprintln!("{why}");
            std::ptr::null()
        }
        None => ABI_VERSION.as_ptr(),
    })
}

/// filter_config (StringValue) may be a decimal limit; default 100.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_config_new(
    _envoy: ConfigEnvoyPtr,
    _name: EnvoyBuffer,
    config: EnvoyBuffer,
) -> ConfigModulePtr {
    guard(std::ptr::null(), || {
        let bytes: &[u8] = if config.ptr.is_null() || config.length == 0 {
            &[]
        } else {
            // SAFETY: Envoy guarantees `config` is readable for the duration of this call.
            unsafe { std::slice::from_raw_parts(config.ptr as *const u8, config.length) }
        };
        let limit = std::str::from_utf8(bytes).ok().and_then(|s| s.trim().parse().ok()).unwrap_or(100);
        Box::into_raw(Box::new(Config { limit })) as ConfigModulePtr
    })
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_config_destroy(config: ConfigModulePtr) {
    guard((), || {
        if !config.is_null() {
            // SAFETY: created by Box::into_raw in config_new; Envoy destroys it exactly once.
            drop(unsafe { Box::from_raw(config as *mut Config) });
        }
    })
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_new(config: ConfigModulePtr, _envoy: FilterEnvoyPtr) -> FilterModulePtr {
    guard(std::ptr::null(), || {
        // SAFETY: the config outlives every filter created from it.
        let limit = unsafe { (*(config as *const Config)).limit };
        Box::into_raw(Box::new(Filter { limit, hits: 0 })) as FilterModulePtr
    })
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_destroy(filter: FilterModulePtr) {
    guard((), || {
        if !filter.is_null() {
            // SAFETY: created by Box::into_raw in filter_new; destroyed exactly once.
            drop(unsafe { Box::from_raw(filter as *mut Filter) });
        }
    })
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_request_headers(envoy: FilterEnvoyPtr, filter: FilterModulePtr, _eos: bool) -> HeadersStatus {
    guard(HeadersStatus::Continue, || {
        if filter.is_null() {
            return HeadersStatus::Continue;
        }
        // SAFETY: the per-stream object is only touched on its worker thread, one hook at a time.
        let f = unsafe { &mut *(filter as *mut Filter) };
        let mut addr = EnvoyBuffer { ptr: std::ptr::null(), length: 0 };
        // SAFETY: `envoy` is the live filter pointer of this hook; the buffer is Envoy-owned and
        // only read before this hook returns.
        let key: &[u8] = unsafe {
            if envoy_dynamic_module_callback_http_filter_get_attribute_string(envoy, SOURCE_ADDRESS, &mut addr)
                && !addr.ptr.is_null()
            {
                std::slice::from_raw_parts(addr.ptr as *const u8, addr.length)
            } else {
                &[]
            }
        };
        f.hits = TABLE[slot(key)].fetch_add(1, Ordering::Relaxed) + 1;
        HeadersStatus::Continue
    })
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_response_headers(envoy: FilterEnvoyPtr, filter: FilterModulePtr, _eos: bool) -> HeadersStatus {
    guard(HeadersStatus::Continue, || {
        if filter.is_null() {
            return HeadersStatus::Continue;
        }
        // SAFETY: see request_headers.
        let f = unsafe { &*(filter as *const Filter) };
        let (mut a, mut b) = ([0u8; 20], [0u8; 20]);
        let limit = fmt_u64(f.limit, &mut a);
        let remaining = fmt_u64(f.limit.saturating_sub(f.hits), &mut b);
        // SAFETY: live filter pointer; Envoy copies key and value during the call.
        unsafe {
            envoy_dynamic_module_callback_http_add_header(envoy, HeaderType::ResponseHeader, buf(b"x-ratelimit-limit"), buf(limit));
            envoy_dynamic_module_callback_http_add_header(envoy, HeaderType::ResponseHeader, buf(b"x-ratelimit-remaining"), buf(remaining));
        }
        HeadersStatus::Continue
    })
}

// The remaining mandatory hooks: nothing to do (Continue), still behind the panic guard.

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_request_body(_e: FilterEnvoyPtr, _f: FilterModulePtr, _eos: bool) -> BodyStatus {
    guard(BodyStatus::Continue, || BodyStatus::Continue)
}
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_request_trailers(_e: FilterEnvoyPtr, _f: FilterModulePtr) -> TrailersStatus {
    guard(TrailersStatus::Continue, || TrailersStatus::Continue)
}
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_response_body(_e: FilterEnvoyPtr, _f: FilterModulePtr, _eos: bool) -> BodyStatus {
    guard(BodyStatus::Continue, || BodyStatus::Continue)
}
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_response_trailers(_e: FilterEnvoyPtr, _f: FilterModulePtr) -> TrailersStatus {
    guard(TrailersStatus::Continue, || TrailersStatus::Continue)
}
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_stream_complete(_e: FilterEnvoyPtr, _f: FilterModulePtr) {
    guard((), || ())
}
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_scheduled(_e: FilterEnvoyPtr, _f: FilterModulePtr, _event_id: u64) {
    guard((), || ())
}
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_downstream_above_write_buffer_high_watermark(_e: FilterEnvoyPtr, _f: FilterModulePtr) {
    guard((), || ())
}
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_downstream_below_write_buffer_low_watermark(_e: FilterEnvoyPtr, _f: FilterModulePtr) {
    guard((), || ())
}
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_callout_done(
    _e: FilterEnvoyPtr,
    _f: FilterModulePtr,
    _id: u64,
    _result: CalloutResult,
    _headers: *mut EnvoyHeader,
    _headers_size: usize,
    _body: *mut EnvoyBuffer,
    _body_size: usize,
) {
    guard((), || ())
}
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_headers(
    _e: FilterEnvoyPtr,
    _f: FilterModulePtr,
    _id: u64,
    _headers: *mut EnvoyHeader,
    _n: usize,
    _eos: bool,
) {
    guard((), || ())
}
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_data(
    _e: FilterEnvoyPtr,
    _f: FilterModulePtr,
    _id: u64,
    _data: *const EnvoyBuffer,
    _n: usize,
    _eos: bool,
) {
    guard((), || ())
}
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_trailers(_e: FilterEnvoyPtr, _f: FilterModulePtr, _id: u64, _t: *mut EnvoyHeader, _n: usize) {
    guard((), || ())
}
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_complete(_e: FilterEnvoyPtr, _f: FilterModulePtr, _id: u64) {
    guard((), || ())
}
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_reset(_e: FilterEnvoyPtr, _f: FilterModulePtr, _id: u64, _reason: ResetReason) {
    guard((), || ())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slot_ignores_the_port() {
        assert_eq!(slot(b"10.0.0.1:1234"), slot(b"10.0.0.1:55555"));
        assert_eq!(slot(b"[::1]:1234"), slot(b"[::1]:9"));
        assert_ne!(slot(b"10.0.0.1:1"), slot(b"10.0.0.2:1"));
        assert!(slot(b"") < SLOTS);
    }

    #[test]
    fn formats_numbers() {
        let mut b = [0u8; 20];
        assert_eq!(fmt_u64(0, &mut b), b"0");
        assert_eq!(fmt_u64(u64::MAX, &mut b), b"18446744073709551615");
    }
}
