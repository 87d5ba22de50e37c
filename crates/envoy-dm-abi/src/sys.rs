//! The raw ABI: the types and callbacks of Envoy's `abi.h` that this crate uses, written by hand
//! from the vendored declarations in `abi/<envoy-version>/abi.decl` and checked against
//! every vendored release by `header_check.rs` (signatures, enum values, struct layouts). The
//! module itself goes through the safe API of the crate root; this module is public for
//! `bench/floor-native`, which measures the least a dynamic module can do per request.
//!
//! One set of declarations serves every supported release: the declarations the crate uses are
//! identical in the 1.39.3 and 1.40.0 headers (the test checks both). `ENVOY_VERSION` at build
//! time only selects [`ABI_VERSION`] and [`MARKER`] (see `build.rs`).
//!
//! Values Envoy hands to the module (results, reasons) are `u32` newtypes, not Rust enums: a
//! value a newer Envoy added would be undefined behaviour in a Rust enum.
#![allow(non_camel_case_types)]

use std::ffi::c_void;
use std::os::raw::c_char;

include!(concat!(env!("OUT_DIR"), "/abi_selection.rs"));

// --------------------------------------------------------------------------------------------
// Types
// --------------------------------------------------------------------------------------------

/// `envoy_dynamic_module_type_abi_version_module_ptr`.
pub type AbiVersionPtr = *const c_char;
/// `envoy_dynamic_module_type_http_filter_config_envoy_ptr`: Envoy's side of a configuration.
pub type ConfigEnvoyPtr = *mut c_void;
/// `envoy_dynamic_module_type_http_filter_config_module_ptr`: the module's side.
pub type ConfigModulePtr = *const c_void;
/// `envoy_dynamic_module_type_http_filter_envoy_ptr`: Envoy's side of a stream.
pub type FilterEnvoyPtr = *mut c_void;
/// `envoy_dynamic_module_type_http_filter_module_ptr`: the module's side of a stream.
pub type FilterModulePtr = *const c_void;
/// `envoy_dynamic_module_type_http_filter_scheduler_module_ptr`.
pub type SchedulerPtr = *mut c_void;
/// `envoy_dynamic_module_type_http_filter_config_scheduler_module_ptr`.
pub type ConfigSchedulerPtr = *mut c_void;

/// `envoy_dynamic_module_type_envoy_buffer`: bytes Envoy lends.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct EnvoyBuffer {
    pub ptr: *const c_char,
    pub length: usize,
}

/// `envoy_dynamic_module_type_module_buffer`: bytes the module lends for one call.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ModuleBuffer {
    pub ptr: *const c_char,
    pub length: usize,
}

/// `envoy_dynamic_module_type_module_http_header`: a header the module lends.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ModuleHeader {
    pub key_ptr: *const c_char,
    pub key_length: usize,
    pub value_ptr: *const c_char,
    pub value_length: usize,
}

/// `envoy_dynamic_module_type_envoy_http_header`: a header Envoy lends.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct EnvoyHeader {
    pub key_ptr: *const c_char,
    pub key_length: usize,
    pub value_ptr: *const c_char,
    pub value_length: usize,
}

/// `envoy_dynamic_module_type_http_header_type` (the maps this crate uses).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HeaderType {
    RequestHeader = 0,
    ResponseHeader = 2,
    ResponseTrailer = 3,
}

/// `envoy_dynamic_module_type_http_body_type`: which body a body callback reads. Only the
/// module hands it to Envoy, so a Rust enum.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BodyType {
    /// The request body piece of the current request body hook (none outside it).
    ReceivedRequestBody = 0,
    /// The request body held so far (by `StopIterationAndBuffer`), without the current piece:
    /// it joins after the hook.
    BufferedRequestBody = 1,
    /// The response body piece of the current response body hook (none outside it).
    ReceivedResponseBody = 2,
    /// The response body held so far, likewise.
    BufferedResponseBody = 3,
}

/// `envoy_dynamic_module_type_metadata_source`: where a metadata getter looks. The module hands
/// it to Envoy, so a Rust enum.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MetadataSource {
    /// The stream's dynamic metadata (what filters before this one set).
    Dynamic = 0,
    /// The route's metadata.
    Route = 1,
    /// The cluster's metadata.
    Cluster = 2,
    /// The upstream host's metadata.
    Host = 3,
    /// The upstream host's locality metadata.
    HostLocality = 4,
}

/// `envoy_dynamic_module_type_log_level` (spdlog's levels).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogLevel {
    Trace = 0,
    Debug = 1,
    Info = 2,
    Warn = 3,
    Error = 4,
    Critical = 5,
}

/// `envoy_dynamic_module_type_on_http_filter_{request,response}_headers_status`: what a header
/// hook tells Envoy.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HeadersStatus {
    /// Go on with the next filter.
    Continue = 0,
    /// Wait: the module continues the stream later (or has replied).
    StopIteration = 1,
}

/// `envoy_dynamic_module_type_on_http_filter_{request,response}_body_status`: what a body hook
/// tells Envoy.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BodyStatus {
    /// Pass this piece on (and, after headers that stopped, the headers and what was buffered).
    Continue = 0,
    /// Hold the piece: Envoy buffers it and calls the hook again with the next one. Past the
    /// connection's buffer limit (1 MiB by default) Envoy answers a request 413 itself.
    StopIterationAndBuffer = 1,
    /// Hold the piece, buffering with flow control (watermarks) instead of a limit.
    StopIterationAndWatermark = 2,
    /// Hold without buffering: the module continues the stream itself.
    StopIterationNoBuffer = 3,
}

/// `envoy_dynamic_module_type_on_http_filter_{request,response}_trailers_status`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TrailersStatus {
    Continue = 0,
    /// Wait: the module continues the stream later (or has replied).
    StopIteration = 1,
}

/// `envoy_dynamic_module_type_on_http_filter_local_reply_status`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LocalReplyStatus {
    Continue = 0,
}

/// `envoy_dynamic_module_type_attribute_id`.
#[repr(transparent)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttributeId(pub u32);

/// `request.path` (query included).
pub const REQUEST_PATH: AttributeId = AttributeId(0);
/// `request.host`.
pub const REQUEST_HOST: AttributeId = AttributeId(2);
/// `request.method`.
pub const REQUEST_METHOD: AttributeId = AttributeId(4);
/// `source.address`: `ip:port`, `[ipv6]:port`.
pub const SOURCE_ADDRESS: AttributeId = AttributeId(24);

/// `envoy_dynamic_module_type_metrics_result` and `envoy_dynamic_module_type_http_callout_init_result`:
/// results Envoy returns.
#[repr(transparent)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Code(pub u32);

/// Both result enums' `Success`.
pub const SUCCESS: Code = Code(0);

/// `envoy_dynamic_module_type_http_stream_reset_reason`: why a call's stream was reset.
#[repr(transparent)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ResetReason(pub u32);

/// `envoy_dynamic_module_type_http_callout_result`: how a one-shot callout ended.
#[repr(transparent)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CalloutResult(pub u32);

// --------------------------------------------------------------------------------------------
// Callbacks (implemented by Envoy)
// --------------------------------------------------------------------------------------------

extern "C" {
    pub fn envoy_dynamic_module_callback_log(level: LogLevel, message: ModuleBuffer);
    pub fn envoy_dynamic_module_callback_log_enabled(level: LogLevel) -> bool;

    pub fn envoy_dynamic_module_callback_http_filter_config_define_counter(
        filter_config_envoy_ptr: ConfigEnvoyPtr,
        name: ModuleBuffer,
        label_names: *mut ModuleBuffer,
        label_names_length: usize,
        counter_id_ptr: *mut usize,
    ) -> Code;
    pub fn envoy_dynamic_module_callback_http_filter_config_define_gauge(
        filter_config_envoy_ptr: ConfigEnvoyPtr,
        name: ModuleBuffer,
        label_names: *mut ModuleBuffer,
        label_names_length: usize,
        gauge_id_ptr: *mut usize,
    ) -> Code;
    pub fn envoy_dynamic_module_callback_http_filter_config_increment_counter(
        filter_config_envoy_ptr: ConfigEnvoyPtr,
        id: usize,
        label_values: *mut ModuleBuffer,
        label_values_length: usize,
        value: u64,
    ) -> Code;
    pub fn envoy_dynamic_module_callback_http_filter_config_increment_gauge(
        filter_config_envoy_ptr: ConfigEnvoyPtr,
        id: usize,
        label_values: *mut ModuleBuffer,
        label_values_length: usize,
        value: u64,
    ) -> Code;
    pub fn envoy_dynamic_module_callback_http_filter_config_decrement_gauge(
        filter_config_envoy_ptr: ConfigEnvoyPtr,
        id: usize,
        label_values: *mut ModuleBuffer,
        label_values_length: usize,
        value: u64,
    ) -> Code;
    pub fn envoy_dynamic_module_callback_http_filter_config_set_gauge(
        filter_config_envoy_ptr: ConfigEnvoyPtr,
        id: usize,
        label_values: *mut ModuleBuffer,
        label_values_length: usize,
        value: u64,
    ) -> Code;

    pub fn envoy_dynamic_module_callback_http_get_header(
        filter_envoy_ptr: FilterEnvoyPtr,
        header_type: HeaderType,
        key: ModuleBuffer,
        result_buffer: *mut EnvoyBuffer,
        index: usize,
        optional_size: *mut usize,
    ) -> bool;
    pub fn envoy_dynamic_module_callback_http_add_header(
        filter_envoy_ptr: FilterEnvoyPtr,
        header_type: HeaderType,
        key: ModuleBuffer,
        value: ModuleBuffer,
    ) -> bool;
    pub fn envoy_dynamic_module_callback_http_set_header(
        filter_envoy_ptr: FilterEnvoyPtr,
        header_type: HeaderType,
        key: ModuleBuffer,
        value: ModuleBuffer,
    ) -> bool;
    pub fn envoy_dynamic_module_callback_http_send_response(
        filter_envoy_ptr: FilterEnvoyPtr,
        status_code: u32,
        headers_vector: *mut ModuleHeader,
        headers_vector_size: usize,
        body: ModuleBuffer,
        details: ModuleBuffer,
    );
    pub fn envoy_dynamic_module_callback_http_get_body_size(
        filter_envoy_ptr: FilterEnvoyPtr,
        body_type: BodyType,
    ) -> usize;
    pub fn envoy_dynamic_module_callback_http_get_body_chunks_size(
        filter_envoy_ptr: FilterEnvoyPtr,
        body_type: BodyType,
    ) -> usize;
    pub fn envoy_dynamic_module_callback_http_get_body_chunks(
        filter_envoy_ptr: FilterEnvoyPtr,
        body_type: BodyType,
        result_buffer_vector: *mut EnvoyBuffer,
    ) -> bool;
    pub fn envoy_dynamic_module_callback_http_set_dynamic_metadata_number(
        filter_envoy_ptr: FilterEnvoyPtr,
        ns: ModuleBuffer,
        key: ModuleBuffer,
        value: f64,
    );
    pub fn envoy_dynamic_module_callback_http_set_dynamic_metadata_string(
        filter_envoy_ptr: FilterEnvoyPtr,
        ns: ModuleBuffer,
        key: ModuleBuffer,
        value: ModuleBuffer,
    );
    pub fn envoy_dynamic_module_callback_http_get_metadata_number(
        filter_envoy_ptr: FilterEnvoyPtr,
        metadata_source: MetadataSource,
        ns: ModuleBuffer,
        key: ModuleBuffer,
        result: *mut f64,
    ) -> bool;
    pub fn envoy_dynamic_module_callback_http_get_metadata_string(
        filter_envoy_ptr: FilterEnvoyPtr,
        metadata_source: MetadataSource,
        ns: ModuleBuffer,
        key: ModuleBuffer,
        result: *mut EnvoyBuffer,
    ) -> bool;
    pub fn envoy_dynamic_module_callback_http_get_filter_state_bytes(
        filter_envoy_ptr: FilterEnvoyPtr,
        key: ModuleBuffer,
        result: *mut EnvoyBuffer,
    ) -> bool;

    pub fn envoy_dynamic_module_callback_http_filter_scheduler_new(
        filter_envoy_ptr: FilterEnvoyPtr,
    ) -> SchedulerPtr;
    pub fn envoy_dynamic_module_callback_http_filter_scheduler_commit(
        scheduler_module_ptr: SchedulerPtr,
        event_id: u64,
    );
    pub fn envoy_dynamic_module_callback_http_filter_scheduler_delete(
        scheduler_module_ptr: SchedulerPtr,
    );
    pub fn envoy_dynamic_module_callback_http_filter_config_scheduler_new(
        filter_config_envoy_ptr: ConfigEnvoyPtr,
    ) -> ConfigSchedulerPtr;
    pub fn envoy_dynamic_module_callback_http_filter_config_scheduler_delete(
        scheduler_module_ptr: ConfigSchedulerPtr,
    );
    pub fn envoy_dynamic_module_callback_http_filter_config_scheduler_commit(
        scheduler_module_ptr: ConfigSchedulerPtr,
        event_id: u64,
    );

    pub fn envoy_dynamic_module_callback_http_filter_get_attribute_string(
        filter_envoy_ptr: FilterEnvoyPtr,
        attribute_id: AttributeId,
        result: *mut EnvoyBuffer,
    ) -> bool;

    pub fn envoy_dynamic_module_callback_http_filter_start_http_stream(
        filter_envoy_ptr: FilterEnvoyPtr,
        stream_id_out: *mut u64,
        cluster_name: ModuleBuffer,
        headers: *mut ModuleHeader,
        headers_size: usize,
        body: ModuleBuffer,
        end_stream: bool,
        timeout_milliseconds: u64,
    ) -> Code;
    pub fn envoy_dynamic_module_callback_http_filter_config_start_http_stream(
        filter_config_envoy_ptr: ConfigEnvoyPtr,
        stream_id_out: *mut u64,
        cluster_name: ModuleBuffer,
        headers: *mut ModuleHeader,
        headers_size: usize,
        body: ModuleBuffer,
        end_stream: bool,
        timeout_milliseconds: u64,
    ) -> Code;
    pub fn envoy_dynamic_module_callback_http_filter_continue_decoding(
        filter_envoy_ptr: FilterEnvoyPtr,
    );
}
