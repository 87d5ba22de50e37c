//! The documentation's pages as the tests read them: README.md, every page of the book
//! (docs/src/**/*.md) and every example's README, with mdBook's `{{#include PATH}}` and
//! `{{#include PATH:ANCHOR}}` expanded (paths relative to the page), split into fenced blocks,
//! each with the replay marker on the line before its fence (`<!-- replay: KIND ARGS -->`).
use std::path::{Path, PathBuf};

/// One page: its path (relative to the repository root) and its lines once includes are
/// expanded, each with the line of the page it comes from (an included line: the include's).
pub struct Page {
    pub path: String,
    pub lines: Vec<(usize, String)>,
}

/// A fenced block of a page.
pub struct Block {
    /// `path:line` of its opening fence.
    pub at: String,
    /// The fence's info string (`console`, `json`, `yaml`, ...).
    pub lang: String,
    /// What the marker on the line before the fence says (`demo native`, `example per-ip`,
    /// `cli`), if there is one.
    pub marker: Option<String>,
    /// The block's text (without its fences).
    pub text: String,
}

fn root() -> PathBuf {
    super::root()
}

/// Every page: README.md, docs/src/**/*.md (sorted), examples/*/README.md (sorted).
pub fn all() -> Vec<Page> {
    let root = root();
    let mut paths = vec!["README.md".to_string()];
    let mut book = Vec::new();
    walk(&root.join("docs/src"), &mut book);
    book.sort();
    paths.extend(book.iter().map(|p| rel(p)));
    let mut examples: Vec<String> = std::fs::read_dir(root.join("examples"))
        .unwrap()
        .map(|e| e.unwrap().path().join("README.md"))
        .filter(|p| p.is_file())
        .map(|p| rel(&p))
        .collect();
    examples.sort();
    paths.extend(examples);
    paths.iter().map(|p| page(p)).collect()
}

fn rel(p: &Path) -> String {
    p.strip_prefix(root())
        .unwrap()
        .to_string_lossy()
        .into_owned()
}

fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries {
        let p = e.unwrap().path();
        if p.is_dir() {
            walk(&p, out);
        } else if p.extension().is_some_and(|x| x == "md") {
            out.push(p);
        }
    }
}

/// One page (path relative to the repository root), includes expanded.
pub fn page(path: &str) -> Page {
    let file = root().join(path);
    let text = std::fs::read_to_string(&file).unwrap_or_else(|e| panic!("{path}: {e}"));
    let mut lines = Vec::new();
    for (i, line) in text.lines().enumerate() {
        match include(line, &file, path, i + 1) {
            Some(included) => {
                for l in included.lines() {
                    lines.push((i + 1, l.to_string()));
                }
            }
            None => lines.push((i + 1, line.to_string())),
        }
    }
    Page {
        path: path.to_string(),
        lines,
    }
}

/// The text a line `{{#include PATH}}` or `{{#include PATH:ANCHOR}}` stands for (mdBook: the
/// whole file, or the lines between `ANCHOR: NAME` and `ANCHOR_END: NAME`; every line naming an
/// anchor dropped). Text around the directive on the same line is kept.
fn include(line: &str, file: &Path, page: &str, n: usize) -> Option<String> {
    let start = line.find("{{#include ")?;
    let end = start + line[start..].find("}}")?;
    let arg = line[start + "{{#include ".len()..end].trim();
    let (target, anchor) = match arg.rsplit_once(':') {
        Some((p, a)) if !a.contains('/') && !a.chars().all(|c| c.is_ascii_digit() || c == '-') => {
            (p, Some(a))
        }
        _ => (arg, None),
    };
    let path = file.parent().unwrap().join(target);
    let body = std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!(
            "{page}:{n}: {{{{#include {arg}}}}}: {}: {e}",
            path.display()
        )
    });
    let is_anchor = |l: &str| l.contains("ANCHOR:") || l.contains("ANCHOR_END:");
    let kept: Vec<&str> = match anchor {
        None => body.lines().filter(|l| !is_anchor(l)).collect(),
        Some(a) => {
            let named = |l: &str, tag: &str| {
                l.split_once(tag)
                    .is_some_and(|(_, rest)| rest.split_whitespace().next() == Some(a))
            };
            let mut inside = false;
            let mut found = false;
            let mut out = Vec::new();
            for l in body.lines() {
                if named(l, "ANCHOR:") {
                    inside = true;
                    found = true;
                } else if named(l, "ANCHOR_END:") {
                    inside = false;
                } else if inside && !is_anchor(l) {
                    out.push(l);
                }
            }
            assert!(found, "{page}:{n}: anchor {a} not in {}", path.display());
            out
        }
    };
    let mut text = line[..start].to_string();
    text.push_str(&kept.join("\n"));
    text.push_str(&line[end + 2..]);
    Some(text)
}

/// The marker a line holds: `<!-- replay: KIND ARGS -->` gives `KIND ARGS`.
pub fn marker(line: &str) -> Option<String> {
    let inner = line
        .trim()
        .strip_prefix("<!--")?
        .strip_suffix("-->")?
        .trim()
        .strip_prefix("replay:")?;
    Some(inner.split_whitespace().collect::<Vec<_>>().join(" "))
}

impl Page {
    /// The page's fenced blocks, in order (fences of three or more backticks, indented or
    /// not; a block's lines lose the fence's indentation).
    pub fn blocks(&self) -> Vec<Block> {
        let mut out = Vec::new();
        let mut i = 0;
        while i < self.lines.len() {
            let (n, line) = &self.lines[i];
            let trimmed = line.trim_start();
            let indent = line.len() - trimmed.len();
            let ticks = trimmed.chars().take_while(|&c| c == '`').count();
            if ticks < 3 {
                i += 1;
                continue;
            }
            let lang = trimmed[ticks..].trim().to_string();
            let marker = i.checked_sub(1).and_then(|p| marker(&self.lines[p].1));
            let mut text = String::new();
            i += 1;
            while i < self.lines.len() {
                let l = &self.lines[i].1;
                let t = l.trim_start();
                if t.starts_with(&"`".repeat(ticks)) && t.trim_matches('`').trim().is_empty() {
                    break;
                }
                let cut = l.len() - t.len();
                text.push_str(if cut >= indent { &l[indent..] } else { t });
                text.push('\n');
                i += 1;
            }
            out.push(Block {
                at: format!("{}:{n}", self.path),
                lang,
                marker,
                text,
            });
            i += 1;
        }
        out
    }
}

/// A console block's commands and what each prints: `$ ` lines are commands, the lines up to
/// the next command their output.
pub fn commands(text: &str) -> Vec<(String, String)> {
    let mut out: Vec<(String, String)> = Vec::new();
    for line in text.lines() {
        match line.strip_prefix("$ ") {
            Some(cmd) => out.push((cmd.to_string(), String::new())),
            None => {
                let Some(last) = out.last_mut() else {
                    panic!("output before any command: {line}");
                };
                last.1.push_str(line);
                last.1.push('\n');
            }
        }
    }
    out
}
