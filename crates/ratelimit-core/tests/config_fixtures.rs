//! Every bad configuration in `tests/fixtures/bad/NAME.json` is refused with exactly the message
//! in `NAME.error`; every configuration in `tests/fixtures/good/` is accepted.
#![allow(clippy::unwrap_used, clippy::panic)]

use ratelimit_core::testkit as common;

use ratelimit_core::config::Config;

#[test]
fn bad_configs_are_refused_with_their_exact_message() {
    let files = common::fixture_files("bad");
    assert!(files.len() >= 30, "fixtures missing");
    for json in files {
        let expected = std::fs::read_to_string(json.with_extension("error")).unwrap();
        let got = match Config::parse(&std::fs::read(&json).unwrap()) {
            Ok(c) => panic!("{} was accepted: {c:?}", json.display()),
            Err(e) => e.to_string(),
        };
        assert_eq!(got, expected.trim_end(), "{}", json.display());
    }
}

#[test]
fn good_configs_are_accepted() {
    for json in common::fixture_files("good") {
        if let Err(e) = Config::parse(&std::fs::read(&json).unwrap()) {
            panic!("{}: {e}", json.display());
        }
    }
}
