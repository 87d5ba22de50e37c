//! A fleet of proxies and their rate limit service as a discrete-event simulation on a virtual
//! clock (µs; the core reads it in ms, as a host's clock gives it).
//!
//! Each proxy is the core's own [`Runtime`] over one [`MemoryStore`] (every worker of a proxy
//! shares its store, and in the native build its runtime and background), driven as the hosts
//! drive it: each request through a [`StreamState`] (its headers, the calls it starts, their
//! answers, its end), and the proxy's [`Background`] ticked at the period it asks for, its
//! calls started and answered. A call reaches the [`Service`] half a round trip after it is
//! sent and is answered a round trip after it is sent. Nothing else decides: the simulation
//! only carries requests, calls and answers.

use crate::service::Service;
use crate::tally::{quantile, Accuracy, Tally};
use crate::traffic::{self, Keys, Traffic};
use ratelimit_core::config::Config;
use ratelimit_core::key::Seed;
use ratelimit_core::runtime::{Background, Next, Runtime, StreamState};
use ratelimit_core::store::MemoryStore;
use ratelimit_core::testkit::{FakeHost, Rng};
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::fmt;

/// How the proxies' rule counts across the fleet.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// No `global`: each proxy alone.
    Local,
    /// `global.mode: sync`: each request waits for the service.
    Sync,
    /// `global.mode: async`: decided locally, hits reported every `flush_ms`.
    Async {
        /// `global.flush_ms`.
        flush_ms: u32,
    },
    /// `global.mode: lease`: admitted from blocks claimed from the service.
    Lease {
        /// `global.flush_ms` (claims ahead of need are sent at the next tick).
        flush_ms: u32,
        /// `global.max_block` (`None`: the default, a tenth of the limit).
        max_block: Option<u64>,
    },
}

impl Mode {
    /// The mode as the tables name it, with its numbers (`limit`: the rule's, for the default
    /// block): `local only`, `sync`, `async, flush 100 ms`, `lease, flush 100 ms, max_block
    /// 30 (default)`.
    pub fn describe(&self, limit: u64) -> String {
        match *self {
            Mode::Local => "local only".into(),
            Mode::Sync => "sync".into(),
            Mode::Async { flush_ms } => format!("async, flush {flush_ms} ms"),
            Mode::Lease {
                flush_ms,
                max_block: Some(b),
            } => format!("lease, flush {flush_ms} ms, max_block {b}"),
            Mode::Lease { flush_ms, .. } => format!(
                "lease, flush {flush_ms} ms, max_block {} (default)",
                (limit / 10).max(1)
            ),
        }
    }

    /// The rule's `global` object (`None` for local mode).
    fn global(&self) -> Option<String> {
        let common = r#""cluster": "rls", "domain": "fleet", "timeout_ms": 60000"#;
        Some(match *self {
            Mode::Local => return None,
            Mode::Sync => format!(r#"{{{common}, "mode": "sync"}}"#),
            Mode::Async { flush_ms } => {
                format!(r#"{{{common}, "mode": "async", "flush_ms": {flush_ms}}}"#)
            }
            Mode::Lease {
                flush_ms,
                max_block,
            } => {
                let block = max_block.map_or(String::new(), |b| format!(r#", "max_block": {b}"#));
                format!(r#"{{{common}, "mode": "lease", "flush_ms": {flush_ms}{block}}}"#)
            }
        })
    }
}

/// When requests come.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Load {
    /// A Poisson stream of `per_s` requests a second to the fleet, spread evenly over the
    /// proxies (as a load balancer spreads them).
    Poisson {
        /// The fleet's request rate.
        per_s: f64,
    },
    /// Each proxy offered one request every `1 / per_s_each` s (from a random phase).
    Paced {
        /// Each proxy's request rate.
        per_s_each: f64,
    },
    /// `clients` clients on each proxy, each sending its next request `think_us` after the
    /// last was decided (full speed: the time Envoy and the upstream take).
    Closed {
        /// Clients per proxy.
        clients: u32,
        /// The time between a decision and the client's next request, µs.
        think_us: u64,
    },
}

/// One run of the model.
#[derive(Clone, Debug, PartialEq)]
pub struct Scenario {
    /// Proxies in the fleet.
    pub proxies: usize,
    /// The mode of the rule.
    pub mode: Mode,
    /// The keys requests are for.
    pub traffic: Traffic,
    /// When requests come.
    pub load: Load,
    /// The limit of each key, per window (the rule's and the service's).
    pub limit: u64,
    /// The window, s: 1, 60, 3600 or 86400 (the rule's unit).
    pub window_s: u64,
    /// The service's round trip, µs.
    pub latency_us: u64,
    /// How long requests come, ms.
    pub duration_ms: u64,
    /// The seed of every random draw.
    pub seed: u64,
}

/// What a run measured.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Outcome {
    /// Requests offered.
    pub offered: u64,
    /// Requests admitted.
    pub admitted: u64,
    /// Each proxy's admitted requests.
    pub per_proxy: Vec<u64>,
    /// Calls to the service (every request's and background call).
    pub calls: u64,
    /// Admitted against the limit, window by window.
    pub accuracy: Accuracy,
    /// Requests that waited for the service (a sync answer, a lease claim).
    pub waited: u64,
    /// The 99th percentile of the time added to requests (0 for one that did not wait), µs.
    pub p99_wait_us: u64,
    /// The longest time added to a request, µs.
    pub max_wait_us: u64,
}

impl Outcome {
    /// Service calls per 100 requests offered.
    pub fn calls_per_100(&self) -> f64 {
        per_100(self.calls, self.offered)
    }

    /// Admitted beyond the limit, in % of what an exact limiter admits.
    pub fn over_pct(&self) -> f64 {
        per_100(self.accuracy.over, self.accuracy.exact)
    }

    /// Refused with room left, in % of what an exact limiter admits.
    pub fn under_pct(&self) -> f64 {
        per_100(self.accuracy.under, self.accuracy.exact)
    }
}

fn per_100(n: u64, of: u64) -> f64 {
    if of == 0 {
        0.0
    } else {
        n as f64 * 100.0 / of as f64
    }
}

/// Why a scenario cannot run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Error(pub String);

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Error {}

/// The filter configuration of a scenario: one rule keyed on the client address.
pub fn config_json(mode: &Mode, limit: u64, window_s: u64) -> Result<String, Error> {
    let unit = match window_s {
        1 => "second",
        60 => "minute",
        3_600 => "hour",
        86_400 => "day",
        s => return Err(Error(format!("a window of {s} s is not a rule's unit"))),
    };
    let global = mode
        .global()
        .map_or(String::new(), |g| format!(r#", "global": {g}"#));
    Ok(format!(
        r#"{{"rules": [{{"name": "g", "key": ["remote_address"],
            "rate_limit": {{"requests_per_unit": {limit}, "unit": "{unit}"}}{global}}}]}}"#
    ))
}

/// The simulation's epoch on the core's clock, ms (not aligned to a minute: windows of the
/// local algorithms are aligned to the epoch, the service's start at a key's first hit).
const EPOCH_MS: u64 = 1_800_000_017_321;
/// How long the simulation runs on after the last request comes, for the answers, ms.
const DRAIN_MS: u64 = 2_000;

/// Runs one scenario.
pub fn run(s: &Scenario) -> Result<Outcome, Error> {
    let json = config_json(&s.mode, s.limit, s.window_s)?;
    let proxies = (0..s.proxies.max(1))
        .map(|i| {
            let config = Config::parse(json.as_bytes()).map_err(|e| Error(e.to_string()))?;
            let rt = Runtime::new(config, Seed([s.seed, i as u64]), MemoryStore::new());
            let bg = Background::new(&rt);
            Ok(Proxy {
                rt,
                bg,
                streams: HashMap::new(),
                admitted: 0,
            })
        })
        .collect::<Result<Vec<_>, Error>>()?;
    let mut sim = Sim::new(s, proxies);
    sim.start();
    sim.run();
    Ok(sim.outcome())
}

/// What happens at an instant.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Event {
    /// A request comes to a proxy (from a client of a closed load).
    Arrival { proxy: usize, client: Option<u32> },
    /// A call reaches the service.
    Decide { call: u64 },
    /// A call's answer reaches its proxy.
    Answer { call: u64 },
    /// A proxy's background timer fires.
    Tick { proxy: usize },
}

/// One request in flight at a proxy.
struct Stream {
    st: StreamState,
    host: FakeHost,
    key: u32,
    arrival_us: u64,
    client: Option<u32>,
}

/// One proxy: its runtime, its background, its requests in flight.
struct Proxy {
    rt: Runtime<MemoryStore>,
    bg: Background,
    streams: HashMap<u64, Stream>,
    admitted: u64,
}

/// Whose call it is.
#[derive(Clone, Copy, Debug)]
enum Owner {
    Stream(u64),
    Background,
}

/// A call in flight.
struct Call {
    proxy: usize,
    owner: Owner,
    message: Vec<u8>,
    answer: Option<ratelimit_core::rls::Response>,
}

/// The clock, the events to come and the calls in flight.
struct Wire {
    queue: BinaryHeap<Reverse<(u64, u64, Event)>>,
    seq: u64,
    calls: HashMap<u64, Call>,
    next_call: u64,
    started: u64,
    latency_us: u64,
}

impl Wire {
    fn at(&mut self, t_us: u64, e: Event) {
        self.seq += 1;
        self.queue.push(Reverse((t_us, self.seq, e)));
    }

    /// Sends `message` at `now_us`: the call's id.
    fn call(&mut self, proxy: usize, owner: Owner, message: Vec<u8>, now_us: u64) -> u64 {
        self.next_call += 1;
        self.started += 1;
        let id = self.next_call;
        self.calls.insert(
            id,
            Call {
                proxy,
                owner,
                message,
                answer: None,
            },
        );
        self.at(now_us + self.latency_us / 2, Event::Decide { call: id });
        id
    }
}

struct Sim<'s> {
    s: &'s Scenario,
    proxies: Vec<Proxy>,
    wire: Wire,
    service: Service,
    tally: Tally,
    /// Every request's added wait, µs.
    waits: Vec<u64>,
    rng: Rng,
    keys: Keys,
    addresses: Vec<String>,
    next_stream: u64,
    offered: u64,
    start_us: u64,
    end_us: u64,
}

impl<'s> Sim<'s> {
    fn new(s: &'s Scenario, proxies: Vec<Proxy>) -> Sim<'s> {
        let start_us = EPOCH_MS * 1000;
        Sim {
            s,
            proxies,
            wire: Wire {
                queue: BinaryHeap::new(),
                seq: 0,
                calls: HashMap::new(),
                next_call: 0,
                started: 0,
                latency_us: s.latency_us,
            },
            service: Service::new(s.limit, s.window_s),
            tally: Tally::new(s.traffic.keys()),
            waits: Vec::new(),
            rng: Rng(s.seed.max(1)),
            keys: Keys::new(&s.traffic),
            addresses: (0..s.traffic.keys()).map(traffic::address).collect(),
            next_stream: 0,
            offered: 0,
            start_us,
            end_us: start_us + s.duration_ms * 1000,
        }
    }

    /// Schedules each proxy's first tick (at a random phase of its period) and first requests.
    fn start(&mut self) {
        for proxy in 0..self.proxies.len() {
            let period_us = self
                .proxies
                .get(proxy)
                .map_or(1_000_000, |p| u64::from(p.bg.period_ms()) * 1000);
            let phase = self.rng.below(period_us);
            self.wire.at(self.start_us + phase, Event::Tick { proxy });
            match self.s.load {
                Load::Poisson { .. } | Load::Paced { .. } => {
                    let gap = self.gap();
                    let first = self.start_us + self.rng.below(gap);
                    self.wire.at(
                        first,
                        Event::Arrival {
                            proxy,
                            client: None,
                        },
                    );
                }
                Load::Closed { clients, think_us } => {
                    for c in 0..clients {
                        let first = self.start_us + self.rng.below(think_us.max(1));
                        let e = Event::Arrival {
                            proxy,
                            client: Some(c),
                        };
                        self.wire.at(first, e);
                    }
                }
            }
        }
    }

    /// The time to a proxy's next request under an open load, µs.
    fn gap(&mut self) -> u64 {
        let n = self.proxies.len().max(1) as f64;
        match self.s.load {
            Load::Poisson { per_s } => traffic::exponential_us(&mut self.rng, per_s / n),
            Load::Paced { per_s_each } => ((1e6 / per_s_each) as u64).max(1),
            Load::Closed { think_us, .. } => think_us.max(1),
        }
    }

    fn run(&mut self) {
        let stop = self.end_us + DRAIN_MS * 1000;
        while let Some(Reverse((t, _, e))) = self.wire.queue.pop() {
            if t > stop {
                break;
            }
            match e {
                Event::Arrival { proxy, client } => self.arrive(proxy, client, t),
                Event::Decide { call } => self.decide(call, t),
                Event::Answer { call } => self.answer(call, t),
                Event::Tick { proxy } => self.tick(proxy, t, stop),
            }
        }
    }

    fn arrive(&mut self, proxy: usize, client: Option<u32>, now: u64) {
        if now >= self.end_us {
            return;
        }
        if client.is_none() {
            let next = now + self.gap();
            self.wire.at(next, Event::Arrival { proxy, client });
        }
        self.offered += 1;
        let key = self.keys.draw(&mut self.rng);
        let address = self.addresses.get(key as usize).map_or("10.0.0.0", |a| a);
        let mut host = FakeHost::new(address, "/");
        host.now = now / 1000;
        let Some(p) = self.proxies.get_mut(proxy) else {
            return;
        };
        let mut st = StreamState::default();
        let next = st.request_headers(&p.rt, &mut host);
        self.next_stream += 1;
        let id = self.next_stream;
        p.streams.insert(
            id,
            Stream {
                st,
                host,
                key,
                arrival_us: now,
                client,
            },
        );
        self.carry_out(proxy, id, next, now);
    }

    /// Does what a stream's state says next, as a host does.
    fn carry_out(&mut self, proxy: usize, id: u64, mut next: Next, now: u64) {
        loop {
            let Some(p) = self.proxies.get_mut(proxy) else {
                return;
            };
            let Some(stream) = p.streams.get_mut(&id) else {
                return;
            };
            next = match next {
                Next::Call { message, .. } => {
                    let call = self.wire.call(proxy, Owner::Stream(id), message, now);
                    stream.st.started(&p.rt, &mut stream.host, Ok(call))
                }
                // No rule of the model holds requests (delay mode): it would go on at once.
                Next::Hold { .. } => stream.st.release(&p.rt),
                Next::Wait => return,
                Next::Continue => return self.decided(proxy, id, true, now),
                Next::Reply(_) => return self.decided(proxy, id, false, now),
            };
        }
    }

    /// A request was admitted or refused at `now`: its stream ends.
    fn decided(&mut self, proxy: usize, id: u64, admitted: bool, now: u64) {
        let Some(p) = self.proxies.get_mut(proxy) else {
            return;
        };
        let Some(mut stream) = p.streams.remove(&id) else {
            return;
        };
        stream.st.complete(&p.rt, || now / 1000, |_, _| {});
        p.admitted += u64::from(admitted);
        self.tally.record(stream.key, stream.arrival_us, admitted);
        self.waits.push(now - stream.arrival_us);
        if let (Some(client), Load::Closed { think_us, .. }) = (stream.client, self.s.load) {
            let e = Event::Arrival {
                proxy,
                client: Some(client),
            };
            self.wire.at(now + think_us.max(1), e);
        }
    }

    fn decide(&mut self, id: u64, now: u64) {
        let latency = self.wire.latency_us;
        if let Some(call) = self.wire.calls.get_mut(&id) {
            call.answer = Some(self.service.decide(&call.message, now));
            self.wire
                .at(now + latency - latency / 2, Event::Answer { call: id });
        }
    }

    fn answer(&mut self, id: u64, now: u64) {
        let Some(Call {
            proxy,
            owner,
            answer: Some(answer),
            ..
        }) = self.wire.calls.remove(&id)
        else {
            return;
        };
        let Some(p) = self.proxies.get_mut(proxy) else {
            return;
        };
        match owner {
            Owner::Background => {
                p.bg.answered(&p.rt, id, Ok(answer), now / 1000);
            }
            Owner::Stream(stream) => {
                let Some(s) = p.streams.get_mut(&stream) else {
                    return;
                };
                s.host.now = now / 1000;
                let next = s.st.call_answer(&p.rt, &mut s.host, id, Ok(answer));
                self.carry_out(proxy, stream, next, now);
            }
        }
    }

    fn tick(&mut self, proxy: usize, now: u64, stop: u64) {
        let Some(p) = self.proxies.get_mut(proxy) else {
            return;
        };
        let work = p.bg.tick(&p.rt, now / 1000, None);
        for call in work.calls {
            let id = self
                .wire
                .call(proxy, Owner::Background, call.message.clone(), now);
            p.bg.started(&p.rt, call, Some(id));
        }
        let next = now + u64::from(p.bg.period_ms().max(1)) * 1000;
        if next <= stop {
            self.wire.at(next, Event::Tick { proxy });
        }
    }

    fn outcome(mut self) -> Outcome {
        let window_us = self.s.window_s * 1_000_000;
        let mut starts: HashMap<u32, &[u64]> = HashMap::new();
        let by_address: HashMap<&[u8], u32> = self
            .addresses
            .iter()
            .enumerate()
            .map(|(i, a)| (a.as_bytes(), u32::try_from(i).unwrap_or(u32::MAX)))
            .collect();
        for (descriptor, windows) in self.service.windows() {
            let key = descriptor
                .last()
                .and_then(|(_, v)| by_address.get(v.as_slice()));
            if let Some(&key) = key {
                starts.insert(key, windows);
            }
        }
        let accuracy = self
            .tally
            .accuracy(self.s.limit, window_us, self.s.latency_us / 2, |k| {
                starts.get(&k).copied().unwrap_or(&[])
            });
        let waited = self.waits.iter().filter(|&&w| w > 0).count() as u64;
        let max_wait_us = self.waits.iter().copied().max().unwrap_or(0);
        let p99_wait_us = quantile(&mut self.waits, 0.99);
        let per_proxy: Vec<u64> = self.proxies.iter().map(|p| p.admitted).collect();
        Outcome {
            offered: self.offered,
            admitted: per_proxy.iter().sum(),
            per_proxy,
            calls: self.wire.started,
            accuracy,
            waited,
            p99_wait_us,
            max_wait_us,
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn scenario(mode: Mode) -> Scenario {
        Scenario {
            proxies: 3,
            mode,
            traffic: Traffic::Hot,
            load: Load::Paced { per_s_each: 20.0 },
            limit: 50,
            window_s: 60,
            latency_us: 2_000,
            duration_ms: 5_000,
            seed: 3,
        }
    }

    #[test]
    fn a_sync_fleet_admits_the_limit_exactly_and_every_request_waits_a_round_trip() {
        let o = run(&scenario(Mode::Sync)).unwrap();
        assert_eq!((o.offered, o.admitted, o.calls), (300, 50, 300));
        assert_eq!(
            (o.accuracy.over, o.accuracy.under, o.accuracy.windows),
            (0, 0, 1)
        );
        assert_eq!(
            (o.waited, o.p99_wait_us, o.max_wait_us),
            (300, 2_000, 2_000)
        );
    }

    #[test]
    fn a_lease_fleet_admits_from_blocks_and_never_past_the_limit() {
        let o = run(&scenario(Mode::Lease {
            flush_ms: 20,
            max_block: None,
        }))
        .unwrap();
        // Blocks of 4 at first, doubling up to the default cap (5): at most a block a proxy
        // lapses unused.
        assert!((35..=50).contains(&o.admitted), "{o:?}");
        assert_eq!(o.accuracy.over, 0);
        assert!(o.calls < 40, "{o:?}");
    }

    #[test]
    fn local_proxies_each_admit_the_whole_limit() {
        let o = run(&scenario(Mode::Local)).unwrap();
        assert_eq!(
            (o.admitted, o.per_proxy.clone(), o.calls),
            (150, vec![50; 3], 0)
        );
        assert_eq!(o.accuracy.over, 100);
    }

    #[test]
    fn a_run_repeats_with_its_seed() {
        let s = Scenario {
            load: Load::Poisson { per_s: 100.0 },
            ..scenario(Mode::Async { flush_ms: 50 })
        };
        assert_eq!(run(&s).unwrap(), run(&s).unwrap());
        let other = Scenario {
            seed: 4,
            ..s.clone()
        };
        assert_ne!(run(&s).unwrap(), run(&other).unwrap());
    }

    #[test]
    fn a_window_that_is_no_unit_is_refused() {
        assert!(config_json(&Mode::Sync, 10, 7).is_err());
        let json = config_json(
            &Mode::Lease {
                flush_ms: 20,
                max_block: Some(3),
            },
            10,
            60,
        )
        .unwrap();
        let config = Config::parse(json.as_bytes()).unwrap();
        assert_eq!(config.rules.len(), 1);
    }
}
