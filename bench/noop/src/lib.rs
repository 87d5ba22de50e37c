//! A proxy-wasm HTTP filter that lets every request through untouched: what any Rust wasm
//! filter costs before it does any work.

use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::ContextType;

proxy_wasm::main! {{
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(Noop) });
}}

struct Noop;

impl Context for Noop {}

impl RootContext for Noop {
    fn create_http_context(&self, _: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(Noop))
    }
    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

impl HttpContext for Noop {}
