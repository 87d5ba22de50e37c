//! `ratelimit-config explain`: the examples' configurations, each explained for a request.
#![allow(clippy::unwrap_used, clippy::panic)]

mod run;

use ratelimit_core::testkit as common;

const SEED: &str = "000102030405060708090a0b0c0d0e0f";

/// Runs `explain ARGS` from the repository root: (exit code, stdout, stderr).
fn explain(args: &[&str]) -> (i32, String, String) {
    let mut all = vec!["explain"];
    all.extend_from_slice(args);
    run::cli(&all)
}

fn ok(args: &[&str]) -> String {
    let (code, out, err) = explain(args);
    assert_eq!(code, 0, "{out}{err}");
    out
}

#[test]
fn api_key_tiers_names_the_tier_that_applies_and_why_the_others_do_not() {
    let out = ok(&[
        "examples/api-key-tiers/envoy.yaml",
        "--path",
        "/api/orders",
        "--header",
        "x-tier: free",
        "--header",
        "X-Api-Key: abc",
        "--seed",
        SEED,
        "--raw-keys",
    ]);
    assert_eq!(
        out,
        "\
examples/api-key-tiers/envoy.yaml (Wasm filter api-key-tiers): GET /api/orders (authority localhost, from 127.0.0.1)
  free:      applies
             key 195016d0fa1b815f (header:x-api-key=abc)
             cost 1
             limit 3 per minute (sliding_window)
  pro:       does not apply: match.headers x-tier = \"pro\" does not hold for header x-tier \"free\"
  anonymous: does not apply: match.headers x-api-key absent does not hold for header x-api-key \"abc\"
"
    );
    // Without --raw-keys the key is only its hash; without a seed only its raw parts.
    let out = ok(&[
        "examples/api-key-tiers/envoy.yaml",
        "--path=/api/orders",
        "--header=x-tier: free",
        "--header=x-api-key: abc",
        "--seed",
        SEED,
    ]);
    assert!(out.contains("             key 195016d0fa1b815f\n"), "{out}");
    let out = ok(&[
        "examples/api-key-tiers/envoy.yaml",
        "--path",
        "/api/orders",
        "--header",
        "x-api-key: abc",
    ]);
    assert!(
        out.contains(
            "  keys shown raw: the hashed key the filter logs needs key_seed in the configuration, \
             or --seed with the seed of the Envoy you compare with\n"
        ),
        "{out}"
    );
    assert!(
        out.contains(
            "  free:      does not apply: match.headers x-tier = \"free\" does not hold for a request without header x-tier\n"
        ),
        "{out}"
    );
    assert!(out.contains("  anonymous: does not apply: match.headers x-api-key absent does not hold for header x-api-key \"abc\"\n"), "{out}");
}

#[test]
fn per_ip_keys_ipv6_clients_per_64() {
    let out = ok(&[
        "examples/per-ip/envoy.yaml",
        "--path",
        "/api/items?page=2",
        "--source",
        "[2001:db8:1:2::7]:5000",
        "--seed",
        SEED,
        "--raw-keys",
    ]);
    assert_eq!(
        out,
        "\
examples/per-ip/envoy.yaml (Wasm filter per-ip): GET /api/items?page=2 (authority localhost, from [2001:db8:1:2::7]:5000)
  per-ip: applies
          key 5a16e6dfb495196d (remote_address=2001:db8:1:2::/64)
          cost 1
          limit 5 per minute (sliding_window)
"
    );
    // Another address of the same /64, bare: the same key.
    let out = ok(&[
        "examples/per-ip/envoy.yaml",
        "--path",
        "/api/",
        "--source",
        "2001:db8:1:2:ffff::1",
        "--seed",
        SEED,
    ]);
    assert!(out.contains("key 5a16e6dfb495196d\n"), "{out}");
    let out = ok(&["examples/per-ip/envoy.yaml", "--path", "/health"]);
    assert!(
        out.contains(
            "  per-ip: does not apply: match.path_prefix \"/api/\" does not hold for path \"/health\"\n"
        ),
        "{out}"
    );
}

#[test]
fn login_needs_its_user_parameter() {
    let args = [
        "examples/login/envoy.yaml",
        "--method",
        "POST",
        "--source",
        "10.0.0.7",
    ];
    let with = |path: &str| ok(&[&args[..], &["--path", path]].concat());
    assert!(with("/login")
        .contains("  login: does not apply: key part query:user is missing (absent)\n"));
    assert!(with("/login?user=").contains(
        "  login: does not apply: key part query:user is missing (empty; empty values count as absent)\n"
    ));
    let out = with("/login?user=alice");
    assert!(out.contains("  login: applies\n"), "{out}");
    assert!(out.contains("remote_address=10.0.0.7"), "{out}");
    assert!(out.contains("query:user=alice"), "{out}");
}

#[test]
fn token_rules_show_their_reservation() {
    let out = ok(&[
        "examples/anthropic-tokens/config.json",
        "--method",
        "POST",
        "--path",
        "/v1/messages",
        "--header",
        "x-api-key: k",
    ]);
    assert!(out.contains("                 cost 1024 reserved if the request body names no maximum (the filter sizes it from the body; charged what the response reports)\n"), "{out}");
    assert!(
        out.contains("                 limit 5000 per hour (sliding_window)\n"),
        "{out}"
    );
    let out = ok(&[
        "examples/llm-tokens/envoy.yaml",
        "--path",
        "/v1/x",
        "--header",
        "x-api-key: k1",
    ]);
    assert!(
        out.contains("cost 200 reserved (charged what the response reports)\n"),
        "{out}"
    );
}

#[test]
fn json_has_one_object_per_rule() {
    let out = ok(&[
        "examples/replay/config.json",
        "--json",
        "--source",
        "[::ffff:10.0.0.7]:1",
        "--seed",
        SEED,
        "--raw-keys",
    ]);
    let rules: Vec<serde_json::Value> = out
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(rules.len(), 3, "{out}");
    let per_ip = &rules[0];
    assert_eq!(per_ip["rule"], "per-ip");
    assert_eq!(per_ip["applies"], true);
    assert_eq!(per_ip["shadow"], true);
    assert_eq!(per_ip["key"].as_str().unwrap().len(), 16);
    assert_eq!(per_ip["parts"][0]["value"], "10.0.0.7");
    assert_eq!(per_ip["parts"][0]["note"], "an IPv4 client seen over IPv6");
    assert_eq!(per_ip["limit"]["requests_per_unit"], 120);
    assert_eq!(per_ip["limit"]["window_s"], 60);
    assert_eq!(per_ip["cost"]["value"], 1);
    assert_eq!(rules[1]["applies"], false);
    assert_eq!(rules[1]["condition"], "match.path_prefix \"/api/\"");
    assert_eq!(rules[1]["found"], "/");
    // The same client over IPv4: the same key.
    let out = ok(&[
        "examples/replay/config.json",
        "--json",
        "--source",
        "10.0.0.7",
        "--seed",
        SEED,
    ]);
    let first: serde_json::Value = serde_json::from_str(out.lines().next().unwrap()).unwrap();
    assert_eq!(first["key"], per_ip["key"]);
    assert!(
        first.get("parts").is_none(),
        "raw parts only with --raw-keys: {first}"
    );
}

#[test]
fn limits_read_from_the_request_say_what_became_of_them() {
    let dir = common::scratch("explain-plan");
    let config = dir.join("plan.json");
    std::fs::write(
        &config,
        r#"{"rules": [{"name": "plan", "key": ["header:x-key"],
            "rate_limit": {"requests_per_unit":
                {"from": "metadata:envoy.filters.http.ext_authz:rpm", "default": 10, "max": 1000},
                "unit": "minute"}},
            {"name": "tenant", "key": ["header:x-key"],
             "in_flight": {"max": {"from": "filter_state:plan.max", "default": 2, "max": 8}}}],
          "key_seed": "000102030405060708090a0b0c0d0e0f"}"#,
    )
    .unwrap();
    let config = config.to_str().unwrap();
    let out = ok(&[
        config,
        "--header",
        "x-key: k",
        "--metadata",
        "envoy.filters.http.ext_authz:rpm=5000",
        "--filter-state",
        "plan.max=four",
    ]);
    assert!(!out.contains("keys shown raw"), "key_seed is set: {out}");
    assert!(
        out.contains("         limit 1000 per minute (sliding_window)\n"),
        "{out}"
    );
    assert!(out.contains("         requests_per_unit from metadata:envoy.filters.http.ext_authz:rpm = 5000: above the cap: the cap 1000\n"), "{out}");
    assert!(
        out.contains("         limit 2 in flight (in_flight)\n"),
        "{out}"
    );
    assert!(
        out.contains(
            "         in_flight.max from filter_state:plan.max = \"four\": invalid: the default 2\n"
        ),
        "{out}"
    );
    let out = ok(&[
        config,
        "--header",
        "x-key: k",
        "--metadata",
        "envoy.filters.http.ext_authz:rpm=60",
    ]);
    assert!(out.contains("rpm = 60: taken\n"), "{out}");
    assert!(
        out.contains("plan.max = nothing: missing: the default 2\n"),
        "{out}"
    );
    // --seed does not override key_seed.
    let out = ok(&[config, "--seed", "ffffffffffffffffffffffffffffffff"]);
    assert!(
        out.contains("  --seed ignored: the configuration sets key_seed\n"),
        "{out}"
    );
}

#[test]
fn every_configuration_of_a_file_is_explained_and_a_bad_one_fails() {
    let file = common::fixtures()
        .join("manifests")
        .join("two-plugins.yaml");
    let (code, out, _) = explain(&[file.to_str().unwrap()]);
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains("(WasmPlugin good): GET / (authority localhost, from 127.0.0.1)\n"),
        "{out}"
    );
    assert!(out.contains("  per-ip: applies\n"), "{out}");
    assert!(
        out.contains(
            "(WasmPlugin typo): INVALID\n  rules[0].rate_limit.unit: unknown unit \"minutes\""
        ),
        "{out}"
    );
}

#[test]
fn usage_errors_exit_2() {
    for args in [
        &[][..],
        &["examples/per-ip/envoy.yaml", "--header", "no-colon"],
        &["examples/per-ip/envoy.yaml", "--seed", "abc"],
        &["examples/per-ip/envoy.yaml", "--metadata", "nokey=1"],
        &["examples/per-ip/envoy.yaml", "--filter-state", "=1"],
        &["examples/per-ip/envoy.yaml", "--bogus"],
        &["examples/per-ip/envoy.yaml", "--path"],
        &["examples/per-ip/envoy.yaml", "examples/login/envoy.yaml"],
        &["examples/per-ip/envoy.yaml", "--source", "not-an-address"],
        &["examples/per-ip/envoy.yaml", "--source", "10.0.0.300"],
        &[
            "examples/per-ip/envoy.yaml",
            "--source",
            "2001:db8::7:5000x",
        ],
    ] {
        let (code, _, err) = explain(args);
        assert_eq!(code, 2, "{args:?}");
        assert!(
            err.contains("usage: ratelimit-config explain [OPTIONS] CONFIG"),
            "{args:?}: {err}"
        );
    }
    let (code, _, err) = explain(&["/nonexistent/config.json"]);
    assert_eq!(code, 2, "{err}");
    // A typo in --source names itself instead of explaining another client's request.
    let (_, _, err) = explain(&["examples/per-ip/envoy.yaml", "--source", "not-an-address"]);
    assert!(
        err.contains("--source not-an-address: expected an IP address"),
        "{err}"
    );
    for good in [
        "10.0.0.7",
        "10.0.0.7:5000",
        "2001:db8::7",
        "[2001:db8::7]:5000",
    ] {
        let (code, _, err) = explain(&["examples/per-ip/envoy.yaml", "--source", good]);
        assert_eq!(code, 0, "{good}: {err}");
    }
}

#[test]
fn customer_plans_show_the_plan_each_request_carries() {
    let plan = |rpm: &str| {
        ok(&[
            "examples/customer-plans/envoy.yaml",
            "--header",
            "x-api-key: k-pro",
            "--metadata",
            &format!("plans:rpm={rpm}"),
            "--seed",
            SEED,
        ])
    };
    let out = plan("600");
    assert!(
        out.contains("                limit 600 per minute (sliding_window)\n"),
        "{out}"
    );
    assert!(
        out.contains("                requests_per_unit from metadata:plans:rpm = 600: taken\n"),
        "{out}"
    );
    let out = plan("5000");
    assert!(
        out.contains("                limit 1000 per minute (sliding_window)\n"),
        "{out}"
    );
    assert!(
        out.contains("metadata:plans:rpm = 5000: above the cap: the cap 1000\n"),
        "{out}"
    );
    let out = plan("gold");
    assert!(
        out.contains("metadata:plans:rpm = \"gold\": invalid: the default 1\n"),
        "{out}"
    );
    let out = ok(&[
        "examples/customer-plans/envoy.yaml",
        "--header",
        "x-api-key: k",
        "--json",
    ]);
    let rule: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(rule["key"], serde_json::Value::Null);
    assert_eq!(rule["parts"][0]["value"], "k");
    assert_eq!(rule["carried"][0]["resolved"], "missing");
    assert_eq!(rule["carried"][0]["in_force"], 1);
    assert_eq!(rule["limit"]["requests_per_unit"], 1);
}

/// A rule charged in money says which prices the request's model takes, and that a model
/// without a price is refused; a rule pricing the answer's model says so.
#[test]
fn a_money_rule_names_the_prices_of_the_requests_model() {
    let config = "crates/ratelimit-core/tests/fixtures/good/money.json";
    let cost = |body: &str| {
        let out = ok(&[
            config,
            "--method=POST",
            "--header=x-team: red",
            "--header=x-api-key: k",
            "--body",
            body,
        ]);
        out.lines()
            .filter(|l| l.trim_start().starts_with("cost "))
            .map(|l| l.split_once("reports)").unwrap().1.to_string())
            .collect::<Vec<_>>()
    };
    assert_eq!(
        cost(r#"{"model": "o4-mini-2025-04-16", "max_tokens": 100}"#),
        [
            "; model \"o4-mini-2025-04-16\" priced as \"o4-mini*\": input 1100000, cached input \
             275000, output 4400000 usd-micros per 1M tokens",
            "; priced by the model the answer names",
        ]
    );
    assert_eq!(
        cost(r#"{"model": "o3"}"#)[0],
        "; model \"o3\": no price, refused with a 400 (price.default: \"refuse\")"
    );
    assert_eq!(
        cost("not json")[0],
        "; no model named: no price, refused with a 400 (price.default: \"refuse\")"
    );
}

#[test]
fn a_leased_shared_rule_says_each_envoy_shares_its_part() {
    let config = "crates/ratelimit-core/tests/fixtures/good/share-lease.json";
    let out = ok(&[
        config,
        "--header",
        "x-team: a",
        "--header",
        "x-team-weight: 3",
    ]);
    assert!(
        out.contains("global lease (cluster ratelimit, domain gateway)")
            && out.contains(
                "shared: this tenant weighs 3, one band; alone it may use the whole limit; \
                 while the limit is contended, its share is at least 485 x 3 / the weights of \
                 the tenants active then; leased for the whole fleet: each Envoy shares its \
                 part of the limit, learned from the service's answers, among the tenants it \
                 sees"
            ),
        "{out}"
    );
}

#[test]
fn a_shared_rule_names_the_tenants_weight_and_band_and_what_its_share_is() {
    let config = "crates/ratelimit-core/tests/fixtures/good/share.json";
    let out = ok(&[config, "--path", "/v1/chat", "--header", "x-team: a"]);
    assert!(
        out.contains(
            "shared: this tenant weighs 1, band batch (from \
             metadata:envoy.filters.http.ext_authz:band = nothing); alone it may use the whole \
             limit; while the limit is contended, its share is at least its band's budget (at \
             most 485) x 1 / the weights of the tenants active then"
        ),
        "{out}"
    );
    let out = ok(&[
        config,
        "--path",
        "/v1/chat",
        "--header",
        "x-team: a",
        "--metadata",
        "envoy.filters.http.ext_authz:weight=250",
        "--metadata",
        "envoy.filters.http.ext_authz:band=interactive",
    ]);
    assert!(
        out.contains("share.weight from metadata:envoy.filters.http.ext_authz:weight = 250: above the cap: the cap 100"),
        "{out}"
    );
    assert!(
        out.contains("this tenant weighs 100, band interactive"),
        "{out}"
    );
    let out = ok(&[config, "--header", "x-api-key: k", "--json"]);
    let simple: serde_json::Value = serde_json::from_str(out.lines().last().unwrap()).unwrap();
    assert_eq!(
        simple["share"],
        serde_json::json!({"weight": 1, "weight_from": null, "band": "default",
                           "band_from": null, "band_value": null, "handed_out": 97})
    );
}
