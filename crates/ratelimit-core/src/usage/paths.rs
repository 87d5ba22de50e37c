//! The paths a scan looks for, as a trie of segments, and the prefilter's needles.

use super::{MAX_DEPTH, MAX_SLOTS};
use memchr::memmem::Finder;

/// A trie node's index; [`NONE`] is no node.
pub(super) type NodeId = u8;
/// No node: the value sits where no path leads.
pub(super) const NONE: NodeId = u8::MAX;
/// The root node, where every path starts (a document's top-level object).
pub(super) const ROOT: NodeId = 0;

/// JSON paths to find, compiled once at config time. Several paths may share a slot
/// (alternatives).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Paths {
    /// Node 0 is the root.
    nodes: Vec<Node>,
    /// Each node's children are a run of edges sorted by key, so the children whose keys start
    /// with the bytes of a key read so far are a range that narrows as they come.
    edges: Vec<Edge>,
    slots: usize,
    /// `None` when some path could be written in a way no needle finds.
    needles: Option<Needles>,
}

impl Default for Paths {
    /// No paths: a scan finds nothing.
    fn default() -> Paths {
        Paths {
            nodes: vec![Node {
                first: 0,
                end: 0,
                slots: 0,
            }],
            edges: Vec::new(),
            slots: 0,
            needles: None,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
struct Node {
    /// `edges[first..end]` lead to the children.
    first: u16,
    end: u16,
    /// The slots of the paths ending here, a bit each.
    slots: u16,
}

#[derive(Clone, Debug, PartialEq, Eq)]
struct Edge {
    key: Box<[u8]>,
    node: NodeId,
}

/// Substrings one of which is in every document in which a path has a value.
#[derive(Clone, Debug)]
struct Needles {
    bytes: Vec<Box<[u8]>>,
    finders: Vec<Finder<'static>>,
}

// The finders are built from the bytes.
impl PartialEq for Needles {
    fn eq(&self, other: &Needles) -> bool {
        self.bytes == other.bytes
    }
}

impl Eq for Needles {}

impl Paths {
    /// `paths`: (segments, slot). Err(message) for an empty path, an empty segment, >
    /// MAX_DEPTH segments, slot >= MAX_SLOTS (or more than 254 distinct segments in all).
    pub fn new(paths: &[(Vec<String>, usize)]) -> Result<Paths, String> {
        // The trie as it grows: each node's children, then its slots.
        let mut children: Vec<Vec<(&[u8], usize)>> = vec![Vec::new()];
        let mut slot_bits: Vec<u16> = vec![0];
        let mut slots = 0;
        for (segments, slot) in paths {
            let shown = segments.join(".");
            if segments.is_empty() {
                return Err("a usage path needs at least one key".into());
            }
            if segments.len() > MAX_DEPTH {
                return Err(format!(
                    "usage path '{shown}' has {} keys, the most is {MAX_DEPTH}",
                    segments.len()
                ));
            }
            if *slot >= MAX_SLOTS {
                return Err(format!(
                    "usage path '{shown}': slot {slot}, the most is {}",
                    MAX_SLOTS - 1
                ));
            }
            slots = slots.max(slot + 1);
            let mut node = 0;
            for segment in segments {
                if segment.is_empty() {
                    return Err(format!("usage path '{shown}' has an empty key"));
                }
                let key = segment.as_bytes();
                let found = children
                    .get(node)
                    .and_then(|c| c.iter().find(|(k, _)| *k == key))
                    .map(|&(_, n)| n);
                node = match found {
                    Some(n) => n,
                    None => {
                        let n = children.len();
                        if n >= usize::from(NONE) {
                            return Err(format!("usage paths: more than {} keys in all", NONE - 1));
                        }
                        children.push(Vec::new());
                        slot_bits.push(0);
                        if let Some(c) = children.get_mut(node) {
                            c.push((key, n));
                        }
                        n
                    }
                };
            }
            if let Some(bits) = slot_bits.get_mut(node) {
                *bits |= 1 << slot;
            }
        }
        let mut nodes = Vec::with_capacity(children.len());
        let mut edges = Vec::new();
        for (mut c, slots) in children.into_iter().zip(slot_bits) {
            c.sort_unstable();
            let first = edges.len();
            edges.extend(c.into_iter().map(|(key, n)| Edge {
                key: key.into(),
                // Below NONE, checked when the node was made.
                node: NodeId::try_from(n).unwrap_or(NONE),
            }));
            nodes.push(Node {
                // At most 254 edges (one per node but the root).
                first: u16::try_from(first).unwrap_or(0),
                end: u16::try_from(edges.len()).unwrap_or(0),
                slots,
            });
        }
        Ok(Paths {
            nodes,
            edges,
            slots,
            needles: needles(paths),
        })
    }

    /// How many slots the paths fill: one more than the highest slot.
    pub fn slots(&self) -> usize {
        self.slots
    }

    /// The slots of the paths ending at `node`.
    pub(super) fn slots_at(&self, node: NodeId) -> u16 {
        self.nodes.get(usize::from(node)).map_or(0, |n| n.slots)
    }

    /// The edges to `node`'s children, as a range for [`Paths::narrow`].
    pub(super) fn children(&self, node: NodeId) -> (u16, u16) {
        self.nodes
            .get(usize::from(node))
            .map_or((0, 0), |n| (n.first, n.end))
    }

    /// Of the edges `lo..hi`, whose keys all start with the same `pos` bytes, those whose
    /// next bytes are `bytes` (empty when none's are): a key's bytes compared a run at a time.
    pub(super) fn narrow(&self, (lo, hi): (u16, u16), pos: u32, bytes: &[u8]) -> (u16, u16) {
        let at = usize::try_from(pos).unwrap_or(usize::MAX);
        let end = at.saturating_add(bytes.len());
        let edges = self
            .edges
            .get(usize::from(lo)..usize::from(hi))
            .unwrap_or_default();
        let mut found: Option<(u16, u16)> = None;
        for (i, edge) in (lo..).zip(edges) {
            if edge.key.get(at..end) == Some(bytes) {
                found = Some((found.map_or(i, |f| f.0), i + 1));
            } else if found.is_some() {
                // Sorted: the keys with byte `b` there are all together.
                break;
            }
        }
        found.unwrap_or((hi, hi))
    }

    /// The node whose key is exactly the `pos` bytes the edges `lo..hi` share, or NONE.
    pub(super) fn exact(&self, (lo, hi): (u16, u16), pos: u32) -> NodeId {
        // Sorted: a key that is a prefix of the others comes first.
        match self.edges.get(usize::from(lo)) {
            Some(edge) if lo < hi && u32::try_from(edge.key.len()) == Ok(pos) => edge.node,
            _ => NONE,
        }
    }

    /// Whether documents can be prefiltered: see [`Paths::may_match`].
    pub(super) fn prefilters(&self) -> bool {
        self.needles.is_some()
    }

    /// Whether a document without `\u` escapes may hold a value at some path (false only if
    /// it holds none: it contains no needle). The caller checks for `\u`, in the search it
    /// makes anyway for the document's end.
    pub(super) fn may_match(&self, document: &[u8]) -> bool {
        match &self.needles {
            None => true,
            Some(needles) => needles.finders.iter().any(|f| f.find(document).is_some()),
        }
    }
}

/// The prefilter's needles: each path's longest key (a document holding a value at the path
/// contains that key, unless it escapes some character of it, which takes a `\u` for the
/// characters allowed here), reduced to the shortest that cover the others. None
/// when a key has a character JSON may write with another escape (`\/`, `\"`, `\\`, `\n`...)
/// or non-ASCII (raw or escaped, both legal).
fn needles(paths: &[(Vec<String>, usize)]) -> Option<Needles> {
    let mut longest: Vec<&[u8]> = Vec::new();
    for (segments, _) in paths {
        let plain = |s: &String| {
            s.bytes()
                .all(|b| (0x20..0x7f).contains(&b) && !matches!(b, b'/' | b'"' | b'\\'))
        };
        if !segments.iter().all(plain) {
            return None;
        }
        let key = segments.iter().rev().max_by_key(|s| s.len())?;
        longest.push(key.as_bytes());
    }
    longest.sort_unstable_by_key(|k| k.len());
    longest.dedup();
    let mut bytes: Vec<Box<[u8]>> = Vec::new();
    for key in longest {
        // A document with `key` contains any needle `key` contains: one search is enough.
        if !bytes.iter().any(|n| memchr::memmem::find(key, n).is_some()) {
            bytes.push(key.into());
        }
    }
    let finders = bytes.iter().map(|n| Finder::new(n).into_owned()).collect();
    Some(Needles { bytes, finders })
}
