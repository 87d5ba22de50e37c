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


def check_layout(layout, wasm, tag, digest=None):
    """Checks the OCI image layout in directory `layout`: it holds the filter `wasm` (bytes),
    tagged `tag` (and its manifest has `digest`, when given). Returns the manifest's digest."""
    check("oci-layout", json.loads((layout / "oci-layout").read_text()) == {"imageLayoutVersion": "1.0.0"})
    index = json.loads((layout / "index.json").read_text())
    check("one manifest", len(index["manifests"]) == 1)
    desc = index["manifests"][0]
    check("manifest media type", desc["mediaType"] == "application/vnd.oci.image.manifest.v1+json")
    check("tag", desc["annotations"]["org.opencontainers.image.ref.name"] == tag)
    if digest is not None:
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
    return desc["digest"]


def dockerfile_copies(dockerfile):
    """The Dockerfile's instructions (comments dropped), and the file its one COPY takes, with
    the `ARG WASM=` default put in: (instructions, source path as written)."""
    lines = [l.split() for l in Path(dockerfile).read_text().splitlines()
             if l.strip() and not l.startswith("#")]
    args = dict(l[1].split("=", 1) for l in lines if l[0] == "ARG" and "=" in l[1])
    copies = [l for l in lines if l[0] == "COPY"]
    source = copies[0][1].replace("${WASM}", args.get("WASM", "")) if len(copies) == 1 else None
    return lines, source


def check_dockerfile(dockerfile, wasm_path, base):
    """The Dockerfile builds the same image for docker users: from scratch, one COPY (one
    layer) of the filter, `wasm_path`, as plugin.wasm (no docker engine here, so its
    instructions are checked as written). `base`: the directory the build runs in."""
    lines, source = dockerfile_copies(dockerfile)
    check("Dockerfile FROM scratch", lines[0] == ["FROM", "scratch"], lines)
    check("Dockerfile has one COPY, to plugin.wasm",
          source is not None and [l for l in lines if l[0] == "COPY"][0][2] == "./plugin.wasm", lines)
    check("Dockerfile copies the built filter",
          source is not None and (Path(base) / source).resolve() == Path(wasm_path).resolve(), source)


def main(wasm_path):
    wasm = Path(wasm_path).read_bytes()
    with tempfile.TemporaryDirectory() as tmp:
        layout = Path(tmp) / "image"
        digest = build.build(wasm_path, layout, "0.1.0")
        check_layout(layout, wasm, "0.1.0", digest)
        # Reproducible: building again gives the same manifest digest.
        again = build.build(wasm_path, Path(tmp) / "again", "0.1.0")
        check("reproducible", again == digest)
        with tarfile.open(f"{layout}.tar") as tar:
            check("tarball holds the layout", {"oci-layout", "index.json"} <= set(tar.getnames()))
    root = Path(__file__).resolve().parents[2]
    check_dockerfile(root / "deploy/oci/Dockerfile", wasm_path, root)
    print(f"oci: {passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
