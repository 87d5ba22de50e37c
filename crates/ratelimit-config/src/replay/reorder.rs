//! Putting log entries back in start-time order. Envoy writes an entry when its stream ends,
//! so a log is in order of end times, roughly: a long request's entry comes after those of
//! requests that started later. [`Reorder`] holds entries for a bounded window of start times
//! (and at most a bounded number of them) and lets them go in order; [`Merge`] interleaves
//! several logs (several proxies, several files) by start time.

use super::input::Entry;
use std::cmp::{Ordering, Reverse};
use std::collections::BinaryHeap;

/// An entry waiting, ordered by start time, then by arrival (boxed: the heap moves it often).
#[derive(Debug)]
struct Waiting {
    start_ms: u64,
    seq: u64,
    entry: Box<Entry>,
}

impl PartialEq for Waiting {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}
impl Eq for Waiting {}
impl PartialOrd for Waiting {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Waiting {
    fn cmp(&self, other: &Self) -> Ordering {
        (self.start_ms, self.seq).cmp(&(other.start_ms, other.seq))
    }
}

/// What reordering met, for the report.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Disorder {
    /// Entries that came after an entry that started later.
    pub out_of_order: u64,
    /// By how much the latest of those started before the latest start seen, ms.
    pub max_disorder_ms: u64,
    /// Entries that came after a later-starting entry had already been let go (beyond the
    /// window, or the buffer was full): replayed out of order.
    pub late: u64,
    /// By how much the latest of those started before the last entry let go, ms.
    pub max_late_ms: u64,
}

impl Disorder {
    /// Adds another log's counts.
    pub fn add(&mut self, other: &Disorder) {
        self.out_of_order += other.out_of_order;
        self.max_disorder_ms = self.max_disorder_ms.max(other.max_disorder_ms);
        self.late += other.late;
        self.max_late_ms = self.max_late_ms.max(other.max_late_ms);
    }
}

/// A reorder buffer: an entry is let go once an entry starting `window_ms` later has been
/// seen, or when more than `max` entries wait (the earliest goes first).
#[derive(Debug)]
pub struct Reorder {
    window_ms: u64,
    max: usize,
    heap: BinaryHeap<Reverse<Waiting>>,
    seq: u64,
    newest_ms: Option<u64>,
    released_ms: Option<u64>,
    /// What was met so far.
    pub disorder: Disorder,
}

impl Reorder {
    /// A buffer for a window of `window_ms` holding at most `max` (≥ 1) entries.
    pub fn new(window_ms: u64, max: usize) -> Reorder {
        Reorder {
            window_ms,
            max: max.max(1),
            heap: BinaryHeap::new(),
            seq: 0,
            newest_ms: None,
            released_ms: None,
            disorder: Disorder::default(),
        }
    }

    /// Takes an entry in.
    pub fn push(&mut self, entry: Entry) {
        let start = entry.start_ms;
        match self.newest_ms {
            Some(newest) if start < newest => {
                self.disorder.out_of_order += 1;
                self.disorder.max_disorder_ms = self.disorder.max_disorder_ms.max(newest - start);
            }
            _ => self.newest_ms = Some(start),
        }
        if let Some(released) = self.released_ms.filter(|r| start < *r) {
            self.disorder.late += 1;
            self.disorder.max_late_ms = self.disorder.max_late_ms.max(released - start);
        }
        self.seq += 1;
        self.heap.push(Reverse(Waiting {
            start_ms: start,
            seq: self.seq,
            entry: Box::new(entry),
        }));
    }

    /// The earliest entry, if it may go: its window has passed, or the buffer is over `max`.
    pub fn ready(&mut self) -> Option<Entry> {
        let earliest = self.heap.peek()?.0.start_ms;
        let newest = self.newest_ms.unwrap_or(earliest);
        if self.heap.len() <= self.max && earliest.saturating_add(self.window_ms) > newest {
            return None;
        }
        self.release()
    }

    /// The earliest entry, whatever the window (at the end of the log).
    pub fn release(&mut self) -> Option<Entry> {
        let Reverse(w) = self.heap.pop()?;
        self.released_ms = Some(self.released_ms.map_or(w.start_ms, |r| r.max(w.start_ms)));
        Some(*w.entry)
    }
}

/// Several ordered streams of entries as one, by start time (ties: the earlier stream first).
#[derive(Debug)]
pub struct Merge<I> {
    heads: Vec<(I, Option<Option<Entry>>)>,
}

impl<I: Iterator<Item = Entry>> Merge<I> {
    /// Merges `streams`.
    pub fn new(streams: Vec<I>) -> Merge<I> {
        Merge {
            heads: streams.into_iter().map(|s| (s, None)).collect(),
        }
    }

    /// The streams, in the order given.
    pub fn streams(&self) -> impl Iterator<Item = &I> {
        self.heads.iter().map(|(s, _)| s)
    }
}

impl<I: Iterator<Item = Entry>> Iterator for Merge<I> {
    type Item = Entry;

    fn next(&mut self) -> Option<Entry> {
        let mut best: Option<(usize, u64)> = None;
        for (i, (stream, head)) in self.heads.iter_mut().enumerate() {
            let head = head.get_or_insert_with(|| stream.next());
            if let Some(e) = head {
                if best.is_none_or(|(_, t)| e.start_ms < t) {
                    best = Some((i, e.start_ms));
                }
            }
        }
        let (i, _) = best?;
        self.heads.get_mut(i)?.1.take().flatten()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(start_ms: u64, tag: u64) -> Entry {
        Entry {
            start_ms,
            duration_ms: Some(tag),
            ..Entry::default()
        }
    }

    fn drain(r: &mut Reorder, out: &mut Vec<u64>) {
        while let Some(e) = r.ready() {
            out.push(e.start_ms);
        }
    }

    #[test]
    fn entries_written_at_their_end_come_out_by_their_start() {
        // (start, duration) in the order Envoy writes them: by end time.
        let mut written = vec![(0, 50), (10, 45), (60, 1), (20, 100), (90, 5), (130, 0)];
        written.sort_by_key(|(s, d)| s + d);
        let mut r = Reorder::new(200, 100);
        let mut out = Vec::new();
        for (s, d) in written {
            r.push(entry(s, d));
            drain(&mut r, &mut out);
        }
        assert!(out.is_empty(), "nothing leaves within the window");
        while let Some(e) = r.release() {
            out.push(e.start_ms);
        }
        assert_eq!(out, [0, 10, 20, 60, 90, 130]);
        assert_eq!(
            r.disorder,
            Disorder {
                out_of_order: 1, // 20 (ending at 120) came after 90 (ending at 95)
                max_disorder_ms: 70,
                late: 0,
                max_late_ms: 0
            }
        );
    }

    #[test]
    fn the_window_and_the_size_bound_what_waits() {
        let mut r = Reorder::new(100, 3);
        let mut out = Vec::new();
        for s in [1000, 1050, 1101] {
            r.push(entry(s, 0));
            drain(&mut r, &mut out);
        }
        assert_eq!(out, [1000], "1000 + 100 <= 1101: its window has passed");
        r.push(entry(1102, 0));
        r.push(entry(1103, 0));
        drain(&mut r, &mut out);
        // Four waited, one more than allowed: the earliest went although its window had not
        // passed.
        assert_eq!(out, [1000, 1050]);
        assert_eq!(r.heap.len(), 3);
        // An entry older than what already left is late: it still goes out, first.
        r.push(entry(1010, 0));
        drain(&mut r, &mut out);
        assert_eq!(out, [1000, 1050, 1010]);
        assert_eq!(r.disorder.late, 1);
        assert_eq!(r.disorder.max_late_ms, 40);
        assert_eq!(r.disorder.max_disorder_ms, 93);
    }

    #[test]
    fn equal_starts_keep_their_order() {
        let mut r = Reorder::new(0, 10);
        for tag in 0..3 {
            r.push(entry(5, tag));
        }
        let tags: Vec<_> = std::iter::from_fn(|| r.release())
            .map(|e| e.duration_ms)
            .collect();
        assert_eq!(tags, [Some(0), Some(1), Some(2)]);
    }

    #[test]
    fn merged_streams_interleave_by_start() {
        let a = vec![entry(1, 0), entry(5, 0), entry(9, 0)].into_iter();
        let b = vec![entry(2, 1), entry(5, 1), entry(6, 1)].into_iter();
        let c = Vec::new().into_iter();
        let m = Merge::new(vec![a, b, c]);
        let got: Vec<_> = m.map(|e| (e.start_ms, e.duration_ms)).collect();
        assert_eq!(
            got,
            [
                (1, Some(0)),
                (2, Some(1)),
                (5, Some(0)),
                (5, Some(1)),
                (6, Some(1)),
                (9, Some(0))
            ]
        );
    }
}
