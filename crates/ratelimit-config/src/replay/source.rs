//! One access log as a stream of requests in start-time order: lines read one at a time (of
//! bounded length), parsed by the [`Mapping`], bad ones counted, and put back in order by a
//! [`Reorder`] buffer.

use super::input::{read_line, Entry, Mapping, MAX_LINE};
use super::reorder::Reorder;
use std::io::BufRead;
use std::sync::Arc;

/// How many bad lines are listed by number (all are counted).
pub const LISTED_BAD_LINES: usize = 5;

/// A log being read.
pub struct LogSource {
    /// The log's name as given (`-` for standard input).
    pub name: String,
    reader: Box<dyn BufRead>,
    mapping: Arc<Mapping>,
    reorder: Reorder,
    buf: Vec<u8>,
    /// Which fields the line being parsed has (reused).
    scratch: Vec<bool>,
    done: bool,
    /// Lines read.
    pub lines: u64,
    /// Requests read from them.
    pub requests: u64,
    /// Lines that could not be read as a request.
    pub bad: u64,
    /// The first [`LISTED_BAD_LINES`] of them: `name:line: why`.
    pub first_bad: Vec<String>,
    /// Per field of the mapping, how many requests had it.
    pub found: Vec<u64>,
    /// Bytes read so far.
    pub bytes: u64,
    /// Why reading stopped early, if it did.
    pub error: Option<String>,
}

impl LogSource {
    /// A log read from `reader`, put in order by `reorder`.
    pub fn new(
        name: String,
        reader: Box<dyn BufRead>,
        mapping: Arc<Mapping>,
        reorder: Reorder,
    ) -> LogSource {
        let fields = mapping.fields().len();
        LogSource {
            name,
            reader,
            mapping,
            reorder,
            buf: Vec::new(),
            scratch: Vec::new(),
            done: false,
            lines: 0,
            requests: 0,
            bad: 0,
            first_bad: Vec::new(),
            found: vec![0; fields],
            bytes: 0,
            error: None,
        }
    }

    /// What reordering met in this log.
    pub fn reorder(&self) -> &Reorder {
        &self.reorder
    }

    fn bad_line(&mut self, why: &str) {
        self.bad += 1;
        if self.first_bad.len() < LISTED_BAD_LINES {
            self.first_bad
                .push(format!("{}:{}: {why}", self.name, self.lines));
        }
    }

    /// Reads one more line into the reorder buffer; false at the end of the log.
    fn read_one(&mut self) -> bool {
        let whole = match read_line(&mut self.reader, &mut self.buf) {
            Ok(Some(whole)) => whole,
            Ok(None) => return false,
            Err(e) => {
                self.error = Some(format!(
                    "{}: read error after line {}: {e}",
                    self.name, self.lines
                ));
                return false;
            }
        };
        self.lines += 1;
        self.bytes += if whole {
            self.buf.len() as u64 + 1
        } else {
            MAX_LINE as u64
        };
        if !whole {
            self.bad_line("longer than 1 MiB");
            return true;
        }
        let line = String::from_utf8_lossy(&self.buf);
        if line.trim().is_empty() {
            return true;
        }
        let mut found = std::mem::take(&mut self.scratch);
        found.clear();
        found.resize(self.found.len(), false);
        let parsed = self.mapping.parse(&line, &mut found);
        match parsed {
            Ok(entry) => {
                self.requests += 1;
                for (count, hit) in self.found.iter_mut().zip(&found) {
                    *count += u64::from(*hit);
                }
                self.reorder.push(entry);
            }
            Err(why) => self.bad_line(why),
        }
        self.scratch = found;
        true
    }
}

impl Iterator for LogSource {
    type Item = Entry;

    fn next(&mut self) -> Option<Entry> {
        loop {
            if let Some(e) = self.reorder.ready() {
                return Some(e);
            }
            if self.done {
                return self.reorder.release();
            }
            self.done = !self.read_one();
        }
    }
}
