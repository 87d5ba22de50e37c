//! `rls-server LISTEN REDIS_URL LIMITS_JSON [DELAY_MS [serial]]`: Envoy's rate limit service
//! (`envoy.service.ratelimit.v3.RateLimitService`) on the limitador engine with Redis storage
//! (or its in-memory storage, counters in this process, when REDIS_URL is `memory`), mapping
//! requests the way Kuadrant's Limitador server does: the domain is the namespace, the
//! descriptors are bound as `descriptors[i].<entry key>`, `hits_addend` (at least 1) is the delta.
//!
//! LIMITS_JSON: `[{"namespace", "max_value", "seconds", "conditions": [CEL], "variables": [CEL],
//! "name"}]`. DELAY_MS delays every answer (to test a slow service). `serial` answers one call
//! at a time: limitador 0.14's Redis storage checks a counter, then updates it in a second
//! step, so concurrent calls near the limit can all pass the check and be counted past it;
//! serialized, the engine never grants beyond the limit. The in-memory storage checks and
//! counts in two steps too (an atomic read, then an atomic add), nanoseconds apart instead of
//! a Redis round trip. Test support only.
//!
//! With `RLS_DESCRIPTORS=each` in its environment, it counts each descriptor of a call by itself,
//! as envoyproxy/ratelimit does (`GetHitsAddends` and its Redis cache, at commit f2fb157): by the
//! descriptor's own `hits_addend` where it has one (0: read the counter, do not add), else by the
//! call's (at least 1), and answers one status per descriptor with its own code and what remains
//! of its counter; the call is refused if any descriptor is. A descriptor no limit matches is
//! answered `OK`, with no limit. What stays limitador's: a refused descriptor is not counted
//! (envoyproxy/ratelimit adds to its counter first and compares after, unless started with
//! `STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT`). Limitador's own server reads neither.
//!
//! With `RLS_LOG=FILE` in its environment, it appends one JSON line per call to FILE: the
//! domain, each descriptor's entries as `[key, value]` pairs, `hits_addend`, whether the call
//! was refused, and the names of the limits that counted it (`services.rs` checks the examples'
//! service configurations against what the filter sends).

mod proto;

use limitador::limit::{Context, Expression, Limit, Namespace, Predicate};
use limitador::storage::redis::AsyncRedisStorage;
use limitador::{AsyncRateLimiter, CheckResult, RateLimiter};
use proto::{
    Code, DescriptorStatus, HeaderValue, PbDuration, RateLimit, RateLimitRequest,
    RateLimitResponse, RateLimitService, RateLimitServiceServer, Unit,
};
use std::collections::HashMap;
use std::time::Duration;
use tonic::{Request, Response, Status};

/// The engine over its storage.
enum Limiter {
    Redis(AsyncRateLimiter),
    Memory(RateLimiter),
}

impl Limiter {
    fn add_limit(&self, limit: Limit) {
        match self {
            Limiter::Redis(l) => l.add_limit(limit),
            Limiter::Memory(l) => l.add_limit(limit),
        };
    }

    async fn check_and_update(
        &self,
        namespace: &Namespace,
        ctx: &Context<'_>,
        hits: u64,
    ) -> Result<CheckResult, String> {
        match self {
            Limiter::Redis(l) => l.check_rate_limited_and_update(namespace, ctx, hits).await,
            Limiter::Memory(l) => l.check_rate_limited_and_update(namespace, ctx, hits),
        }
        .map_err(|e| e.to_string())
    }
}

struct Service {
    limiter: Limiter,
    delay: Duration,
    /// Held across each check and update when calls are serialized.
    serial: Option<tokio::sync::Mutex<()>>,
    /// Where each call is logged (`RLS_LOG`).
    log: Option<std::path::PathBuf>,
    /// Each descriptor counted by itself (`RLS_DESCRIPTORS=each`).
    each: bool,
}

impl Service {
    fn log_call(&self, req: &RateLimitRequest, limited: bool, limits: Vec<String>) {
        use std::io::Write;
        let Some(path) = &self.log else { return };
        let descriptors: Vec<Vec<[&str; 2]>> = req
            .descriptors
            .iter()
            .map(|d| {
                d.entries
                    .iter()
                    .map(|e| [e.key.as_str(), e.value.as_str()])
                    .collect()
            })
            .collect();
        let line = serde_json::json!({
            "domain": req.domain,
            "descriptors": descriptors,
            "hits": req.hits_addend,
            "limited": limited,
            "limits": limits,
        });
        if let Ok(mut f) = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
        {
            let _ = writeln!(f, "{line}");
        }
    }
}

/// A descriptor's status from one of its counters, with the code `code`.
fn status(c: &limitador::counter::Counter, code: Code) -> DescriptorStatus {
    let (_, u) = unit(c.window().as_secs());
    // A counter without an expiry says nothing of its reset (0 would read as "the window
    // turns now").
    let reset = c.expires_in();
    DescriptorStatus {
        code: code.into(),
        current_limit: Some(RateLimit {
            name: c.limit().name().unwrap_or_default().to_string(),
            requests_per_unit: u32::try_from(c.max_value()).unwrap_or(u32::MAX),
            unit: u.into(),
        }),
        limit_remaining: u32::try_from(c.remaining().unwrap_or(0)).unwrap_or(0),
        duration_until_reset: reset.map(|r| PbDuration {
            seconds: r.as_secs() as i64,
            nanos: r.subsec_nanos() as i32,
        }),
    }
}

impl Service {
    /// A call counted descriptor by descriptor (`RLS_DESCRIPTORS=each`).
    async fn each_descriptor(&self, req: RateLimitRequest) -> Result<RateLimitResponse, Status> {
        let namespace = Namespace::from(req.domain.as_str());
        let _one_at_a_time = match &self.serial {
            Some(m) => Some(m.lock().await),
            None => None,
        };
        let mut statuses = Vec::with_capacity(req.descriptors.len());
        let mut limits = Vec::new();
        let mut any_limited = false;
        for d in &req.descriptors {
            let values: Vec<HashMap<String, String>> = vec![d
                .entries
                .iter()
                .map(|e| (e.key.clone(), e.value.clone()))
                .collect()];
            let mut ctx = Context::default();
            ctx.list_binding("descriptors".to_string(), values);
            let hits = d
                .hits_addend
                .map_or(u64::from(req.hits_addend.max(1)), |h| h.value);
            let result = self
                .limiter
                .check_and_update(&namespace, &ctx, hits)
                .await
                .map_err(Status::unavailable)?;
            let code = if result.limited {
                Code::OverLimit
            } else {
                Code::Ok
            };
            any_limited |= result.limited;
            limits.extend(
                result
                    .counters
                    .iter()
                    .map(|c| c.limit().name().unwrap_or_default().to_string()),
            );
            // The counter with the least remaining speaks for the descriptor.
            let tightest = result
                .counters
                .iter()
                .min_by_key(|c| c.remaining().unwrap_or(0));
            statuses.push(tightest.map_or(
                DescriptorStatus {
                    code: Code::Ok.into(),
                    current_limit: None,
                    limit_remaining: 0,
                    duration_until_reset: None,
                },
                |c| status(c, code),
            ));
        }
        self.log_call(&req, any_limited, limits);
        Ok(RateLimitResponse {
            overall_code: if any_limited { Code::OverLimit } else { Code::Ok }.into(),
            statuses,
            response_headers_to_add: vec![HeaderValue {
                key: "x-rls-server".into(),
                value: "limitador".into(),
            }],
        })
    }
}

fn unit(seconds: u64) -> (u32, Unit) {
    match seconds {
        1 => (1, Unit::Second),
        60 => (1, Unit::Minute),
        3600 => (1, Unit::Hour),
        86400 => (1, Unit::Day),
        604800 => (1, Unit::Week),
        _ => (1, Unit::Unknown),
    }
}

#[tonic::async_trait]
impl RateLimitService for Service {
    async fn should_rate_limit(
        &self,
        request: Request<RateLimitRequest>,
    ) -> Result<Response<RateLimitResponse>, Status> {
        if !self.delay.is_zero() {
            tokio::time::sleep(self.delay).await;
        }
        let req = request.into_inner();
        if req.domain.is_empty() {
            return Ok(Response::new(RateLimitResponse {
                overall_code: Code::Unknown.into(),
                ..Default::default()
            }));
        }
        if self.each {
            return Ok(Response::new(self.each_descriptor(req).await?));
        }
        let namespace = Namespace::from(req.domain.as_str());
        let values: Vec<HashMap<String, String>> = req
            .descriptors
            .iter()
            .map(|d| {
                d.entries
                    .iter()
                    .map(|e| (e.key.clone(), e.value.clone()))
                    .collect()
            })
            .collect();
        let mut ctx = Context::default();
        ctx.list_binding("descriptors".to_string(), values);
        let hits = u64::from(req.hits_addend.max(1));
        let _one_at_a_time = match &self.serial {
            Some(m) => Some(m.lock().await),
            None => None,
        };
        let mut result = self
            .limiter
            .check_and_update(&namespace, &ctx, hits)
            .await
            .map_err(Status::unavailable)?;
        self.log_call(
            &req,
            result.limited,
            result
                .counters
                .iter()
                .map(|c| c.limit().name().unwrap_or_default().to_string())
                .collect(),
        );
        let code = if result.limited {
            Code::OverLimit
        } else {
            Code::Ok
        };
        let statuses = result
            .counters
            .iter()
            .map(|c| status(c, code))
            .collect();
        let headers = result
            .response_header()
            .into_iter()
            .map(|(key, value)| HeaderValue { key, value })
            .chain(std::iter::once(HeaderValue {
                key: "x-rls-server".into(),
                value: "limitador".into(),
            }))
            .collect();
        Ok(Response::new(RateLimitResponse {
            overall_code: code.into(),
            statuses,
            response_headers_to_add: headers,
        }))
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    if args.len() < 4 {
        eprintln!("usage: rls-server LISTEN REDIS_URL|memory LIMITS_JSON [DELAY_MS [serial]]");
        std::process::exit(2);
    }
    let limiter = match args[2].as_str() {
        "memory" => Limiter::Memory(RateLimiter::new(10_000)),
        url => Limiter::Redis(AsyncRateLimiter::new_with_storage(Box::new(
            AsyncRedisStorage::new(url).await?,
        ))),
    };
    let limits: serde_json::Value = serde_json::from_str(&args[3])?;
    for l in limits.as_array().ok_or("LIMITS_JSON must be an array")? {
        let strings = |field: &str| -> Vec<String> {
            l[field]
                .as_array()
                .map(|a| {
                    a.iter()
                        .filter_map(|s| s.as_str().map(str::to_string))
                        .collect()
                })
                .unwrap_or_default()
        };
        let conditions: Vec<Predicate> = strings("conditions")
            .into_iter()
            .map(|c| Predicate::try_from(c).expect("condition"))
            .collect();
        let variables: Vec<Expression> = strings("variables")
            .into_iter()
            .map(|v| Expression::try_from(v).expect("variable"))
            .collect();
        let mut limit = Limit::new(
            l["namespace"].as_str().unwrap_or("edge"),
            l["max_value"].as_u64().unwrap_or(1),
            l["seconds"].as_u64().unwrap_or(60),
            conditions,
            variables,
        );
        if let Some(name) = l["name"].as_str() {
            limit.set_name(name.to_string());
        }
        limiter.add_limit(limit);
    }
    let delay = Duration::from_millis(args.get(4).and_then(|d| d.parse().ok()).unwrap_or(0));
    let serial =
        (args.get(5).map(String::as_str) == Some("serial")).then(|| tokio::sync::Mutex::new(()));
    let addr = args[1].parse()?;
    eprintln!("rls-server listening on {addr}");
    tonic::transport::Server::builder()
        .add_service(RateLimitServiceServer::new(Service {
            limiter,
            delay,
            serial,
            log: std::env::var_os("RLS_LOG").map(std::path::PathBuf::from),
            each: std::env::var("RLS_DESCRIPTORS").is_ok_and(|v| v == "each"),
        }))
        .serve(addr)
        .await?;
    Ok(())
}
