//! The rate limit service's protobuf messages on arbitrary bytes: the answer decoder (what a
//! service, or anything posing as one, sends back), assembled from a gRPC stream's events as
//! the hosts hand them; and the request decoder, with a round trip through the encoder.
//!
//! Input: a byte choosing the statuses, four bytes seeding the body's split, the message.

use crate::{pieces, Bytes};
use ratelimit_core::rls::{self, Code, GrpcAnswer, MAX_RESET_MS};

pub fn run(data: &[u8]) {
    let mut input = Bytes(data);
    let choice = input.u8();
    let seed = input.u32();
    let message = input.rest();

    // The answer, decoded alone.
    let decoded = rls::decode_response(message);
    if let Ok(r) = &decoded {
        // Every status and header takes at least two bytes of the message.
        assert!(r.statuses.len() + r.headers.len() <= message.len() / 2 + 1);
        for s in &r.statuses {
            assert!(s.reset_ms.is_none_or(|ms| ms <= MAX_RESET_MS));
            assert!(s
                .unit_seconds
                .is_none_or(|u| [1, 60, 3600, 86_400, 604_800].contains(&u)));
        }
        let _ = matches!(r.overall_code, Code::Ok | Code::OverLimit | Code::Unknown);
    }

    // The same message framed as gRPC, in pieces, with statuses the input picks.
    let mut answer = GrpcAnswer::default();
    let http: &[u8] = match choice & 3 {
        0 => b"200",
        1 => b" 200 ",
        2 => b"503",
        _ => b"x",
    };
    let grpc: &[u8] = match (choice >> 2) & 3 {
        0 => b"0",
        1 => b"14",
        2 => b"",
        _ => b"99999999999999999999",
    };
    let trailers_only = choice & 16 != 0;
    answer.headers([(&b":status"[..], http)]);
    if trailers_only {
        answer.headers([(&b"grpc-status"[..], grpc)]);
    }
    let frame = if choice & 32 != 0 {
        message.to_vec() // unframed: must be refused unless it happens to be a frame
    } else {
        rls::grpc_frame(message)
    };
    for piece in pieces(&frame, seed) {
        answer.data(piece);
    }
    if !trailers_only {
        answer.headers([(&b"grpc-status"[..], grpc)]);
    }
    let finished = answer.finish();
    // ":status: x" is no status: the gRPC status decides.
    let (http_ok, grpc_ok) = (choice & 3 != 2, (choice >> 2) & 3 == 0);
    if choice & 32 == 0 && http_ok && grpc_ok {
        // A good status and a well-framed message: the message's own decoding.
        assert_eq!(finished.as_ref().ok(), decoded.as_ref().ok());
        assert_eq!(finished.is_ok(), decoded.is_ok());
    } else if !http_ok || !grpc_ok {
        assert!(finished.is_err(), "a failed call decoded");
    }

    // The request decoder, and a round trip through the encoder of the request's shape: one
    // descriptor with no hits_addend of its own (encode_request), or descriptors that each have
    // one and a request hits_addend of 1 (encode_request_each).
    if let Ok(r) = rls::decode_request(message) {
        assert!(r.hits >= 1);
        assert_eq!(r.descriptor_hits.len(), r.descriptors.len());
        let entries: Vec<Vec<(&str, &[u8])>> = r
            .descriptors
            .iter()
            .map(|d| d.iter().map(|(k, v)| (k.as_str(), v.as_slice())).collect())
            .collect();
        let own: Option<Vec<u64>> = r.descriptor_hits.iter().copied().collect();
        let encoded = match (&entries[..], u32::try_from(r.hits), own) {
            ([one], Ok(hits), _) if r.descriptor_hits == [None] => {
                Some(rls::encode_request(&r.domain, one, hits))
            }
            (_, _, Some(own)) if r.hits == 1 => {
                let each: Vec<rls::Each<'_>> = entries
                    .iter()
                    .zip(own)
                    .map(|(e, hits)| rls::Each { entries: e, hits })
                    .collect();
                Some(rls::encode_request_each(&r.domain, &each))
            }
            _ => None,
        };
        if let Some(encoded) = encoded {
            let again = rls::decode_request(&encoded);
            assert_eq!(
                again.as_ref(),
                Ok(&r),
                "encode(decode(m)) does not decode to the same"
            );
        }
    }
}
