//! Nothing but tests: see `tests/`. Each test drives a real Envoy (`make integration`).
