//! The part of Envoy's rate limit service API (`envoy.service.ratelimit.v3`) this server speaks,
//! as prost messages written out by hand from the protocol's `.proto` files (field numbers and
//! enum values as published), and the gRPC service around `ShouldRateLimit`. Fields the server
//! never reads are left out (prost skips them when decoding); fields it never writes too. This
//! replaces a crate that generates every message of Envoy's API, most of the server's build.

use std::sync::Arc;
use tonic::codegen::{http, Body, BoxFuture, Context, Poll, Service, StdError};

/// `RateLimitRequest`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct RateLimitRequest {
    #[prost(string, tag = "1")]
    pub domain: String,
    #[prost(message, repeated, tag = "2")]
    pub descriptors: Vec<RateLimitDescriptor>,
    #[prost(uint32, tag = "3")]
    pub hits_addend: u32,
}

/// `envoy.extensions.common.ratelimit.v3.RateLimitDescriptor` (its entries and its own
/// `hits_addend`).
#[derive(Clone, PartialEq, prost::Message)]
pub struct RateLimitDescriptor {
    #[prost(message, repeated, tag = "1")]
    pub entries: Vec<Entry>,
    #[prost(message, optional, tag = "3")]
    pub hits_addend: Option<UInt64Value>,
}

/// `google.protobuf.UInt64Value`.
#[derive(Clone, Copy, PartialEq, prost::Message)]
pub struct UInt64Value {
    #[prost(uint64, tag = "1")]
    pub value: u64,
}

/// `RateLimitDescriptor.Entry`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Entry {
    #[prost(string, tag = "1")]
    pub key: String,
    #[prost(string, tag = "2")]
    pub value: String,
}

/// `RateLimitResponse`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct RateLimitResponse {
    #[prost(enumeration = "Code", tag = "1")]
    pub overall_code: i32,
    #[prost(message, repeated, tag = "2")]
    pub statuses: Vec<DescriptorStatus>,
    #[prost(message, repeated, tag = "3")]
    pub response_headers_to_add: Vec<HeaderValue>,
}

/// `RateLimitResponse.Code`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, prost::Enumeration)]
#[repr(i32)]
pub enum Code {
    Unknown = 0,
    Ok = 1,
    OverLimit = 2,
}

/// `RateLimitResponse.DescriptorStatus`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct DescriptorStatus {
    #[prost(enumeration = "Code", tag = "1")]
    pub code: i32,
    #[prost(message, optional, tag = "2")]
    pub current_limit: Option<RateLimit>,
    #[prost(uint32, tag = "3")]
    pub limit_remaining: u32,
    #[prost(message, optional, tag = "4")]
    pub duration_until_reset: Option<PbDuration>,
}

/// `RateLimitResponse.RateLimit`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct RateLimit {
    #[prost(string, tag = "3")]
    pub name: String,
    #[prost(uint32, tag = "1")]
    pub requests_per_unit: u32,
    #[prost(enumeration = "Unit", tag = "2")]
    pub unit: i32,
}

/// `RateLimitResponse.RateLimit.Unit`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, prost::Enumeration)]
#[repr(i32)]
pub enum Unit {
    Unknown = 0,
    Second = 1,
    Minute = 2,
    Hour = 3,
    Day = 4,
    Month = 5,
    Year = 6,
    Week = 7,
}

/// `envoy.config.core.v3.HeaderValue`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct HeaderValue {
    #[prost(string, tag = "1")]
    pub key: String,
    #[prost(string, tag = "2")]
    pub value: String,
}

/// `google.protobuf.Duration`.
#[derive(Clone, Copy, PartialEq, prost::Message)]
pub struct PbDuration {
    #[prost(int64, tag = "1")]
    pub seconds: i64,
    #[prost(int32, tag = "2")]
    pub nanos: i32,
}

/// What answers `ShouldRateLimit`.
#[tonic::async_trait]
pub trait RateLimitService: Send + Sync + 'static {
    async fn should_rate_limit(
        &self,
        request: tonic::Request<RateLimitRequest>,
    ) -> Result<tonic::Response<RateLimitResponse>, tonic::Status>;
}

/// The gRPC service `envoy.service.ratelimit.v3.RateLimitService` over `T`.
pub struct RateLimitServiceServer<T>(Arc<T>);

impl<T> RateLimitServiceServer<T> {
    pub fn new(inner: T) -> Self {
        RateLimitServiceServer(Arc::new(inner))
    }
}

impl<T> Clone for RateLimitServiceServer<T> {
    fn clone(&self) -> Self {
        RateLimitServiceServer(self.0.clone())
    }
}

impl<T> tonic::server::NamedService for RateLimitServiceServer<T> {
    const NAME: &'static str = "envoy.service.ratelimit.v3.RateLimitService";
}

/// One call of `ShouldRateLimit`, for tonic's unary handling.
struct ShouldRateLimit<T>(Arc<T>);

impl<T: RateLimitService> tonic::server::UnaryService<RateLimitRequest> for ShouldRateLimit<T> {
    type Response = RateLimitResponse;
    type Future = BoxFuture<tonic::Response<RateLimitResponse>, tonic::Status>;

    fn call(&mut self, request: tonic::Request<RateLimitRequest>) -> Self::Future {
        let inner = self.0.clone();
        Box::pin(async move { inner.should_rate_limit(request).await })
    }
}

impl<T, B> Service<http::Request<B>> for RateLimitServiceServer<T>
where
    T: RateLimitService,
    B: Body + Send + 'static,
    B::Error: Into<StdError> + Send + 'static,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = std::convert::Infallible;
    type Future = BoxFuture<Self::Response, Self::Error>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        let inner = self.0.clone();
        if req.uri().path() == "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit" {
            return Box::pin(async move {
                let mut grpc = tonic::server::Grpc::new(tonic_prost::ProstCodec::default());
                Ok(grpc.unary(ShouldRateLimit(inner), req).await)
            });
        }
        Box::pin(async move {
            let mut response = http::Response::new(tonic::body::Body::default());
            let headers = response.headers_mut();
            headers.insert(
                tonic::Status::GRPC_STATUS,
                (tonic::Code::Unimplemented as i32).into(),
            );
            headers.insert(
                http::header::CONTENT_TYPE,
                tonic::metadata::GRPC_CONTENT_TYPE,
            );
            Ok(response)
        })
    }
}
