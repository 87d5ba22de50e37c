//! The few Envoy dynamic-module ABI declarations this bench module needs, copied from the
//! hand-written declarations checked against Envoy 1.40.0 (ABI "v0.2.0", x86-64 Linux).
//! Source of truth: `source/extensions/dynamic_modules/abi/abi.h` in envoyproxy/envoy; a
//! signature mismatch is NOT caught at load time, so pin the Envoy version.

use std::os::raw::{c_char, c_void};

/// Envoy-owned bytes, valid until the current hook returns.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct EnvoyBuffer {
    pub ptr: *const c_char,
    pub length: usize,
}

/// Module-owned bytes, read (and copied) by Envoy during the call only.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ModuleBuffer {
    pub ptr: *const c_char,
    pub length: usize,
}

impl ModuleBuffer {
    pub fn new(b: &[u8]) -> Self {
        ModuleBuffer { ptr: b.as_ptr() as *const c_char, length: b.len() }
    }
}

pub type ConfigEnvoyPtr = *mut c_void;
pub type ConfigModulePtr = *const c_void;
pub type FilterEnvoyPtr = *mut c_void;
pub type FilterModulePtr = *const c_void;

/// `envoy_dynamic_module_type_http_header_type`
#[allow(dead_code)]
#[repr(C)]
#[derive(Clone, Copy)]
pub enum HeaderType {
    RequestHeader = 0,
    RequestTrailer = 1,
    ResponseHeader = 2,
    ResponseTrailer = 3,
}

/// `envoy_dynamic_module_type_attribute_id` value for `source.address`
/// ("IP:PORT", IPv6 as "[addr]:PORT").
pub const ATTRIBUTE_SOURCE_ADDRESS: u32 = 24;

/// FilterHeadersStatus / FilterDataStatus / FilterTrailersStatus: 0 = Continue for all.
pub const CONTINUE: u32 = 0;

unsafe extern "C" {
    pub fn envoy_dynamic_module_callback_http_filter_get_attribute_string(
        filter_envoy_ptr: FilterEnvoyPtr,
        attribute_id: u32,
        result: *mut EnvoyBuffer,
    ) -> bool;

    /// Appends a header value (copied). `header_type` selects the map.
    pub fn envoy_dynamic_module_callback_http_add_header(
        filter_envoy_ptr: FilterEnvoyPtr,
        header_type: HeaderType,
        key: ModuleBuffer,
        value: ModuleBuffer,
    ) -> bool;
}
