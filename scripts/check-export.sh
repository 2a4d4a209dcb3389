#!/usr/bin/env bash
# Trains a tiny tied GPT, exports it, and checks the export independently of Rust:
# scripts/check-export.py (NumPy + the safetensors package) checks that it is exactly a
# nanoGPT state dict, recomputes its checksum, and computes nanoGPT's loss on it, which must
# equal `switchyard eval`.
set -euo pipefail
cd "$(dirname "$0")/.."

venv="${SWITCHYARD_CHECK_VENV:-target/check-export-venv}"
if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
    "$venv/bin/pip" install --quiet numpy safetensors
fi

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
# SWITCHYARD_BIN: a switchyard binary already built (CI's one release build); else the
# release build of this checkout.
bin="${SWITCHYARD_BIN:-}"
if [ -z "$bin" ]; then
    bin=target/release/switchyard
    cargo build --release --quiet
fi
data=crates/train/data/kjv-genesis-ruth.txt
"$bin" train --d-model 32 --layers 2 --heads 4 --tied --steps 20 --quiet --checkpoint-dir "$work/ckpt" >/dev/null
"$bin" export --checkpoint "$work/ckpt" --out "$work/model.safetensors"
ours=$("$bin" eval --checkpoint "$work/model.safetensors" --data "$data" --seq-len 64 --max-windows 32 --json)
theirs=$("$venv/bin/python" scripts/check-export.py "$work/model.safetensors" "$data" --seq-len 64 --max-windows 32 --heads 4)
echo "switchyard eval: $ours"
echo "nanoGPT (NumPy): $theirs"
"$venv/bin/python" - "$ours" "$theirs" <<'PY'
import json, sys
a, b = (json.loads(s)["nats_per_byte"] for s in sys.argv[1:3])
if json.loads(sys.argv[2])["checksum"] != "ok":
    sys.exit("the export carries no checksum")
if abs(a - b) > 1e-5 * abs(b):
    sys.exit(f"the export computes another function: {a} vs {b}")
print(f"export matches nanoGPT's forward pass: {a:.6f} vs {b:.6f}")
PY
