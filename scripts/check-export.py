#!/usr/bin/env python3
"""Checks that a `switchyard export` file is a nanoGPT state dict, independently of Rust.

Reads the file with the `safetensors` Python package, checks that its keys and shapes are
exactly those of nanoGPT's `GPT.state_dict()` (as `model.py` builds it: `[out, in]`
linears, fused `c_attn` with rows q | k | v, the head under `lm_head.weight`), runs
nanoGPT's forward pass written out in NumPy, and prints the mean cross-entropy over the
evaluation windows `switchyard eval` uses (see crates/train/src/weights.rs): consecutive
non-overlapping windows of L + 1 bytes from byte 0, inputs the first L, targets the last L.

    scripts/check-export.py model.safetensors TEXT --seq-len L --max-windows N --heads H

It also recomputes the export's `checksum` metadata from the raw file (the recipe in
docs/reference/checkpoint-format.md, written out here independently of Rust) and fails
if it does not match; a file without one is reported as `"checksum": "absent"`.

The one deliberate difference from nanoGPT's `model.py` is the GELU: nanoGPT uses the
exact `nn.GELU()`, switchyard GPT-2's tanh approximation (`nn.GELU(approximate="tanh")`).
Needs `pip install numpy safetensors`. CI compares its output with `switchyard eval`.
"""

import argparse
import json
import sys

import numpy as np
from safetensors import safe_open
from safetensors.numpy import load_file


def nanogpt_shapes(v, block, n_layer, d):
    shapes = {"transformer.wte.weight": (v, d), "transformer.wpe.weight": (block, d)}
    for i in range(n_layer):
        p = f"transformer.h.{i}."
        shapes.update({
            p + "ln_1.weight": (d,), p + "ln_1.bias": (d,),
            p + "attn.c_attn.weight": (3 * d, d), p + "attn.c_attn.bias": (3 * d,),
            p + "attn.c_proj.weight": (d, d), p + "attn.c_proj.bias": (d,),
            p + "ln_2.weight": (d,), p + "ln_2.bias": (d,),
            p + "mlp.c_fc.weight": (4 * d, d), p + "mlp.c_fc.bias": (4 * d,),
            p + "mlp.c_proj.weight": (d, 4 * d), p + "mlp.c_proj.bias": (d,),
        })
    shapes.update({"transformer.ln_f.weight": (d,), "transformer.ln_f.bias": (d,), "lm_head.weight": (v, d)})
    return shapes


def fnv1a64_checksum(path):
    """The export checksum: FNV-1a 64 over NAME 0 DTYPE 0 SHAPE 0 DATA per tensor, by name."""
    with open(path, "rb") as f:
        raw = f.read()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    data = raw[8 + n :]
    h = 0xCBF29CE484222325
    for name in sorted((k for k in header if k != "__metadata__"), key=lambda k: k.encode()):
        t = header[name]
        begin, end = t["data_offsets"]
        shape = ",".join(str(d) for d in t["shape"])
        piece = f"{name}\0{t['dtype']}\0{shape}\0".encode() + data[begin:end]
        for byte in piece:
            h = ((h ^ byte) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return f"fnv1a64:{h:016x}"


def layer_norm(x, w, b):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + 1e-5) * w + b


def gelu_tanh(x):
    return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x ** 3)))


def forward(sd, ids, n_layer, n_head):
    b, t = ids.shape
    d = sd["transformer.wte.weight"].shape[1]
    hd = d // n_head
    x = sd["transformer.wte.weight"][ids] + sd["transformer.wpe.weight"][:t]
    mask = np.triu(np.full((t, t), -np.inf), 1)
    for i in range(n_layer):
        p = lambda n: sd[f"transformer.h.{i}.{n}"]
        h = layer_norm(x, p("ln_1.weight"), p("ln_1.bias"))
        qkv = h @ p("attn.c_attn.weight").T + p("attn.c_attn.bias")
        q, k, v = np.split(qkv, 3, axis=-1)
        q, k, v = (z.reshape(b, t, n_head, hd).transpose(0, 2, 1, 3) for z in (q, k, v))
        att = q @ k.transpose(0, 1, 3, 2) / np.sqrt(hd) + mask
        att = np.exp(att - att.max(-1, keepdims=True))
        att /= att.sum(-1, keepdims=True)
        y = (att @ v).transpose(0, 2, 1, 3).reshape(b, t, d)
        x = x + y @ p("attn.c_proj.weight").T + p("attn.c_proj.bias")
        h = layer_norm(x, p("ln_2.weight"), p("ln_2.bias"))
        h = gelu_tanh(h @ p("mlp.c_fc.weight").T + p("mlp.c_fc.bias"))
        x = x + h @ p("mlp.c_proj.weight").T + p("mlp.c_proj.bias")
    x = layer_norm(x, sd["transformer.ln_f.weight"], sd["transformer.ln_f.bias"])
    return x @ sd["lm_head.weight"].T


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("weights")
    ap.add_argument("text")
    ap.add_argument("--seq-len", type=int, required=True)
    ap.add_argument("--max-windows", type=int, required=True)
    ap.add_argument("--heads", type=int, required=True)
    a = ap.parse_args()

    sd = {k: v.astype(np.float64) for k, v in load_file(a.weights).items()}
    with safe_open(a.weights, "np") as f:
        meta = f.metadata() or {}
    checksum = "absent"
    if "checksum" in meta:
        got = fnv1a64_checksum(a.weights)
        if got != meta["checksum"]:
            sys.exit(f"checksum mismatch: the tensors give {got}, the metadata says {meta['checksum']}")
        checksum = "ok"
    n_layer = sum(1 for k in sd if k.endswith(".ln_1.weight"))
    v, d = sd["transformer.wte.weight"].shape
    want = nanogpt_shapes(v, sd["transformer.wpe.weight"].shape[0], n_layer, d)
    got = {k: tuple(x.shape) for k, x in sd.items()}
    if got != want:
        missing = sorted(set(want) - set(got))
        extra = sorted(set(got) - set(want))
        wrong = sorted(k for k in set(got) & set(want) if got[k] != want[k])
        sys.exit(f"not a nanoGPT state dict: missing {missing}, unexpected {extra}, wrong shapes {wrong}")

    data = np.frombuffer(open(a.text, "rb").read(), dtype=np.uint8).astype(np.int64)
    w = a.seq_len + 1
    n = min(len(data) // w, a.max_windows)
    windows = data[: n * w].reshape(n, w)
    logits = forward(sd, windows[:, :-1], n_layer, a.heads)
    logits -= logits.max(-1, keepdims=True)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    targets = windows[:, 1:]
    loss = -np.take_along_axis(logp, targets[..., None], -1).mean()
    print(json.dumps({"windows": int(n), "nats_per_byte": float(loss), "metadata_format": meta.get("format"), "checksum": checksum}))


if __name__ == "__main__":
    main()
