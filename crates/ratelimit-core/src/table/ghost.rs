//! The ghosts of forgotten keys. Forgotten is not forgiven: a live key the table evicts leaves a
//! [`Ghost`] in its bucket, its [`Trace`] (what it used, until when) under 32 bits of its
//! fingerprint ([`tag_of`]), and a key that comes back starts from that trace
//! ([`crate::limiter::Policy::seeded`]), not from a fresh budget. A bucket keeps
//! [`GHOSTS`] ghosts. With no room for another: while fewer than two of them (the new one
//! included) are full, the lightest light one is dropped (a flood of one-off keys costs nobody
//! anything); otherwise two full ones, of one rule if there are such, become one that refuses
//! every key of its rule it stands for until the later of their ends (a merged ghost lists up
//! to three keys of one rule by their own bits, else keeps a set of 32 marks, two per key,
//! taken from its tag). So a key that reached its limit is never
//! forgiven, a key below it only what it had used, and only when its ghost is the lightest of
//! its bucket's light ones; an innocent key pays only when a merged ghost of its rule takes it
//! for one of its own. Owns the ghosts' layout in a bucket's bytes and their rules; uses the limiters'
//! states and traces only.

use super::{GHOSTS, GHOST_LEN};
use crate::limiter::{State, Trace};

/// The trace of a forgotten key, or of several merged into one, kept in its bucket: see the
/// module's documentation.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Ghost {
    /// One key's ghost: its fingerprint's tag ([`tag_of`]). A merged ghost: its keys, as
    /// `listed` says.
    pub tag: u32,
    /// It stands for several keys of its rule: those it lists, else every key whose two marks
    /// ([`marks_of`]) are in its set.
    pub merged: bool,
    /// A merged ghost of one rule that lists its keys: 2, the 16 bits of its own hash of each
    /// of two keys ([`own_of`]); 3, the low 10 of each of three. 0: a set of marks
    /// ([`Ghost::keys`]).
    pub listed: u8,
    /// A merged ghost: the rule tag ([`rule_of`]) of the keys it stands for; `None`: keys of
    /// several rules, and it stands for keys of any rule. (One key's ghost: `None`, its tag
    /// holds its rule's, [`Ghost::rule`].)
    pub rule: Option<u16>,
    /// Every key it stands for is refused until `until_s`: the fleet had refused the key, or
    /// the ghost is merged.
    pub blocked: bool,
    /// The key(s) had reached their limit (or it was not known).
    pub full: bool,
    /// The requests remembered, as [`weight_code`] (rounded up); a merged ghost refuses.
    pub weight: u16,
    /// When they stop counting, whole seconds since the epoch, rounded up; 0: no ghost.
    pub until_s: u32,
}

/// A fingerprint's ghost tag: its top 32 bits, its rule's tag ([`crate::key::TAG_MASK`]) and
/// 16 bits of the key's own hash above the bits that choose its bucket. Two keys of a bucket
/// share one about once in 2³² pairs.
pub fn tag_of(fp: u64) -> u32 {
    u32::try_from(fp >> 32).unwrap_or(u32::MAX)
}

/// The rule tag of a ghost tag: its top 16 bits ([`crate::key::TAG_MASK`]).
pub fn rule_of(tag: u32) -> u16 {
    u16::try_from(tag >> 16).unwrap_or(0)
}

/// The 16 bits of a key's own hash in its ghost tag (the rest is its rule's tag).
pub fn own_of(tag: u32) -> u16 {
    u16::try_from(tag & 0xffff).unwrap_or(0)
}

/// The two marks a key with ghost tag `tag` sets in a merged ghost's set of 32: two 5-bit
/// fields of the key's own bits of its tag, as one 32-bit mask.
pub fn marks_of(tag: u32) -> u32 {
    (1u32 << (tag & 31)) | (1u32 << ((tag >> 5) & 31))
}

/// A weight in 16 bits, rounded up: exact below 2,048, then 11 significant bits (at most 1
/// part in 2,048 more), up to about 4.4 × 10¹² (the largest code stands for anything more).
pub fn weight_code(weight: u64) -> u16 {
    if weight < 0x800 {
        return u16::try_from(weight).unwrap_or(0);
    }
    let shift = 64 - weight.leading_zeros() - 12; // weight >> shift is 2,048..=4,095
    let mut e = u64::from(shift) + 1;
    let mut m = weight.div_ceil(1 << shift) - 0x800;
    if m == 0x800 {
        e += 1;
        m = 0;
    }
    if e > 31 {
        return u16::MAX;
    }
    u16::try_from((e << 11) | m).unwrap_or(u16::MAX)
}

/// The weight a [`weight_code`] stands for (the largest code: any weight at all).
pub fn weight_of(code: u16) -> u64 {
    let (e, m) = (u64::from(code >> 11), u64::from(code & 0x7ff));
    if code == u16::MAX {
        u64::MAX
    } else if e == 0 {
        m
    } else {
        (0x800 | m) << (e - 1)
    }
}

impl Ghost {
    /// The ghost of the key `fp`, forgotten with `trace`, its limit `limit` ([`super::limit_code`]; 0:
    /// not known, taken as reached).
    pub fn of(fp: u64, trace: &Trace, limit: u16) -> Ghost {
        Ghost {
            tag: tag_of(fp),
            merged: false,
            listed: 0,
            rule: None,
            blocked: trace.blocked,
            full: trace.blocked || limit == 0 || trace.weight >= weight_of(limit),
            weight: weight_code(trace.weight),
            until_s: u32::try_from(trace.until_ms.div_ceil(1000)).unwrap_or(u32::MAX),
        }
    }

    /// What it holds for a key it stands for: at least the trace it was made from; a merged
    /// ghost refuses until its end.
    pub fn trace(&self) -> Trace {
        Trace {
            weight: if self.merged {
                u64::MAX
            } else {
                weight_of(self.weight)
            },
            until_ms: u64::from(self.until_s) * 1000,
            blocked: self.blocked || self.merged,
        }
    }

    /// Whether it still counts at `now_ms`.
    pub fn live(&self, now_ms: u64) -> bool {
        u64::from(self.until_s) * 1000 > now_ms
    }

    /// The set of marks of the keys it stands for (of a list: its keys' marks).
    pub fn keys(&self) -> u32 {
        match (self.merged, self.members()) {
            (false, _) => marks_of(self.tag),
            (true, Some((keys, n))) => keys
                .iter()
                .take(n)
                .fold(0, |set, &k| set | marks_of(u32::from(k))),
            (true, None) => self.tag,
        }
    }

    /// The keys it lists, by their own bits ([`own_of`]; of a list of three, the low 10 only),
    /// and how many: one key's ghost and lists; `None` for a set of marks.
    fn members(&self) -> Option<([u16; 3], usize)> {
        match (self.merged, self.listed) {
            (false, _) => Some(([own_of(self.tag), 0, 0], 1)),
            (true, 2) => Some(([own_of(self.tag >> 16), own_of(self.tag), 0], 2)),
            (true, 3) => {
                let ten = |shift: u32| own_of(self.tag >> shift) & 0x3ff;
                Some(([ten(20), ten(10), ten(0)], 3))
            }
            _ => None,
        }
    }

    /// The rule tag of the keys it stands for (`None`: several rules').
    pub fn rule(&self) -> Option<u16> {
        if self.merged {
            self.rule
        } else {
            Some(rule_of(self.tag))
        }
    }

    /// Whether it stands for the key `fp`.
    pub fn covers(&self, fp: u64) -> bool {
        let tag = tag_of(fp);
        if !self.merged {
            return self.tag == tag;
        }
        if self.rule().is_some_and(|r| r != rule_of(tag)) {
            return false;
        }
        match (self.listed, self.members()) {
            (2, Some((keys, _))) => keys.iter().take(2).any(|&k| k == own_of(tag)),
            (3, Some((keys, _))) => keys.contains(&(own_of(tag) & 0x3ff)),
            _ => {
                let marks = marks_of(tag);
                self.keys() & marks == marks
            }
        }
    }

    /// One ghost that stands for every key either does: it refuses them all until the later of
    /// their ends. Keys of one rule, three at most, are listed (two by 16 bits each, three by
    /// 10: another key is taken for one of them about once in 32,768 or 341); more, or keys of
    /// two rules, become a set of marks (two of 32 a key: with four keys a key of the rule
    /// falls under it about once in 16).
    fn merged(&self, other: &Ghost) -> Ghost {
        let rule = self.rule().filter(|&r| other.rule() == Some(r));
        let mut ghost = Ghost {
            tag: self.keys() | other.keys(),
            merged: true,
            listed: 0,
            rule,
            blocked: true,
            full: true,
            weight: u16::MAX,
            until_s: self.until_s.max(other.until_s),
        };
        if let (Some(_), Some((a, n)), Some((b, m))) = (rule, self.members(), other.members()) {
            // Two keys' ghosts (n + m = 2), or one key's and a list of two (3).
            let keys = a.iter().take(n).chain(b.iter().take(m));
            let (width, mask) = if n + m == 2 {
                (16, 0xffff)
            } else {
                (10, 0x3ff)
            };
            if n + m <= 3 {
                ghost.listed = u8::try_from(n + m).unwrap_or(0);
                ghost.tag = keys.fold(0, |tag, &k| tag << width | u32::from(k & mask));
            }
        }
        ghost
    }

    pub(super) fn encode(&self, out: &mut [u8]) {
        let mut bytes = [0u8; GHOST_LEN];
        if self.until_s != 0 {
            // A list is kept only with its rule (none is made without one): without, its keys'
            // marks, which a decoder reads as a set that covers them.
            let (tag, listed) = match (self.merged, self.listed, self.rule) {
                (true, 2 | 3, Some(_)) => (self.tag, self.listed),
                (true, _, _) => (self.keys(), 0),
                (false, _, _) => (self.tag, 0),
            };
            let [t0, t1, t2, t3] = tag.to_le_bytes();
            // A merged ghost refuses whatever its weight: its two bytes keep its rule's tag.
            let (one_rule, weight) = match (self.merged, self.rule) {
                (true, Some(rule)) => (true, rule),
                (true, None) => (false, u16::MAX),
                (false, _) => (false, self.weight),
            };
            let [w0, w1] = weight.to_le_bytes();
            let [u0, u1, u2, u3] = self.until_s.to_le_bytes();
            let listed = listed << 4;
            let flags = u8::from(self.merged)
                | (u8::from(self.full) << 1)
                | (u8::from(self.blocked) << 2)
                | (u8::from(one_rule) << 3)
                | listed;
            bytes = [t0, t1, t2, t3, flags, w0, w1, u0, u1, u2, u3];
        }
        if let Some(dst) = out.get_mut(..GHOST_LEN) {
            dst.copy_from_slice(&bytes);
        }
    }

    /// Never fails: any 11 bytes are some ghost.
    pub(super) fn decode(raw: &[u8]) -> Ghost {
        let b = |i: usize| raw.get(i).copied().unwrap_or(0);
        let tag = u32::from_le_bytes([b(0), b(1), b(2), b(3)]);
        let merged = b(4) & 1 != 0;
        let weight = u16::from_le_bytes([b(5), b(6)]);
        let (rule, weight) = match (merged, b(4) & 8 != 0) {
            (false, _) => (None, weight),
            (true, true) => (Some(weight), u16::MAX),
            (true, false) => (None, u16::MAX),
        };
        // A list needs its rule: without one, a set of marks.
        let listed = match (merged, rule, b(4) >> 4 & 3) {
            (true, Some(_), n @ (2 | 3)) => n,
            _ => 0,
        };
        Ghost {
            tag,
            merged,
            listed,
            rule,
            full: b(4) & 2 != 0,
            blocked: b(4) & 4 != 0,
            weight,
            until_s: u32::from_le_bytes([b(7), b(8), b(9), b(10)]),
        }
    }
}

/// What the live ghosts among `ghosts` hold for `fp` at `now_ms`.
pub(super) fn haunting(ghosts: impl Iterator<Item = Ghost>, fp: u64, now_ms: u64) -> Option<Trace> {
    ghosts
        .filter(|g| g.live(now_ms) && g.covers(fp))
        .map(|g| g.trace())
        .reduce(Trace::max)
}

/// Keeps `ghost` among a bucket's ghosts at `now_ms`: in a free place (no ghost, or one that
/// no longer counts), else, while fewer than two of the five are full, without the lightest
/// light one; else with the two full ones whose merged ghost is the most precise merged.
pub(super) fn haunt(ghosts: &mut [Ghost; GHOSTS], ghost: Ghost, now_ms: u64) {
    if let Some(free) = ghosts.iter_mut().find(|g| !g.live(now_ms)) {
        *free = ghost;
        return;
    }
    // No room. While fewer than two of the ghosts (the new one included) are full, the lightest
    // light one goes (among equals, the one that ends first): a key below its limit loses what
    // it had used, and no key at its limit is ever dropped. Otherwise two full ones whose merged
    // set of keys is smallest become one (it refuses them all, and the few others it covers).
    let mut all = [ghost; GHOSTS + 1];
    for (a, g) in all.iter_mut().zip(ghosts.iter()) {
        *a = *g;
    }
    let (gone, merged) = if all.iter().filter(|g| g.full).count() < 2 {
        let lightest = all
            .iter()
            .enumerate()
            .filter(|(_, g)| !g.full)
            .min_by_key(|(_, g)| (g.weight, g.until_s));
        match lightest {
            Some((i, _)) => (i, None),
            None => return,
        }
    } else {
        // The pair whose merged ghost stands for the fewest other keys: of one rule (the
        // other rules' keys stay clear of it), with the smallest set.
        let mut best: Option<((bool, u8, u32), usize, usize)> = None;
        for (i, a) in all.iter().enumerate().filter(|(_, g)| g.full) {
            for (j, b) in all.iter().enumerate().skip(i + 1).filter(|(_, g)| g.full) {
                let m = a.merged(b);
                // Lists of two, then of three, before a set of marks (see [`Ghost::merged`]).
                let kind = match m.listed {
                    2 => 0,
                    3 => 1,
                    _ => 2,
                };
                let covered = (m.rule().is_none(), kind, m.keys().count_ones());
                if best.is_none_or(|(least, ..)| covered < least) {
                    best = Some((covered, i, j));
                }
            }
        }
        let Some((_, i, j)) = best else { return };
        match (all.get(i), all.get(j)) {
            (Some(a), Some(b)) => (j, Some((i, a.merged(b)))),
            _ => return,
        }
    };
    if let Some((i, m)) = merged {
        if let Some(a) = all.get_mut(i) {
            *a = m;
        }
    }
    let kept = all.iter().enumerate().filter(|(k, _)| *k != gone);
    for (slot, (_, g)) in ghosts.iter_mut().zip(kept) {
        *slot = *g;
    }
}

/// A key placed in a bucket with `state` at `now_ms` takes back its own ghost (one that stands
/// for it alone) once its state holds at least what the ghost did.
pub(super) fn lay(ghosts: &mut [Ghost; GHOSTS], fp: u64, state: &State, now_ms: u64) {
    let held = state.trace(now_ms);
    for g in ghosts.iter_mut() {
        if g.until_s != 0 && !g.merged && g.tag == tag_of(fp) {
            let own = g.trace();
            if held.is_some_and(|h| h.weight >= own.weight && h.until_ms >= own.until_ms) {
                *g = Ghost::default();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::table::limit_code;

    #[test]
    fn weights_code_rounded_up_and_limits_rounded_down() {
        let mut last = 0;
        for w in (0..5_000u64).chain((12..62).map(|b| (1u64 << b) + 12_345)) {
            let code = weight_code(w);
            let back = weight_of(code);
            assert!(back >= w, "{w} -> {back}");
            assert!(
                back - w <= w / 2048 + 1 || code == u16::MAX,
                "{w} -> {back}"
            );
            assert!(code >= last, "monotone at {w}");
            last = code;
            let l = limit_code(w);
            assert!(
                weight_of(l) <= w && (w == 0) == (l == 0),
                "{w} -> {}",
                weight_of(l)
            );
        }
        assert_eq!(weight_of(weight_code(u64::MAX)), u64::MAX);
    }

    #[test]
    fn ghosts_round_trip_and_cover_what_they_stand_for() {
        let fp = 0x7700_abcd_0000_1235u64;
        let trace = Trace {
            weight: 70_000,
            until_ms: 61_001,
            blocked: false,
        };
        let g = Ghost::of(fp, &trace, limit_code(100_000));
        assert!(!g.full && !g.merged && g.covers(fp) && !g.covers(fp ^ (1 << 40)));
        assert!(g.trace().weight >= 70_000 && g.trace().until_ms >= 61_001);
        let mut raw = [0u8; GHOST_LEN];
        g.encode(&mut raw);
        assert_eq!(Ghost::decode(&raw), g);
        assert!(Ghost::of(fp, &trace, limit_code(70_000)).full);
        assert!(
            Ghost::of(fp, &trace, 0).full,
            "a limit not known counts as reached"
        );
        // A merged ghost stands for both keys, refuses them, and for few others.
        let other = 0x7700_1234_0000_0001u64;
        let m = g.merged(&Ghost::of(other, &trace, 0));
        assert!(m.covers(fp) && m.covers(other) && m.trace().blocked);
        let mut rng = crate::testkit::Rng(7);
        let of_rule = |rule: u64, rng: &mut crate::testkit::Rng| rule << 48 | rng.next() >> 16;
        let strangers = (0..10_000)
            .filter(|_| m.covers(of_rule(0x7700, &mut rng)))
            .count();
        assert!(strangers < 300, "{strangers} of 10,000 other keys covered");
        // Keys of another rule: never, unless keys of two rules were merged.
        assert_eq!(m.rule, Some(0x7700));
        assert!(!m.covers(fp ^ 1 << 62));
        let across = m.merged(&Ghost::of(0x1100_0000_0000_0001, &trace, 0));
        assert_eq!(across.rule, None);
        assert!(across.covers(fp ^ 1 << 62));
        // Two keys of a rule are listed by 16 bits each, three by 10, four become a set.
        assert_eq!(m.listed, 2);
        let third = Ghost::of(0x7700_5555_0000_0001, &trace, 0);
        let fourth = Ghost::of(0x7700_0f0f_0000_0001, &trace, 0);
        let three = m.merged(&third);
        let four = three.merged(&fourth);
        assert_eq!((three.listed, four.listed), (3, 0));
        for fp in [fp, other, 0x7700_5555_0000_0001] {
            assert!(three.covers(fp) && four.covers(fp), "{fp:x}");
        }
        assert!(four.covers(0x7700_0f0f_0000_0001));
        let covered = |g: &Ghost, rng: &mut crate::testkit::Rng| {
            (0..100_000)
                .filter(|_| g.covers(of_rule(0x7700, rng)))
                .count()
        };
        let (by_two, by_three, by_four) = (
            covered(&m, &mut rng),
            covered(&three, &mut rng),
            covered(&four, &mut rng),
        );
        assert!(by_two < 20, "{by_two} of 100,000 covered by a list of two");
        assert!(
            by_three < 600,
            "{by_three} of 100,000 covered by a list of three"
        );
        assert!(
            by_four > by_three,
            "{by_four} of 100,000 covered by a set of four"
        );
        // A set keeps bits 4-5 of its flags clear; a list
        // that lost its rule is written as the set of its keys' marks.
        four.encode(&mut raw);
        assert_eq!(raw[4] & 0x30, 0);
        let ruleless = Ghost {
            rule: None,
            ..three
        };
        ruleless.encode(&mut raw);
        let back = Ghost::decode(&raw);
        assert_eq!((back.listed, back.rule), (0, None));
        for fp in [fp, other, 0x7700_5555_0000_0001] {
            assert!(back.covers(fp), "{fp:x}");
        }
        for ghost in [m, across, three, four] {
            ghost.encode(&mut raw);
            assert_eq!(Ghost::decode(&raw), ghost);
        }
    }

    /// Full ghosts of two rules in one bucket merge with their own rule's: a flood against one
    /// rule leaves the other rule's new keys clear.
    #[test]
    fn full_ghosts_merge_within_their_rule() {
        let trace = Trace {
            weight: 5,
            until_ms: 60_000,
            blocked: false,
        };
        let (a, b) = (0x1111u64 << 48, 0x2222u64 << 48);
        let key = |rule: u64, i: u64| rule | ((i * 0x9e37_79b9) & 0xffff) << 32 | 1;
        let mut ghosts = [Ghost::default(); GHOSTS];
        for i in 0..12 {
            let rule = if i % 3 == 2 { b } else { a };
            haunt(&mut ghosts, Ghost::of(key(rule, i), &trace, 0), 1_000);
        }
        assert!(ghosts.iter().all(|g| g.rule().is_some()), "{ghosts:?}");
        for i in 0..12 {
            let rule = if i % 3 == 2 { b } else { a };
            assert!(ghosts.iter().any(|g| g.covers(key(rule, i))), "key {i}");
        }
        // Rule b's keys it never saw: only b's ghosts may stand for them.
        let clear = (100..1_100).filter(|&i| {
            !ghosts
                .iter()
                .filter(|g| g.rule() == Some(0x1111))
                .any(|g| g.covers(key(b, i)))
        });
        assert_eq!(clear.count(), 1_000);
    }
}
