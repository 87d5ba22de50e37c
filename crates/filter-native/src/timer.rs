//! One module thread for whatever must happen later: a held request's turn, and each
//! configuration's periodic event. It only posts events through Envoy's schedulers; the work
//! itself runs on Envoy's threads (the stream's worker, or the main thread).

use envoy_dm_abi::{ConfigScheduler, Scheduler};
use std::collections::{BTreeMap, HashMap};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Condvar, Mutex, MutexGuard, OnceLock, PoisonError};
use std::time::{Duration, Instant};

/// A periodic event of one configuration.
struct Tick {
    scheduler: ConfigScheduler,
    event: u64,
    period: Duration,
    next: Instant,
}

#[derive(Default)]
struct State {
    /// Held requests' turns, by (time, token).
    releases: BTreeMap<(Instant, u64), (Scheduler, u64)>,
    /// Configurations' periodic events, by token.
    ticks: HashMap<u64, Tick>,
    next_token: u64,
}

struct Timer {
    state: Mutex<State>,
    wake: Condvar,
}

fn timer() -> &'static Timer {
    static TIMER: OnceLock<Timer> = OnceLock::new();
    TIMER.get_or_init(|| {
        let spawned = std::thread::Builder::new()
            .name("ratelimit-timer".into())
            .spawn(run);
        if let Err(e) = spawned {
            log::error!("no timer thread ({e}): held requests and metrics will stall");
        }
        Timer {
            state: Mutex::default(),
            wake: Condvar::new(),
        }
    })
}

fn lock(t: &Timer) -> MutexGuard<'_, State> {
    t.state.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The thread: posts every event that is due, then sleeps until the next one.
fn run() {
    let t = timer();
    let mut st = lock(t);
    loop {
        let now = Instant::now();
        let next = catch_unwind(AssertUnwindSafe(|| fire(&mut st, now))).unwrap_or(None);
        st = match next {
            Some(at) => {
                t.wake
                    .wait_timeout(st, at.saturating_duration_since(now))
                    .unwrap_or_else(PoisonError::into_inner)
                    .0
            }
            None => t.wake.wait(st).unwrap_or_else(PoisonError::into_inner),
        };
    }
}

/// Posts the events due at `now`; returns when the next one is due.
fn fire(st: &mut State, now: Instant) -> Option<Instant> {
    while let Some(entry) = st.releases.first_entry() {
        if entry.key().0 > now {
            break;
        }
        let (scheduler, event) = entry.remove();
        scheduler.commit(event); // deleted right after: the posted event holds its own reference
    }
    for tick in st.ticks.values_mut() {
        if tick.next <= now {
            tick.scheduler.commit(tick.event);
            tick.next = now + tick.period;
        }
    }
    let release = st.releases.keys().next().map(|(at, _)| *at);
    let tick = st.ticks.values().map(|t| t.next).min();
    release.into_iter().chain(tick).min()
}

/// Registers a value under a fresh token and wakes the thread.
fn register(f: impl FnOnce(&mut State, u64)) -> u64 {
    let t = timer();
    let mut st = lock(t);
    st.next_token += 1;
    let token = st.next_token;
    f(&mut st, token);
    t.wake.notify_one();
    token
}

/// A held request's turn: `event` is posted to its stream's worker after `wait`, unless this
/// is dropped first (the stream is gone, or its turn came and went).
pub struct Release {
    key: (Instant, u64),
}

impl Release {
    /// Schedules the release.
    pub fn at(scheduler: Scheduler, event: u64, wait: Duration) -> Release {
        let at = Instant::now() + wait;
        let token = register(|st, token| {
            st.releases.insert((at, token), (scheduler, event));
        });
        Release { key: (at, token) }
    }
}

impl Drop for Release {
    fn drop(&mut self) {
        // Deletes the stream's scheduler if the event was not posted yet.
        lock(timer()).releases.remove(&self.key);
    }
}

/// A configuration's periodic event, posted to the main thread every `period` until dropped.
pub struct Ticker {
    token: u64,
}

impl Ticker {
    /// Starts posting `event` every `period`.
    pub fn start(scheduler: ConfigScheduler, event: u64, period: Duration) -> Ticker {
        let token = register(|st, token| {
            let tick = Tick {
                scheduler,
                event,
                period,
                next: Instant::now() + period,
            };
            st.ticks.insert(token, tick);
        });
        Ticker { token }
    }
}

impl Drop for Ticker {
    fn drop(&mut self) {
        // No event is posted after this returns; the scheduler is deleted.
        lock(timer()).ticks.remove(&self.token);
    }
}
