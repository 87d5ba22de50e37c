#!/usr/bin/env python3
"""Checks what `make dist` builds (run by `make deploy-test`):

    python3 deploy/dist/test_dist.py target/dist

- the files are the ones expected for the workspace's version, each .sha256 and SHA256SUMS
  match (and `sha256sum -c` agrees);
- the OCI layout in the tar passes deploy/oci/test_oci.py's checks, and Dockerfile.wasm copies
  the release's .wasm as plugin.wasm;
- each native archive holds one directory with libwasm_ratelimit.so, LICENSE and README, and
  Dockerfile.native takes the module built for the Envoy it starts from;
- the release's .wasm runs the demo (envoy.yaml) in the pinned Envoy, and each archive's module,
  unpacked, runs the native demo (envoy-native.yaml) in the Envoy of its ABI, found through
  ENVOY_DYNAMIC_MODULES_SEARCH_PATH: a 200, then the demo's limit (a 429 on the sixth request).
  The 1.39 module runs in .venv-envoy/1.39.3 when it is installed (`make envoys`), else is
  skipped with a line saying so.
The Dockerfiles are checked as written: there is no docker engine here to build them.
"""

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "deploy/oci"))
sys.path.insert(0, str(ROOT / "bench"))
import bench  # noqa: E402  (its Envoy: one process, on free ports, waited for)
import test_oci  # noqa: E402
from test_oci import check  # noqa: E402

# The Envoy each native build is for (Makefile: PINNED_ENVOY, PREV_ENVOY) and where it is.
ENVOYS = {
    "1.40": os.environ.get("ENVOY_1_40", str(ROOT / ".venv/bin/envoy")),
    "1.39": os.environ.get("ENVOY_1_39", str(ROOT / ".venv-envoy/1.39.3/bin/envoy")),
}
skipped = []


def version():
    text = (ROOT / "Cargo.toml").read_text()
    section = text.split("[workspace.package]", 1)[1].split("\n[", 1)[0]
    return re.search(r'^version = "(.+)"$', section, re.M).group(1)


def sha256(path):
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def check_sums(dist, names):
    for name in names:
        if name.startswith("wasm-ratelimit") and name.endswith((".wasm", ".tar", ".tar.gz")):
            check(f"{name}.sha256", (dist / f"{name}.sha256").read_text() == f"{sha256(dist / name)}  {name}\n")
    listed = {}
    for line in (dist / "SHA256SUMS").read_text().splitlines():
        digest, name = line.split("  ", 1)
        listed[name] = digest
    expected = {n for n in names if not n.endswith(".sha256") and n != "SHA256SUMS"}
    check("SHA256SUMS lists every artefact", set(listed) == expected, sorted(listed))
    for name, digest in listed.items():
        check(f"SHA256SUMS: {name}", (dist / name).is_file() and sha256(dist / name) == digest)
    if shutil.which("sha256sum"):
        r = subprocess.run(["sha256sum", "-c", "--quiet", "SHA256SUMS"], cwd=dist, capture_output=True, text=True)
        check("sha256sum -c SHA256SUMS", r.returncode == 0, r.stdout + r.stderr)


def get(port, path="/"):
    """The status of a GET, or None when nothing answers."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return None


def run_demo(name, envoy, config, module_dir=None):
    """Starts `envoy` with the demo `config` (its ports moved to free ones) and checks a 200,
    then the demo's per-client limit of 5 a minute."""
    if not Path(envoy).is_file():
        skipped.append(f"{name}: no {envoy} (make envoys installs it)")
        return

    def on_ports(port, admin):
        return config.read_text().replace("port_value: 10000", f"port_value: {port}") \
            .replace("port_value: 9901", f"port_value: {admin}")

    with tempfile.TemporaryDirectory() as tmp:
        try:
            proc = bench.Envoy(envoy, "demo", None, Path(tmp), config=on_ports, workers=1,
                               module_dir=module_dir, cwd=ROOT)
        except SystemExit as e:
            check(f"{name}: Envoy starts", False, f"{e}\n{(Path(tmp) / 'demo.log').read_text()[-2000:]}")
            return
        try:
            statuses = [get(proc.port) for _ in range(6)]
            ok = statuses == [200, 200, 200, 200, 200, 429]
            check(f"{name}: 200, then the demo's limit", ok,
                  f"{statuses}\n{proc.log_path.read_text()[-2000:]}")
            if ok:
                print(f"{name}: 200 x5, 429 (Envoy {envoy})")
        finally:
            proc.stop()


def check_native(dist, name, minor, tmp):
    archive = dist / name
    top = name[: -len(".tar.gz")]
    with tarfile.open(archive) as tar:
        members = tar.getmembers()
        check(f"{name}: one directory, the module, LICENSE, README",
              [m.name for m in members] == [top, f"{top}/libwasm_ratelimit.so", f"{top}/LICENSE", f"{top}/README"],
              [m.name for m in members])
        check(f"{name}: no build machine's times or owners",
              all(m.mtime == 0 and m.uid == 0 and m.uname == "" for m in members))
        check(f"{name}: the module is executable", members[1].mode == 0o755 if len(members) > 1 else False)
        tar.extractall(tmp)
    unpacked = Path(tmp) / top
    check(f"{name}: an ELF shared object", (unpacked / "libwasm_ratelimit.so").read_bytes()[:4] == b"\x7fELF")
    check(f"{name}: LICENSE is the repository's", (unpacked / "LICENSE").read_bytes() == (ROOT / "LICENSE").read_bytes())
    check(f"{name}: README names the Envoy", f"for Envoy {minor}" in (unpacked / "README").read_text())
    run_demo(f"native module for Envoy {minor}", ENVOYS[minor], ROOT / "envoy-native.yaml", unpacked)
    return unpacked


def check_native_dockerfile(dist, defaults):
    """Dockerfile.native: FROM the Envoy image of ARG ENVOY, the module of ARG MODULE copied to
    the directory ENVOY_DYNAMIC_MODULES_SEARCH_PATH names; its defaults belong together."""
    lines = [l.split(None, 1) for l in (dist / "Dockerfile.native").read_text().splitlines()
             if l.strip() and not l.startswith("#")]
    args = dict(l[1].split("=", 1) for l in lines if l[0] == "ARG" and "=" in l[1])
    check("Dockerfile.native FROM envoyproxy/envoy:${ENVOY}", ["FROM", "envoyproxy/envoy:${ENVOY}"] in lines, lines)
    envoy = args.get("ENVOY", "")
    minor = ".".join(envoy.lstrip("v").split(".")[:2])
    check("Dockerfile.native's default module is the one for its default Envoy",
          args.get("MODULE") == f"{defaults.get(minor)}/libwasm_ratelimit.so", (envoy, args.get("MODULE")))
    copies = [l[1].split() for l in lines if l[0] == "COPY"]
    envs = [l[1] for l in lines if l[0] == "ENV"]
    check("Dockerfile.native copies ${MODULE} as libwasm_ratelimit.so",
          len(copies) == 1 and copies[0][0] == "${MODULE}" and copies[0][1].endswith("/libwasm_ratelimit.so"), copies)
    if len(copies) == 1:
        directory = copies[0][1].rsplit("/", 1)[0]
        check("Dockerfile.native searches the module's directory",
              envs == [f"ENVOY_DYNAMIC_MODULES_SEARCH_PATH={directory}"], envs)


def main(dist):
    started = time.time()
    dist = Path(dist)
    v = version()
    arch = os.uname().machine
    natives = {minor: f"wasm-ratelimit-native-{v}-envoy-{minor}-{arch}-linux.tar.gz" for minor in ENVOYS}
    artefacts = [f"wasm-ratelimit-{v}.wasm", f"wasm-ratelimit-{v}-oci.tar", *natives.values()]
    expected = sorted(["Dockerfile.wasm", "Dockerfile.native", "SHA256SUMS", *artefacts,
                       *(f"{a}.sha256" for a in artefacts)])
    names = sorted(p.name for p in dist.iterdir())
    check("the release's files", names == expected, names)
    check_sums(dist, names)

    wasm_path = dist / f"wasm-ratelimit-{v}.wasm"
    wasm = wasm_path.read_bytes()
    check("the .wasm is a wasm module", wasm[:4] == b"\0asm")
    with tempfile.TemporaryDirectory() as tmp:
        with tarfile.open(dist / f"wasm-ratelimit-{v}-oci.tar") as tar:
            tar.extractall(tmp)
        test_oci.check_layout(Path(tmp), wasm, v)
    test_oci.check_dockerfile(dist / "Dockerfile.wasm", wasm_path, dist)
    with tempfile.TemporaryDirectory() as tmp:
        demo = Path(tmp) / "envoy.yaml"
        demo.write_text((ROOT / "envoy.yaml").read_text().replace(
            "target/wasm32-wasip1/release/wasm_ratelimit.wasm", str(wasm_path.resolve())))
        run_demo("the .wasm", ENVOYS["1.40"], demo)

    defaults = {}
    for minor, name in natives.items():
        with tempfile.TemporaryDirectory() as tmp:
            defaults[minor] = check_native(dist, name, minor, tmp).name
    check_native_dockerfile(dist, defaults)

    for line in skipped:
        print(f"skipped {line}")
    print(f"dist: {test_oci.passed} passed, {test_oci.failed} failed, {len(skipped)} skipped "
          f"({time.time() - started:.1f} s)")
    return 1 if test_oci.failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else ROOT / "target/dist"))
