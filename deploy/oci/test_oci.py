#!/usr/bin/env python3
"""Checks what `make oci` builds against Istio's Wasm image spec (compat variant): the layout's
index, the manifest and its media types, every blob's digest and size, and that the single
layer holds `plugin.wasm` byte-for-byte equal to the built filter. Run by `make test`."""

import gzip
import hashlib
import io
import json
import sys
import tarfile
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import build  # noqa: E402

passed = failed = 0


def check(name, ok, detail=""):
    global passed, failed
    if ok:
        passed += 1
    else:
        failed += 1
        print(f"FAIL {name} {detail}")


def blob(layout, desc):
    algo, hexd = desc["digest"].split(":")
    data = (layout / "blobs" / algo / hexd).read_bytes()
    check(f"digest of {desc['digest'][:19]}", hashlib.sha256(data).hexdigest() == hexd)
    check(f"size of {desc['digest'][:19]}", len(data) == desc["size"])
    return data


def main(wasm_path):
    wasm = Path(wasm_path).read_bytes()
    with tempfile.TemporaryDirectory() as tmp:
        layout = Path(tmp) / "image"
        digest = build.build(wasm_path, layout, "0.1.0")
        check("oci-layout", json.loads((layout / "oci-layout").read_text()) == {"imageLayoutVersion": "1.0.0"})
        index = json.loads((layout / "index.json").read_text())
        check("one manifest", len(index["manifests"]) == 1)
        desc = index["manifests"][0]
        check("manifest media type", desc["mediaType"] == "application/vnd.oci.image.manifest.v1+json")
        check("tag", desc["annotations"]["org.opencontainers.image.ref.name"] == "0.1.0")
        check("digest returned", desc["digest"] == digest)
        manifest = json.loads(blob(layout, desc))
        check("schemaVersion", manifest["schemaVersion"] == 2)
        check("compat variant annotation", manifest["annotations"].get("module.wasm.image/variant") == "compat")
        check("config media type", manifest["config"]["mediaType"] == "application/vnd.oci.image.config.v1+json")
        config = json.loads(blob(layout, manifest["config"]))
        check("single layer", len(manifest["layers"]) == 1)
        layer_desc = manifest["layers"][0]
        check("layer media type", layer_desc["mediaType"] == "application/vnd.oci.image.layer.v1.tar+gzip")
        layer = blob(layout, layer_desc)
        layer_tar = gzip.decompress(layer)
        check("diff_id", config["rootfs"]["diff_ids"] == ["sha256:" + hashlib.sha256(layer_tar).hexdigest()])
        with tarfile.open(fileobj=io.BytesIO(layer_tar)) as tar:
            names = tar.getnames()
            check("layer holds plugin.wasm only", names == ["plugin.wasm"], names)
            inside = tar.extractfile("plugin.wasm").read()
        check("plugin.wasm is the built filter", hashlib.sha256(inside).digest() == hashlib.sha256(wasm).digest())
        check("wasm magic", inside[:4] == b"\0asm")
        # Reproducible: building again gives the same manifest digest.
        again = build.build(wasm_path, Path(tmp) / "again", "0.1.0")
        check("reproducible", again == digest)
        with tarfile.open(f"{layout}.tar") as tar:
            check("tarball holds the layout", {"oci-layout", "index.json"} <= set(tar.getnames()))
    # The Dockerfile builds the same image for docker users: from scratch, the filter as
    # plugin.wasm (no docker engine here, so its instructions are checked as written).
    root = Path(__file__).resolve().parents[2]
    lines = [l.split() for l in (root / "deploy/oci/Dockerfile").read_text().splitlines()
             if l.strip() and not l.startswith("#")]
    check("Dockerfile FROM scratch", lines[0] == ["FROM", "scratch"], lines)
    check("Dockerfile copies the built filter to plugin.wasm",
          len(lines) == 2 and lines[1][0] == "COPY" and lines[1][2] == "./plugin.wasm"
          and (root / lines[1][1]).resolve() == Path(wasm_path).resolve(), lines)
    print(f"oci: {passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
