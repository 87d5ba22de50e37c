//! Envoy's dynamic-module ABI, as far as an HTTP filter like this one uses it: the raw types and
//! callbacks of `abi.h` ([`sys`]), safe handles over them ([`Stream`], [`ConfigHandle`],
//! schedulers), and the hooks Envoy calls ([`hooks`], exported by [`export_http_filter!`]). All
//! the `unsafe` of the native build is in this crate. Buffers Envoy lends are valid until the
//! hook that received them returns, and no handle outlives its hook.
//!
//! The declarations are checked against Envoy's own, vendored per release under `abi/` (see
//! `abi/README.md` and `src/header_check.rs`); `ENVOY_VERSION` at build time (default 1.40.0)
//! selects the release the module reports and requires ([`ENVOY_VERSION`], [`ABI_VERSION`]).
#![allow(non_camel_case_types)]

use std::ptr::null_mut;

#[cfg(test)]
mod header_check;
pub mod hooks;
pub mod sys;

use sys::*;
pub use sys::{
    BodyStatus, BodyType, Code, ConfigEnvoyPtr, ConfigModulePtr, EnvoyBuffer, EnvoyHeader,
    FilterEnvoyPtr, FilterModulePtr, HeadersStatus, LocalReplyStatus, LogLevel, TrailersStatus,
    ABI_VERSION, ENVOY_VERSION,
};

impl EnvoyBuffer {
    const NULL: EnvoyBuffer = EnvoyBuffer {
        ptr: std::ptr::null(),
        length: 0,
    };

    /// The bytes.
    ///
    /// # Safety
    /// `ptr..ptr + length` must be readable for `'a` (for Envoy's buffers: at most until the
    /// hook that received them returns).
    pub(crate) unsafe fn bytes<'a>(self) -> &'a [u8] {
        if self.ptr.is_null() || self.length == 0 {
            &[]
        } else {
            // SAFETY: the caller vouches for the range.
            unsafe { std::slice::from_raw_parts(self.ptr.cast::<u8>(), self.length) }
        }
    }
}

impl ModuleBuffer {
    fn of(bytes: &[u8]) -> ModuleBuffer {
        ModuleBuffer {
            ptr: bytes.as_ptr().cast(),
            length: bytes.len(),
        }
    }
}

impl ModuleHeader {
    fn of(key: &str, value: &[u8]) -> ModuleHeader {
        ModuleHeader {
            key_ptr: key.as_ptr().cast(),
            key_length: key.len(),
            value_ptr: value.as_ptr().cast(),
            value_length: value.len(),
        }
    }
}

// --------------------------------------------------------------------------------------------
// The Envoy this module runs in
// --------------------------------------------------------------------------------------------

#[cfg(target_os = "linux")]
extern "C" {
    /// The C library's symbol lookup (`<dlfcn.h>`).
    fn dlsym(
        handle: *mut std::ffi::c_void,
        symbol: *const std::os::raw::c_char,
    ) -> *mut std::ffi::c_void;
}

/// Whether the running process (Envoy) exports `symbol`: a lookup in the global scope
/// (`dlsym(RTLD_DEFAULT, symbol)`), where Envoy's `envoy_dynamic_module_callback_*` are.
#[cfg(target_os = "linux")]
pub fn envoy_exports(symbol: &std::ffi::CStr) -> bool {
    // RTLD_DEFAULT is the null handle in glibc and musl.
    // SAFETY: dlsym only reads the NUL-terminated name; the result is compared, never called.
    unsafe { !dlsym(null_mut(), symbol.as_ptr()).is_null() }
}

/// Whether the running process exports `symbol` (not checked outside Linux: true).
#[cfg(not(target_os = "linux"))]
pub fn envoy_exports(_symbol: &std::ffi::CStr) -> bool {
    true
}

/// Why this Envoy cannot run the module, or `None`: an Envoy without [`sys::MARKER`] is older
/// than the release the module was built for ([`ENVOY_VERSION`]), and Envoy only promises that a
/// module built for 1.N runs on 1.N and 1.N+1.
pub fn unsupported_envoy(module: &str) -> Option<String> {
    if envoy_exports(MARKER) {
        return None;
    }
    Some(format!(
        "{module} was built for the dynamic-module ABI of Envoy {ENVOY_VERSION} ({abi}), but this \
         Envoy does not export {marker}, which Envoy {ENVOY_VERSION} does: it is an older Envoy. \
         Refusing to load. Build the module for this Envoy's release (make build-native \
         ENVOY_VERSION=<release>; vendored releases: crates/envoy-dm-abi/abi/).",
        abi = ABI_VERSION.to_string_lossy(),
        marker = MARKER.to_string_lossy(),
    ))
}

// --------------------------------------------------------------------------------------------
// Safe wrappers
// --------------------------------------------------------------------------------------------

/// Writes a log line through Envoy's `dynamic_modules` logger.
pub fn log(level: LogLevel, message: &str) {
    // SAFETY: the message is borrowed for the call only; Envoy copies it.
    unsafe { envoy_dynamic_module_callback_log(level, ModuleBuffer::of(message.as_bytes())) }
}

/// Whether Envoy would print a line at `level`.
pub fn log_enabled(level: LogLevel) -> bool {
    // SAFETY: a plain query.
    unsafe { envoy_dynamic_module_callback_log_enabled(level) }
}

/// Bytes as text, `None` if they are not UTF-8. What Envoy lends is nearly always ASCII (an
/// address, a method, a path), which is checked a word at a time; the full UTF-8 check, byte by
/// byte on short strings, is left to the rest.
#[inline]
pub fn text(bytes: &[u8]) -> Option<&str> {
    if bytes.is_ascii() {
        // SAFETY: ASCII is valid UTF-8.
        Some(unsafe { std::str::from_utf8_unchecked(bytes) })
    } else {
        std::str::from_utf8(bytes).ok()
    }
}

/// Label values lent to Envoy for one call.
fn labels(values: &[&str]) -> (Vec<ModuleBuffer>, usize) {
    let v: Vec<ModuleBuffer> = values
        .iter()
        .map(|s| ModuleBuffer::of(s.as_bytes()))
        .collect();
    let n = v.len();
    (v, n)
}

/// Envoy's filter configuration object: valid from `config_new` until `config_destroy`. Its
/// callbacks are made on the main thread only (`config_new`, config scheduler events, config
/// stream events).
#[derive(Clone, Copy)]
pub struct ConfigHandle(ConfigEnvoyPtr);

// SAFETY: the pointer is only dereferenced by Envoy, in calls this module makes on the main
// thread; holding it elsewhere (in the shared module config) is fine.
unsafe impl Send for ConfigHandle {}
// SAFETY: as above.
unsafe impl Sync for ConfigHandle {}

impl ConfigHandle {
    /// Envoy's configuration pointer given to `config_new` (kept for the configuration's life).
    pub(crate) fn of(ptr: ConfigEnvoyPtr) -> ConfigHandle {
        ConfigHandle(ptr)
    }

    /// Defines a counter (only during `config_new`); its id, if Envoy took it.
    pub fn define_counter(&self, name: &str, label_names: &[&str]) -> Option<usize> {
        let (mut names, n) = labels(label_names);
        let mut id = 0usize;
        // SAFETY: `self.0` is live during config_new; name and labels are copied by Envoy.
        let code = unsafe {
            envoy_dynamic_module_callback_http_filter_config_define_counter(
                self.0,
                ModuleBuffer::of(name.as_bytes()),
                names.as_mut_ptr(),
                n,
                &mut id,
            )
        };
        (code == SUCCESS).then_some(id)
    }

    /// Defines a gauge (only during `config_new`).
    pub fn define_gauge(&self, name: &str, label_names: &[&str]) -> Option<usize> {
        let (mut names, n) = labels(label_names);
        let mut id = 0usize;
        // SAFETY: as for define_counter.
        let code = unsafe {
            envoy_dynamic_module_callback_http_filter_config_define_gauge(
                self.0,
                ModuleBuffer::of(name.as_bytes()),
                names.as_mut_ptr(),
                n,
                &mut id,
            )
        };
        (code == SUCCESS).then_some(id)
    }

    /// Adds `n` to a labelled counter (main thread).
    pub fn increment_counter(&self, id: usize, label_values: &[&str], n: u64) {
        let (mut values, len) = labels(label_values);
        // SAFETY: `self.0` is live until config_destroy; label values are copied.
        let _ = unsafe {
            envoy_dynamic_module_callback_http_filter_config_increment_counter(
                self.0,
                id,
                values.as_mut_ptr(),
                len,
                n,
            )
        };
    }

    /// Moves a labelled gauge by `delta`.
    pub fn gauge_add(&self, id: usize, label_values: &[&str], delta: i64) {
        let (mut values, len) = labels(label_values);
        let n = delta.unsigned_abs();
        // SAFETY: `self.0` is live until config_destroy; label values are copied.
        let _ = unsafe {
            if delta >= 0 {
                envoy_dynamic_module_callback_http_filter_config_increment_gauge(
                    self.0,
                    id,
                    values.as_mut_ptr(),
                    len,
                    n,
                )
            } else {
                envoy_dynamic_module_callback_http_filter_config_decrement_gauge(
                    self.0,
                    id,
                    values.as_mut_ptr(),
                    len,
                    n,
                )
            }
        };
    }

    /// Sets a labelled gauge.
    pub fn set_gauge(&self, id: usize, label_values: &[&str], value: u64) {
        let (mut values, n) = labels(label_values);
        // SAFETY: `self.0` is live; label values are copied.
        let _ = unsafe {
            envoy_dynamic_module_callback_http_filter_config_set_gauge(
                self.0,
                id,
                values.as_mut_ptr(),
                n,
                value,
            )
        };
    }

    /// A scheduler whose events reach `on_http_filter_config_scheduled` on the main thread.
    pub fn scheduler(&self) -> Option<ConfigScheduler> {
        // SAFETY: `self.0` is live (called from config_new).
        let s = unsafe { envoy_dynamic_module_callback_http_filter_config_scheduler_new(self.0) };
        (!s.is_null()).then_some(ConfigScheduler(s))
    }

    /// Starts a gRPC call owned by the configuration (main thread); its events reach the
    /// `on_http_filter_config_http_stream_*` hooks.
    pub fn start_grpc(
        &self,
        cluster: &str,
        path: &str,
        frame: &[u8],
        timeout_ms: u32,
    ) -> Result<u64, Code> {
        let mut headers = grpc_headers(cluster, path);
        let mut id = 0u64;
        // SAFETY: `self.0` is live; headers and body are copied by Envoy during the call.
        let code = unsafe {
            envoy_dynamic_module_callback_http_filter_config_start_http_stream(
                self.0,
                &mut id,
                ModuleBuffer::of(cluster.as_bytes()),
                headers.as_mut_ptr(),
                headers.len(),
                ModuleBuffer::of(frame),
                true,
                u64::from(timeout_ms),
            )
        };
        if code == SUCCESS {
            Ok(id)
        } else {
            Err(code)
        }
    }
}

/// The request headers of a unary gRPC call (HTTP/2 on the cluster).
fn grpc_headers<'a>(authority: &'a str, path: &'a str) -> [ModuleHeader; 6] {
    [
        ModuleHeader::of(":method", b"POST"),
        ModuleHeader::of(":path", path.as_bytes()),
        ModuleHeader::of(":authority", authority.as_bytes()),
        ModuleHeader::of(":scheme", b"http"),
        ModuleHeader::of("content-type", b"application/grpc"),
        ModuleHeader::of("te", b"trailers"),
    ]
}

/// A scheduler for the main thread. Owned by the module: deleted once, on drop.
pub struct ConfigScheduler(ConfigSchedulerPtr);

// SAFETY: Envoy's config scheduler may be committed from any thread (it posts to the main
// dispatcher); it is deleted once, on drop.
unsafe impl Send for ConfigScheduler {}
// SAFETY: as above; `commit` takes `&self` and Envoy's commit is thread-safe.
unsafe impl Sync for ConfigScheduler {}

impl ConfigScheduler {
    /// Posts `event` to the main thread.
    pub fn commit(&self, event: u64) {
        // SAFETY: the scheduler is live until dropped.
        unsafe { envoy_dynamic_module_callback_http_filter_config_scheduler_commit(self.0, event) }
    }
}

impl Drop for ConfigScheduler {
    fn drop(&mut self) {
        // SAFETY: created by config_scheduler_new, deleted exactly once here.
        unsafe { envoy_dynamic_module_callback_http_filter_config_scheduler_delete(self.0) }
    }
}

/// A scheduler bound to one stream's worker. Owned by the module: deleted once, on drop; a
/// commit after the stream is gone does nothing.
pub struct Scheduler(SchedulerPtr);

// SAFETY: Envoy's filter scheduler may be committed and deleted from any thread (it holds a weak
// reference to the filter and posts to the worker's dispatcher).
unsafe impl Send for Scheduler {}

impl Scheduler {
    /// Posts `event` to the stream's worker (`on_http_filter_scheduled`).
    pub fn commit(&self, event: u64) {
        // SAFETY: the scheduler is live until dropped.
        unsafe { envoy_dynamic_module_callback_http_filter_scheduler_commit(self.0, event) }
    }
}

impl Drop for Scheduler {
    fn drop(&mut self) {
        // SAFETY: created by scheduler_new, deleted exactly once here.
        unsafe { envoy_dynamic_module_callback_http_filter_scheduler_delete(self.0) }
    }
}

/// One stream's Envoy filter, for the duration of one hook (not `Send`: worker thread only).
pub struct Stream<'hook> {
    ptr: FilterEnvoyPtr,
    _hook: std::marker::PhantomData<&'hook ()>,
}

impl Stream<'_> {
    /// Envoy's stream pointer given to the current hook.
    pub(crate) fn of<'hook>(ptr: FilterEnvoyPtr) -> Stream<'hook> {
        Stream {
            ptr,
            _hook: std::marker::PhantomData,
        }
    }

    fn attribute(&self, id: AttributeId) -> Option<&[u8]> {
        let mut out = EnvoyBuffer::NULL;
        // SAFETY: `ptr` is live during the hook; the value stays valid until the hook returns
        // and no header of the request is set meanwhile (this filter only sets response
        // headers).
        unsafe {
            envoy_dynamic_module_callback_http_filter_get_attribute_string(self.ptr, id, &mut out)
                .then(|| out.bytes())
        }
    }

    /// `source.address` (`ip:port`).
    pub fn source_address(&self) -> Option<&[u8]> {
        self.attribute(SOURCE_ADDRESS)
    }

    /// `:path`, query included.
    pub fn path(&self) -> Option<&[u8]> {
        self.attribute(REQUEST_PATH)
    }

    /// `:method`.
    pub fn method(&self) -> Option<&[u8]> {
        self.attribute(REQUEST_METHOD)
    }

    /// `:authority`.
    pub fn authority(&self) -> Option<&[u8]> {
        self.attribute(REQUEST_HOST)
    }

    fn header(&self, kind: HeaderType, name: &str) -> Option<&[u8]> {
        self.header_at(kind, name, 0, None)
    }

    /// Value `index` of a header, and, given `count`, how many values it has (0 when the map
    /// is not available).
    fn header_at(
        &self,
        kind: HeaderType,
        name: &str,
        index: usize,
        count: Option<&mut usize>,
    ) -> Option<&[u8]> {
        let mut out = EnvoyBuffer::NULL;
        let count = count.map_or(null_mut(), |c| c as *mut usize);
        // SAFETY: as for attribute() (this filter sets no header of a map it reads while the
        // value is in use); Envoy copies the key, writes the number of values to `count` when
        // it is not null, and answers false when the map is not available or has no such
        // value.
        unsafe {
            envoy_dynamic_module_callback_http_get_header(
                self.ptr,
                kind,
                ModuleBuffer::of(name.as_bytes()),
                &mut out,
                index,
                count,
            )
            .then(|| out.bytes())
        }
    }

    /// Gives `line` each value of a header, in order: one lookup when it has one line, and one
    /// more per further line.
    fn header_lines(&self, kind: HeaderType, name: &str, mut line: impl FnMut(&[u8])) {
        let mut count = 0usize;
        let Some(first) = self.header_at(kind, name, 0, Some(&mut count)) else {
            return;
        };
        line(first);
        // Nothing runs on the stream between the calls: every index below `count` has a value.
        for index in 1..count {
            if let Some(value) = self.header_at(kind, name, index, None) {
                line(value);
            }
        }
    }

    /// Gives `line` each value of a response header (each line of it), in order, in the
    /// response headers hook.
    pub fn response_header_lines(&self, name: &str, line: impl FnMut(&[u8])) {
        self.header_lines(HeaderType::ResponseHeader, name, line);
    }

    /// Gives `line` each value of a response trailer, in order, in the response trailers hook.
    pub fn response_trailer_lines(&self, name: &str, line: impl FnMut(&[u8])) {
        self.header_lines(HeaderType::ResponseTrailer, name, line);
    }

    /// A request header's first value (`Some(b"")` for an empty value).
    pub fn request_header(&self, name: &str) -> Option<&[u8]> {
        self.header(HeaderType::RequestHeader, name)
    }

    /// A response header's first value, in the response headers hook.
    pub fn response_header_value(&self, name: &str) -> Option<&[u8]> {
        self.header(HeaderType::ResponseHeader, name)
    }

    /// A response trailer's first value, in the response trailers hook.
    pub fn response_trailer(&self, name: &str) -> Option<&[u8]> {
        self.header(HeaderType::ResponseTrailer, name)
    }

    /// The bytes of the response body piece this body hook received.
    pub fn received_response_body(&self) -> usize {
        self.body_size(BodyType::ReceivedResponseBody)
    }

    /// The size in bytes of a body: 0 when Envoy has none of that type (a received body outside
    /// its body hook, a body not buffered).
    pub fn body_size(&self, which: BodyType) -> usize {
        // SAFETY: `ptr` is live during the hook; a plain query.
        unsafe { envoy_dynamic_module_callback_http_get_body_size(self.ptr, which) }
    }

    /// Calls `f` with each chunk of a body, in order, and how many chunks there are, without
    /// copying: Envoy lends its own buffer slices, for this call only. Nothing when Envoy has no
    /// body of that type.
    pub fn body(&self, which: BodyType, mut f: impl FnMut(&[u8], usize)) {
        /// Chunks read without allocating: a received piece is usually one slice, a buffered
        /// body one per ~16 KiB read.
        const INLINE: usize = 16;
        // SAFETY: `ptr` is live during the hook; a plain query.
        let n = unsafe { envoy_dynamic_module_callback_http_get_body_chunks_size(self.ptr, which) };
        if n == 0 {
            return;
        }
        let mut inline = [EnvoyBuffer::NULL; INLINE];
        let mut heap = Vec::new();
        let slots: &mut [EnvoyBuffer] = match inline.get_mut(..n) {
            Some(s) => s,
            None => {
                heap.resize(n, EnvoyBuffer::NULL);
                &mut heap
            }
        };
        // SAFETY: `ptr` is live; `slots` holds the `n` entries Envoy writes (the body cannot
        // change between the two calls: nothing runs on this stream in between). Envoy answers
        // false, writing nothing, when it has no such body.
        let available = unsafe {
            envoy_dynamic_module_callback_http_get_body_chunks(self.ptr, which, slots.as_mut_ptr())
        };
        if !available {
            return;
        }
        for chunk in slots.iter() {
            // SAFETY: Envoy's slices of the body, valid until the hook returns unless the body
            // is changed: `f` only gets `&[u8]` for its call and this crate has no body setter.
            f(unsafe { chunk.bytes() }, n);
        }
    }

    /// Sets a number in the stream's dynamic metadata (`namespace`, `key`), replacing any value
    /// there: what an access log reads with `%DYNAMIC_METADATA(namespace:key)%`.
    pub fn set_metadata_number(&self, namespace: &str, key: &str, value: f64) {
        // SAFETY: `ptr` is live; namespace and key are copied during the call.
        unsafe {
            envoy_dynamic_module_callback_http_set_dynamic_metadata_number(
                self.ptr,
                ModuleBuffer::of(namespace.as_bytes()),
                ModuleBuffer::of(key.as_bytes()),
                value,
            )
        }
    }

    /// Sets a string in the stream's dynamic metadata (`namespace`, `key`), replacing any value
    /// there.
    pub fn set_metadata_string(&self, namespace: &str, key: &str, value: &str) {
        self.set_metadata_text(namespace, key, value.as_bytes());
    }

    /// [`Stream::set_metadata_string`] for a value given as bytes, if they are ASCII (a check
    /// cheaper than making a `&str` of them); `false`, and nothing set, otherwise.
    pub fn set_metadata_ascii(&self, namespace: &str, key: &str, value: &[u8]) -> bool {
        if !value.is_ascii() {
            return false;
        }
        self.set_metadata_text(namespace, key, value);
        true
    }

    /// Sets `value`, UTF-8 as both callers know.
    fn set_metadata_text(&self, namespace: &str, key: &str, value: &[u8]) {
        // SAFETY: `ptr` is live; namespace, key and value are copied during the call.
        unsafe {
            envoy_dynamic_module_callback_http_set_dynamic_metadata_string(
                self.ptr,
                ModuleBuffer::of(namespace.as_bytes()),
                ModuleBuffer::of(key.as_bytes()),
                ModuleBuffer::of(value),
            )
        }
    }

    /// A key of the stream's dynamic metadata under `namespace` that is a number.
    pub fn metadata_number(&self, namespace: &str, key: &str) -> Option<f64> {
        let mut out = 0f64;
        // SAFETY: `ptr` is live; namespace and key are read during the call; `out` is a local
        // Envoy writes only when it answers true.
        unsafe {
            envoy_dynamic_module_callback_http_get_metadata_number(
                self.ptr,
                MetadataSource::Dynamic,
                ModuleBuffer::of(namespace.as_bytes()),
                ModuleBuffer::of(key.as_bytes()),
                &mut out,
            )
        }
        .then_some(out)
    }

    /// A key of the stream's dynamic metadata under `namespace` that is a string, lent by Envoy
    /// for the hook.
    pub fn metadata_string(&self, namespace: &str, key: &str) -> Option<&[u8]> {
        let mut out = EnvoyBuffer::NULL;
        // SAFETY: `ptr` is live; namespace and key are read during the call; Envoy's buffer
        // stays valid until the hook returns (this crate sets no metadata string in between
        // while the borrow of `self` lives).
        unsafe {
            envoy_dynamic_module_callback_http_get_metadata_string(
                self.ptr,
                MetadataSource::Dynamic,
                ModuleBuffer::of(namespace.as_bytes()),
                ModuleBuffer::of(key.as_bytes()),
                &mut out,
            )
            .then(|| out.bytes())
        }
    }

    /// A filter state object of the stream that holds a string (what Envoy's
    /// `set_filter_state` filter and other modules store), lent by Envoy for the hook.
    pub fn filter_state(&self, key: &str) -> Option<&[u8]> {
        let mut out = EnvoyBuffer::NULL;
        // SAFETY: `ptr` is live; the key is read during the call; Envoy's buffer stays valid
        // until the hook returns (this crate sets no filter state).
        unsafe {
            envoy_dynamic_module_callback_http_get_filter_state_bytes(
                self.ptr,
                ModuleBuffer::of(key.as_bytes()),
                &mut out,
            )
            .then(|| out.bytes())
        }
    }

    /// Adds (`append`) or sets a response header.
    pub fn response_header(&self, name: &str, value: &str, append: bool) {
        let (k, v) = (
            ModuleBuffer::of(name.as_bytes()),
            ModuleBuffer::of(value.as_bytes()),
        );
        // SAFETY: `ptr` is live; key and value are copied.
        let _ = unsafe {
            if append {
                envoy_dynamic_module_callback_http_add_header(
                    self.ptr,
                    HeaderType::ResponseHeader,
                    k,
                    v,
                )
            } else {
                envoy_dynamic_module_callback_http_set_header(
                    self.ptr,
                    HeaderType::ResponseHeader,
                    k,
                    v,
                )
            }
        };
    }

    /// Removes every line of a response header (a null value removes, as the ABI says).
    pub fn remove_response_header(&self, name: &str) {
        let (k, v) = (
            ModuleBuffer::of(name.as_bytes()),
            ModuleBuffer {
                ptr: std::ptr::null(),
                length: 0,
            },
        );
        // SAFETY: `ptr` is live; the key is copied; a null value is the ABI's removal.
        let _ = unsafe {
            envoy_dynamic_module_callback_http_set_header(
                self.ptr,
                HeaderType::ResponseHeader,
                k,
                v,
            )
        };
    }

    /// Sends a local reply. Envoy calls this filter's `local_reply` hook before returning (and
    /// not its response hooks): hold no borrow of the filter's state across this call.
    pub fn send_response<'a>(
        &self,
        status: u16,
        headers: impl Iterator<Item = (&'a str, &'a str)>,
        body: &[u8],
        details: &str,
    ) {
        let mut h: Vec<ModuleHeader> = headers
            .map(|(k, v)| ModuleHeader::of(k, v.as_bytes()))
            .collect();
        // SAFETY: `ptr` is live; headers, body and details are copied during the call.
        unsafe {
            envoy_dynamic_module_callback_http_send_response(
                self.ptr,
                u32::from(status),
                h.as_mut_ptr(),
                h.len(),
                ModuleBuffer::of(body),
                ModuleBuffer::of(details.as_bytes()),
            )
        }
    }

    /// Lets a stopped request go on. Envoy may run later filters and this filter's response
    /// hooks before returning: hold no borrow of the filter's state across this call.
    pub fn continue_decoding(&self) {
        // SAFETY: `ptr` is live.
        unsafe { envoy_dynamic_module_callback_http_filter_continue_decoding(self.ptr) }
    }

    /// A scheduler for this stream's worker.
    pub fn scheduler(&self) -> Option<Scheduler> {
        // SAFETY: `ptr` is live; the scheduler is owned (and deleted) by the returned value.
        let s = unsafe { envoy_dynamic_module_callback_http_filter_scheduler_new(self.ptr) };
        (!s.is_null()).then_some(Scheduler(s))
    }

    /// Starts a gRPC call owned by this stream; its events reach the
    /// `on_http_filter_http_stream_*` hooks (none after the stream is gone).
    pub fn start_grpc(
        &self,
        cluster: &str,
        path: &str,
        frame: &[u8],
        timeout_ms: u32,
    ) -> Result<u64, Code> {
        let mut headers = grpc_headers(cluster, path);
        let mut id = 0u64;
        // SAFETY: `ptr` is live; headers and body are copied during the call.
        let code = unsafe {
            envoy_dynamic_module_callback_http_filter_start_http_stream(
                self.ptr,
                &mut id,
                ModuleBuffer::of(cluster.as_bytes()),
                headers.as_mut_ptr(),
                headers.len(),
                ModuleBuffer::of(frame),
                true,
                u64::from(timeout_ms),
            )
        };
        if code == SUCCESS {
            Ok(id)
        } else {
            Err(code)
        }
    }
}

/// Header fields Envoy lends to a stream hook, as byte pairs.
///
/// # Safety
/// `headers..headers + n` must be Envoy's array for the current hook.
pub(crate) unsafe fn header_pairs<'a>(
    headers: *const EnvoyHeader,
    n: usize,
) -> impl Iterator<Item = (&'a [u8], &'a [u8])> {
    let all: &[EnvoyHeader] = if headers.is_null() || n == 0 {
        &[]
    } else {
        // SAFETY: the caller vouches for the array.
        unsafe { std::slice::from_raw_parts(headers, n) }
    };
    all.iter().map(|h| {
        // SAFETY: each field is Envoy's, valid for the hook.
        unsafe {
            (
                EnvoyBuffer {
                    ptr: h.key_ptr,
                    length: h.key_length,
                }
                .bytes(),
                EnvoyBuffer {
                    ptr: h.value_ptr,
                    length: h.value_length,
                }
                .bytes(),
            )
        }
    })
}

/// Data chunks Envoy lends to a stream hook.
///
/// # Safety
/// `chunks..chunks + n` must be Envoy's array for the current hook.
pub(crate) unsafe fn chunks<'a>(
    chunks: *const EnvoyBuffer,
    n: usize,
) -> impl Iterator<Item = &'a [u8]> {
    let all: &[EnvoyBuffer] = if chunks.is_null() || n == 0 {
        &[]
    } else {
        // SAFETY: the caller vouches for the array.
        unsafe { std::slice::from_raw_parts(chunks, n) }
    };
    // SAFETY: each chunk is Envoy's, valid for the hook.
    all.iter().map(|c| unsafe { c.bytes() })
}
