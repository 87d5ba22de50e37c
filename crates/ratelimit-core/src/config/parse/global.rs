//! Reading `global`: a rule's rate limit service (`cluster`, `domain`) and how the rule uses it
//! (`mode`: asking first, reporting afterwards, or leasing blocks of its quota), with
//! `timeout_ms`, `flush_ms` and `max_block`.
//!
//! Uses the reader's helpers and the configuration's types (`super`) only.

use super::*;

impl Validator {
    pub(super) fn global(&mut self, v: &Value, path: &str) -> Option<Global> {
        let map = self.object(
            v,
            path,
            &[
                "cluster",
                "domain",
                "mode",
                "timeout_ms",
                "flush_ms",
                "max_block",
            ],
        )?;
        let mut text = |field: &str| match map.get(field) {
            Some(t) => match self.string(t, &join(path, field)) {
                Some("") => {
                    self.error(&join(path, field), "must not be empty");
                    None
                }
                other => other.map(str::to_string),
            },
            None => {
                self.error(&join(path, field), "required field is missing");
                None
            }
        };
        let cluster = text("cluster");
        let domain = text("domain");
        let mode = match map.get("mode") {
            Some(m) => self.choice(
                m,
                &join(path, "mode"),
                "mode",
                &[
                    ("sync", GlobalMode::Sync),
                    ("async", GlobalMode::Async),
                    ("lease", GlobalMode::Lease),
                ],
            ),
            None => Some(GlobalMode::Sync),
        };
        let mut millis = |field: &str, default: u64| match map.get(field) {
            Some(n) => self
                .integer(n, &join(path, field), 1, 60_000)
                .and_then(|n| u32::try_from(n).ok()),
            None => u32::try_from(default).ok(),
        };
        let timeout_ms = millis("timeout_ms", DEFAULT_GLOBAL_TIMEOUT_MS);
        let flush_ms = millis("flush_ms", DEFAULT_FLUSH_MS);
        if mode == Some(GlobalMode::Sync) && map.contains_key("flush_ms") {
            self.error(
                &join(path, "flush_ms"),
                "only used with \"mode\": \"async\" or \"lease\"",
            );
            return None;
        }
        let max_block = match map.get("max_block") {
            Some(_) if mode != Some(GlobalMode::Lease) => {
                self.error(
                    &join(path, "max_block"),
                    "only used with \"mode\": \"lease\"",
                );
                return None;
            }
            Some(n) => Some(self.integer(n, &join(path, "max_block"), 1, u64::from(u32::MAX))?),
            None => Some(0), // a tenth of the limit, set with the rule's limit
        };
        Some(Global {
            cluster: cluster?,
            domain: domain?,
            mode: mode?,
            timeout_ms: timeout_ms?,
            flush_ms: flush_ms?,
            max_block: max_block?,
        })
    }
}
