//! Envoy's rate limit service protocol (`envoy.service.ratelimit.v3`), the few messages the
//! filter sends and reads, encoded by hand: a protobuf crate would add tens of kilobytes to the
//! `.wasm` for two messages. Unknown fields are skipped, as protobuf requires, so newer services
//! interoperate.

use crate::error::ServiceError;

/// The gRPC service and method of `ShouldRateLimit`.
pub const SERVICE: &str = "envoy.service.ratelimit.v3.RateLimitService";
/// The method name.
pub const METHOD: &str = "ShouldRateLimit";
/// The HTTP/2 path of `ShouldRateLimit`, for hosts that speak gRPC as plain HTTP/2.
pub const PATH: &str = "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit";

/// A gRPC message as sent on the wire: not compressed, its length (big-endian u32), the bytes.
pub fn grpc_frame(message: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(message.len() + 5);
    out.push(0);
    out.extend_from_slice(
        &u32::try_from(message.len())
            .unwrap_or(u32::MAX)
            .to_be_bytes(),
    );
    out.extend_from_slice(message);
    out
}

/// A unary gRPC answer assembled from an HTTP/2 stream's events: headers, data, trailers. The
/// status may come in the headers (a trailers-only answer, which is how Envoy reports an
/// unreachable service or a timeout) or in the trailers.
#[derive(Debug, Default)]
pub struct GrpcAnswer {
    http_status: Option<u32>,
    grpc_status: Option<u32>,
    body: Vec<u8>,
}

impl GrpcAnswer {
    /// Takes the fields of a header or trailer block.
    pub fn headers<'a>(&mut self, fields: impl IntoIterator<Item = (&'a [u8], &'a [u8])>) {
        for (name, value) in fields {
            let number = || std::str::from_utf8(value).ok()?.trim().parse().ok();
            match name {
                b":status" => self.http_status = number(),
                b"grpc-status" => self.grpc_status = number(),
                _ => {}
            }
        }
    }

    /// Takes a piece of the body.
    pub fn data(&mut self, bytes: &[u8]) {
        // A ShouldRateLimit answer is small; a service sending megabytes is broken.
        if self.body.len() + bytes.len() <= 1 << 20 {
            self.body.extend_from_slice(bytes);
        }
    }

    /// The decoded answer once the stream is complete.
    pub fn finish(&self) -> Result<Response, ServiceError> {
        match (self.http_status, self.grpc_status) {
            (Some(s), _) if s != 200 => return Err(ServiceError::Http(s)),
            (_, Some(0)) => {}
            (_, Some(code)) => return Err(ServiceError::Grpc(code)),
            (_, None) => return Err(ServiceError::NoStatus),
        }
        let message = match self.body.split_first_chunk::<5>() {
            Some(([0, len @ ..], rest)) if u32::from_be_bytes(*len) as usize == rest.len() => rest,
            _ => return Err(ServiceError::Undecodable),
        };
        decode_response(message).map_err(|_| ServiceError::Undecodable)
    }
}

/// `RateLimitResponse.Code`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Code {
    /// `UNKNOWN` (0): the service could not decide.
    #[default]
    Unknown,
    /// `OK` (1).
    Ok,
    /// `OVER_LIMIT` (2).
    OverLimit,
}

impl Code {
    fn from_u64(n: u64) -> Code {
        match n {
            1 => Code::Ok,
            2 => Code::OverLimit,
            _ => Code::Unknown,
        }
    }
}

/// One descriptor's status in the answer.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DescriptorStatus {
    /// The descriptor's own code.
    pub code: Code,
    /// `current_limit.requests_per_unit`, if the service said.
    pub requests_per_unit: Option<u32>,
    /// `current_limit.unit` in seconds (SECOND to WEEK), if the service said one of a fixed
    /// length: MONTH and YEAR are calendar ones, whose length the rule's own window gives.
    pub unit_seconds: Option<u64>,
    /// `limit_remaining`.
    pub limit_remaining: u32,
    /// `duration_until_reset`, in milliseconds, if the service said.
    pub reset_ms: Option<u64>,
}

/// A decoded `RateLimitResponse`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Response {
    /// `overall_code`.
    pub overall_code: Code,
    /// `statuses`, one per descriptor sent.
    pub statuses: Vec<DescriptorStatus>,
    /// `response_headers_to_add` (key, value).
    pub headers: Vec<(String, String)>,
}

/// The response could not be decoded.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DecodeError;

impl std::fmt::Display for DecodeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("not a RateLimitResponse")
    }
}

impl std::error::Error for DecodeError {}

fn put_varint(out: &mut Vec<u8>, mut n: u64) {
    while n >= 0x80 {
        out.push((n as u8 & 0x7f) | 0x80);
        n >>= 7;
    }
    out.push(n as u8);
}

fn put_bytes(out: &mut Vec<u8>, field: u32, bytes: &[u8]) {
    put_varint(out, u64::from(field << 3 | 2));
    put_varint(out, bytes.len() as u64);
    out.extend_from_slice(bytes);
}

/// Encodes a `RateLimitRequest` with one descriptor of `entries` (key, value).
pub fn encode_request(domain: &str, entries: &[(&str, &[u8])], hits_addend: u32) -> Vec<u8> {
    let mut descriptor = Vec::with_capacity(64);
    put_descriptor(&mut descriptor, entries, None);
    let mut out = Vec::with_capacity(descriptor.len() + domain.len() + 16);
    put_bytes(&mut out, 1, domain.as_bytes());
    put_bytes(&mut out, 2, &descriptor);
    if hits_addend != 1 {
        put_varint(&mut out, 3 << 3);
        put_varint(&mut out, u64::from(hits_addend));
    }
    out
}

/// A descriptor's fields: its `entries` (key, value) and, if `hits` is given, its own
/// `hits_addend` (a `google.protobuf.UInt64Value`, field 3: set even when 0, which a service
/// that reads it takes as "check, do not count").
fn put_descriptor(out: &mut Vec<u8>, entries: &[(&str, &[u8])], hits: Option<u64>) {
    for (key, value) in entries {
        let mut entry = Vec::with_capacity(key.len() + value.len() + 4);
        put_bytes(&mut entry, 1, key.as_bytes());
        put_bytes(&mut entry, 2, value);
        put_bytes(out, 1, &entry);
    }
    if let Some(h) = hits {
        let mut wrapper = Vec::with_capacity(10);
        if h != 0 {
            put_varint(&mut wrapper, 1 << 3);
            put_varint(&mut wrapper, h);
        }
        put_bytes(out, 3, &wrapper);
    }
}

/// One descriptor of a request with several: its entries and its own `hits_addend`.
pub struct Each<'a> {
    /// Its entries (key, value).
    pub entries: &'a [(&'a str, &'a [u8])],
    /// What the service adds to its counter (0: only read it).
    pub hits: u64,
}

/// Encodes a `RateLimitRequest` of several descriptors, each with its own `hits_addend`
/// (`envoy.extensions.common.ratelimit.v3.RateLimitDescriptor.hits_addend`). A service that
/// reads it (envoyproxy/ratelimit) counts each descriptor by its own and answers a status for
/// each; one that does not (Limitador's server) counts every descriptor by the request's
/// `hits_addend`, left out here (1).
pub fn encode_request_each(domain: &str, descriptors: &[Each<'_>]) -> Vec<u8> {
    let mut out = Vec::with_capacity(domain.len() + 64 * descriptors.len() + 8);
    put_bytes(&mut out, 1, domain.as_bytes());
    append_each(&mut out, descriptors);
    out
}

/// Appends `descriptors`, each with its own `hits_addend`, to the encoded `RateLimitRequest`
/// `out` (a message's fields may come in any order: they follow those already there). A
/// request of [`encode_request`] with these after its own descriptor counts that one by the
/// request's `hits_addend` and each of these by its own, at a service that reads them.
pub fn append_each(out: &mut Vec<u8>, descriptors: &[Each<'_>]) {
    out.reserve(64 * descriptors.len());
    let mut descriptor = Vec::with_capacity(64);
    for d in descriptors {
        descriptor.clear();
        put_descriptor(&mut descriptor, d.entries, Some(d.hits));
        put_bytes(out, 2, &descriptor);
    }
}

/// A protobuf field as read.
enum Field<'a> {
    Varint(u64),
    Bytes(&'a [u8]),
    Other,
}

/// Reads protobuf fields one by one.
struct Reader<'a> {
    buf: &'a [u8],
}

impl<'a> Reader<'a> {
    fn varint(&mut self) -> Result<u64, DecodeError> {
        let mut n = 0u64;
        for shift in (0..64).step_by(7) {
            let (&b, rest) = self.buf.split_first().ok_or(DecodeError)?;
            self.buf = rest;
            n |= u64::from(b & 0x7f) << shift;
            if b < 0x80 {
                return Ok(n);
            }
        }
        Err(DecodeError)
    }

    fn take(&mut self, n: u64) -> Result<&'a [u8], DecodeError> {
        let n = usize::try_from(n).map_err(|_| DecodeError)?;
        if n > self.buf.len() {
            return Err(DecodeError);
        }
        let (head, rest) = self.buf.split_at(n);
        self.buf = rest;
        Ok(head)
    }

    /// The next (field number, value), or `None` at the end.
    fn next(&mut self) -> Result<Option<(u64, Field<'a>)>, DecodeError> {
        if self.buf.is_empty() {
            return Ok(None);
        }
        let tag = self.varint()?;
        let field = match tag & 7 {
            0 => Field::Varint(self.varint()?),
            1 => {
                self.take(8)?;
                Field::Other
            }
            2 => {
                let len = self.varint()?;
                Field::Bytes(self.take(len)?)
            }
            5 => {
                self.take(4)?;
                Field::Other
            }
            _ => return Err(DecodeError),
        };
        Ok(Some((tag >> 3, field)))
    }
}

fn fields(
    buf: &[u8],
    mut f: impl FnMut(u64, Field<'_>) -> Result<(), DecodeError>,
) -> Result<(), DecodeError> {
    let mut r = Reader { buf };
    while let Some((number, field)) = r.next()? {
        f(number, field)?;
    }
    Ok(())
}

/// The length of a `RateLimitResponse.RateLimit.Unit`, s: SECOND (1) to DAY (4), and WEEK (7,
/// added to the protocol after YEAR); `None` for UNKNOWN and the calendar's MONTH (5) and YEAR
/// (6), which have no one length.
fn unit_seconds(unit: u64) -> Option<u64> {
    match unit {
        1 => Some(1),
        2 => Some(60),
        3 => Some(3_600),
        4 => Some(86_400),
        7 => Some(7 * 86_400),
        _ => None,
    }
}

/// The longest `duration_until_reset` taken (a leap year); longer ones are cut to it.
pub const MAX_RESET_MS: u64 = 366 * 86_400_000;

fn decode_status(buf: &[u8]) -> Result<DescriptorStatus, DecodeError> {
    let mut s = DescriptorStatus::default();
    fields(buf, |n, f| {
        match (n, f) {
            (1, Field::Varint(c)) => s.code = Code::from_u64(c),
            (2, Field::Bytes(limit)) => fields(limit, |n, f| {
                match (n, f) {
                    (1, Field::Varint(v)) => s.requests_per_unit = u32::try_from(v).ok(),
                    (2, Field::Varint(u)) => s.unit_seconds = unit_seconds(u),
                    _ => {}
                }
                Ok(())
            })?,
            (3, Field::Varint(v)) => s.limit_remaining = u32::try_from(v).unwrap_or(u32::MAX),
            (4, Field::Bytes(d)) => {
                let (mut secs, mut nanos) = (0u64, 0u64);
                fields(d, |n, f| {
                    match (n, f) {
                        (1, Field::Varint(v)) => secs = v,
                        (2, Field::Varint(v)) => nanos = v,
                        _ => {}
                    }
                    Ok(())
                })?;
                // A negative duration (a two's complement varint) says nothing; a month's or a
                // year's reset is up to 366 days away.
                let ms = secs.saturating_mul(1000).saturating_add(nanos / 1_000_000);
                s.reset_ms = (i64::try_from(secs).is_ok()).then_some(ms.min(MAX_RESET_MS));
            }
            _ => {}
        }
        Ok(())
    })?;
    Ok(s)
}

/// A `RateLimitRequest` as decoded: what a service reads of it (for the fleet model and the
/// tests, which play the service).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Request {
    /// The domain.
    pub domain: String,
    /// Each descriptor's entries (key, value).
    pub descriptors: Vec<Vec<(String, Vec<u8>)>>,
    /// `hits_addend`, 1 when absent (as services read it).
    pub hits: u64,
    /// Each descriptor's own `hits_addend`, where it has one (in the order of `descriptors`).
    pub descriptor_hits: Vec<Option<u64>>,
}

/// Decodes a `RateLimitRequest`.
pub fn decode_request(buf: &[u8]) -> Result<Request, DecodeError> {
    let mut r = Request {
        hits: 1,
        ..Request::default()
    };
    fields(buf, |n, f| {
        match (n, f) {
            (1, Field::Bytes(d)) => r.domain = String::from_utf8_lossy(d).into_owned(),
            (2, Field::Bytes(d)) => {
                let mut entries = Vec::new();
                let mut own = None;
                fields(d, |n, f| {
                    if let (3, Field::Bytes(w)) = (n, &f) {
                        let mut v = 0;
                        fields(w, |n, f| {
                            if let (1, Field::Varint(h)) = (n, f) {
                                v = h;
                            }
                            Ok(())
                        })?;
                        own = Some(v);
                    }
                    if let (1, Field::Bytes(e)) = (n, f) {
                        let (mut key, mut value) = (String::new(), Vec::new());
                        fields(e, |n, f| {
                            match (n, f) {
                                (1, Field::Bytes(k)) => {
                                    key = String::from_utf8_lossy(k).into_owned()
                                }
                                (2, Field::Bytes(v)) => value = v.to_vec(),
                                _ => {}
                            }
                            Ok(())
                        })?;
                        entries.push((key, value));
                    }
                    Ok(())
                })?;
                r.descriptors.push(entries);
                r.descriptor_hits.push(own);
            }
            (3, Field::Varint(h)) => r.hits = h.max(1),
            _ => {}
        }
        Ok(())
    })?;
    Ok(r)
}

/// Decodes a `RateLimitResponse`.
pub fn decode_response(buf: &[u8]) -> Result<Response, DecodeError> {
    let mut r = Response::default();
    fields(buf, |n, f| {
        match (n, f) {
            (1, Field::Varint(c)) => r.overall_code = Code::from_u64(c),
            (2, Field::Bytes(s)) => r.statuses.push(decode_status(s)?),
            (3, Field::Bytes(h)) => {
                let (mut key, mut value) = (String::new(), String::new());
                fields(h, |n, f| {
                    match (n, f) {
                        (1, Field::Bytes(k)) => key = String::from_utf8_lossy(k).into_owned(),
                        (2 | 3, Field::Bytes(v)) => value = String::from_utf8_lossy(v).into_owned(),
                        _ => {}
                    }
                    Ok(())
                })?;
                r.headers.push((key, value));
            }
            _ => {}
        }
        Ok(())
    })?;
    Ok(r)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_bytes_are_canonical_protobuf() {
        let bytes = encode_request(
            "edge",
            &[("rule", b"r"), ("remote_address", b"10.0.0.1")],
            3,
        );
        let mut expected = vec![0x0a, 4];
        expected.extend_from_slice(b"edge");
        // descriptors (2): entries (1) {key 1, value 2} twice.
        let e1: Vec<u8> = [&[0x0a, 4][..], b"rule", &[0x12, 1], b"r"].concat();
        let e2: Vec<u8> = [&[0x0a, 14][..], b"remote_address", &[0x12, 8], b"10.0.0.1"].concat();
        let descriptor: Vec<u8> = [
            &[0x0a, e1.len() as u8][..],
            &e1,
            &[0x0a, e2.len() as u8],
            &e2,
        ]
        .concat();
        expected.extend_from_slice(&[0x12, descriptor.len() as u8]);
        expected.extend_from_slice(&descriptor);
        expected.extend_from_slice(&[0x18, 3]);
        assert_eq!(bytes, expected);
        // hits_addend 1 is the default and left out.
        assert!(!encode_request("d", &[], 1).ends_with(&[0x18, 1]));
    }

    /// Two descriptors, `k=a` adding 5 and `k=b` only read.
    const TWO: [Each<'static>; 2] = [
        Each {
            entries: &[("k", b"a")],
            hits: 5,
        },
        Each {
            entries: &[("k", b"b")],
            hits: 0,
        },
    ];

    #[test]
    fn each_descriptor_carries_its_own_hits_addend() {
        let bytes = encode_request_each("d", &TWO);
        let entry = |v: u8| [&[0x0a, 6, 0x0a, 1][..], b"k", &[0x12, 1, v]].concat();
        // descriptor.hits_addend (3): a UInt64Value {value (1)}; 0 is an empty one, still set.
        let d1 = [entry(b'a'), vec![0x1a, 2, 0x08, 5]].concat();
        let d2 = [entry(b'b'), vec![0x1a, 0]].concat();
        let expected = [
            &[0x0a, 1, b'd'][..],
            &[0x12, d1.len() as u8],
            &d1,
            &[0x12, d2.len() as u8],
            &d2,
        ]
        .concat();
        assert_eq!(bytes, expected);
        let r = decode_request(&bytes).unwrap();
        assert_eq!(r.descriptor_hits, [Some(5), Some(0)]);
        assert_eq!(r.hits, 1, "the request's own hits_addend is left out");
        let one = decode_request(&encode_request("d", &[("k", b"a")], 2)).unwrap();
        assert_eq!((one.hits, one.descriptor_hits), (2, vec![None]));
    }

    #[test]
    fn descriptors_appended_to_a_request_keep_their_own_hits_and_it_its_own() {
        let mut bytes = encode_request("d", &[("k", b"claim")], 20);
        append_each(&mut bytes, &TWO);
        let r = decode_request(&bytes).unwrap();
        assert_eq!(r.domain, "d");
        let values: Vec<&[u8]> = r.descriptors.iter().map(|d| &d[0].1[..]).collect();
        assert_eq!(values, [&b"claim"[..], b"a", b"b"]);
        // The first counts by the request's hits_addend; the others by their own, 0 set.
        assert_eq!(r.hits, 20);
        assert_eq!(r.descriptor_hits, [None, Some(5), Some(0)]);
    }

    #[test]
    fn responses_decode_and_skip_unknown_fields() {
        // overall_code OVER_LIMIT; a status {code 2, current_limit {10, MINUTE, "x"},
        // remaining 0, duration 42.5 s}; a header; and unknown fields of every wire type.
        let limit = [&[0x08, 10, 0x10, 2, 0x1a, 1][..], b"x"].concat();
        let duration = [0x08, 42, 0x10, 0x80, 0xca, 0xb5, 0xee, 0x01]; // 500_000_000 ns
        let status = [
            &[0x08, 2, 0x12, limit.len() as u8][..],
            &limit,
            &[0x18, 0, 0x22, duration.len() as u8],
            &duration,
            &[0x2d, 1, 2, 3, 4], // field 5, fixed32: unknown
        ]
        .concat();
        let header = [&[0x0a, 3][..], b"x-a", &[0x12, 1], b"1"].concat();
        let msg = [
            &[0x08, 2, 0x12, status.len() as u8][..],
            &status,
            &[0x1a, header.len() as u8],
            &header,
            &[0x29, 0, 0, 0, 0, 0, 0, 0, 0], // field 5, fixed64: unknown
            &[0x3a, 2, 9, 9],                // field 7, bytes: unknown
        ]
        .concat();
        let r = decode_response(&msg).unwrap();
        assert_eq!(r.overall_code, Code::OverLimit);
        assert_eq!(
            r.statuses,
            [DescriptorStatus {
                code: Code::OverLimit,
                requests_per_unit: Some(10),
                unit_seconds: Some(60),
                limit_remaining: 0,
                reset_ms: Some(42_500),
            }]
        );
        assert_eq!(r.headers, [("x-a".to_string(), "1".to_string())]);
        assert_eq!(decode_response(&[]).unwrap(), Response::default());
    }

    /// A status with `current_limit.unit` `unit` and `duration_until_reset` of `secs` seconds
    /// (a varint: a negative one is two's complement).
    fn status(unit: u8, secs: i64) -> DescriptorStatus {
        let mut duration = vec![0x08];
        put_varint(&mut duration, secs as u64);
        let status = [
            &[
                0x08,
                1,
                0x12,
                4,
                0x08,
                5,
                0x10,
                unit,
                0x22,
                duration.len() as u8,
            ][..],
            &duration,
        ]
        .concat();
        let msg = [&[0x08, 1, 0x12, status.len() as u8][..], &status].concat();
        decode_response(&msg).unwrap().statuses.remove(0)
    }

    #[test]
    fn weeks_months_and_long_resets() {
        assert_eq!(status(7, 1).unit_seconds, Some(604_800), "WEEK is 7");
        assert_eq!(status(4, 1).unit_seconds, Some(86_400), "DAY");
        // MONTH and YEAR have no one length: the rule's own window is reported.
        assert_eq!(status(5, 1).unit_seconds, None);
        assert_eq!(status(6, 1).unit_seconds, None);
        // A month's reset, 20 days away, is taken whole; past a leap year it is cut.
        assert_eq!(status(5, 20 * 86_400).reset_ms, Some(20 * 86_400_000));
        assert_eq!(status(6, 400 * 86_400).reset_ms, Some(MAX_RESET_MS));
        // A negative duration says nothing (it used to read as a day).
        assert_eq!(status(5, -5).reset_ms, None);
    }

    #[test]
    fn grpc_frames_and_answers() {
        assert_eq!(grpc_frame(b"ab"), [0, 0, 0, 0, 2, b'a', b'b']);
        let ok: &[u8] = &[0x08, 1]; // overall_code OK
        let mut a = GrpcAnswer::default();
        a.headers([
            (&b":status"[..], &b"200"[..]),
            (b"content-type", b"application/grpc"),
        ]);
        let frame = grpc_frame(ok);
        a.data(&frame[..3]);
        a.data(&frame[3..]);
        a.headers([(&b"grpc-status"[..], &b"0"[..])]);
        assert_eq!(a.finish().unwrap().overall_code, Code::Ok);
        // Trailers-only: how Envoy reports an unreachable service or a timeout.
        let mut refused = GrpcAnswer::default();
        refused.headers([(&b":status"[..], &b"200"[..]), (b"grpc-status", b"14")]);
        assert_eq!(refused.finish().unwrap_err().to_string(), "gRPC status 14");
        let mut http = GrpcAnswer::default();
        http.headers([(&b":status"[..], &b"503"[..])]);
        assert_eq!(http.finish().unwrap_err().to_string(), "HTTP status 503");
        assert_eq!(
            GrpcAnswer::default().finish().unwrap_err().to_string(),
            "no gRPC status"
        );
        let mut short = GrpcAnswer::default();
        short.headers([(&b"grpc-status"[..], &b"0"[..])]);
        short.data(&[0, 0, 0, 0, 9, 1]);
        assert_eq!(
            short.finish().unwrap_err().to_string(),
            "undecodable answer"
        );
    }

    #[test]
    fn garbage_is_an_error_not_a_panic() {
        assert_eq!(decode_response(&[0x12, 50, 1]), Err(DecodeError));
        assert_eq!(decode_response(&[0x0f]), Err(DecodeError));
        assert_eq!(decode_response(&[0x80; 20]), Err(DecodeError));
        let mut seed = 7u64;
        for len in 0..2_000 {
            let bytes: Vec<u8> = (0..len % 64)
                .map(|_| {
                    seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1);
                    (seed >> 56) as u8
                })
                .collect();
            let _ = decode_response(&bytes);
        }
    }
}
