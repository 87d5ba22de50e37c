#!/usr/bin/env python3
"""Builds a release's artefacts into one directory (`make dist`):

    python3 deploy/dist/dist.py VERSION WASM OUT RELEASE=SO [RELEASE=SO ...]

VERSION: the workspace's version (Cargo.toml). WASM: the built filter. RELEASE=SO: a native
module and the Envoy release whose ABI it was built for (1.40.0=target/native/libwasm_ratelimit.so).
OUT is emptied, then holds:

    wasm-ratelimit-VERSION.wasm                              the proxy-wasm filter
    wasm-ratelimit-VERSION-oci.tar                           its OCI image layout (Istio's Wasm
                                                             image spec, compat variant), tag VERSION
    Dockerfile.wasm                                          the same image, for docker
    wasm-ratelimit-native-VERSION-envoy-X.Y-ARCH-linux.tar.gz  per Envoy ABI: libwasm_ratelimit.so,
                                                             LICENSE, README
    Dockerfile.native                                        Envoy with the native module
    SHA256SUMS                                               every file above (sha256sum -c)

and a NAME.sha256 beside each .wasm, .tar and .tar.gz. Reproducible: no timestamps, owners or
modes from the build machine in the archives. deploy/dist/test_dist.py checks the result.
"""

import gzip
import hashlib
import io
import platform
import shutil
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "deploy/oci"))
import build as oci  # noqa: E402

README = """wasm-ratelimit {version}, the native build: an Envoy dynamic module for Envoy {minor}
({arch} Linux), built against the dynamic-module ABI of Envoy {release}.

The module is built for one Envoy release's ABI and tested in it (the book's
reference/versions.md says what other releases do with it). Put libwasm_ratelimit.so in a
directory Envoy searches and name it in the configuration:

    ENVOY_DYNAMIC_MODULES_SEARCH_PATH=/path/to/this/directory envoy -c envoy.yaml

    http_filters:
    - name: envoy.filters.http.dynamic_modules
      typed_config:
        "@type": type.googleapis.com/envoy.extensions.filters.http.dynamic_modules.v3.DynamicModuleFilter
        dynamic_module_config: {{name: wasm_ratelimit}}   # loads libwasm_ratelimit.so
        filter_name: edge                               # the plugin's name: metrics, counters
        filter_config:
          "@type": type.googleapis.com/google.protobuf.StringValue
          value: '{{"rules": [{{"name": "per-ip", "key": ["remote_address"],
                   "rate_limit": {{"requests_per_unit": 100, "unit": "minute"}}}}]}}'
    - name: envoy.filters.http.router
      typed_config:
        "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router

A new module needs an Envoy restart, and the restart starts every local counter from zero.
The book (docs/ in the source repository) has the rest: how-to/deploy-envoy-native.md,
how-to/upgrade.md, reference/versions.md. Licensed under the Apache License 2.0 (LICENSE).
"""


def sha256_file(path):
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def write_sum(path):
    """NAME.sha256 beside `path`, in sha256sum's format."""
    Path(f"{path}.sha256").write_text(f"{sha256_file(path)}  {Path(path).name}\n")


def native_archive(out, version, release, so):
    """wasm-ratelimit-native-VERSION-envoy-X.Y-ARCH-linux.tar.gz: one directory of that name
    holding libwasm_ratelimit.so, LICENSE and README."""
    minor = ".".join(release.split(".")[:2])
    arch = platform.machine()
    name = f"wasm-ratelimit-native-{version}-envoy-{minor}-{arch}-linux"
    readme = README.format(version=version, minor=minor, release=release, arch=arch)
    files = [
        ("libwasm_ratelimit.so", Path(so).read_bytes(), 0o755),
        ("LICENSE", (ROOT / "LICENSE").read_bytes(), 0o644),
        ("README", readme.encode(), 0o644),
    ]
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        top = tarfile.TarInfo(name)
        top.type, top.mode, top.mtime = tarfile.DIRTYPE, 0o755, 0
        tar.addfile(top)
        for file, data, mode in files:
            info = tarfile.TarInfo(f"{name}/{file}")
            info.size, info.mode, info.mtime = len(data), mode, 0
            tar.addfile(info, io.BytesIO(data))
    path = out / f"{name}.tar.gz"
    path.write_bytes(gzip.compress(buf.getvalue(), mtime=0))
    return path, name


def with_default(dockerfile, arg, value):
    """The Dockerfile's text with `ARG <arg>=`'s default set to `value`."""
    lines = dockerfile.read_text().splitlines(keepends=True)
    hits = [i for i, l in enumerate(lines) if l.startswith(f"ARG {arg}=")]
    if len(hits) != 1:
        raise SystemExit(f"{dockerfile}: expected one `ARG {arg}=` line")
    lines[hits[0]] = f"ARG {arg}={value}\n"
    return "".join(lines)


def main(version, wasm, out, natives):
    out = Path(out)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    made = []

    wasm_out = out / f"wasm-ratelimit-{version}.wasm"
    shutil.copyfile(wasm, wasm_out)
    made.append(wasm_out)

    # The layout as one tar (build.py writes LAYOUT and LAYOUT.tar); only the tar is shipped.
    layout = out / f"wasm-ratelimit-{version}-oci"
    oci.build(str(wasm_out), layout, version)
    shutil.rmtree(layout)
    made.append(out / f"wasm-ratelimit-{version}-oci.tar")
    (out / "Dockerfile.wasm").write_text(
        with_default(ROOT / "deploy/oci/Dockerfile", "WASM", wasm_out.name))

    # The native Dockerfile's default module: the archive built for its default Envoy.
    native_docker = ROOT / "deploy/native/Dockerfile"
    envoy_default = next(l.split("=", 1)[1].strip() for l in native_docker.read_text().splitlines()
                         if l.startswith("ARG ENVOY="))
    default_dir = None
    for spec in natives:
        release, so = spec.split("=", 1)
        path, name = native_archive(out, version, release, so)
        made.append(path)
        if envoy_default == f"v{release}":
            default_dir = name
    if default_dir is None:
        raise SystemExit(f"{native_docker}: no module built for its default Envoy {envoy_default}")
    (out / "Dockerfile.native").write_text(
        with_default(native_docker, "MODULE", f"{default_dir}/libwasm_ratelimit.so"))

    for path in made:
        write_sum(path)
    listed = sorted(p for p in out.iterdir() if p.suffix != ".sha256")
    (out / "SHA256SUMS").write_text("".join(f"{sha256_file(p)}  {p.name}\n" for p in listed))
    for p in sorted(out.iterdir()):
        print(f"{p}: {p.stat().st_size} bytes")


if __name__ == "__main__":
    if len(sys.argv) < 5:
        raise SystemExit(__doc__)
    main(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:])
