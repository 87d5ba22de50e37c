//! The hooks Envoy calls, written once for any module: [`export_http_filter!`] exports them for
//! a configuration type implementing [`HttpFilterConfig`]. Each hook turns Envoy's pointers into
//! references that live no longer than the hook, and catches panics: a panic unwinding out of an
//! `extern "C"` function aborts the whole Envoy process. A stream whose hook panicked is
//! poisoned: its filter is not called again (its request went the way
//! [`HttpFilter::request_headers_failed`] says, or on unfiltered).

use crate::sys::AbiVersionPtr;
use crate::{
    chunks, header_pairs, BodyStatus, ConfigEnvoyPtr, ConfigHandle, ConfigModulePtr, EnvoyBuffer,
    EnvoyHeader, FilterEnvoyPtr, FilterModulePtr, HeadersStatus, Stream, TrailersStatus,
};
use std::alloc::{alloc, dealloc, handle_alloc_error, Layout};
use std::cell::{Cell, RefCell};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::ptr::null;
use std::ptr::NonNull;

/// Header fields Envoy lends to one hook: (name, value).
pub type Fields<'r, 'a> = &'r mut dyn Iterator<Item = (&'a [u8], &'a [u8])>;
/// Data chunks Envoy lends to one hook.
pub type Chunks<'r, 'a> = &'r mut dyn Iterator<Item = &'a [u8]>;

/// A module's filter configuration: one per `filter_config`, shared by every worker thread.
pub trait HttpFilterConfig: Sized + Sync + 'static {
    /// The per-stream object.
    type Filter: HttpFilter<Config = Self>;

    /// Once, when Envoy loads the module (before any configuration). `false` refuses the
    /// module.
    fn program_init() -> bool;
    /// A hook caught a panic (the module counts and publishes them).
    fn panicked();
    /// A new configuration: `name` is the `filter_name`, `config` the `filter_config` bytes.
    /// `None` refuses the configuration.
    fn new(handle: ConfigHandle, name: &[u8], config: &[u8]) -> Option<Self>;
    /// A new stream's filter.
    fn new_filter(&self) -> Self::Filter;
    /// A configuration-level event (main thread).
    fn scheduled(&self, event: u64);
    /// A configuration-level call's headers or trailers (main thread).
    fn call_headers(&self, id: u64, fields: Fields<'_, '_>);
    /// A configuration-level call's body (main thread).
    fn call_data(&self, id: u64, chunks: Chunks<'_, '_>);
    /// A configuration-level call ended: complete (`None`) or reset with a reason.
    fn call_done(&self, id: u64, reset: Option<u32>);
}

/// One stream's filter. Every method gets its configuration and, where Envoy gives one, the
/// stream, for the hook only.
pub trait HttpFilter: 'static {
    /// The configuration this filter belongs to.
    type Config;

    /// The request's headers; `end_of_stream`: the request has no body (no body hook will
    /// come, so a `StopIteration` here waits for a `continue_decoding`, not for a body).
    fn request_headers(&self, c: &Self::Config, s: &Stream, end_of_stream: bool) -> HeadersStatus;
    /// What becomes of the request when `request_headers` panicked (the stream is poisoned).
    fn request_headers_failed(c: &Self::Config, s: &Stream) -> HeadersStatus;
    /// A piece of the request body; `end_of_stream`: the last call (often with no bytes). The
    /// piece is [`crate::BodyType::ReceivedRequestBody`]; what `StopIterationAndBuffer` held
    /// before it is [`crate::BodyType::BufferedRequestBody`] (the piece joins it after the
    /// hook). `Continue` after headers that stopped sends the headers, what was held and the
    /// piece, even if the filter meant to hold the request longer: a filter that stops
    /// headers of a request with a body must hold its body too. A panic passes the request on
    /// (`Continue`) and poisons the stream. By default: `Continue`, what the hook answered
    /// before filters could see it.
    fn request_body(&self, c: &Self::Config, s: &Stream, end_of_stream: bool) -> BodyStatus {
        let _ = (c, s, end_of_stream);
        BodyStatus::Continue
    }
    /// The request's trailers (its body, if any, has ended). By default: `Continue`.
    fn request_trailers(&self, c: &Self::Config, s: &Stream) -> TrailersStatus {
        let _ = (c, s);
        TrailersStatus::Continue
    }
    /// The response's headers; `end_of_stream`: the response has no body.
    fn response_headers(&self, c: &Self::Config, s: &Stream, end_of_stream: bool) -> HeadersStatus;
    /// A piece of the response body ([`crate::BodyType::ReceivedResponseBody`]), passed on;
    /// `end_of_stream`: the last call (often with no bytes). A response that ends with
    /// trailers or is cut short never gets `end_of_stream` here; [`HttpFilter::complete`] comes
    /// in every case.
    fn response_body(&self, c: &Self::Config, s: &Stream, end_of_stream: bool);
    /// The response's trailers.
    fn response_trailers(&self, c: &Self::Config, s: &Stream);
    /// A stream-level event this filter scheduled.
    fn scheduled(&self, c: &Self::Config, s: &Stream, event: u64);
    /// A call this stream started: its headers or trailers.
    fn call_headers(&self, c: &Self::Config, id: u64, fields: Fields<'_, '_>);
    /// A call this stream started: its body.
    fn call_data(&self, c: &Self::Config, id: u64, chunks: Chunks<'_, '_>);
    /// A call this stream started ended: complete (`None`) or reset with a reason.
    fn call_done(&self, c: &Self::Config, s: &Stream, id: u64, reset: Option<u32>);
    /// The stream ended, however it ended (a reset, a disconnect, a local reply included; not
    /// called for a poisoned stream). The stream is still Envoy's here: dynamic metadata set
    /// now is in the access log, written after this hook (measured in Envoy 1.40.0).
    fn complete(&self, c: &Self::Config, s: &Stream);
}

/// What Envoy holds for one stream.
struct StreamBox<C: HttpFilterConfig> {
    config: *const C,
    filter: C::Filter,
    /// A hook of this stream panicked: the filter is not called again.
    poisoned: Cell<bool>,
}

/// Runs `body`; a panic is counted, poisons the stream (when there is one) and gives
/// `fallback()`.
fn guard<C: HttpFilterConfig, R>(
    poison: Option<&Cell<bool>>,
    fallback: impl FnOnce() -> R,
    body: impl FnOnce() -> R,
) -> R {
    caught(
        C::panicked,
        || {
            if let Some(p) = poison {
                p.set(true);
            }
            fallback()
        },
        body,
    )
}

/// Runs `body`; a panic is counted with `panicked` and gives `fallback()`.
fn caught<R>(panicked: fn(), fallback: impl FnOnce() -> R, body: impl FnOnce() -> R) -> R {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(r) => r,
        Err(_) => {
            // The count itself must not unwind out of the hook.
            let _ = catch_unwind(panicked);
            fallback()
        }
    }
}

/// The module's configuration, for one hook.
///
/// # Safety
/// `ptr` must come from [`config_new`] and not yet be destroyed.
unsafe fn config<'a, C: HttpFilterConfig>(ptr: ConfigModulePtr) -> Option<&'a C> {
    // SAFETY: the caller vouches for the pointer; null is refused.
    unsafe { ptr.cast::<C>().as_ref() }
}

/// A stream's box, its configuration and Envoy's stream, for one hook; `None` once poisoned.
///
/// # Safety
/// `filter` must come from [`filter_new`] and not yet be destroyed; `envoy` must be the pointer
/// Envoy passed to the current hook.
unsafe fn stream<'a, C: HttpFilterConfig>(
    envoy: FilterEnvoyPtr,
    filter: FilterModulePtr,
) -> Option<(&'a StreamBox<C>, &'a C, Stream<'a>)> {
    // SAFETY: the caller vouches for the pointer. Only shared references are made: a filter
    // keeps its state in a RefCell, so hooks Envoy runs inside another hook (a local reply,
    // continue_decoding) cannot alias a `&mut`.
    let b = unsafe { filter.cast::<StreamBox<C>>().as_ref() }?;
    if b.poisoned.get() {
        return None;
    }
    // SAFETY: Envoy destroys a configuration only after every stream made from it (each
    // stream holds a reference to it), so it is live for this hook.
    let c = unsafe { b.config.as_ref() }?;
    Some((b, c, Stream::of(envoy)))
}

/// `envoy_dynamic_module_on_program_init`: the ABI version this module was built against, or
/// null (Envoy refuses the module) when Envoy is older than the release the module was built
/// for, or when `program_init` says no or panics. `module` names the module in the message.
pub fn program_init<C: HttpFilterConfig>(module: &str) -> AbiVersionPtr {
    if let Some(why) = catch_unwind(|| crate::unsupported_envoy(module)).unwrap_or(None) {
        refuse(&why);
        return null();
    }
    match catch_unwind(C::program_init) {
        Ok(true) => crate::ABI_VERSION.as_ptr(),
        _ => null(),
    }
}

/// Says why the module refuses to load: on stderr, and in Envoy's log when its logging callback
/// is there (it is on every Envoy that got as far as calling `program_init`: the module imports
/// it, and the dynamic linker resolves every import before).
fn refuse(why: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "[dynamic module] {why}");
    if crate::envoy_exports(c"envoy_dynamic_module_callback_log") {
        crate::log(crate::LogLevel::Error, why);
    }
}

/// `envoy_dynamic_module_on_http_filter_config_new`.
///
/// # Safety
/// Envoy's buffers, valid for the call.
pub unsafe fn config_new<C: HttpFilterConfig>(
    envoy: ConfigEnvoyPtr,
    name: EnvoyBuffer,
    config: EnvoyBuffer,
) -> ConfigModulePtr {
    guard::<C, _>(None, null, || {
        // SAFETY: both buffers are Envoy's, valid during this call; they are copied.
        let (name, config) = unsafe { (name.bytes(), config.bytes()) };
        match C::new(ConfigHandle::of(envoy), name, config) {
            Some(c) => Box::into_raw(Box::new(c)).cast_const().cast(),
            None => null(),
        }
    })
}

/// `envoy_dynamic_module_on_http_filter_config_destroy`.
///
/// # Safety
/// Called by Envoy once per configuration, after its last stream.
pub unsafe fn config_destroy<C: HttpFilterConfig>(ptr: ConfigModulePtr) {
    guard::<C, _>(
        None,
        || (),
        || {
            if !ptr.is_null() {
                // SAFETY: made by Box::into_raw in config_new; Envoy destroys it once, after the
                // last stream that uses it.
                drop(unsafe { Box::from_raw(ptr.cast_mut().cast::<C>()) });
            }
        },
    )
}

/// `envoy_dynamic_module_on_http_filter_config_scheduled`.
///
/// # Safety
/// A live configuration.
pub unsafe fn config_scheduled<C: HttpFilterConfig>(ptr: ConfigModulePtr, event: u64) {
    // SAFETY: the caller's.
    if let Some(c) = unsafe { config::<C>(ptr) } {
        guard::<C, _>(None, || (), || c.scheduled(event));
    }
}

/// `envoy_dynamic_module_on_http_filter_config_http_stream_headers` and `_trailers`.
///
/// # Safety
/// A live configuration and Envoy's header array for the call.
pub unsafe fn config_call_headers<C: HttpFilterConfig>(
    ptr: ConfigModulePtr,
    id: u64,
    headers: *const EnvoyHeader,
    n: usize,
) {
    // SAFETY: the caller's.
    let (c, mut lent) = unsafe { (config::<C>(ptr), header_pairs(headers, n)) };
    if let Some(c) = c {
        guard::<C, _>(None, || (), || c.call_headers(id, &mut lent));
    }
}

/// `envoy_dynamic_module_on_http_filter_config_http_stream_data`.
///
/// # Safety
/// A live configuration and Envoy's chunks for the call.
pub unsafe fn config_call_data<C: HttpFilterConfig>(
    ptr: ConfigModulePtr,
    id: u64,
    data: *const EnvoyBuffer,
    n: usize,
) {
    // SAFETY: the caller's.
    let (c, mut lent) = unsafe { (config::<C>(ptr), chunks(data, n)) };
    if let Some(c) = c {
        guard::<C, _>(None, || (), || c.call_data(id, &mut lent));
    }
}

/// `envoy_dynamic_module_on_http_filter_config_http_stream_complete` and `_reset`.
///
/// # Safety
/// A live configuration.
pub unsafe fn config_call_done<C: HttpFilterConfig>(
    ptr: ConfigModulePtr,
    id: u64,
    reset: Option<u32>,
) {
    // SAFETY: the caller's.
    if let Some(c) = unsafe { config::<C>(ptr) } {
        guard::<C, _>(None, || (), || c.call_done(id, reset));
    }
}

/// The most stream boxes a thread keeps for its next streams.
const MAX_SPARE: usize = 128;

/// Memory of stream boxes whose streams ended on this thread, for the thread's next streams:
/// Envoy makes and destroys one per stream, and the allocator costs more than this list. All of
/// one layout (a module has one filter type); given back to the allocator when the thread ends.
struct Spare {
    layout: Layout,
    free: Vec<NonNull<u8>>,
}

impl Drop for Spare {
    fn drop(&mut self) {
        for p in self.free.drain(..) {
            // SAFETY: allocated with `layout` by `alloc_stream_box`, not in use.
            unsafe { dealloc(p.as_ptr(), self.layout) }
        }
    }
}

thread_local! {
    static SPARE: RefCell<Spare> = const {
        RefCell::new(Spare {
            layout: Layout::new::<()>(),
            free: Vec::new(),
        })
    };
}

/// Memory for a stream box of `layout` (not zero-sized): a spare one, or the allocator's.
fn alloc_stream_box(layout: Layout) -> NonNull<u8> {
    let spare = SPARE
        .try_with(|s| {
            let mut s = s.try_borrow_mut().ok()?;
            if s.layout == layout {
                s.free.pop()
            } else {
                None
            }
        })
        .ok()
        .flatten();
    spare.unwrap_or_else(|| {
        // SAFETY: `layout` is not zero-sized (a stream box holds a pointer).
        NonNull::new(unsafe { alloc(layout) }).unwrap_or_else(|| handle_alloc_error(layout))
    })
}

/// Gives back a stream box's memory (its value already dropped).
///
/// # Safety
/// `p` came from `alloc_stream_box(layout)` and is no longer used.
unsafe fn free_stream_box(p: NonNull<u8>, layout: Layout) {
    let kept = SPARE
        .try_with(|s| {
            let Ok(mut s) = s.try_borrow_mut() else {
                return false;
            };
            if s.layout != layout {
                if !s.free.is_empty() {
                    return false;
                }
                s.layout = layout;
            }
            if s.free.len() >= MAX_SPARE {
                return false;
            }
            s.free.push(p);
            true
        })
        .unwrap_or(false);
    if !kept {
        // SAFETY: the caller's: allocated with `layout`, unused.
        unsafe { dealloc(p.as_ptr(), layout) }
    }
}

/// `envoy_dynamic_module_on_http_filter_new`.
///
/// # Safety
/// A live configuration.
pub unsafe fn filter_new<C: HttpFilterConfig>(ptr: ConfigModulePtr) -> FilterModulePtr {
    // SAFETY: the caller's.
    let Some(c) = (unsafe { config::<C>(ptr) }) else {
        return null();
    };
    guard::<C, _>(None, null, || {
        let p = alloc_stream_box(Layout::new::<StreamBox<C>>()).cast::<StreamBox<C>>();
        // SAFETY: fresh memory of a StreamBox's layout, written once (the box built in place
        // where the compiler can: no copy of it through the stack).
        unsafe {
            p.as_ptr().write(StreamBox {
                config: std::ptr::from_ref(c),
                filter: c.new_filter(),
                poisoned: Cell::new(false),
            })
        };
        p.as_ptr().cast_const().cast()
    })
}

/// `envoy_dynamic_module_on_http_filter_destroy`.
///
/// # Safety
/// Called by Envoy once per stream.
pub unsafe fn filter_destroy<C: HttpFilterConfig>(filter: FilterModulePtr) {
    guard::<C, _>(
        None,
        || (),
        || {
            if let Some(p) = NonNull::new(filter.cast_mut().cast::<StreamBox<C>>()) {
                // SAFETY: written by filter_new; destroyed once: dropped, then its memory is
                // given back (the drop may panic: the memory is then leaked, not reused).
                unsafe {
                    std::ptr::drop_in_place(p.as_ptr());
                    free_stream_box(p.cast(), Layout::new::<StreamBox<C>>());
                }
            }
        },
    )
}

/// `envoy_dynamic_module_on_http_filter_request_headers`.
///
/// # Safety
/// Envoy's live stream for this hook.
pub unsafe fn request_headers<C: HttpFilterConfig>(
    envoy: FilterEnvoyPtr,
    filter: FilterModulePtr,
    end_of_stream: bool,
) -> HeadersStatus {
    // SAFETY: the caller's.
    let Some((b, c, s)) = (unsafe { stream::<C>(envoy, filter) }) else {
        return HeadersStatus::Continue;
    };
    guard::<C, _>(
        Some(&b.poisoned),
        || {
            catch_unwind(AssertUnwindSafe(|| {
                <C::Filter as HttpFilter>::request_headers_failed(c, &s)
            }))
            .unwrap_or(HeadersStatus::Continue)
        },
        || b.filter.request_headers(c, &s, end_of_stream),
    )
}

/// `envoy_dynamic_module_on_http_filter_response_headers`.
///
/// # Safety
/// Envoy's live stream for this hook.
pub unsafe fn response_headers<C: HttpFilterConfig>(
    envoy: FilterEnvoyPtr,
    filter: FilterModulePtr,
    end_of_stream: bool,
) -> HeadersStatus {
    // SAFETY: the caller's.
    let Some((b, c, s)) = (unsafe { stream::<C>(envoy, filter) }) else {
        return HeadersStatus::Continue;
    };
    guard::<C, _>(
        Some(&b.poisoned),
        || HeadersStatus::Continue,
        || b.filter.response_headers(c, &s, end_of_stream),
    )
}

/// `envoy_dynamic_module_on_http_filter_request_body`: what the filter says, `Continue` for a
/// poisoned stream or a panic (the request goes on with what was held).
///
/// # Safety
/// Envoy's live stream for this hook.
pub unsafe fn request_body<C: HttpFilterConfig>(
    envoy: FilterEnvoyPtr,
    filter: FilterModulePtr,
    end_of_stream: bool,
) -> BodyStatus {
    // SAFETY: the caller's.
    let Some((b, c, s)) = (unsafe { stream::<C>(envoy, filter) }) else {
        return BodyStatus::Continue;
    };
    guard::<C, _>(
        Some(&b.poisoned),
        || BodyStatus::Continue,
        || b.filter.request_body(c, &s, end_of_stream),
    )
}

/// `envoy_dynamic_module_on_http_filter_response_body`.
///
/// # Safety
/// Envoy's live stream for this hook.
pub unsafe fn response_body<C: HttpFilterConfig>(
    envoy: FilterEnvoyPtr,
    filter: FilterModulePtr,
    end_of_stream: bool,
) -> BodyStatus {
    // SAFETY: the caller's.
    if let Some((b, c, s)) = unsafe { stream::<C>(envoy, filter) } {
        guard::<C, _>(
            Some(&b.poisoned),
            || (),
            || b.filter.response_body(c, &s, end_of_stream),
        );
    }
    BodyStatus::Continue
}

/// `envoy_dynamic_module_on_http_filter_request_trailers`.
///
/// # Safety
/// Envoy's live stream for this hook.
pub unsafe fn request_trailers<C: HttpFilterConfig>(
    envoy: FilterEnvoyPtr,
    filter: FilterModulePtr,
) -> TrailersStatus {
    // SAFETY: the caller's.
    let Some((b, c, s)) = (unsafe { stream::<C>(envoy, filter) }) else {
        return TrailersStatus::Continue;
    };
    guard::<C, _>(
        Some(&b.poisoned),
        || TrailersStatus::Continue,
        || b.filter.request_trailers(c, &s),
    )
}

/// `envoy_dynamic_module_on_http_filter_response_trailers`.
///
/// # Safety
/// Envoy's live stream for this hook.
pub unsafe fn response_trailers<C: HttpFilterConfig>(
    envoy: FilterEnvoyPtr,
    filter: FilterModulePtr,
) -> TrailersStatus {
    // SAFETY: the caller's.
    if let Some((b, c, s)) = unsafe { stream::<C>(envoy, filter) } {
        guard::<C, _>(
            Some(&b.poisoned),
            || (),
            || b.filter.response_trailers(c, &s),
        );
    }
    TrailersStatus::Continue
}

/// `envoy_dynamic_module_on_http_filter_stream_complete`.
///
/// # Safety
/// Envoy's live stream for this hook.
pub unsafe fn stream_complete<C: HttpFilterConfig>(envoy: FilterEnvoyPtr, filter: FilterModulePtr) {
    // SAFETY: the caller's.
    if let Some((b, c, s)) = unsafe { stream::<C>(envoy, filter) } {
        guard::<C, _>(Some(&b.poisoned), || (), || b.filter.complete(c, &s));
    }
}

/// `envoy_dynamic_module_on_http_filter_scheduled`.
///
/// # Safety
/// Envoy's live stream for this hook.
pub unsafe fn scheduled<C: HttpFilterConfig>(
    envoy: FilterEnvoyPtr,
    filter: FilterModulePtr,
    event: u64,
) {
    // SAFETY: the caller's.
    if let Some((b, c, s)) = unsafe { stream::<C>(envoy, filter) } {
        guard::<C, _>(
            Some(&b.poisoned),
            || (),
            || b.filter.scheduled(c, &s, event),
        );
    }
}

/// `envoy_dynamic_module_on_http_filter_http_stream_headers` and `_trailers`.
///
/// # Safety
/// Envoy's live stream and header array for this hook.
pub unsafe fn call_headers<C: HttpFilterConfig>(
    envoy: FilterEnvoyPtr,
    filter: FilterModulePtr,
    id: u64,
    headers: *const EnvoyHeader,
    n: usize,
) {
    // SAFETY: the caller's.
    let (f, mut lent) = unsafe { (stream::<C>(envoy, filter), header_pairs(headers, n)) };
    if let Some((b, c, _)) = f {
        guard::<C, _>(
            Some(&b.poisoned),
            || (),
            || b.filter.call_headers(c, id, &mut lent),
        );
    }
}

/// `envoy_dynamic_module_on_http_filter_http_stream_data`.
///
/// # Safety
/// Envoy's live stream and chunks for this hook.
pub unsafe fn call_data<C: HttpFilterConfig>(
    envoy: FilterEnvoyPtr,
    filter: FilterModulePtr,
    id: u64,
    data: *const EnvoyBuffer,
    n: usize,
) {
    // SAFETY: the caller's.
    let (f, mut lent) = unsafe { (stream::<C>(envoy, filter), chunks(data, n)) };
    if let Some((b, c, _)) = f {
        guard::<C, _>(
            Some(&b.poisoned),
            || (),
            || b.filter.call_data(c, id, &mut lent),
        );
    }
}

/// `envoy_dynamic_module_on_http_filter_http_stream_complete` and `_reset`.
///
/// # Safety
/// Envoy's live stream for this hook.
pub unsafe fn call_done<C: HttpFilterConfig>(
    envoy: FilterEnvoyPtr,
    filter: FilterModulePtr,
    id: u64,
    reset: Option<u32>,
) {
    // SAFETY: the caller's.
    if let Some((b, c, s)) = unsafe { stream::<C>(envoy, filter) } {
        guard::<C, _>(
            Some(&b.poisoned),
            || (),
            || b.filter.call_done(c, &s, id, reset),
        );
    }
}

/// Exports every hook Envoy resolves for an HTTP filter, for the configuration type `$config`
/// (an [`HttpFilterConfig`]). Hooks this ABI requires but filters of this kind have no use for
/// (request trailers, local replies, watermarks, one-shot callouts) do nothing.
#[macro_export]
macro_rules! export_http_filter {
    ($config:ty) => {
        mod envoy_dynamic_module_hooks {
            #![allow(clippy::undocumented_unsafe_blocks, missing_docs)]
            use super::*;
            use $crate::hooks as h;
            use $crate::sys::{
                AbiVersionPtr, BodyStatus, CalloutResult, ConfigEnvoyPtr, ConfigModulePtr,
                EnvoyBuffer, EnvoyHeader, FilterEnvoyPtr, FilterModulePtr, HeadersStatus,
                LocalReplyStatus, ResetReason, TrailersStatus,
            };
            type C = $config;

            #[no_mangle]
            pub extern "C" fn envoy_dynamic_module_on_program_init() -> AbiVersionPtr {
                h::program_init::<C>(concat!(env!("CARGO_PKG_NAME"), " ", env!("CARGO_PKG_VERSION")))
            }
            #[no_mangle]
            pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_config_new(
                envoy: ConfigEnvoyPtr, name: EnvoyBuffer, config: EnvoyBuffer,
            ) -> ConfigModulePtr {
                unsafe { h::config_new::<C>(envoy, name, config) }
            }
            #[no_mangle]
            pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_config_destroy(ptr: ConfigModulePtr) {
                unsafe { h::config_destroy::<C>(ptr) }
            }
            #[no_mangle]
            pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_config_scheduled(
                _envoy: ConfigEnvoyPtr, ptr: ConfigModulePtr, event: u64,
            ) {
                unsafe { h::config_scheduled::<C>(ptr, event) }
            }
            #[no_mangle]
            pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_config_http_stream_headers(
                _envoy: ConfigEnvoyPtr, ptr: ConfigModulePtr, id: u64, headers: *mut EnvoyHeader,
                n: usize, _end_stream: bool,
            ) {
                unsafe { h::config_call_headers::<C>(ptr, id, headers.cast_const(), n) }
            }
            #[no_mangle]
            pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_config_http_stream_data(
                _envoy: ConfigEnvoyPtr, ptr: ConfigModulePtr, id: u64, data: *const EnvoyBuffer,
                n: usize, _end_stream: bool,
            ) {
                unsafe { h::config_call_data::<C>(ptr, id, data, n) }
            }
            #[no_mangle]
            pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_config_http_stream_trailers(
                _envoy: ConfigEnvoyPtr, ptr: ConfigModulePtr, id: u64, trailers: *mut EnvoyHeader,
                n: usize,
            ) {
                unsafe { h::config_call_headers::<C>(ptr, id, trailers.cast_const(), n) }
            }
            #[no_mangle]
            pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_config_http_stream_complete(
                _envoy: ConfigEnvoyPtr, ptr: ConfigModulePtr, id: u64,
            ) {
                unsafe { h::config_call_done::<C>(ptr, id, None) }
            }
            #[no_mangle]
            pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_config_http_stream_reset(
                _envoy: ConfigEnvoyPtr, ptr: ConfigModulePtr, id: u64, reason: ResetReason,
            ) {
                unsafe { h::config_call_done::<C>(ptr, id, Some(reason.0)) }
            }
            #[no_mangle]
            pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_new(
                ptr: ConfigModulePtr, _envoy: FilterEnvoyPtr,
            ) -> FilterModulePtr {
                unsafe { h::filter_new::<C>(ptr) }
            }
            #[no_mangle]
            pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_destroy(filter: FilterModulePtr) {
                unsafe { h::filter_destroy::<C>(filter) }
            }
            #[no_mangle]
            pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_request_headers(
                envoy: FilterEnvoyPtr, filter: FilterModulePtr, end_of_stream: bool,
            ) -> HeadersStatus {
                unsafe { h::request_headers::<C>(envoy, filter, end_of_stream) }
            }
            #[no_mangle]
            pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_response_headers(
                envoy: FilterEnvoyPtr, filter: FilterModulePtr, end_of_stream: bool,
            ) -> HeadersStatus {
                unsafe { h::response_headers::<C>(envoy, filter, end_of_stream) }
            }
            #[no_mangle]
            pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_request_body(
                envoy: FilterEnvoyPtr, filter: FilterModulePtr, end_of_stream: bool,
            ) -> BodyStatus {
                unsafe { h::request_body::<C>(envoy, filter, end_of_stream) }
            }
            #[no_mangle]
            pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_response_body(
                envoy: FilterEnvoyPtr, filter: FilterModulePtr, end_of_stream: bool,
            ) -> BodyStatus {
                unsafe { h::response_body::<C>(envoy, filter, end_of_stream) }
            }
            #[no_mangle]
            pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_response_trailers(
                envoy: FilterEnvoyPtr, filter: FilterModulePtr,
            ) -> TrailersStatus {
                unsafe { h::response_trailers::<C>(envoy, filter) }
            }
            #[no_mangle]
            pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_stream_complete(
                envoy: FilterEnvoyPtr, filter: FilterModulePtr,
            ) {
                unsafe { h::stream_complete::<C>(envoy, filter) }
            }
            #[no_mangle]
            pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_scheduled(
                envoy: FilterEnvoyPtr, filter: FilterModulePtr, event: u64,
            ) {
                unsafe { h::scheduled::<C>(envoy, filter, event) }
            }
            #[no_mangle]
            pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_headers(
                envoy: FilterEnvoyPtr, filter: FilterModulePtr, id: u64, headers: *mut EnvoyHeader,
                n: usize, _end_stream: bool,
            ) {
                unsafe { h::call_headers::<C>(envoy, filter, id, headers.cast_const(), n) }
            }
            #[no_mangle]
            pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_data(
                envoy: FilterEnvoyPtr, filter: FilterModulePtr, id: u64, data: *const EnvoyBuffer,
                n: usize, _end_stream: bool,
            ) {
                unsafe { h::call_data::<C>(envoy, filter, id, data, n) }
            }
            #[no_mangle]
            pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_trailers(
                envoy: FilterEnvoyPtr, filter: FilterModulePtr, id: u64, trailers: *mut EnvoyHeader,
                n: usize,
            ) {
                unsafe { h::call_headers::<C>(envoy, filter, id, trailers.cast_const(), n) }
            }
            #[no_mangle]
            pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_complete(
                envoy: FilterEnvoyPtr, filter: FilterModulePtr, id: u64,
            ) {
                unsafe { h::call_done::<C>(envoy, filter, id, None) }
            }
            #[no_mangle]
            pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_reset(
                envoy: FilterEnvoyPtr, filter: FilterModulePtr, id: u64, reason: ResetReason,
            ) {
                unsafe { h::call_done::<C>(envoy, filter, id, Some(reason.0)) }
            }
            #[no_mangle]
            pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_request_trailers(
                envoy: FilterEnvoyPtr, filter: FilterModulePtr,
            ) -> TrailersStatus {
                unsafe { h::request_trailers::<C>(envoy, filter) }
            }
            #[no_mangle]
            pub extern "C" fn envoy_dynamic_module_on_http_filter_local_reply(
                _: FilterEnvoyPtr, _: FilterModulePtr, _code: u32, _details: EnvoyBuffer,
                _reset_imminent: bool,
            ) -> LocalReplyStatus {
                LocalReplyStatus::Continue
            }
            #[no_mangle]
            pub extern "C" fn envoy_dynamic_module_on_http_filter_downstream_above_write_buffer_high_watermark(
                _: FilterEnvoyPtr, _: FilterModulePtr,
            ) {
            }
            #[no_mangle]
            pub extern "C" fn envoy_dynamic_module_on_http_filter_downstream_below_write_buffer_low_watermark(
                _: FilterEnvoyPtr, _: FilterModulePtr,
            ) {
            }
            #[no_mangle]
            pub extern "C" fn envoy_dynamic_module_on_http_filter_http_callout_done(
                _: FilterEnvoyPtr, _: FilterModulePtr, _id: u64, _result: CalloutResult,
                _headers: *mut EnvoyHeader, _headers_size: usize, _body: *mut EnvoyBuffer,
                _body_size: usize,
            ) {
            }
        }
    };
}

// ---------------------------------------------------------------------------------------------
// Bootstrap extension
// ---------------------------------------------------------------------------------------------

/// `envoy_dynamic_module_type_event_cb`: what Envoy gives a hook to call when asynchronous work
/// it waits for is done (`void (*)(void* context)`; null-checked, so an `Option`).
pub type EventCallback = Option<unsafe extern "C" fn(*mut std::ffi::c_void)>;

/// A module's bootstrap extension (`envoy.bootstrap.dynamic_modules` in the bootstrap's
/// `bootstrap_extensions`): one per extension configuration, on Envoy's **main thread** only,
/// exported by [`export_bootstrap!`] beside the HTTP filter's hooks. Envoy holds traffic until
/// the extension says it is ready: the hooks say so as soon as [`Bootstrap::new`] returns.
pub trait Bootstrap: Sized + 'static {
    /// A new extension configuration: `name` is its `extension_name`, `config` the bytes of
    /// its `extension_config`. `None` refuses it (and with it Envoy's configuration).
    fn new(name: &[u8], config: &[u8]) -> Option<Self>;
    /// The server is up: the time to register admin endpoints ([`BootstrapHandle`]).
    fn server_initialized(&self, envoy: &BootstrapHandle);
    /// A request to an admin endpoint this extension registered: its method, its path with the
    /// query, its body. Returns the status and the response body.
    fn admin(&self, method: &[u8], path: &[u8], body: &[u8]) -> (u32, String);
    /// A hook caught a panic (the module counts them).
    fn panicked();
}

/// What Envoy holds for a bootstrap extension configuration (and its extension: the same).
struct BootstrapBox<B> {
    envoy: BootstrapHandle,
    ext: B,
}

/// Envoy's bootstrap extension configuration: valid from the extension's `config_new` to its
/// `config_destroy`, used on the main thread only (not `Send`: it stays in the hooks).
pub struct BootstrapHandle(crate::sys::BootstrapConfigEnvoyPtr);

impl BootstrapHandle {
    /// Registers the admin endpoint `path` (after the server is up), with a line of help;
    /// `mutates`: Envoy only lets `POST` requests through to it. Whether Envoy took it.
    pub fn register_admin(&self, path: &str, help: &str, mutates: bool) -> bool {
        // SAFETY: the configuration is live (hooks only), both buffers are borrowed for the
        // call (Envoy copies them).
        unsafe {
            crate::sys::envoy_dynamic_module_callback_bootstrap_extension_register_admin_handler(
                self.0,
                crate::ModuleBuffer::of(path.as_bytes()),
                crate::ModuleBuffer::of(help.as_bytes()),
                false,
                mutates,
            )
        }
    }
}

/// The extension box behind a module pointer Envoy hands back.
///
/// # Safety
/// `ptr` must come from [`bootstrap_config_new`] and not yet be destroyed.
unsafe fn bootstrap<'a, B: Bootstrap>(ptr: *const std::ffi::c_void) -> Option<&'a BootstrapBox<B>> {
    // SAFETY: the caller vouches for the pointer; null is refused.
    unsafe { ptr.cast::<BootstrapBox<B>>().as_ref() }
}

/// `envoy_dynamic_module_on_bootstrap_extension_config_new`: the extension, and Envoy told it
/// is ready.
///
/// # Safety
/// Envoy's configuration pointer and buffers, valid for the call.
pub unsafe fn bootstrap_config_new<B: Bootstrap>(
    envoy: crate::sys::BootstrapConfigEnvoyPtr,
    name: EnvoyBuffer,
    config: EnvoyBuffer,
) -> crate::sys::BootstrapConfigModulePtr {
    caught(B::panicked, null, || {
        // SAFETY: both buffers are Envoy's, valid during this call; they are copied.
        let (name, config) = unsafe { (name.bytes(), config.bytes()) };
        let Some(ext) = B::new(name, config) else {
            return null();
        };
        // SAFETY: Envoy's live configuration, in its config_new hook (main thread).
        unsafe {
            crate::sys::envoy_dynamic_module_callback_bootstrap_extension_config_signal_init_complete(envoy)
        };
        let b = BootstrapBox {
            envoy: BootstrapHandle(envoy),
            ext,
        };
        Box::into_raw(Box::new(b)).cast_const().cast()
    })
}

/// `envoy_dynamic_module_on_bootstrap_extension_config_destroy`.
///
/// # Safety
/// Called by Envoy once per configuration.
pub unsafe fn bootstrap_config_destroy<B: Bootstrap>(ptr: crate::sys::BootstrapConfigModulePtr) {
    caught(
        B::panicked,
        || (),
        || {
            if !ptr.is_null() {
                // SAFETY: made by Box::into_raw in bootstrap_config_new; destroyed once.
                drop(unsafe { Box::from_raw(ptr.cast_mut().cast::<BootstrapBox<B>>()) });
            }
        },
    )
}

/// `envoy_dynamic_module_on_bootstrap_extension_server_initialized`. The extension pointer is
/// the configuration's ([`bootstrap_config_new`]'s box): `bootstrap_extension_new` hands it
/// back as is.
///
/// # Safety
/// A live configuration.
pub unsafe fn bootstrap_server_initialized<B: Bootstrap>(ptr: crate::sys::BootstrapModulePtr) {
    // SAFETY: the caller's.
    if let Some(b) = unsafe { bootstrap::<B>(ptr) } {
        caught(B::panicked, || (), || b.ext.server_initialized(&b.envoy));
    }
}

/// `envoy_dynamic_module_on_bootstrap_extension_admin_request`: the extension's answer, its
/// body set through Envoy; a panic answers 500.
///
/// # Safety
/// Envoy's live configuration pointers and buffers, valid for the call.
pub unsafe fn bootstrap_admin_request<B: Bootstrap>(
    envoy: crate::sys::BootstrapConfigEnvoyPtr,
    ptr: crate::sys::BootstrapConfigModulePtr,
    method: EnvoyBuffer,
    path: EnvoyBuffer,
    body: EnvoyBuffer,
) -> u32 {
    // SAFETY: the caller's.
    let Some(b) = (unsafe { bootstrap::<B>(ptr) }) else {
        return 500;
    };
    let (status, answer) = caught(
        B::panicked,
        || (500, "the rate limiter's admin handler failed\n".to_string()),
        || {
            // SAFETY: Envoy's buffers, valid during this call.
            let (m, p, body) = unsafe { (method.bytes(), path.bytes(), body.bytes()) };
            b.ext.admin(m, p, body)
        },
    );
    // SAFETY: inside the admin_request hook, as Envoy requires; Envoy copies the body.
    unsafe {
        crate::sys::envoy_dynamic_module_callback_bootstrap_extension_admin_set_response(
            envoy,
            crate::ModuleBuffer::of(answer.as_bytes()),
        )
    };
    status
}

/// `envoy_dynamic_module_on_bootstrap_extension_shutdown`: nothing to clean up; Envoy waits
/// for the completion callback, which is called at once.
///
/// # Safety
/// Envoy's callback and its context.
pub unsafe fn bootstrap_shutdown(done: EventCallback, context: *mut std::ffi::c_void) {
    if let Some(done) = done {
        // SAFETY: Envoy's completion callback, called exactly once with its own context.
        unsafe { done(context) }
    }
}

/// Exports every hook Envoy resolves for a bootstrap extension (it requires them all), for
/// the type `$ext` (a [`Bootstrap`]). The hooks it has no use for (events it never asked for:
/// timers, file changes, callouts, cluster and listener changes; workers starting, draining)
/// do nothing. Use it beside [`export_http_filter!`], which exports `on_program_init`.
#[macro_export]
macro_rules! export_bootstrap {
    ($ext:ty) => {
        mod envoy_dynamic_module_bootstrap_hooks {
            #![allow(clippy::undocumented_unsafe_blocks, missing_docs)]
            use super::*;
            use ::std::ffi::c_void;
            use $crate::hooks as h;
            use $crate::hooks::EventCallback;
            use $crate::sys::{
                BootstrapConfigEnvoyPtr, BootstrapConfigModulePtr, BootstrapEnvoyPtr,
                BootstrapModulePtr, BootstrapTimerPtr, CalloutResult, EnvoyBuffer, EnvoyHeader,
            };
            type B = $ext;

            #[no_mangle]
            pub unsafe extern "C" fn envoy_dynamic_module_on_bootstrap_extension_config_new(
                envoy: BootstrapConfigEnvoyPtr,
                name: EnvoyBuffer,
                config: EnvoyBuffer,
            ) -> BootstrapConfigModulePtr {
                unsafe { h::bootstrap_config_new::<B>(envoy, name, config) }
            }
            #[no_mangle]
            pub unsafe extern "C" fn envoy_dynamic_module_on_bootstrap_extension_config_destroy(
                ptr: BootstrapConfigModulePtr,
            ) {
                unsafe { h::bootstrap_config_destroy::<B>(ptr) }
            }
            #[no_mangle]
            pub extern "C" fn envoy_dynamic_module_on_bootstrap_extension_new(
                config: BootstrapConfigModulePtr,
                _envoy: BootstrapEnvoyPtr,
            ) -> BootstrapModulePtr {
                config
            }
            #[no_mangle]
            pub unsafe extern "C" fn envoy_dynamic_module_on_bootstrap_extension_server_initialized(
                _envoy: BootstrapEnvoyPtr,
                ext: BootstrapModulePtr,
            ) {
                unsafe { h::bootstrap_server_initialized::<B>(ext) }
            }
            #[no_mangle]
            pub extern "C" fn envoy_dynamic_module_on_bootstrap_extension_worker_thread_initialized(
                _envoy: BootstrapEnvoyPtr,
                _ext: BootstrapModulePtr,
            ) {
            }
            #[no_mangle]
            pub extern "C" fn envoy_dynamic_module_on_bootstrap_extension_drain_started(
                _envoy: BootstrapEnvoyPtr,
                _ext: BootstrapModulePtr,
            ) {
            }
            #[no_mangle]
            pub unsafe extern "C" fn envoy_dynamic_module_on_bootstrap_extension_shutdown(
                _envoy: BootstrapEnvoyPtr,
                _ext: BootstrapModulePtr,
                done: EventCallback,
                context: *mut c_void,
            ) {
                unsafe { h::bootstrap_shutdown(done, context) }
            }
            #[no_mangle]
            pub extern "C" fn envoy_dynamic_module_on_bootstrap_extension_destroy(
                _ext: BootstrapModulePtr,
            ) {
            }
            #[no_mangle]
            pub extern "C" fn envoy_dynamic_module_on_bootstrap_extension_config_scheduled(
                _envoy: BootstrapConfigEnvoyPtr,
                _config: BootstrapConfigModulePtr,
                _event: u64,
            ) {
            }
            #[no_mangle]
            pub extern "C" fn envoy_dynamic_module_on_bootstrap_extension_timer_fired(
                _envoy: BootstrapConfigEnvoyPtr,
                _config: BootstrapConfigModulePtr,
                _timer: BootstrapTimerPtr,
            ) {
            }
            #[no_mangle]
            pub extern "C" fn envoy_dynamic_module_on_bootstrap_extension_file_changed(
                _envoy: BootstrapConfigEnvoyPtr,
                _config: BootstrapConfigModulePtr,
                _path: EnvoyBuffer,
                _events: u32,
            ) {
            }
            #[no_mangle]
            pub extern "C" fn envoy_dynamic_module_on_bootstrap_extension_cluster_add_or_update(
                _envoy: BootstrapConfigEnvoyPtr,
                _config: BootstrapConfigModulePtr,
                _name: EnvoyBuffer,
            ) {
            }
            #[no_mangle]
            pub extern "C" fn envoy_dynamic_module_on_bootstrap_extension_cluster_removal(
                _envoy: BootstrapConfigEnvoyPtr,
                _config: BootstrapConfigModulePtr,
                _name: EnvoyBuffer,
            ) {
            }
            #[no_mangle]
            pub extern "C" fn envoy_dynamic_module_on_bootstrap_extension_listener_add_or_update(
                _envoy: BootstrapConfigEnvoyPtr,
                _config: BootstrapConfigModulePtr,
                _name: EnvoyBuffer,
            ) {
            }
            #[no_mangle]
            pub extern "C" fn envoy_dynamic_module_on_bootstrap_extension_listener_removal(
                _envoy: BootstrapConfigEnvoyPtr,
                _config: BootstrapConfigModulePtr,
                _name: EnvoyBuffer,
            ) {
            }
            #[no_mangle]
            pub extern "C" fn envoy_dynamic_module_on_bootstrap_extension_http_callout_done(
                _envoy: BootstrapConfigEnvoyPtr,
                _config: BootstrapConfigModulePtr,
                _id: u64,
                _result: CalloutResult,
                _headers: *mut EnvoyHeader,
                _headers_size: usize,
                _body: *mut EnvoyBuffer,
                _body_size: usize,
            ) {
            }
            #[no_mangle]
            pub unsafe extern "C" fn envoy_dynamic_module_on_bootstrap_extension_admin_request(
                envoy: BootstrapConfigEnvoyPtr,
                config: BootstrapConfigModulePtr,
                method: EnvoyBuffer,
                path: EnvoyBuffer,
                body: EnvoyBuffer,
            ) -> u32 {
                unsafe { h::bootstrap_admin_request::<B>(envoy, config, method, path, body) }
            }
        }
    };
}

#[cfg(test)]
#[allow(clippy::panic, clippy::unwrap_used, clippy::undocumented_unsafe_blocks)]
mod tests {
    //! The guards, without Envoy: a fake configuration whose filter panics where told, driven
    //! through the hooks as Envoy drives them (no hook here calls back into Envoy).
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    static PANICS: AtomicUsize = AtomicUsize::new(0);

    struct Fake {
        /// Where the filter panics: "new_filter", "request_headers", "request_body",
        /// "response_headers".
        panic_in: &'static str,
    }

    struct FakeFilter {
        panic_in: &'static str,
        calls: Cell<usize>,
    }

    impl FakeFilter {
        fn call(&self, hook: &str) {
            self.calls.set(self.calls.get() + 1);
            if self.panic_in == hook {
                panic!("{hook} panics");
            }
        }
    }

    impl HttpFilterConfig for Fake {
        type Filter = FakeFilter;
        fn program_init() -> bool {
            true
        }
        fn panicked() {
            PANICS.fetch_add(1, Ordering::SeqCst);
        }
        fn new(_: ConfigHandle, _: &[u8], _: &[u8]) -> Option<Self> {
            None
        }
        fn new_filter(&self) -> FakeFilter {
            if self.panic_in == "new_filter" {
                panic!("new_filter panics");
            }
            FakeFilter {
                panic_in: self.panic_in,
                calls: Cell::new(0),
            }
        }
        fn scheduled(&self, _: u64) {}
        fn call_headers(&self, _: u64, _: Fields<'_, '_>) {}
        fn call_data(&self, _: u64, _: Chunks<'_, '_>) {}
        fn call_done(&self, _: u64, _: Option<u32>) {}
    }

    impl HttpFilter for FakeFilter {
        type Config = Fake;
        fn request_headers(&self, _: &Fake, _: &Stream, _: bool) -> HeadersStatus {
            self.call("request_headers");
            HeadersStatus::Continue
        }
        fn request_headers_failed(_: &Fake, _: &Stream) -> HeadersStatus {
            HeadersStatus::StopIteration // what `failure_mode: deny` answers
        }
        fn request_body(&self, _: &Fake, _: &Stream, end_of_stream: bool) -> BodyStatus {
            self.call("request_body");
            if end_of_stream {
                BodyStatus::Continue
            } else {
                BodyStatus::StopIterationAndBuffer
            }
        }
        fn response_headers(&self, _: &Fake, _: &Stream, _: bool) -> HeadersStatus {
            self.call("response_headers");
            HeadersStatus::Continue
        }
        fn response_body(&self, _: &Fake, _: &Stream, _: bool) {
            self.call("response_body");
        }
        fn response_trailers(&self, _: &Fake, _: &Stream) {
            self.call("response_trailers");
        }
        fn scheduled(&self, _: &Fake, _: &Stream, _: u64) {
            self.call("scheduled");
        }
        fn call_headers(&self, _: &Fake, _: u64, _: Fields<'_, '_>) {
            self.call("call_headers");
        }
        fn call_data(&self, _: &Fake, _: u64, _: Chunks<'_, '_>) {
            self.call("call_data");
        }
        fn call_done(&self, _: &Fake, _: &Stream, _: u64, _: Option<u32>) {
            self.call("call_done");
        }
        fn complete(&self, _: &Fake, _: &Stream) {
            self.call("complete");
        }
    }

    fn calls(filter: FilterModulePtr) -> usize {
        unsafe { &*filter.cast::<StreamBox<Fake>>() }
            .filter
            .calls
            .get()
    }

    /// Every hook of one stream, as Envoy calls them; returns what request_headers and the
    /// first request_body (not the end of the stream) answered.
    fn drive(filter: FilterModulePtr) -> (HeadersStatus, BodyStatus) {
        let envoy = std::ptr::null_mut();
        unsafe {
            let status = request_headers::<Fake>(envoy, filter, false);
            let body = request_body::<Fake>(envoy, filter, false);
            request_body::<Fake>(envoy, filter, true);
            response_headers::<Fake>(envoy, filter, false);
            response_body::<Fake>(envoy, filter, true);
            response_trailers::<Fake>(envoy, filter);
            scheduled::<Fake>(envoy, filter, 1);
            call_headers::<Fake>(envoy, filter, 1, std::ptr::null(), 0);
            call_data::<Fake>(envoy, filter, 1, std::ptr::null(), 0);
            call_done::<Fake>(envoy, filter, 1, None);
            stream_complete::<Fake>(envoy, filter);
            (status, body)
        }
    }

    #[test]
    fn a_panicking_hook_poisons_its_stream_and_the_request_follows_the_fallback() {
        let quiet = std::panic::take_hook();
        std::panic::set_hook(Box::new(|_| {}));
        use BodyStatus::{Continue, StopIterationAndBuffer};
        for (panic_in, status, calls_made) in [
            (
                "nowhere",
                (HeadersStatus::Continue, StopIterationAndBuffer),
                11,
            ),
            // The request gets what request_headers_failed says; nothing else is called.
            (
                "request_headers",
                (HeadersStatus::StopIteration, Continue),
                1,
            ),
            // The request body goes on (what was held with it); nothing else is called.
            ("request_body", (HeadersStatus::Continue, Continue), 2),
            // The request went on; the hooks after the panic are not called.
            (
                "response_headers",
                (HeadersStatus::Continue, StopIterationAndBuffer),
                4,
            ),
        ] {
            let config = Box::new(Fake { panic_in });
            let ptr: ConfigModulePtr = std::ptr::from_ref(&*config).cast();
            let before = PANICS.load(Ordering::SeqCst);
            let filter = unsafe { filter_new::<Fake>(ptr) };
            assert!(!filter.is_null());
            assert_eq!(drive(filter), status, "{panic_in}");
            assert_eq!(calls(filter), calls_made, "{panic_in}");
            let panicked = usize::from(panic_in != "nowhere");
            assert_eq!(
                PANICS.load(Ordering::SeqCst) - before,
                panicked,
                "{panic_in}"
            );
            unsafe { filter_destroy::<Fake>(filter) };
        }
        // A stream whose filter cannot be made is null for Envoy, and counted.
        let config = Box::new(Fake {
            panic_in: "new_filter",
        });
        let before = PANICS.load(Ordering::SeqCst);
        let filter = unsafe { filter_new::<Fake>(std::ptr::from_ref(&*config).cast()) };
        assert!(filter.is_null());
        assert_eq!(PANICS.load(Ordering::SeqCst) - before, 1);
        // Hooks given a null stream or configuration do nothing.
        assert_eq!(
            drive(std::ptr::null()),
            (HeadersStatus::Continue, BodyStatus::Continue)
        );
        assert!(unsafe { filter_new::<Fake>(std::ptr::null()) }.is_null());
        std::panic::set_hook(quiet);
    }
}
