#!/usr/bin/env python3
"""Compares two ZeroTrain checkpoints array by array, bitwise, whatever device counts wrote them.

Each array of manifest.json is assembled from its ranges (file, offset, bytes) and the two
results are compared byte for byte. Exit status 0 when every array of the first exists in the
second with identical bytes. Usage: compare_checkpoints.py CHECKPOINT_A CHECKPOINT_B
"""
import json
import os
import sys


def arrays(ckpt):
    with open(os.path.join(ckpt, "manifest.json")) as f:
        manifest = json.load(f)
    out = {}
    for a in manifest["arrays"]:
        parts = []
        for r in sorted(a["ranges"], key=lambda r: r["begin"]):
            with open(os.path.join(ckpt, r["file"]), "rb") as f:
                f.seek(r["offset"])
                parts.append(f.read(r["bytes"]))
        out[a["name"]] = (a["dtype"], b"".join(parts))
    return manifest.get("meta", {}), out


def main():
    if len(sys.argv) != 3:
        print(__doc__)
        return 2
    meta_a, a = arrays(sys.argv[1])
    meta_b, b = arrays(sys.argv[2])
    bad = 0
    for name, (dtype, data) in sorted(a.items()):
        if name not in b:
            print(f"{name}: missing from {sys.argv[2]}")
            bad += 1
        elif b[name] != (dtype, data):
            print(f"{name}: differs ({dtype}, {len(data)} bytes)")
            bad += 1
    print(f"{len(a)} arrays compared: {'identical' if not bad else f'{bad} differ'} "
          f"({meta_a.get('devices')} devices stage {meta_a.get('zero_stage')} vs "
          f"{meta_b.get('devices')} devices stage {meta_b.get('zero_stage')})")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
