#!/usr/bin/env python3
"""Builds an OCI image layout of the filter, without docker, following Istio's Wasm image
specification, compat variant: one gzip tar layer holding `plugin.wasm`.

    python3 deploy/oci/build.py WASM OUT_DIR [TAG]

OUT_DIR becomes an OCI image layout (oci-layout, index.json, blobs/sha256/...); OUT_DIR.tar is
the same layout as one file. Push either with a registry client, e.g.
    skopeo copy oci:OUT_DIR:TAG docker://registry.example.com/wasm-ratelimit:TAG
    oras cp --from-oci-layout OUT_DIR:TAG registry.example.com/wasm-ratelimit:TAG
Everything is byte-for-byte reproducible: no timestamps, owners or modes from the build machine.
"""

import gzip
import hashlib
import io
import json
import sys
import tarfile
from pathlib import Path

MANIFEST = "application/vnd.oci.image.manifest.v1+json"
CONFIG = "application/vnd.oci.image.config.v1+json"
LAYER = "application/vnd.oci.image.layer.v1.tar+gzip"
VARIANT = {"module.wasm.image/variant": "compat"}


def sha256(data):
    return "sha256:" + hashlib.sha256(data).hexdigest()


def tar_of(wasm):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        info = tarfile.TarInfo("plugin.wasm")
        info.size, info.mode, info.mtime = len(wasm), 0o644, 0
        tar.addfile(info, io.BytesIO(wasm))
    return buf.getvalue()


def canonical(obj):
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def build(wasm_path, out, tag="latest"):
    wasm = Path(wasm_path).read_bytes()
    if wasm[:4] != b"\0asm":
        raise SystemExit(f"{wasm_path} is not a wasm module")
    layer_tar = tar_of(wasm)
    layer = gzip.compress(layer_tar, mtime=0)
    config = canonical({
        "architecture": "wasm",
        "os": "wasip1",
        "rootfs": {"type": "layers", "diff_ids": [sha256(layer_tar)]},
        "config": {},
    })
    manifest = canonical({
        "schemaVersion": 2,
        "mediaType": MANIFEST,
        "config": {"mediaType": CONFIG, "digest": sha256(config), "size": len(config)},
        "layers": [{"mediaType": LAYER, "digest": sha256(layer), "size": len(layer),
                    "annotations": {"org.opencontainers.image.title": "plugin.wasm"}}],
        "annotations": VARIANT,
    })
    index = canonical({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [{"mediaType": MANIFEST, "digest": sha256(manifest), "size": len(manifest),
                       "annotations": {"org.opencontainers.image.ref.name": tag}}],
    })
    out = Path(out)
    blobs = out / "blobs" / "sha256"
    blobs.mkdir(parents=True, exist_ok=True)
    for blob in (layer, config, manifest):
        (blobs / sha256(blob).split(":")[1]).write_bytes(blob)
    (out / "oci-layout").write_bytes(canonical({"imageLayoutVersion": "1.0.0"}))
    (out / "index.json").write_bytes(index)
    with tarfile.open(f"{out}.tar", "w", format=tarfile.USTAR_FORMAT) as tar:
        for path in sorted(p for p in out.rglob("*") if p.is_file()):
            info = tarfile.TarInfo(str(path.relative_to(out)))
            data = path.read_bytes()
            info.size, info.mode, info.mtime = len(data), 0o644, 0
            tar.addfile(info, io.BytesIO(data))
    return sha256(manifest)


if __name__ == "__main__":
    if len(sys.argv) not in (3, 4):
        raise SystemExit(__doc__)
    digest = build(*sys.argv[1:])
    print(f"{sys.argv[2]}: OCI image layout, manifest {digest} ({sys.argv[2]}.tar alongside)")
