//! `loadgen ADDR RATE SECONDS CONNECTIONS`: sends GET / at RATE requests/s in total, spread over
//! CONNECTIONS keep-alive connections (one thread each, each on its own schedule), and prints
//! JSON with the achieved rate and latency percentiles in microseconds. Latency runs from the
//! request's scheduled send time, so a stalled server is not hidden (no coordinated omission).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.len() != 5 {
        eprintln!("usage: loadgen ADDR RATE SECONDS CONNECTIONS");
        std::process::exit(2);
    }
    let addr = args[1].clone();
    let rate: f64 = args[2].parse().expect("RATE");
    let seconds: f64 = args[3].parse().expect("SECONDS");
    let conns: usize = args[4].parse().expect("CONNECTIONS");
    let interval = Duration::from_secs_f64(conns as f64 / rate);
    let start = Instant::now() + Duration::from_millis(100);
    let end = start + Duration::from_secs_f64(seconds);
    let threads: Vec<_> = (0..conns)
        .map(|i| {
            let addr = addr.clone();
            std::thread::spawn(move || {
                let stream = TcpStream::connect(&addr).expect("connect");
                stream.set_nodelay(true).ok();
                let mut reader = BufReader::new(stream);
                let mut lat = Vec::new();
                let mut errors = 0u64;
                // Stagger the connections evenly over one interval.
                let mut due = start + interval.mul_f64(i as f64 / conns as f64);
                let req = b"GET / HTTP/1.1\r\nhost: bench\r\n\r\n";
                let mut line = String::new();
                while due < end {
                    let now = Instant::now();
                    if due > now {
                        std::thread::sleep(due - now);
                    }
                    if reader.get_mut().write_all(req).is_err() {
                        errors += 1;
                        break;
                    }
                    let mut len = 0usize;
                    let mut ok = false;
                    loop {
                        line.clear();
                        if reader.read_line(&mut line).unwrap_or(0) == 0 {
                            break;
                        }
                        let l = line.trim_end();
                        if l.is_empty() {
                            ok = true;
                            break;
                        }
                        if let Some(v) = l.to_ascii_lowercase().strip_prefix("content-length:") {
                            len = v.trim().parse().unwrap_or(0);
                        }
                    }
                    let mut body = vec![0; len];
                    if !ok || reader.read_exact(&mut body).is_err() {
                        errors += 1;
                        break;
                    }
                    lat.push(due.elapsed().as_micros() as u64);
                    due += interval;
                }
                (lat, errors)
            })
        })
        .collect();
    let mut all = Vec::new();
    let mut errors = 0;
    for t in threads {
        let (l, e) = t.join().expect("thread");
        all.extend(l);
        errors += e;
    }
    all.sort_unstable();
    let pct = |p: f64| -> u64 {
        if all.is_empty() {
            return 0;
        }
        let i = ((p / 100.0) * (all.len() - 1) as f64).round() as usize;
        all[i.min(all.len() - 1)]
    };
    println!(
        "{{\"requests\": {}, \"errors\": {}, \"rps\": {:.1}, \"p50_us\": {}, \"p99_us\": {}, \"p999_us\": {}}}",
        all.len(),
        errors,
        all.len() as f64 / seconds,
        pct(50.0),
        pct(99.0),
        pct(99.9)
    );
}
