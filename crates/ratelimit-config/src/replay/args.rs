//! The command line of `ratelimit-config replay`.

use super::input::{Field, ENVOY_DEFAULT_FORMAT};
use ratelimit_core::config::Unit;

/// How to use the subcommand (printed on a usage error).
pub const USAGE: &str = "\
usage: ratelimit-config replay [OPTIONS] CONFIG LOG...
  Runs every request of Envoy access logs through the filter's own decision code and reports,
  per rule, what the configuration would have allowed and limited.
  CONFIG  the plugin configuration: JSON, YAML or Istio WasmPlugin manifests (as check reads it)
  LOG     Envoy access logs: the default text format, a --format, or JSON lines; - for stdin
options:
  --what-if RULE=LIMIT   also replay with RULE's limit set to LIMIT: N or N/UNIT (a rate) or N
                         (in_flight.max); repeatable, each is one more configuration
  --plugin NAME          the WasmPlugin to replay, when CONFIG holds several
  --format FORMAT        the text log format, as Envoy's format string (default: Envoy's default)
  --field FIELD=KEY      where FIELD comes from: a JSON key, or a text format command in %...%;
                         FIELD: start_time remote_address method path authority duration
                         bytes_sent header:NAME response:NAME; repeatable
  --reorder-window SECS  how late an entry may come after entries that started later (default 10)
  --reorder-max N        the most entries held to reorder them (default 100000)
  --top N                limited keys listed per rule (default 10)
  --raw-keys             also show each key's raw value (it may be an API key)
  --json                 print the report as JSON
  --html FILE            also write the report as HTML, with a timeline per rule";

/// A `--what-if RULE=LIMIT`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WhatIf {
    /// The rule's name.
    pub rule: String,
    /// The new `requests_per_unit` (or `in_flight.max`), as written: the configuration it
    /// makes is checked like any other (a 0 is refused there, with its field path).
    pub limit: u64,
    /// The new unit, if given.
    pub unit: Option<Unit>,
    /// As written on the command line.
    pub text: String,
}

impl WhatIf {
    /// Reads `RULE=N` or `RULE=N/UNIT`.
    pub fn parse(text: &str) -> Result<WhatIf, String> {
        let bad = || format!("--what-if {text}: expected RULE=N or RULE=N/UNIT");
        let (rule, limit) = text.rsplit_once('=').ok_or_else(bad)?;
        let (n, unit) = match limit.split_once('/') {
            Some((n, u)) => (n, Some(u)),
            None => (limit, None),
        };
        let limit: u64 = n.trim().parse().map_err(|_| bad())?;
        let unit = match unit {
            None => None,
            Some(u) => Some(match u.trim() {
                "second" | "s" => Unit::Second,
                "minute" | "m" => Unit::Minute,
                "hour" | "h" => Unit::Hour,
                "day" | "d" => Unit::Day,
                "week" => Unit::Week,
                "month" => Unit::Month,
                other => {
                    return Err(format!(
                    "--what-if {text}: unknown unit {other:?} (expected second, minute, hour, day, week, month)"
                ))
                }
            }),
        };
        if rule.is_empty() {
            return Err(bad());
        }
        Ok(WhatIf {
            rule: rule.to_string(),
            limit,
            unit,
            text: text.to_string(),
        })
    }
}

/// What the command line asks for.
#[derive(Clone, Debug, PartialEq)]
pub struct Options {
    /// The configuration file.
    pub config: String,
    /// The logs.
    pub logs: Vec<String>,
    /// The WasmPlugin to replay.
    pub plugin: Option<String>,
    /// One more configuration each.
    pub what_ifs: Vec<WhatIf>,
    /// The text log format.
    pub format: String,
    /// `--field` overrides.
    pub fields: Vec<(Field, String)>,
    /// The reorder window, ms.
    pub reorder_window_ms: u64,
    /// The most entries the reorder buffer holds.
    pub reorder_max: usize,
    /// Limited keys listed per rule.
    pub top: usize,
    /// Show raw keys.
    pub raw_keys: bool,
    /// Print JSON.
    pub json: bool,
    /// Write HTML here.
    pub html: Option<String>,
}

impl Options {
    /// Reads the arguments after `replay`.
    pub fn parse(args: &[String]) -> Result<Options, String> {
        let mut o = Options {
            config: String::new(),
            logs: Vec::new(),
            plugin: None,
            what_ifs: Vec::new(),
            format: ENVOY_DEFAULT_FORMAT.to_string(),
            fields: Vec::new(),
            reorder_window_ms: 10_000,
            reorder_max: 100_000,
            top: 10,
            raw_keys: false,
            json: false,
            html: None,
        };
        let mut positional = Vec::new();
        let mut flags = crate::flags::Flags::new(args);
        while let Some((flag, inline)) = flags.next_arg() {
            match flag {
                "--what-if" => o.what_ifs.push(WhatIf::parse(&flags.value(flag, inline)?)?),
                "--plugin" => o.plugin = Some(flags.value(flag, inline)?),
                "--format" => o.format = flags.value(flag, inline)?,
                "--field" => {
                    let v = flags.value(flag, inline)?;
                    let (f, k) = v
                        .split_once('=')
                        .filter(|(_, k)| !k.is_empty())
                        .ok_or_else(|| format!("--field {v}: expected FIELD=KEY"))?;
                    let field =
                        Field::parse(f).ok_or_else(|| format!("--field {v}: unknown field {f}"))?;
                    o.fields.push((field, k.to_string()));
                }
                "--reorder-window" => {
                    let v = flags.value(flag, inline)?;
                    let secs: f64 = v
                        .parse()
                        .ok()
                        .filter(|s: &f64| s.is_finite() && *s >= 0.0 && *s <= 86_400.0)
                        .ok_or_else(|| format!("--reorder-window {v}: seconds, 0 to 86400"))?;
                    o.reorder_window_ms = (secs * 1000.0).round() as u64;
                }
                "--reorder-max" => o.reorder_max = number(flag, &flags.value(flag, inline)?)?,
                "--top" => o.top = number(flag, &flags.value(flag, inline)?)?,
                "--raw-keys" => o.raw_keys = true,
                "--json" => o.json = true,
                "--html" => o.html = Some(flags.value(flag, inline)?),
                "-" => positional.push(flag.to_string()),
                f if f.starts_with('-') => return Err(format!("unknown option {f}")),
                _ => positional.push(flag.to_string()),
            }
        }
        let mut positional = positional.into_iter();
        o.config = positional.next().ok_or("no CONFIG")?;
        o.logs = positional.collect();
        if o.logs.is_empty() {
            return Err("no LOG".into());
        }
        if o.reorder_max == 0 {
            return Err("--reorder-max must be at least 1".into());
        }
        Ok(o)
    }
}

fn number(flag: &str, v: &str) -> Result<usize, String> {
    v.parse()
        .map_err(|_| format!("{flag} {v}: expected a whole number"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(a: &[&str]) -> Vec<String> {
        a.iter().map(ToString::to_string).collect()
    }

    #[test]
    fn options() {
        let o = Options::parse(&args(&[
            "c.yaml",
            "--what-if",
            "per-ip=50",
            "--what-if=per-ip=2/second",
            "a.log",
            "--field",
            "remote_address=client",
            "--reorder-window",
            "2.5",
            "--json",
            "-",
        ]))
        .unwrap();
        assert_eq!(o.config, "c.yaml");
        assert_eq!(o.logs, ["a.log", "-"]);
        assert_eq!(o.what_ifs.len(), 2);
        assert_eq!(o.what_ifs[1].unit, Some(Unit::Second));
        assert_eq!(o.what_ifs[1].limit, 2);
        assert_eq!(o.what_ifs[1].rule, "per-ip");
        // A limit the filter would refuse is the configuration's error, not a usage error.
        let zero = Options::parse(&args(&["c.json", "a.log", "--what-if", "per-ip=0"])).unwrap();
        assert_eq!(zero.what_ifs[0].limit, 0);
        // A billing period: a month is the configuration's to accept (fixed_window only).
        let month = WhatIf::parse("budget=5000/month").unwrap();
        assert_eq!((month.limit, month.unit), (5000, Some(Unit::Month)));
        assert_eq!(WhatIf::parse("b=1/week").unwrap().unit, Some(Unit::Week));
        assert_eq!(o.fields, [(Field::RemoteAddress, "client".to_string())]);
        assert_eq!(o.reorder_window_ms, 2500);
        assert!(o.json && !o.raw_keys);
        assert_eq!(o.format, ENVOY_DEFAULT_FORMAT);
    }

    #[test]
    fn usage_errors() {
        for bad in [
            &["c.json"][..],
            &["c.json", "a.log", "--what-if", "per-ip"],
            &["c.json", "a.log", "--what-if", "per-ip=-1"],
            &["c.json", "a.log", "--what-if", "=5"],
            &["c.json", "a.log", "--what-if", "per-ip=5/fortnight"],
            &["c.json", "a.log", "--field", "client=x"],
            &["c.json", "a.log", "--top"],
            &["c.json", "a.log", "--reorder-window", "-1"],
            &["c.json", "a.log", "--bogus"],
        ] {
            assert!(Options::parse(&args(bad)).is_err(), "{bad:?}");
        }
    }
}
