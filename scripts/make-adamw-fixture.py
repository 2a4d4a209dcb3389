#!/usr/bin/env python3
"""Makes the PyTorch fixture that `tests/pytorch_adamw.rs` holds switchyard to.

    python3 -m venv .venv && .venv/bin/pip install torch safetensors numpy
    .venv/bin/python scripts/make-adamw-fixture.py            # rewrites tests/fixtures/adamw*

CI does not run this script (it needs PyTorch); it runs the Rust test against the files
this script wrote, which are committed. Rerun it only to change the experiment; the test
reads every setting from `adamw.json`, so a new fixture needs no change in Rust.

What it does, in float32 on the CPU:

1. builds switchyard's GPT in PyTorch: GPT-2 / nanoGPT with nanoGPT's state-dict names
   (`transformer.wte`, `transformer.h.{i}.attn.c_attn`, ..., `lm_head`), `[out, in]`
   linears with biases, a fused `c_attn` whose rows are q | k | v, pre-LayerNorm blocks
   with LayerNorm eps 1e-5, attention scores scaled by 1/sqrt(head dim) under a causal
   mask, GPT-2's tanh GELU (`approximate="tanh"`; nanoGPT's `model.py` has the exact
   GELU, switchyard and GPT-2 the tanh one: see scripts/check-export.py), the final
   LayerNorm, and an untied LM head without bias (switchyard's default);
2. creates its initial weights from a fixed seed: matrices and embeddings N(0, 0.02),
   the residual projections (`c_proj`) N(0, 0.02/sqrt(2·layers)) as GPT-2, and - unlike
   GPT-2, so that the decay of every 1-d parameter is visible - biases N(0, 0.02) and
   LayerNorm gains 1 + N(0, 0.1);
3. saves them as a switchyard export (`adamw-init.safetensors`: nanoGPT names, f32, the
   model config and the tensors' checksum as metadata, the recipe of
   crates/train/src/export.rs) that `switchyard train --init` starts from;
4. reads the bundled corpus as bytes and forms the batches of `switchyard train
   --no-shuffle`: window k = step·B + i (i the row of the step's batch) is bytes
   [(k mod n)(T+1), (k mod n + 1)(T+1)), n = len // (T+1), inputs its first T bytes and
   targets its last T;
5. trains STEPS steps of `torch.optim.AdamW(model.parameters(), ...)`: every parameter
   decays (torch's default, switchyard's `--decay all`), a constant learning rate, no
   gradient clipping, the mean cross-entropy over the batch;
6. writes each step's loss (before that step's update) and the settings to `adamw.json`,
   and the weights after the last step to `adamw-final.safetensors`;
7. repeats the run in float64 and records in `adamw.json` how far float32 PyTorch is
   from it (`float32_vs_float64`): the rounding noise of the experiment itself, which
   the test's tolerance must stand well above.

Why ε = 1e-6 and not torch's default 1e-8: the key bias of every attention layer has a
gradient of exactly zero (adding q·b_k to every score of a row leaves the softmax
unchanged), so in float32 its gradient is rounding noise of about 1e-10, and AdamW's
step lr·m̂/(√v̂ + ε) turns that noise into moves of up to lr·noise/ε. At ε = 1e-8 that
is ~1e-5 after five steps (float32 PyTorch is then 5.8e-6 away from float64 PyTorch on
those biases, and switchyard's float32 1.6e-5): the experiment would compare two
implementations' rounding noise, not their arithmetic. At ε = 1e-6 the noise is a
hundred times smaller and float32 is within 5e-7 of float64 everywhere.
"""

import argparse
import copy
import json
import math
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.numpy import load_file

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "crates/train/data/kjv-genesis-ruth.txt"
FIXTURES = ROOT / "tests/fixtures"
EXPORT_FORMAT = "switchyard-export/1"

# The experiment. The model matches `switchyard train --d-model 16 --layers 2 --heads 2
# --seq-len 16` (block size 64, the default; vocabulary 256: bytes).
CONFIG = dict(vocab_size=256, block_size=64, n_layer=2, n_head=2, d_model=16, tied_embeddings=False)
SETTINGS = dict(seed=20240614, batch=4, seq_len=16, steps=5, lr=1e-2, betas=[0.9, 0.95], eps=1e-6, weight_decay=0.1)


class Attention(nn.Module):
    def __init__(self, d, n_head):
        super().__init__()
        self.n_head = n_head
        self.c_attn = nn.Linear(d, 3 * d)
        self.c_proj = nn.Linear(d, d)

    def forward(self, x):
        b, t, d = x.shape
        hd = d // self.n_head
        q, k, v = self.c_attn(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_head, hd).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hd))
        mask = torch.ones(t, t, dtype=torch.bool).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(b, t, d)
        return self.c_proj(y)


class Mlp(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.c_fc = nn.Linear(d, 4 * d)
        self.c_proj = nn.Linear(4 * d, d)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, d, n_head):
        super().__init__()
        self.ln_1 = nn.LayerNorm(d, eps=1e-5)
        self.attn = Attention(d, n_head)
        self.ln_2 = nn.LayerNorm(d, eps=1e-5)
        self.mlp = Mlp(d)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class Gpt(nn.Module):
    def __init__(self, c):
        super().__init__()
        d = c["d_model"]
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(c["vocab_size"], d),
            wpe=nn.Embedding(c["block_size"], d),
            h=nn.ModuleList(Block(d, c["n_head"]) for _ in range(c["n_layer"])),
            ln_f=nn.LayerNorm(d, eps=1e-5),
        ))
        self.lm_head = nn.Linear(d, c["vocab_size"], bias=False)

    def forward(self, ids):
        t = ids.shape[1]
        tr = self.transformer
        x = tr.wte(ids) + tr.wpe(torch.arange(t))
        for block in tr.h:
            x = block(x)
        return self.lm_head(tr.ln_f(x))


def init_weights(model, n_layer, generator):
    """GPT-2's initialisation, with random biases and LayerNorm gains (see the docstring)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("c_proj.weight"):
                p.normal_(0.0, 0.02 / math.sqrt(2 * n_layer), generator=generator)
            elif "ln_" in name and name.endswith(".weight"):
                p.normal_(0.0, 0.1, generator=generator).add_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=generator)


def checksum(tensors):
    """The export checksum: FNV-1a 64 over NAME 0 DTYPE 0 SHAPE 0 DATA per tensor, by name."""
    h = 0xCBF29CE484222325
    for name in sorted(tensors, key=lambda k: k.encode()):
        a = tensors[name]
        assert a.dtype == np.float32 and a.flags["C_CONTIGUOUS"]
        shape = ",".join(str(d) for d in a.shape)
        for byte in f"{name}\0F32\0{shape}\0".encode() + a.astype("<f4").tobytes():
            h = ((h ^ byte) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return f"fnv1a64:{h:016x}"


def export(model, path):
    """Writes the state dict as `switchyard export` does: f32 tensors and metadata.

    The safetensors layout is written out here (an 8-byte little-endian header length,
    the JSON header padded with spaces to a multiple of 8, then the tensors' bytes in
    name order) so that the file is the same bytes on every run; the `safetensors`
    package then reads it back as a check.
    """
    tensors = {k: v.detach().numpy().astype("<f4") for k, v in model.state_dict().items()}
    header = {"__metadata__": {"format": EXPORT_FORMAT, "config": json.dumps(CONFIG), "checksum": checksum(tensors)}}
    data, offset = [], 0
    for name in sorted(tensors):
        raw = tensors[name].tobytes()
        header[name] = {"dtype": "F32", "shape": list(tensors[name].shape), "data_offsets": [offset, offset + len(raw)]}
        data.append(raw)
        offset += len(raw)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(len(text).to_bytes(8, "little") + text + b"".join(data))
    back = load_file(str(path))
    assert back.keys() == tensors.keys() and all(np.array_equal(back[k], tensors[k]) for k in tensors)


def batch(data, step, b, t):
    """Step `step`'s batch of the sequential order (switchyard's `--no-shuffle`)."""
    w = t + 1
    n = len(data) // w
    rows = [data[(k % n) * w : (k % n + 1) * w] for k in range(step * b, step * b + b)]
    rows = torch.tensor(np.stack(rows), dtype=torch.long)
    return rows[:, :-1], rows[:, 1:]


def train(model):
    """SETTINGS' steps of AdamW on `model` (in its dtype); each step's loss."""
    s = SETTINGS
    data = np.frombuffer(CORPUS.read_bytes(), dtype=np.uint8)
    opt = torch.optim.AdamW(
        model.parameters(), lr=s["lr"], betas=tuple(s["betas"]), eps=s["eps"], weight_decay=s["weight_decay"]
    )
    losses = []
    for step in range(s["steps"]):
        x, y = batch(data, step, s["batch"], s["seq_len"])
        logits = model(x)
        loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=FIXTURES, help="directory for the fixture files")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    s = SETTINGS
    model = Gpt(CONFIG)
    init_weights(model, CONFIG["n_layer"], torch.Generator().manual_seed(s["seed"]))
    export(model, a.out / "adamw-init.safetensors")
    reference = copy.deepcopy(model).double()

    losses = train(model)
    for step, loss in enumerate(losses):
        print(f"step {step}: loss {loss:.6f}")
    export(model, a.out / "adamw-final.safetensors")

    losses64 = train(reference)
    w32, w64 = model.state_dict(), reference.state_dict()
    noise = {
        "losses": max(abs(a - b) for a, b in zip(losses, losses64)),
        "weights": max((w32[k].double() - w64[k]).abs().max().item() for k in w64),
    }
    print(f"float32 vs float64 PyTorch: losses {noise['losses']:.2e}, weights {noise['weights']:.2e}")

    record = {
        "about": "scripts/make-adamw-fixture.py: torch.optim.AdamW on switchyard's GPT; see its docstring",
        "torch": torch.__version__,
        "model": CONFIG,
        **s,
        "decay": "all",
        "data": "crates/train/data/kjv-genesis-ruth.txt, sequential windows (switchyard train --no-shuffle)",
        "losses": losses,
        "float32_vs_float64": noise,
    }
    (a.out / "adamw.json").write_text(json.dumps(record, indent=2) + "\n")
    for f in ("adamw-init.safetensors", "adamw-final.safetensors", "adamw.json"):
        print(f"wrote {a.out / f} ({(a.out / f).stat().st_size} bytes)")


if __name__ == "__main__":
    main()
