//! A stand-in for an LLM provider that enforces its own limit, as OpenAI does: each
//! organisation (the first segment of the request's path) has a token bucket of requests,
//! `rate` a second with room for one second's worth, and a request it has no token for gets a
//! 429 with `retry-after` and OpenAI's `x-ratelimit-*-requests` fields (a 200 gets them too).
//! It tallies what it admitted and refused per organisation and tenant (`x-tenant` by default,
//! or the headers [`Builder::tally_by`] names), by the second since it started, so a test
//! measures the provider's side of a run.
//!
//! An organisation may also have a limit of tokens a second ([`Builder::tokens`], OpenAI's TPM
//! by the second): it answers LLM requests (`/{org}/v1/chat/completions` and the other routes
//! of [`super::llm`]) with the API's JSON and its usage, charges each the tokens that usage
//! reports when it arrives, refuses one that does not fit with a 429 and OpenAI's rate-limit
//! error, and states `x-ratelimit-*-tokens` beside the requests' fields.
//!
//! An organisation may have its own rate ([`Builder::org`]), and may answer honestly on its
//! own bucket but with malformed `x-ratelimit-*` fields ([`Builder::garbage`]), or with its
//! limit on two lines ([`Builder::two_lines`]): a broken or hostile upstream, whose fields a
//! filter must ignore.

use super::http::{header, Incoming, Server};
use super::llm;
use std::collections::HashMap;
use std::io::Write;
use std::net::{SocketAddr, TcpStream};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// A running provider; it stops accepting when dropped.
pub struct Provider {
    pub addr: SocketAddr,
    server: Server<Shared>,
}

/// How a provider is started ([`Provider::builder`]): its terms.
pub struct Builder {
    /// Every organisation's rate but those in `orgs`.
    rate: f64,
    orgs: HashMap<String, f64>,
    /// Organisations answering malformed fields.
    garbage: Vec<String>,
    /// Organisations answering their limit on two lines: the two values, in order.
    two_lines: HashMap<String, [u64; 2]>,
    /// Organisations with a limit of tokens a second.
    tokens: HashMap<String, f64>,
    /// The request headers naming the tenant in the tally (their values joined by `/`, `-`
    /// for one absent).
    tally_by: Vec<String>,
}

struct Shared {
    terms: Builder,
    started: Instant,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    /// Per organisation: requests left, and when they were counted.
    buckets: HashMap<String, (f64, Instant)>,
    /// Per organisation with a token limit: tokens left, and when they were counted.
    token_buckets: HashMap<String, (f64, Instant)>,
    /// (organisation, tenant, second) → (admitted, refused).
    tally: HashMap<(String, String, u64), (u64, u64)>,
    /// (organisation, tenant, second) → tokens of the admitted requests.
    tokens: HashMap<(String, String, u64), u64>,
    /// Per organisation: when it was first asked, and when it last refused (seconds since the
    /// provider started).
    seen: HashMap<String, (f64, Option<f64>)>,
    /// Per garbage organisation: answers written so far (picks the next malformed field).
    answers: HashMap<String, u64>,
}

/// The malformed answers a garbage organisation cycles through: (limit, remaining, reset), each
/// with one field a strict reader must refuse (`{limit}` / `{remaining}` stand for the honest
/// values).
const GARBAGE: [(&str, &str, &str); 9] = [
    ("-1", "{remaining}", "1s"),
    ("abc", "{remaining}", "1s"),
    ("1e9", "{remaining}", "1s"),
    ("5, 6", "{remaining}", "1s"),
    ("1000000000000000000000000", "{remaining}", "1s"),
    ("{limit}", "{above}", "1s"),
    ("{limit}", "{remaining}", "forever"),
    ("{limit}", "{remaining}", "-1s"),
    ("{limit}", "{remaining}", "99999h"),
];

impl Builder {
    /// Organisation `org`'s rate, requests a second.
    fn rate_of(&self, org: &str) -> f64 {
        self.orgs.get(org).copied().unwrap_or(self.rate)
    }

    /// Organisation `org` gets `rate` requests a second.
    pub fn org(mut self, org: &str, rate: f64) -> Builder {
        self.orgs.insert(org.to_string(), rate);
        self
    }

    /// Organisation `org` answers honestly on its own bucket, but each answer's
    /// `x-ratelimit-*-requests` fields hold one malformed value, in turn: a negative limit,
    /// letters, an exponent, two values, 25 digits, a remaining above the limit, a reset
    /// `forever`, `-1s`, `99999h`.
    pub fn garbage(mut self, org: &str) -> Builder {
        self.garbage.push(org.to_string());
        self
    }

    /// Organisation `org` answers honestly on its own bucket, but states its limit on two lines
    /// of `x-ratelimit-limit-requests`, `values` in this order, and a remaining of at most the
    /// lower: either line alone would read as a valid limit, both are a list of two values.
    pub fn two_lines(mut self, org: &str, values: [u64; 2]) -> Builder {
        self.two_lines.insert(org.to_string(), values);
        self
    }

    /// Organisation `org` also has a limit of `per_s` tokens a second (a bucket of one second's
    /// worth): each request costs the tokens its answer reports (`x-test-input-tokens` and
    /// `x-test-output-tokens`, see [`super::llm`]), charged when it arrives.
    pub fn tokens(mut self, org: &str, per_s: f64) -> Builder {
        self.tokens.insert(org.to_string(), per_s);
        self
    }

    /// The tally's tenant: these request headers' values, joined by `/` (`-` for an absent
    /// one), instead of `x-tenant`'s.
    pub fn tally_by(mut self, headers: &[&str]) -> Builder {
        self.tally_by = headers.iter().map(|h| h.to_ascii_lowercase()).collect();
        self
    }

    /// Listens on a free loopback port.
    pub fn start(self) -> Provider {
        let shared = Shared {
            terms: self,
            started: Instant::now(),
            state: Mutex::new(State::default()),
        };
        let server = Server::start(shared, Duration::from_secs(120), answer);
        Provider {
            addr: server.addr,
            server,
        }
    }
}

impl Provider {
    /// Listens on a free loopback port; every organisation gets `rate` requests a second.
    pub fn start(rate: f64) -> Provider {
        Provider::builder(rate).start()
    }

    /// Every organisation gets `rate` requests a second but those of `orgs` (name, rate).
    pub fn start_with(rate: f64, orgs: &[(&str, f64)]) -> Provider {
        orgs.iter()
            .fold(Provider::builder(rate), |b, (o, r)| b.org(o, *r))
            .start()
    }

    /// A provider to configure further; every organisation gets `rate` requests a second
    /// unless told otherwise.
    pub fn builder(rate: f64) -> Builder {
        Builder {
            rate,
            orgs: HashMap::new(),
            garbage: Vec::new(),
            two_lines: HashMap::new(),
            tokens: HashMap::new(),
            tally_by: vec!["x-tenant".to_string()],
        }
    }

    /// Seconds since the provider started.
    pub fn elapsed_s(&self) -> f64 {
        self.server.state().started.elapsed().as_secs_f64()
    }

    /// The seconds measured of traffic that starts now and lasts `run_s`, from `warmup_s` into
    /// it to its end: whole seconds since the provider started, `from..end`.
    pub fn window(&self, warmup_s: f64, run_s: u64) -> (u64, u64) {
        let t0 = self.elapsed_s();
        (
            (t0 + warmup_s).ceil() as u64,
            (t0 + run_s as f64).floor() as u64,
        )
    }

    /// Whether a request sent now falls in the seconds `from..end` since the provider started.
    pub fn measures(&self, (from, end): (u64, u64)) -> bool {
        let now = self.elapsed_s();
        now >= from as f64 && now < end as f64
    }

    /// Per tenant of organisation `org`: (admitted, refused) over the seconds `from..to`
    /// since the provider started.
    pub fn tally(&self, org: &str, from: u64, to: u64) -> HashMap<String, (u64, u64)> {
        let state = self.server.state().state.lock().unwrap();
        let mut out: HashMap<String, (u64, u64)> = HashMap::new();
        for ((o, tenant, second), (a, r)) in &state.tally {
            if o == org && (from..to).contains(second) {
                let e = out.entry(tenant.clone()).or_default();
                e.0 += a;
                e.1 += r;
            }
        }
        out
    }

    /// Per tenant of organisation `org`: the tokens of the requests the provider admitted over
    /// the seconds `from..to` since it started.
    pub fn tokens(&self, org: &str, from: u64, to: u64) -> HashMap<String, u64> {
        let state = self.server.state().state.lock().unwrap();
        let mut out: HashMap<String, u64> = HashMap::new();
        for ((o, tenant, second), n) in &state.tokens {
            if o == org && (from..to).contains(second) {
                *out.entry(tenant.clone()).or_default() += n;
            }
        }
        out
    }

    /// Organisation `org`'s (admitted, refused) over the whole run, every tenant.
    pub fn total(&self, org: &str) -> (u64, u64) {
        self.tally(org, 0, u64::MAX)
            .values()
            .fold((0, 0), |(a, r), (x, y)| (a + x, r + y))
    }

    /// When organisation `org` was first asked, and when it last refused, in seconds since the
    /// provider started (`None`: never asked).
    pub fn seen(&self, org: &str) -> Option<(f64, Option<f64>)> {
        self.server
            .state()
            .state
            .lock()
            .unwrap()
            .seen
            .get(org)
            .copied()
    }

    /// Requests the provider refused in all, every organisation and second.
    pub fn refused(&self) -> u64 {
        let state = self.server.state().state.lock().unwrap();
        state.tally.values().map(|(_, r)| r).sum()
    }
}

/// Answers one request; false if the connection broke.
fn answer(out: &mut TcpStream, req: Incoming, s: &Shared) -> bool {
    let (headers, body) = (&req.headers, &req.body);
    let tenant = s
        .terms
        .tally_by
        .iter()
        .map(|h| header(headers, h).unwrap_or("-"))
        .collect::<Vec<_>>()
        .join("/");
    let path = req.path.as_str();
    let org = path
        .trim_start_matches('/')
        .split('/')
        .next()
        .unwrap_or("")
        .to_string();
    // An organisation with a token limit answers as the API its route names.
    let spec = s
        .terms
        .tokens
        .get(&org)
        .and_then(|_| llm::Spec::from_request(path.get(org.len() + 1..)?, headers, body));
    let cost = spec.as_ref().map(|sp| sp.input_tokens + sp.output_tokens);
    let (admitted, remaining, tokens_left, garbage) = take(s, &org, &tenant, cost);
    let limit = s.terms.rate_of(&org) as u64;
    let remaining = if admitted { remaining } else { 0 };
    let (l, r, reset) = match garbage {
        None => (limit.to_string(), remaining.to_string(), "1s".to_string()),
        Some(n) => {
            let (l, r, reset) = GARBAGE[n as usize % GARBAGE.len()];
            let fill = |v: &str| {
                v.replace("{limit}", &limit.to_string())
                    .replace("{remaining}", &remaining.to_string())
                    .replace("{above}", &(limit + 1000).to_string())
            };
            (fill(l), fill(r), reset.to_string())
        }
    };
    let mut fields = match s.terms.two_lines.get(&org) {
        None => format!(
            "x-ratelimit-limit-requests: {l}\r\nx-ratelimit-remaining-requests: {r}\r\n\
             x-ratelimit-reset-requests: {reset}\r\n"
        ),
        Some([a, b]) => format!(
            "x-ratelimit-limit-requests: {a}\r\nx-ratelimit-remaining-requests: {}\r\n\
             x-ratelimit-reset-requests: 1s\r\nx-ratelimit-limit-requests: {b}\r\n",
            remaining.min(*a.min(b))
        ),
    };
    if let (Some(&per_s), Some(left)) = (s.terms.tokens.get(&org), tokens_left) {
        // Whole again when the bucket has refilled: milliseconds, as OpenAI writes a
        // short reset.
        let reset_ms = ((per_s - left as f64) / per_s * 1000.0).ceil().max(0.0) as u64;
        fields.push_str(&format!(
            "x-ratelimit-limit-tokens: {}\r\nx-ratelimit-remaining-tokens: {left}\r\n\
             x-ratelimit-reset-tokens: {reset_ms}ms\r\n",
            per_s as u64
        ));
    }
    let head = match (spec, admitted) {
        (None, true) => format!("HTTP/1.1 200 OK\r\n{fields}content-length: 2\r\n\r\nok"),
        (None, false) => format!(
            "HTTP/1.1 429 Too Many Requests\r\nretry-after: 1\r\n{fields}\
             content-length: 2\r\n\r\nno"
        ),
        (Some(spec), admitted) => {
            let (status, retry, body) = if admitted {
                let body = String::from_utf8(llm::body_bytes(&spec)).unwrap();
                ("200 OK", "", body)
            } else {
                // OpenAI's refusal for its token limit.
                let body = format!(
                    r#"{{"error":{{"message":"Rate limit reached for {} in organization {org} on tokens per second: Requested {}. Please try again in 1s.","type":"tokens","param":null,"code":"rate_limit_exceeded"}}}}"#,
                    spec.model,
                    cost.unwrap_or(0)
                );
                ("429 Too Many Requests", "retry-after: 1\r\n", body)
            };
            format!(
                "HTTP/1.1 {status}\r\n{retry}{fields}content-type: application/json\r\n\
                 content-length: {}\r\n\r\n{body}",
                body.len()
            )
        }
    };
    out.write_all(head.as_bytes()).is_ok()
}

/// `org`'s bucket in `buckets` (one second of `rate`, full at first), refilled to `now`: what
/// it holds.
fn refilled<'a>(
    buckets: &'a mut HashMap<String, (f64, Instant)>,
    org: &str,
    rate: f64,
    now: Instant,
) -> &'a mut f64 {
    let (left, at) = buckets.entry(org.to_string()).or_insert((rate, now));
    *left = (*left + now.duration_since(*at).as_secs_f64() * rate).min(rate);
    *at = now;
    left
}

/// Takes a token of `org`'s bucket for `tenant`, and `cost` tokens of its token bucket if it
/// has one: whether there were enough, the whole requests left, the whole tokens left (with a
/// token limit), and for a garbage organisation the answer's number.
fn take(
    s: &Shared,
    org: &str,
    tenant: &str,
    cost: Option<u64>,
) -> (bool, u64, Option<u64>, Option<u64>) {
    let now = Instant::now();
    let since = now.duration_since(s.started);
    let second = since.as_secs();
    let rate = s.terms.rate_of(org);
    let mut state = s.state.lock().unwrap();
    let state = &mut *state;
    let tokens = refilled(&mut state.buckets, org, rate, now);
    let mut admitted = *tokens >= 1.0;
    let per_s = s.terms.tokens.get(org).copied();
    let token_left = per_s.map(|per_s| {
        let left = refilled(&mut state.token_buckets, org, per_s, now);
        let cost = cost.unwrap_or(0) as f64;
        if admitted && *left >= cost {
            *left -= cost;
        } else {
            admitted = false;
        }
        *left as u64
    });
    if admitted {
        *tokens -= 1.0;
    }
    let left = *tokens as u64;
    let key = (org.to_string(), tenant.to_string(), second);
    if admitted && per_s.is_some() {
        *state.tokens.entry(key.clone()).or_default() += cost.unwrap_or(0);
    }
    let e = state.tally.entry(key).or_default();
    if admitted {
        e.0 += 1;
    } else {
        e.1 += 1;
    }
    let t = since.as_secs_f64();
    let seen = state.seen.entry(org.to_string()).or_insert((t, None));
    if !admitted {
        seen.1 = Some(t);
    }
    let garbage = s.terms.garbage.iter().any(|g| g == org).then(|| {
        let n = state.answers.entry(org.to_string()).or_default();
        *n += 1;
        *n - 1
    });
    (admitted, left, token_left, garbage)
}
