#!/usr/bin/env bash
# limitador's Redis-only build (default-features = false, features = ["redis_storage"]) does not
# compile in 0.11–0.14: the counter-key encoding that Redis storage uses sits in a module gated
# behind the RocksDB feature. Rather than build RocksDB, take the released crate from crates.io
# and lift those `cfg`s (two lines), into target/patched-limitador (which Cargo.toml patches in).
set -euo pipefail
cd "$(dirname "$0")/../../.."
version=0.14.0
out=target/patched-limitador
[ -f "$out/.patched-$version" ] && exit 0
fetch=target/limitador-fetch
mkdir -p "$fetch/src"
printf '[package]\nname = "fetch"\nversion = "0.0.0"\nedition = "2021"\n[workspace]\n[dependencies]\nlimitador = { version = "=%s", default-features = false }\n' "$version" > "$fetch/Cargo.toml"
touch "$fetch/src/lib.rs"
(cd "$fetch" && cargo fetch -q)
src=$(ls -d "${CARGO_HOME:-$HOME/.cargo}"/registry/src/*/limitador-$version | head -n 1)
rm -rf "$out"
cp -r "$src" "$out"
python3 - "$out" <<'PY'
import sys
root = sys.argv[1]
for path, gated in [
    ("src/storage/keys.rs", '#[cfg(feature = "disk_storage")]\npub mod bin {'),
    ("src/counter.rs", '    #[cfg(feature = "disk_storage")]\n    pub(crate) fn variables_for_key'),
]:
    p = f"{root}/{path}"
    s = open(p).read()
    assert gated in s, f"limitador changed ({path}): review crates/envoy-tests/rls-server/prepare.sh"
    open(p, "w").write(s.replace(gated, gated.split("\n", 1)[1]))
PY
touch "$out/.patched-$version"
echo "patched limitador $version in $out"
