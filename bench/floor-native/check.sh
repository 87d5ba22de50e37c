#!/usr/bin/env bash
# check.sh: build libfloor_native.so and check that Envoy (default: the project's Envoy 1.40 in
# .venv) loads it and that it serves: x-ratelimit-limit / x-ratelimit-remaining on every
# response, remaining counting down per client IP across connections and both workers.
# Starts one Envoy on free ports (--concurrency 2) and stops it (by PID) on exit.
set -eu
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
ENVOY=${ENVOY:-$(readlink -f "$ROOT"/.venv/lib/python3*/site-packages/envoy/_bin/envoy)}
TMP=$(mktemp -d)
EPID=""
cleanup() {
  if [ -n "$EPID" ]; then kill "$EPID" 2>/dev/null || true; wait "$EPID" 2>/dev/null || true; fi
  rm -rf "$TMP"
}
trap cleanup EXIT

(cd "$HERE" && cargo build --release -q)
read -r ADMIN LISTEN BACKEND < <(python3 -c '
import socket
s = [socket.socket() for _ in range(3)]
for x in s: x.bind(("127.0.0.1", 0))
print(*[x.getsockname()[1] for x in s])')

cat > "$TMP/envoy.yaml" <<EOF
admin: {address: {socket_address: {address: 127.0.0.1, port_value: $ADMIN}}}
static_resources:
  clusters:
  - name: backend
    type: STATIC
    load_assignment:
      cluster_name: backend
      endpoints: [{lb_endpoints: [{endpoint: {address: {socket_address: {address: 127.0.0.1, port_value: $BACKEND}}}}]}]
  listeners:
  - name: backend
    address: {socket_address: {address: 127.0.0.1, port_value: $BACKEND}}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: backend
          route_config:
            virtual_hosts: [{name: be, domains: ["*"], routes: [{match: {prefix: "/"}, direct_response: {status: 200, body: {inline_string: ok}}}]}]
          http_filters:
          - name: envoy.filters.http.router
            typed_config: {"@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router}
  - name: main
    address: {socket_address: {address: 127.0.0.1, port_value: $LISTEN}}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: main
          route_config:
            virtual_hosts: [{name: vh, domains: ["*"], routes: [{match: {prefix: "/"}, route: {cluster: backend}}]}]
          http_filters:
          - name: envoy.filters.http.dynamic_modules
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.dynamic_modules.v3.DynamicModuleFilter
              dynamic_module_config: {name: floor_native}
              filter_name: floor
              filter_config: {"@type": type.googleapis.com/google.protobuf.StringValue, value: "10"}
          - name: envoy.filters.http.router
            typed_config: {"@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router}
EOF

ENVOY_DYNAMIC_MODULES_SEARCH_PATH="$HERE/target/release" "$ENVOY" -c "$TMP/envoy.yaml" \
  --concurrency 2 --log-level warn > "$TMP/envoy.log" 2>&1 &
EPID=$!
for _ in $(seq 1 100); do curl -sf "http://127.0.0.1:$ADMIN/ready" >/dev/null 2>&1 && break; sleep 0.1; done
curl -sf "http://127.0.0.1:$ADMIN/ready" >/dev/null || { echo "FAIL: Envoy did not start"; cat "$TMP/envoy.log"; exit 1; }

fail=0
got=""
for i in 1 2 3 4 5 6 7 8 9 10 11 12; do
  h=$(curl -s --max-time 5 -D - -o /dev/null "http://127.0.0.1:$LISTEN/r$i")
  limit=$(printf '%s' "$h" | tr -d '\r' | awk -F': ' 'tolower($1)=="x-ratelimit-limit"{print $2}')
  rem=$(printf '%s' "$h" | tr -d '\r' | awk -F': ' 'tolower($1)=="x-ratelimit-remaining"{print $2}')
  [ "$limit" = 10 ] || fail=1
  got="$got $rem"
done
# 12 requests from 127.0.0.1, each on a new connection (new source port): one slot per IP.
[ "$got" = " 9 8 7 6 5 4 3 2 1 0 0 0" ] || fail=1
workers=$(curl -s "http://127.0.0.1:$ADMIN/stats?filter=^listener.127.0.0.1_$LISTEN.worker_.*downstream_cx_total" | awk '$2>0' | wc -l)
echo "remaining:$got  (workers that took connections: $workers)"
if [ $fail = 0 ]; then echo "PASS floor-native loads in $("$ENVOY" --version 2>/dev/null | grep -o '[0-9]*\.[0-9]*\.[0-9]*/' | tr -d /) and serves"; else echo "FAIL"; exit 1; fi
