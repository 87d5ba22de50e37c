#!/usr/bin/env bash
# Runs the demo's Envoy for `make run` and `make run-native`:
#   tools/run-envoy.sh FOUND PINNED "SUPPORTED..." -- ENVOY_ARGS...
# FOUND is the Envoy the Makefile found (the `envoy` on the PATH, else PINNED); PINNED is the
# pinned release's binary (installed by `make PINNED` when missing); SUPPORTED lists the Envoy
# releases the build is tested on (any patch release of the same minor release counts). FOUND
# runs if it is one of them; otherwise PINNED does. Either way this says which Envoy it runs.
set -euo pipefail

found=$1 pinned=$2 supported=$3
shift 3
[ "${1:-}" = "--" ] && shift

# The release an Envoy binary says it is ("version: <sha>/1.40.0/Clean/RELEASE/BoringSSL").
release() {
    "$1" --version 2>/dev/null | sed -n 's#.*version: [^/]*/\([0-9][0-9]*\.[0-9][0-9]*\.[0-9][0-9]*\)/.*#\1#p' | head -n 1
}

minor() { echo "${1%.*}"; }

supports() {
    local r
    for r in $supported; do
        [ "$(minor "$r")" = "$(minor "$1")" ] && return 0
    done
    return 1
}

envoy=$found
version=$(release "$found" || true)
if [ -z "$version" ] || ! supports "$version"; then
    if [ "$found" != "$pinned" ]; then
        echo "$found is Envoy ${version:-of an unknown release}, not one this build is tested on ($supported): using the pinned one instead" >&2
    fi
    if [ ! -x "$pinned" ]; then
        make --no-print-directory "${pinned#"$PWD"/}"
    fi
    envoy=$pinned
    version=$(release "$pinned")
fi
echo "Envoy $version: $envoy" >&2
exec "$envoy" "$@"
