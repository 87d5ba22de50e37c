//! The proxy-wasm host calls this filter makes, declared against the ABI 0.2.1 directly: the
//! only `unsafe` of the wasm build.
//!
//! The SDK's `hostcalls` wrappers (proxy-wasm 0.2.5) `panic!` on any status they do not
//! expect, and a panic kills the VM with every request on its worker. These wrappers return
//! the status instead, so each caller decides what an error means.

use std::ptr::{null, null_mut};

/// A proxy-wasm status other than `Ok`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Status(pub u32);

/// `NotFound`.
pub const NOT_FOUND: Status = Status(1);
/// `CasMismatch`.
pub const CAS_MISMATCH: Status = Status(8);

/// Header maps.
#[derive(Clone, Copy)]
#[repr(u32)]
pub enum Map {
    /// Request headers.
    RequestHeaders = 0,
    /// Response headers.
    ResponseHeaders = 2,
    /// Response trailers.
    ResponseTrailers = 3,
}

/// Log levels of the ABI.
#[derive(Clone, Copy)]
#[repr(u32)]
pub enum Level {
    Trace = 0,
    Debug = 1,
    Info = 2,
    Warn = 3,
    Error = 4,
    Critical = 5,
}

#[link(wasm_import_module = "env")]
extern "C" {
    fn proxy_log(level: u32, message: *const u8, size: usize) -> u32;
    fn proxy_get_current_time_nanoseconds(out: *mut u64) -> u32;
    fn proxy_get_buffer_bytes(
        kind: u32,
        start: usize,
        max: usize,
        out: *mut *mut u8,
        out_size: *mut usize,
    ) -> u32;
    fn proxy_get_header_map_value(
        map: u32,
        key: *const u8,
        key_size: usize,
        out: *mut *mut u8,
        out_size: *mut usize,
    ) -> u32;
    fn proxy_get_header_map_pairs(map: u32, out: *mut *mut u8, out_size: *mut usize) -> u32;
    fn proxy_add_header_map_value(
        map: u32,
        key: *const u8,
        key_size: usize,
        value: *const u8,
        value_size: usize,
    ) -> u32;
    fn proxy_replace_header_map_value(
        map: u32,
        key: *const u8,
        key_size: usize,
        value: *const u8,
        value_size: usize,
    ) -> u32;
    fn proxy_remove_header_map_value(map: u32, key: *const u8, key_size: usize) -> u32;
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
    fn proxy_send_local_response(
        status: u32,
        details: *const u8,
        details_size: usize,
        body: *const u8,
        body_size: usize,
        headers: *const u8,
        headers_size: usize,
        grpc_status: i32,
    ) -> u32;
    fn proxy_set_tick_period_milliseconds(period: u32) -> u32;
    fn proxy_set_property(
        path: *const u8,
        path_size: usize,
        value: *const u8,
        value_size: usize,
    ) -> u32;
    fn proxy_get_status(code: *mut u32, message: *mut *mut u8, message_size: *mut usize) -> u32;
    fn proxy_set_effective_context(context_id: u32) -> u32;
    fn proxy_continue_stream(stream_type: u32) -> u32;
    fn proxy_define_metric(kind: u32, name: *const u8, name_size: usize, out_id: *mut u32) -> u32;
    fn proxy_increment_metric(id: u32, offset: i64) -> u32;
    fn proxy_record_metric(id: u32, value: u64) -> u32;
}

fn check(status: u32) -> Result<(), Status> {
    if status == 0 {
        Ok(())
    } else {
        Err(Status(status))
    }
}

/// Takes ownership of a buffer the host allocated through the SDK's `proxy_on_memory_allocate`
/// (a `Vec<u8>` of exactly `size` capacity, leaked).
///
/// # Safety
/// `ptr` must be null or come from that allocator with `size` bytes.
unsafe fn owned(ptr: *mut u8, size: usize) -> Option<Vec<u8>> {
    if ptr.is_null() {
        None
    } else {
        Some(Vec::from_raw_parts(ptr, size, size))
    }
}

/// Writes a log line at `level`.
pub fn log(level: Level, message: &str) -> Result<(), Status> {
    // SAFETY: pointers and lengths describe buffers alive for the call; out-pointers are locals.
    check(unsafe { proxy_log(level as u32, message.as_ptr(), message.len()) })
}

/// Envoy's wall clock in milliseconds since the epoch.
///
/// Read through WASI's `clock_time_get` (std's `SystemTime`), which Envoy answers from the same
/// wall clock as `proxy_get_current_time_nanoseconds` but about 1 µs cheaper per call (measured,
/// see BENCHMARKS.md); the proxy-wasm call is the fallback.
pub fn now_ms() -> Result<u64, Status> {
    if let Ok(d) = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH) {
        // Not `as_millis()`: its u128 arithmetic is a library call in wasm32.
        return Ok(d.as_secs() * 1000 + u64::from(d.subsec_millis()));
    }
    let mut ns = 0u64;
    // SAFETY: pointers and lengths describe buffers alive for the call; out-pointers are locals.
    check(unsafe { proxy_get_current_time_nanoseconds(&mut ns) })?;
    Ok(ns / 1_000_000)
}

/// Asks for `on_tick` every `ms` milliseconds on this VM's root context.
pub fn set_tick_period(ms: u32) -> Result<(), Status> {
    // SAFETY: pointers and lengths describe buffers alive for the call; out-pointers are locals.
    check(unsafe { proxy_set_tick_period_milliseconds(ms) })
}

fn buffer(kind: u32, start: usize, size: usize) -> Result<Option<Vec<u8>>, Status> {
    let (mut ptr, mut len) = (null_mut(), 0usize);
    // SAFETY: pointers and lengths describe buffers alive for the call; out-pointers are locals.
    match check(unsafe { proxy_get_buffer_bytes(kind, start, size, &mut ptr, &mut len) }) {
        // SAFETY: on success `ptr` is null or `len` bytes from `proxy_on_memory_allocate`.
        Ok(()) => Ok(unsafe { owned(ptr, len) }),
        Err(NOT_FOUND) => Ok(None),
        Err(s) => Err(s),
    }
}

/// An HTTP body's buffer.
#[derive(Clone, Copy)]
#[repr(u32)]
pub enum Body {
    /// The request body (what Envoy holds of it while the filter pauses).
    Request = 0,
    /// The response body piece of the current hook.
    Response = 1,
}

/// `size` bytes of a body from `start`.
pub fn body(which: Body, start: usize, size: usize) -> Result<Option<Vec<u8>>, Status> {
    buffer(which as u32, start, size)
}

/// Sets a property of the stream: Envoy keeps it as the filter state `wasm.<path>`, which
/// access logs read with `%FILTER_STATE(wasm.<path>:PLAIN)%`.
pub fn set_property(path: &str, value: &[u8]) -> Result<(), Status> {
    // SAFETY: pointers and lengths describe buffers alive for the call.
    check(unsafe { proxy_set_property(path.as_ptr(), path.len(), value.as_ptr(), value.len()) })
}

/// The plugin configuration bytes (`None` when there is none).
pub fn plugin_configuration(size: usize) -> Result<Option<Vec<u8>>, Status> {
    const PLUGIN_CONFIGURATION: u32 = 7;
    buffer(PLUGIN_CONFIGURATION, 0, size)
}

/// The body of a gRPC call's answer.
pub fn grpc_response(size: usize) -> Result<Option<Vec<u8>>, Status> {
    const GRPC_RECEIVE_BUFFER: u32 = 5;
    buffer(GRPC_RECEIVE_BUFFER, 0, size)
}

/// The gRPC status of the call whose answer is being delivered.
pub fn grpc_status() -> Result<u32, Status> {
    let (mut code, mut ptr, mut len) = (0u32, null_mut(), 0usize);
    // SAFETY: pointers and lengths describe buffers alive for the call; out-pointers are locals.
    check(unsafe { proxy_get_status(&mut code, &mut ptr, &mut len) })?;
    // SAFETY: on success `ptr` is null or `len` bytes from `proxy_on_memory_allocate`.
    drop(unsafe { owned(ptr, len) });
    Ok(code)
}

/// Starts a unary gRPC call on `cluster`; the answer comes to the calling context's
/// `on_grpc_call_response`. Goes through the SDK, which must learn the token to route the
/// answer; unknown clusters come back as errors (`ParseFailure`).
pub fn grpc_call(
    cluster: &str,
    service: &str,
    method: &str,
    message: &[u8],
    timeout_ms: u32,
) -> Result<u32, Status> {
    proxy_wasm::hostcalls::dispatch_grpc_call(
        cluster,
        service,
        method,
        Vec::new(),
        Some(message),
        std::time::Duration::from_millis(u64::from(timeout_ms)),
    )
    .map_err(|s| Status(s as u32))
}

/// A header's value, as bytes.
pub fn header(map: Map, name: &str) -> Result<Option<Vec<u8>>, Status> {
    let (mut ptr, mut len) = (null_mut(), 0usize);
    // SAFETY: pointers and lengths describe buffers alive for the call; out-pointers are locals.
    match check(unsafe {
        proxy_get_header_map_value(map as u32, name.as_ptr(), name.len(), &mut ptr, &mut len)
    }) {
        // SAFETY: on success `ptr` is null or `len` bytes from `proxy_on_memory_allocate`.
        Ok(()) => Ok(unsafe { owned(ptr, len) }),
        Err(NOT_FOUND) => Ok(None),
        Err(s) => Err(s),
    }
}

/// Every line of a header map, in one call: the ABI's serialization, a count, each line's name
/// and value lengths, then each name and value with a NUL after it ([`header_pairs`] reads it).
pub fn header_map(map: Map) -> Result<Option<Vec<u8>>, Status> {
    let (mut ptr, mut len) = (null_mut(), 0usize);
    // SAFETY: out-pointers are locals.
    match check(unsafe { proxy_get_header_map_pairs(map as u32, &mut ptr, &mut len) }) {
        // SAFETY: on success `ptr` is null or `len` bytes from `proxy_on_memory_allocate`.
        Ok(()) => Ok(unsafe { owned(ptr, len) }),
        Err(NOT_FOUND) => Ok(None),
        Err(s) => Err(s),
    }
}

/// The (name, value) lines of a [`header_map`], in order; stops at the first inconsistency.
pub fn header_pairs(map: &[u8]) -> impl Iterator<Item = (&[u8], &[u8])> {
    let word = |at: usize| {
        let b: [u8; 4] = map.get(at..at.checked_add(4)?)?.try_into().ok()?;
        Some(u32::from_le_bytes(b) as usize)
    };
    let count = word(0).unwrap_or(0);
    // The lengths come first, the bytes after them.
    let mut sizes = 4;
    let mut data = 4usize.saturating_add(count.saturating_mul(8));
    (0..count).map_while(move |_| {
        let (k, v) = (word(sizes)?, word(sizes.checked_add(4)?)?);
        sizes += 8;
        let name = map.get(data..data.checked_add(k)?)?;
        let value_at = data.checked_add(k)?.checked_add(1)?;
        let value = map.get(value_at..value_at.checked_add(v)?)?;
        data = value_at.checked_add(v)?.checked_add(1)?;
        Some((name, value))
    })
}

/// Adds a header line (keeps existing lines of the same name).
pub fn add_header(map: Map, name: &str, value: &str) -> Result<(), Status> {
    // SAFETY: pointers and lengths describe buffers alive for the call; out-pointers are locals.
    check(unsafe {
        proxy_add_header_map_value(
            map as u32,
            name.as_ptr(),
            name.len(),
            value.as_ptr(),
            value.len(),
        )
    })
}

/// Sets a header, replacing existing lines of the same name.
pub fn replace_header(map: Map, name: &str, value: &str) -> Result<(), Status> {
    // SAFETY: pointers and lengths describe buffers alive for the call; out-pointers are locals.
    check(unsafe {
        proxy_replace_header_map_value(
            map as u32,
            name.as_ptr(),
            name.len(),
            value.as_ptr(),
            value.len(),
        )
    })
}

/// Removes every line of a header.
pub fn remove_header(map: Map, name: &str) -> Result<(), Status> {
    // SAFETY: the pointer and length describe a buffer alive for the call.
    check(unsafe { proxy_remove_header_map_value(map as u32, name.as_ptr(), name.len()) })
}

/// A property by its encoded path, each part followed by a NUL: `b"source\0address\0"` (a
/// constant, so reading one allocates nothing but the value).
pub fn property(encoded: &[u8]) -> Result<Option<Vec<u8>>, Status> {
    let (mut ptr, mut len) = (null_mut(), 0usize);
    // SAFETY: pointers and lengths describe buffers alive for the call; out-pointers are locals.
    match check(unsafe { proxy_get_property(encoded.as_ptr(), encoded.len(), &mut ptr, &mut len) })
    {
        // SAFETY: on success `ptr` is null or `len` bytes from `proxy_on_memory_allocate`.
        Ok(()) => Ok(unsafe { owned(ptr, len) }),
        Err(NOT_FOUND) => Ok(None),
        Err(s) => Err(s),
    }
}

/// A shared-data value and its CAS; `(None, None)` for a key never written.
pub fn get_shared(key: &str) -> Result<(Option<Vec<u8>>, Option<u32>), Status> {
    let (mut ptr, mut len, mut cas) = (null_mut(), 0usize, 0u32);
    // SAFETY: pointers and lengths describe buffers alive for the call; out-pointers are locals.
    match check(unsafe {
        proxy_get_shared_data(key.as_ptr(), key.len(), &mut ptr, &mut len, &mut cas)
    }) {
        // SAFETY: on success `ptr` is null or `len` bytes from `proxy_on_memory_allocate`.
        Ok(()) => Ok((unsafe { owned(ptr, len) }, (cas != 0).then_some(cas))),
        Err(NOT_FOUND) => Ok((None, None)),
        Err(s) => Err(s),
    }
}

/// Writes shared data if its CAS still equals `cas` (0: unconditionally).
pub fn set_shared(key: &str, value: &[u8], cas: u32) -> Result<(), Status> {
    // SAFETY: pointers and lengths describe buffers alive for the call; out-pointers are locals.
    check(unsafe {
        proxy_set_shared_data(key.as_ptr(), key.len(), value.as_ptr(), value.len(), cas)
    })
}

/// Serializes headers in the proxy-wasm map format.
fn serialize(headers: &[(&str, &str)]) -> Vec<u8> {
    let size = 4 + headers
        .iter()
        .map(|(k, v)| k.len() + v.len() + 10)
        .sum::<usize>();
    let mut out = Vec::with_capacity(size);
    out.extend_from_slice(&(headers.len() as u32).to_le_bytes());
    for (k, v) in headers {
        out.extend_from_slice(&(k.len() as u32).to_le_bytes());
        out.extend_from_slice(&(v.len() as u32).to_le_bytes());
    }
    for (k, v) in headers {
        out.extend_from_slice(k.as_bytes());
        out.push(0);
        out.extend_from_slice(v.as_bytes());
        out.push(0);
    }
    out
}

/// Sends a local reply instead of forwarding the request.
pub fn send_local_response(
    status: u16,
    headers: &[(&str, &str)],
    body: &[u8],
) -> Result<(), Status> {
    let map = serialize(headers);
    // SAFETY: pointers and lengths describe buffers alive for the call; out-pointers are locals.
    check(unsafe {
        proxy_send_local_response(
            u32::from(status),
            null(),
            0,
            body.as_ptr(),
            body.len(),
            map.as_ptr(),
            map.len(),
            -1,
        )
    })
}

/// Defines (or finds) a counter by name.
pub fn define_counter(name: &str) -> Result<u32, Status> {
    let mut id = 0u32;
    // SAFETY: pointers and lengths describe buffers alive for the call; out-pointers are locals.
    check(unsafe { proxy_define_metric(0, name.as_ptr(), name.len(), &mut id) })?;
    Ok(id)
}

/// Defines (or finds) a gauge by name.
pub fn define_gauge(name: &str) -> Result<u32, Status> {
    let mut id = 0u32;
    // SAFETY: pointers and lengths describe buffers alive for the call; out-pointers are locals.
    check(unsafe { proxy_define_metric(1, name.as_ptr(), name.len(), &mut id) })?;
    Ok(id)
}

/// Moves a gauge by `delta` (Envoy adds or subtracts; gauges are shared by all workers).
pub fn gauge_add(id: u32, delta: i64) -> Result<(), Status> {
    // SAFETY: pointers and lengths describe buffers alive for the call; out-pointers are locals.
    check(unsafe { proxy_increment_metric(id, delta) })
}

/// Makes later host calls act on the stream `context_id` (from a root context's tick).
/// `Err(BadArgument)` when that stream is gone.
pub fn set_effective_context(context_id: u32) -> Result<(), Status> {
    // SAFETY: pointers and lengths describe buffers alive for the call; out-pointers are locals.
    check(unsafe { proxy_set_effective_context(context_id) })
}

/// Resumes the paused request of the effective context.
pub fn resume_request() -> Result<(), Status> {
    const HTTP_REQUEST: u32 = 0;
    // SAFETY: pointers and lengths describe buffers alive for the call; out-pointers are locals.
    check(unsafe { proxy_continue_stream(HTTP_REQUEST) })
}

/// Adds `n` (> 0) to a counter.
pub fn increment(id: u32, n: u64) -> Result<(), Status> {
    // SAFETY: pointers and lengths describe buffers alive for the call; out-pointers are locals.
    check(unsafe { proxy_increment_metric(id, i64::try_from(n).unwrap_or(i64::MAX)) })
}

/// Sets a gauge to `value`.
pub fn gauge_set(id: u32, value: u64) -> Result<(), Status> {
    // SAFETY: pointers and lengths describe buffers alive for the call; out-pointers are locals.
    check(unsafe { proxy_record_metric(id, value) })
}

/// A `log` backend writing through [`log`], never panicking.
pub struct HostLogger;

impl log::Log for HostLogger {
    fn enabled(&self, metadata: &log::Metadata) -> bool {
        metadata.level() <= log::max_level()
    }

    fn log(&self, record: &log::Record) {
        let level = match record.level() {
            log::Level::Trace => Level::Trace,
            log::Level::Debug => Level::Debug,
            log::Level::Info => Level::Info,
            log::Level::Warn => Level::Warn,
            log::Level::Error => Level::Error,
        };
        let _ = log(level, &record.args().to_string());
    }

    fn flush(&self) {}
}
