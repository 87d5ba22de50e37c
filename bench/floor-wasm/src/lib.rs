//! The floor probe: the least work any per-client rate limiter in proxy-wasm must do per
//! request, done as cheaply as the ABI allows, so a real filter can be compared against it.
//!
//! Per request:
//! 1. `proxy_get_property("source\0address\0")` → `"ip:port"`; the port is cut off.
//! 2. FNV-1a 64 of the address bytes, modulo [`SLOTS`]: the shared-data key `floor/<n>`.
//! 3. `proxy_get_shared_data(key)` → an 8-byte little-endian counter and its CAS.
//! 4. `proxy_set_shared_data(key, counter + 1, cas)` (a missing key is created with a made-up
//!    CAS so a racing creator is refused); on `CasMismatch` read and try again (≤ 8 times).
//! 5. On the response: `proxy_add_header_map_value` twice, `x-ratelimit-limit: 1000000000`
//!    and `x-ratelimit-remaining: <limit − counter>`.
//!
//! Host calls are declared directly against the ABI and every status is handled: nothing here
//! panics (the SDK's own wrappers panic on statuses they do not expect). The SDK is used only for
//! its dispatcher and its `proxy_on_memory_allocate`, which is what any Rust SDK filter pays.

use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, ContextType};
use std::ptr::null_mut;

/// Shared-data slots the addresses are hashed into (a fixed set: keys are never deleted).
const SLOTS: u64 = 4096;
/// The limit reported; never reached.
const LIMIT: u64 = 1_000_000_000;
const LIMIT_STR: &[u8] = b"1000000000";
/// CAS for creating a key: a value no live key carries, so a racing creator gets a mismatch.
const CREATE_CAS: u32 = u32::MAX;
const OK: u32 = 0;
const NOT_FOUND: u32 = 1;
const CAS_MISMATCH: u32 = 8;
const RESPONSE_HEADERS: u32 = 2;

#[link(wasm_import_module = "env")]
extern "C" {
    fn proxy_get_property(
        path: *const u8,
        path_size: usize,
        out: *mut *mut u8,
        out_size: *mut usize,
    ) -> u32;
    fn proxy_get_shared_data(
        key: *const u8,
        key_size: usize,
        out: *mut *mut u8,
        out_size: *mut usize,
        out_cas: *mut u32,
    ) -> u32;
    fn proxy_set_shared_data(
        key: *const u8,
        key_size: usize,
        value: *const u8,
        value_size: usize,
        cas: u32,
    ) -> u32;
    fn proxy_add_header_map_value(
        map: u32,
        key: *const u8,
        key_size: usize,
        value: *const u8,
        value_size: usize,
    ) -> u32;
}

/// Takes back a buffer the host allocated through the SDK's `proxy_on_memory_allocate`.
fn owned(ptr: *mut u8, len: usize) -> Option<Vec<u8>> {
    // SAFETY: the host fills `ptr` with a `Vec<u8>` of capacity `len` the SDK leaked, or null.
    (!ptr.is_null()).then(|| unsafe { Vec::from_raw_parts(ptr, len, len) })
}

proxy_wasm::main! {{
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(FloorRoot) });
}}

struct FloorRoot;

impl Context for FloorRoot {}

impl RootContext for FloorRoot {
    fn create_http_context(&self, _: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(Floor { remaining: None }))
    }
    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

struct Floor {
    /// What to report on the response; `None` if the request was not counted.
    remaining: Option<u64>,
}

impl Context for Floor {}

/// FNV-1a 64.
fn fnv1a(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// Writes the decimal digits of `n` at the end of `buf`; returns where they start.
fn digits(buf: &mut [u8; 20], mut n: u64) -> usize {
    let mut i = buf.len();
    loop {
        i -= 1;
        buf[i] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 || i == 0 {
            return i;
        }
    }
}

/// The address part of `ip:port` / `[ip]:port`.
fn strip_port(a: &[u8]) -> &[u8] {
    match a.iter().rposition(|&b| b == b':') {
        Some(i) if a.first() != Some(&b'[') || a.get(i.wrapping_sub(1)) == Some(&b']') => &a[..i],
        _ => a,
    }
}

impl Floor {
    /// Counts the request in its address's slot; the new count, or `None` if the host failed.
    fn count() -> Option<u64> {
        const PATH: &[u8] = b"source\0address\0";
        let (mut ptr, mut len) = (null_mut(), 0usize);
        // SAFETY: valid pointers to a static path and to locals.
        let status = unsafe { proxy_get_property(PATH.as_ptr(), PATH.len(), &mut ptr, &mut len) };
        let address = owned(ptr, len);
        if status != OK {
            return None;
        }
        let slot = fnv1a(strip_port(address.as_deref().unwrap_or(b""))) % SLOTS;

        // The key `floor/<slot>`, on the stack.
        let mut key = [0u8; 26];
        key[..6].copy_from_slice(b"floor/");
        let mut d = [0u8; 20];
        let at = digits(&mut d, slot);
        let n = d.len() - at;
        key[6..6 + n].copy_from_slice(&d[at..]);
        let key = &key[..6 + n];

        for _ in 0..8 {
            let (mut ptr, mut len, mut cas) = (null_mut(), 0usize, 0u32);
            // SAFETY: valid pointers to the key and to locals.
            let status = unsafe {
                proxy_get_shared_data(key.as_ptr(), key.len(), &mut ptr, &mut len, &mut cas)
            };
            let value = owned(ptr, len);
            let (count, cas) = match status {
                OK => {
                    let v = value.as_deref().and_then(|v| v.first_chunk::<8>());
                    (v.map_or(0, |b| u64::from_le_bytes(*b)), if cas == 0 { CREATE_CAS } else { cas })
                }
                NOT_FOUND => (0, CREATE_CAS),
                _ => return None,
            };
            let next = count.saturating_add(1);
            // SAFETY: valid pointers to the key and to a local.
            match unsafe {
                proxy_set_shared_data(key.as_ptr(), key.len(), next.to_le_bytes().as_ptr(), 8, cas)
            } {
                OK => return Some(next),
                CAS_MISMATCH => continue,
                _ => return None,
            }
        }
        None
    }
}

fn add_response_header(name: &[u8], value: &[u8]) {
    // SAFETY: valid pointers and lengths; a failing status only means the field is not added.
    let _ = unsafe {
        proxy_add_header_map_value(
            RESPONSE_HEADERS,
            name.as_ptr(),
            name.len(),
            value.as_ptr(),
            value.len(),
        )
    };
}

impl HttpContext for Floor {
    fn on_http_request_headers(&mut self, _: usize, _: bool) -> Action {
        self.remaining = Floor::count().map(|n| LIMIT.saturating_sub(n));
        Action::Continue
    }

    fn on_http_response_headers(&mut self, _: usize, _: bool) -> Action {
        if let Some(remaining) = self.remaining.take() {
            add_response_header(b"x-ratelimit-limit", LIMIT_STR);
            let mut d = [0u8; 20];
            let at = digits(&mut d, remaining);
            add_response_header(b"x-ratelimit-remaining", &d[at..]);
        }
        Action::Continue
    }
}
