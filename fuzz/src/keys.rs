//! Client keys built from arbitrary requests: headers, query strings, paths, methods,
//! authorities, bearer tokens, body fields and addresses of any bytes, under every kind of key
//! part (and `first` of them), `shared` or not. No panic; the three ways of reading a key agree
//! (the hash, the descriptor sent to a service, the first missing part); and an address the key
//! code accepts as IP round-trips: its port stripped back to it, its network (as a service sees
//! it) a CIDR that parses and holds it, a CIDR that parses written back the same.
//!
//! Input: choices of parts and prefixes, then the request's fields, each length-prefixed.

use crate::Bytes;
use ratelimit_core::config::{BodyField, Cidr, KeyPart, Prefixes};
use ratelimit_core::key::{self, PlainRequest, Seed};
use std::net::IpAddr;

const HEADERS: [&str; 4] = ["x-api-key", "authorization", "x-tenant", "x-user"];
const QUERY: [&str; 3] = ["key", "k", ""];

fn part(input: &mut Bytes, prefixes: Prefixes, nested: bool) -> KeyPart {
    match input.below(if nested { 9 } else { 8 }) {
        0 => KeyPart::RemoteAddress(prefixes),
        1 => KeyPart::Header(HEADERS[input.below(HEADERS.len())].to_string()),
        2 => KeyPart::Query(QUERY[input.below(QUERY.len())].to_string()),
        3 => KeyPart::Path,
        4 => KeyPart::Method,
        5 => KeyPart::Authority,
        6 => KeyPart::Bearer,
        7 => KeyPart::Body(BodyField {
            path: vec!["model".into()],
            slot: input.below(3),
        }),
        _ => KeyPart::First(
            (0..2 + input.below(2))
                .map(|_| part(input, prefixes, false))
                .collect(),
        ),
    }
}

pub fn run(data: &[u8]) {
    let mut input = Bytes(data);
    // The prefixes a configuration may give: 1 to 32, 1 to 128.
    let prefixes = Prefixes {
        v4: 1 + (input.u8() % 32),
        v6: 1 + (input.u8() % 128),
    };
    let parts: Vec<KeyPart> = (0..input.below(5))
        .map(|_| part(&mut input, prefixes, true))
        .collect();
    let shared = input.bool();
    let seed = Seed([input.u64(), 7]);
    let port = input.u16();
    let mut req = PlainRequest {
        source_address: Some(input.text(64)).filter(|_| input.bool()),
        path: Some(input.text(128)),
        method: Some(input.text(8)).filter(|_| input.bool()),
        authority: Some(input.text(32)),
        ..PlainRequest::default()
    };
    for _ in 0..input.below(4) {
        let name = HEADERS[input.below(HEADERS.len())].to_string();
        req.headers.push((name, input.bytes(96).to_vec()));
    }
    for slot in 0..input.below(3) {
        req.body.push((slot, input.bytes(32).to_vec()));
    }
    let address = req.source_address.clone();

    // The three readings of the key agree.
    let fingerprint = key::rule_fingerprint(seed, "r", &parts, "sliding_window");
    let hash = key::client_key(seed, fingerprint, &parts, shared, &mut req);
    assert_eq!(
        hash,
        key::client_key(seed, fingerprint, &parts, shared, &mut req)
    );
    let entries = key::descriptor_entries("r", &parts, shared, &mut req);
    let missing = key::missing_part(&parts, &mut req);
    assert_eq!(hash.is_some(), entries.is_some());
    assert_eq!(hash.is_some(), shared || missing.is_none());
    if let Some(h) = hash {
        assert_eq!(h & key::TAG_MASK, key::rule_tag(fingerprint));
    }
    if let Some(entries) = &entries {
        assert_eq!(entries.len(), parts.len() + 1);
        for ((name, value), part) in entries.iter().skip(1).zip(&parts) {
            assert_eq!(name, &part.descriptor_key());
            if matches!(part, KeyPart::RemoteAddress(_)) {
                remote_value(address.as_deref(), prefixes, value);
            }
        }
    }

    // The address helpers.
    if let Some(address) = &address {
        addresses(address, prefixes, port);
        if let Ok(cidr) = Cidr::parse(address) {
            assert_eq!(Cidr::parse(&cidr.to_string()), Ok(cidr), "{address}");
            assert!(cidr.contains(cidr.address));
        }
    }
    for (_, value) in &req.headers {
        if let Some(token) = key::bearer_token(value) {
            assert!(!token.is_empty() && token.trim_ascii() == token);
        }
    }
    if let Some((_, Some(query))) = req.path.as_deref().map(key::split_path) {
        for name in QUERY {
            if let Some(v) = key::query_param(query, name) {
                assert!(query.contains(v) && !v.contains('&'));
            }
        }
    }
}

/// The client's address as an IP, v4-mapped v6 as v4.
fn ip_of(address: &str) -> Option<IpAddr> {
    let ip: IpAddr = key::strip_port(address).parse().ok()?;
    Some(match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        v4 => v4,
    })
}

/// A remote-address part's descriptor value: an IP client's network (`a.b.c.0/24`) holding
/// it, or its own address; anything else as it came.
fn remote_value(address: Option<&str>, prefixes: Prefixes, value: &[u8]) {
    let Some(address) = address else {
        return; // a missing part under `shared`
    };
    let text = std::str::from_utf8(value).expect("a descriptor value of text");
    match ip_of(address) {
        Some(ip) => {
            let full = match ip {
                IpAddr::V4(_) => prefixes.v4 >= 32,
                IpAddr::V6(_) => prefixes.v6 >= 128,
            };
            if full {
                assert_eq!(text.parse::<IpAddr>().ok(), Some(ip), "{address}: {text}");
            } else {
                let cidr = Cidr::parse(text).unwrap_or_else(|e| panic!("{address}: {e}"));
                assert!(cidr.contains(ip), "{address}: {text}");
                let want = match ip {
                    IpAddr::V4(_) => prefixes.v4,
                    IpAddr::V6(_) => prefixes.v6,
                };
                assert_eq!(cidr.prefix, want);
            }
        }
        // Not an IP (a pipe's path): the address itself. A network's bytes start with 4 or 6,
        // never a printable byte; Envoy's addresses are printable, the only ones compared.
        None if key::strip_port(address).starts_with(|c: char| c.is_ascii_graphic()) => {
            assert_eq!(text, key::strip_port(address))
        }
        None => {}
    }
}

fn addresses(address: &str, prefixes: Prefixes, port: u16) {
    let bare = key::strip_port(address);
    assert!(address.starts_with(bare) || address.starts_with('['));
    let Ok(ip) = bare.parse::<IpAddr>() else {
        return;
    };
    // Written back with a port, the port is stripped back off.
    let with_port = match ip {
        IpAddr::V4(_) => format!("{ip}:{port}"),
        IpAddr::V6(_) => format!("[{ip}]:{port}"),
    };
    assert_eq!(key::strip_port(&with_port), ip.to_string());
    assert_eq!(key::strip_port(&ip.to_string()), ip.to_string());
    // The network a key holds is that of the address.
    let text = ip.to_string();
    if let Some(net) = key::network(&text, prefixes) {
        let bytes = net.as_bytes();
        let mapped = match ip {
            IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
            v4 => v4,
        };
        match (bytes.first(), mapped) {
            (Some(4), IpAddr::V4(_)) => assert_eq!(bytes.len(), 6),
            (Some(6), IpAddr::V6(_)) => assert_eq!(bytes.len(), 18),
            _ => assert_eq!(bytes, mapped.to_string().as_bytes(), "{address}"),
        }
    } else {
        assert!(ip.is_ipv4() && prefixes.v4 >= 32, "{address}: no network");
    }
}
