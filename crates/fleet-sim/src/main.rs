//! `fleet-sim`: the fleet model's sweep (markdown tables on stdout) and its comparison with the
//! measured Envoy runs. `--quick`: the small sweep; `--json FILE`: every run's figures;
//! `--threads N` (default 2); `--rate R`: the fleet's requests a second (default 200; the
//! limits follow it, at half the demand); `--proxies 3,10,...`; `--latency 1,10` (the
//! service's round trips, ms); `--seconds S` (how long requests come, default 150).
//!
//! `--share`: the shared-capacity study instead (`fleet_sim::share`): a shared rule's capacity
//! split statically over the proxies, under three load balancers and two demand mixes, against
//! the fleet-wide water-filling allocation. With it, `--quick` is its small sweep, `--proxies`
//! and `--tenants 10,100,...` its lists, `--seconds S` its run length (default 60, the first 10
//! left out), `--json FILE` and `--threads N` as above.
//!
//! `--share --lease`: each run of the shared-capacity study twice, split statically and leased
//! for the whole fleet from a rate limit service (`fleet_sim::leased`), side by side. With it,
//! `--quick` is every fleet size, 10 to 1,000 tenants, the random and sticky balancers;
//! `--blocks N`: a proxy's blocks at most `C / N` (default 40); `--per-proxy`: at most
//! `C / (N·P)`, the fleet's blocks together `C / N`.
//!
//! `--share --fair`: each run leased as above and fair across the fleet (`fleet_sim::fair`),
//! side by side, with the same seed: 3 to 1,000 proxies, 10 tenants, pinned, spread and one
//! proxy taking 80 %, both mixes. With it, `--quick` is 3 and 10 proxies; `--proxies`,
//! `--tenants`, `--seconds` (default 30, the first 10 left out), `--seed N`, `--per-proxy-rate
//! R` (the capacity a proxy, default 400 a second), `--json FILE` and `--threads N`.

use fleet_sim::fair::{self, FairSweep};
use fleet_sim::leased;
use fleet_sim::share::{self, ShareSweep};
use fleet_sim::sweep::{self, Sweep};
use std::process::ExitCode;
use std::time::Instant;

const USAGE: &str = "usage: fleet-sim [--quick] [--json FILE] [--threads N] [--rate R] \
                     [--proxies N,N,...] [--latency MS,MS,...] [--seconds S]\n       \
                     fleet-sim --share [--lease [--blocks N] [--per-proxy]] [--quick] \
                     [--json FILE] [--threads N] [--proxies N,N,...] [--tenants N,N,...] \
                     [--seconds S]\n       \
                     fleet-sim --share --fair [--quick] [--json FILE] [--threads N] \
                     [--proxies N,N,...] [--tenants N,N,...] [--seconds S] [--seed N] \
                     [--per-proxy-rate R] [--runtime]";

struct Args {
    quick: bool,
    share: bool,
    lease: bool,
    fair: bool,
    runtime: bool,
    seed: Option<u64>,
    per_proxy_rate: Option<u64>,
    blocks: u64,
    per_proxy: bool,
    tenants: Option<Vec<usize>>,
    json: Option<String>,
    threads: usize,
    rate: Option<f64>,
    proxies: Option<Vec<usize>>,
    latencies_ms: Option<Vec<u64>>,
    seconds: Option<u64>,
}

fn number<T: std::str::FromStr>(flag: &str, v: Option<String>) -> Result<T, String> {
    let v = v.ok_or(format!("{flag} needs a value"))?;
    v.parse().map_err(|_| format!("{flag} {v}: not a number"))
}

fn list<T: std::str::FromStr>(flag: &str, v: Option<String>) -> Result<Vec<T>, String> {
    let v = v.ok_or(format!("{flag} needs a list"))?;
    v.split(',')
        .map(|x| {
            x.trim()
                .parse()
                .map_err(|_| format!("{flag} {v}: not a list of numbers"))
        })
        .collect()
}

fn args() -> Result<Args, String> {
    let mut a = Args {
        quick: false,
        share: false,
        lease: false,
        fair: false,
        runtime: false,
        seed: None,
        per_proxy_rate: None,
        blocks: 40,
        per_proxy: false,
        tenants: None,
        json: None,
        threads: 2,
        rate: None,
        proxies: None,
        latencies_ms: None,
        seconds: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "--quick" => a.quick = true,
            "--share" => a.share = true,
            "--lease" => a.lease = true,
            "--fair" => a.fair = true,
            "--runtime" => a.runtime = true,
            "--seed" => a.seed = Some(number("--seed", it.next())?),
            "--per-proxy-rate" => a.per_proxy_rate = Some(number("--per-proxy-rate", it.next())?),
            "--blocks" => a.blocks = number("--blocks", it.next())?,
            "--per-proxy" => a.per_proxy = true,
            "--tenants" => a.tenants = Some(list("--tenants", it.next())?),
            "--json" => a.json = Some(it.next().ok_or("--json needs a file")?),
            "--threads" => a.threads = number("--threads", it.next())?,
            "--rate" => a.rate = Some(number("--rate", it.next())?),
            "--seconds" => a.seconds = Some(number("--seconds", it.next())?),
            "--proxies" => a.proxies = Some(list("--proxies", it.next())?),
            "--latency" => a.latencies_ms = Some(list("--latency", it.next())?),
            "-h" | "--help" => return Err(USAGE.into()),
            other => return Err(format!("unknown argument {other} (try --help)")),
        }
    }
    Ok(a)
}

fn main() -> ExitCode {
    let args = match args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    if args.share {
        return share_main(args);
    }
    if args.lease || args.fair {
        eprintln!("--lease and --fair go with --share\n{USAGE}");
        return ExitCode::from(2);
    }
    let started = Instant::now();
    let mut sweep = match (args.quick, args.rate) {
        (true, _) => Sweep::quick(),
        (false, Some(rate)) if rate > 0.0 => Sweep::at_rate(rate),
        (false, _) => Sweep::standard(),
    };
    if let Some(p) = args.proxies {
        sweep.proxies = p;
    }
    if let Some(l) = args.latencies_ms {
        sweep.latencies_ms = l;
    }
    if let Some(s) = args.seconds {
        sweep.duration_ms = s * 1000;
    }
    let rows = match sweep::run_all(&sweep.scenarios(), args.threads) {
        Ok(rows) => rows,
        Err(e) => {
            eprintln!("fleet-sim: {e}");
            return ExitCode::FAILURE;
        }
    };
    let comparisons = sweep::comparisons();
    let scenarios = sweep::comparison_runs(&comparisons);
    let compared = match sweep::run_all(&scenarios, args.threads) {
        Ok(rows) => rows,
        Err(e) => {
            eprintln!("fleet-sim: {e}");
            return ExitCode::FAILURE;
        }
    };
    print!("{}", sweep::markdown(&sweep, &rows));
    let per_seed = sweep::COMPARISON_SEEDS as usize;
    let runs: Vec<_> = comparisons
        .into_iter()
        .zip(compared.chunks(per_seed))
        .map(|(c, rows)| (c, rows.iter().map(|r| r.outcome.clone()).collect()))
        .collect();
    print!("{}", sweep::comparison_markdown(&runs));
    if let Some(path) = args.json {
        // One run a line: the file diffs run by run.
        let lines = |rows: &[sweep::Row]| -> String {
            let each: Vec<String> = rows
                .iter()
                .map(|r| format!("    {}", sweep::row_json(r)))
                .collect();
            each.join(",\n")
        };
        let text = format!(
            "{{\n  \"runs\": [\n{}\n  ],\n  \"comparisons\": [\n{}\n  ]\n}}\n",
            lines(&rows),
            lines(&compared)
        );
        if let Err(e) = std::fs::write(&path, text) {
            eprintln!("fleet-sim: {path}: {e}");
            return ExitCode::FAILURE;
        }
    }
    eprintln!(
        "{} runs in {:.1} s",
        rows.len() + compared.len(),
        started.elapsed().as_secs_f64()
    );
    ExitCode::SUCCESS
}

/// `--share`: the shared-capacity study's sweep, its tables and JSON.
fn share_main(args: Args) -> ExitCode {
    let cap = blocks(&args);
    let started = Instant::now();
    if args.fair {
        return fair_main(args, cap, started);
    }
    let mut sweep = match (args.quick, args.lease) {
        (true, true) => ShareSweep::lease_quick(),
        (true, false) => ShareSweep::quick(),
        (false, _) => ShareSweep::standard(),
    };
    if let Some(p) = args.proxies {
        sweep.proxies = p;
    }
    if let Some(t) = args.tenants {
        sweep.tenants = t;
    }
    if let Some(s) = args.seconds {
        sweep.duration_ms = s * 1000;
    }
    let studies = sweep.studies();
    if args.lease {
        return lease_main(&studies, cap, args.threads, args.json, started);
    }
    let runs = share::run_all(&studies, args.threads);
    print!("{}", share::markdown(&runs));
    let rows = runs.iter().map(|(s, f)| share::row_json(s, f).to_string());
    finish(args.json, "share", rows, runs.len(), started)
}

/// Writes `rows` (JSON values) to `json` as the list `name`, one a line, if asked, and says how
/// many runs took how long.
fn finish(
    json: Option<String>,
    name: &str,
    rows: impl Iterator<Item = String>,
    runs: usize,
    started: Instant,
) -> ExitCode {
    if let Some(path) = json {
        let each: Vec<String> = rows.map(|r| format!("    {r}")).collect();
        let text = format!("{{\n  \"{name}\": [\n{}\n  ]\n}}\n", each.join(",\n"));
        if let Err(e) = std::fs::write(&path, text) {
            eprintln!("fleet-sim: {path}: {e}");
            return ExitCode::FAILURE;
        }
    }
    eprintln!("{runs} runs in {:.1} s", started.elapsed().as_secs_f64());
    ExitCode::SUCCESS
}

/// `--share --lease`: every study split statically and leased (blocks at most `cap`), side by
/// side; the JSON holds both runs of each.
fn lease_main(
    studies: &[share::Study],
    cap: share::BlockCap,
    threads: usize,
    json: Option<String>,
    started: Instant,
) -> ExitCode {
    let leased = studies.iter().map(|s| share::Study {
        split: share::Split::Leased(cap),
        ..s.clone()
    });
    let all: Vec<share::Study> = studies.iter().cloned().chain(leased).collect();
    let runs = share::run_all(&all, threads);
    let (statics, leased) = runs.split_at(runs.len().min(studies.len()));
    let pairs: Vec<_> = statics
        .iter()
        .cloned()
        .zip(leased.iter().cloned())
        .collect();
    print!("{}", leased::markdown(&pairs));
    let rows = pairs.iter().map(|((s, f), (l, g))| {
        format!(
            "{{\"static\": {}, \"leased\": {}}}",
            share::row_json(s, f),
            leased::row_json(l, g)
        )
    });
    finish(json, "share_lease", rows, runs.len(), started)
}

/// A leased study's blocks: at most `C / --blocks` (40 unless given; `--per-proxy`: of each
/// proxy's part of C).
fn blocks(args: &Args) -> share::BlockCap {
    if args.per_proxy {
        share::BlockCap::PerProxy(args.blocks)
    } else {
        share::BlockCap::OfCapacity(args.blocks)
    }
}

/// `--share --fair`: every study leased and fair across the fleet, side by side, its blocks
/// at most `cap`.
fn fair_main(args: Args, cap: share::BlockCap, started: Instant) -> ExitCode {
    let mut sweep = if args.quick {
        FairSweep::quick()
    } else {
        FairSweep::standard()
    };
    if let Some(p) = args.proxies {
        sweep.proxies = p;
    }
    if let Some(t) = args.tenants {
        sweep.tenants = t;
    }
    if let Some(s) = args.seconds {
        sweep.duration_ms = s * 1000;
    }
    if let Some(s) = args.seed {
        sweep.seed = s;
    }
    if let Some(r) = args.per_proxy_rate {
        sweep.per_proxy = r;
    }
    sweep.runtime = args.runtime;
    sweep.cap = cap;
    let pairs = sweep.studies();
    let all: Vec<share::Study> = pairs
        .iter()
        .flat_map(|(a, b)| [a.clone(), b.clone()])
        .collect();
    let runs = share::run_all_with(&all, args.threads, fair::run);
    let pairs: Vec<fair::Pair> = runs
        .chunks(2)
        .filter_map(|c| match c {
            [a, b] => Some((a.clone(), b.clone())),
            _ => None,
        })
        .collect();
    print!("{}", fair::markdown(&pairs));
    let rows = pairs.iter().map(|p| fair::row_json(p).to_string());
    finish(args.json, "share_fair", rows, runs.len(), started)
}
