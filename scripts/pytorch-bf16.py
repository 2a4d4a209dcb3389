#!/usr/bin/env python3
"""Times the reference GPT's training step in PyTorch on one CPU core, f32 against bf16 autocast.

    python3 -m venv .venv && .venv/bin/pip install torch safetensors numpy
    target/release/switchyard bench --preset reference --only bf16 --json /tmp/bench.json   # optional
    .venv/bin/python scripts/pytorch-bf16.py [--switchyard /tmp/bench.json]

CI does not run this script (it needs PyTorch and takes a minute of one core); it is the
yardstick for switchyard's bf16 rows: what the standard PyTorch recipe gains from bf16 on
the same CPU, one thread.

What it does:

1. builds switchyard's GPT in PyTorch with the classes of `scripts/make-adamw-fixture.py`
   (loaded from it, hence `safetensors` in the install line): GPT-2 / nanoGPT with nanoGPT's
   names, pre-LayerNorm blocks (eps 1e-5), a fused `c_attn`, biases on every linear,
   attention written out (scores · 1/sqrt(head dim), causal mask, softmax), GPT-2's tanh
   GELU, the final LayerNorm and an untied LM head without bias; at the size of `switchyard
   bench --preset reference`: vocabulary 256 (bytes), d 256, 8 layers, 8 heads, T 128, 32
   sequences a step (4,096 tokens), weights N(0, 0.02) and `c_proj` N(0, 0.02/sqrt(2·layers));
2. trains it with `torch.optim.AdamW` (lr 3e-4, betas 0.9/0.95, weight decay 0.1, eps 1e-8)
   on random byte ids (`torch.randint`, fixed seed), `torch.set_num_threads(1)`;
3. for each precision, from the same initial weights: 2 untimed steps, then the median of
   5 timed steps, a step being forward, the mean cross-entropy in f32, backward, the
   optimizer step and `zero_grad`. The bf16 run is the standard recipe: only forward and
   loss run under `torch.autocast("cpu", dtype=torch.bfloat16)` (the products in bf16,
   the logits cast to f32 before the loss), master weights, gradients and AdamW stay f32,
   and there is no GradScaler (bf16 has f32's exponent range and needs none);
4. prints the torch version, the CPU model and whether /proc/cpuinfo has avx512_bf16 and
   amx_bf16, whether oneDNN is available and supports bf16 here, which oneDNN kernel a bf16
   linear runs (ONEDNN_VERBOSE in a child process), a single bf16 and f32 product of the
   MLP's shape, and the table: step ms, tokens/s, bf16 / f32;
5. with `--switchyard FILE` (the JSON of `switchyard bench ... --json FILE`, a `Report` of
   src/bench/mod.rs), prints the rows "1 worker" (f32) and "1 worker, bf16" beside PyTorch's,
   with their bf16 / f32 ratio.

`--only` of `switchyard bench` splits on commas and keeps every row whose name contains one
of the pieces (and always the first row, "1 worker"): `--only bf16` runs "1 worker",
"1 worker, bf16" and "pp 2 1f1b, bf16"; `--only "1 worker, bf16"` would also run the other
"1 worker" rows. This script picks the two rows by their exact names and ignores the rest.
"""

import argparse
import importlib.util
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

# `switchyard bench --preset reference` (src/bench/mod.rs): the model, the batch, the steps.
CONFIG = dict(vocab_size=256, block_size=128, n_layer=8, n_head=8, d_model=256, tied_embeddings=False)
SETTINGS = dict(seed=20240614, batch=32, seq_len=128, warmup=2, steps=5, lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
F32_ROW, BF16_ROW = "1 worker", "1 worker, bf16"


def load_fixture_script():
    """scripts/make-adamw-fixture.py as a module: its GPT is the one this script times
    (one definition of switchyard's GPT in PyTorch, not two)."""
    path = Path(__file__).with_name("make-adamw-fixture.py")
    spec = importlib.util.spec_from_file_location("make_adamw_fixture", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


Gpt = load_fixture_script().Gpt


def init_weights(model, n_layer, generator):
    """GPT-2's initialisation: N(0, 0.02), residual projections scaled, zero biases, unit gains."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("c_proj.weight"):
                p.normal_(0.0, 0.02 / math.sqrt(2 * n_layer), generator=generator)
            elif name.endswith(".bias"):
                p.zero_()
            elif "ln_" in name and name.endswith(".weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=generator)


def cpu_info():
    """The CPU's model name and whether its flags include avx512_bf16 and amx_bf16."""
    name, flags = "unknown", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and name == "unknown":
                name = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass
    return name, {f: f in flags for f in ("avx512_bf16", "amx_bf16")}


def onednn_kernels():
    """The oneDNN kernels a bf16 linear (forward and backward) runs, from ONEDNN_VERBOSE in a child."""
    code = (
        "import torch\n"
        "torch.set_num_threads(1)\n"
        "lin = torch.nn.Linear(256, 1024)\n"
        "x = torch.randn(512, 256, requires_grad=True)\n"
        "with torch.autocast('cpu', dtype=torch.bfloat16):\n"
        "    y = lin(x)\n"
        "y.float().sum().backward()\n"
    )
    env = dict(os.environ, ONEDNN_VERBOSE="1", DNNL_VERBOSE="1")
    try:
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120).stdout
    except (OSError, subprocess.SubprocessError) as e:
        return f"probe failed: {e}"
    kernels = {}
    for line in out.splitlines():
        parts = line.split(",")
        # onednn_verbose,[timestamp,]primitive,exec,cpu,<kind>,<impl>,...
        if "exec" in parts and "cpu" in parts:
            i = parts.index("exec")
            if i + 3 < len(parts):
                key = f"{parts[i + 2]} {parts[i + 3]}"
                kernels[key] = kernels.get(key, 0) + 1
    if not kernels:
        return "none (the bf16 products did not go through oneDNN)"
    return ", ".join(f"{k} ×{n}" for k, n in sorted(kernels.items()))


def matmul_probe(reps=10):
    """One product of the MLP's shape, [4096, 256] · [256, 1024], in f32 and bf16: GFLOP/s."""
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(4096, 256, generator=g), torch.randn(256, 1024, generator=g)
    rates = {}
    for dtype in (torch.float32, torch.bfloat16):
        x, y = a.to(dtype), b.to(dtype)
        for _ in range(2):
            x @ y
        t = []
        for _ in range(reps):
            t0 = time.perf_counter()
            x @ y
            t.append(time.perf_counter() - t0)
        rates[dtype] = 2 * 4096 * 256 * 1024 / statistics.median(t) / 1e9
    return rates


def batches(n, generator):
    """n batches of random byte ids: inputs [B, T] and targets [B, T]."""
    s = SETTINGS
    out = []
    for _ in range(n):
        rows = torch.randint(0, CONFIG["vocab_size"], (s["batch"], s["seq_len"] + 1), generator=generator)
        out.append((rows[:, :-1].contiguous(), rows[:, 1:].contiguous()))
    return out


def run(init_state, data, bf16):
    """Trains from `init_state` on `data`; each step's seconds and loss."""
    s = SETTINGS
    model = Gpt(CONFIG)
    model.load_state_dict(init_state)
    opt = torch.optim.AdamW(
        model.parameters(), lr=s["lr"], betas=s["betas"], eps=s["eps"], weight_decay=s["weight_decay"]
    )
    seconds, losses = [], []
    for x, y in data:
        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits = model(x)
            loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), y.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        seconds.append(time.perf_counter() - t0)
    return seconds, losses


def switchyard_rows(path):
    """The rows "1 worker" and "1 worker, bf16" of a `switchyard bench --json` report."""
    report = json.loads(Path(path).read_text())
    rows = {r["case"]["name"]: r for r in report.get("rows", [])}
    preset = report.get("preset", {})
    return preset, {name: rows.get(name) for name in (F32_ROW, BF16_ROW)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--switchyard", type=Path, metavar="JSON", help="a `switchyard bench --json` report to print beside PyTorch's")
    a = ap.parse_args()

    torch.set_num_threads(1)
    s = SETTINGS
    name, flags = cpu_info()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread")
    print(f"cpu: {name}; " + ", ".join(f"{f}: {'yes' if v else 'no'}" for f, v in flags.items()))
    bf16_ok = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: "unknown")
    print(
        f"torch.backends.mkldnn.is_available(): {torch.backends.mkldnn.is_available()}; "
        f"oneDNN bf16 supported: {bf16_ok()}; ATen CPU capability: {torch.backends.cpu.get_cpu_capability()}"
    )
    print(f"oneDNN kernels of a bf16 linear (ONEDNN_VERBOSE): {onednn_kernels()}")
    rates = matmul_probe()
    print(
        f"one product [4096,256]·[256,1024]: f32 {rates[torch.float32]:.0f} GFLOP/s, "
        f"bf16 {rates[torch.bfloat16]:.0f} GFLOP/s ({rates[torch.bfloat16] / rates[torch.float32]:.2f} ×)"
    )

    model = Gpt(CONFIG)
    init_weights(model, CONFIG["n_layer"], torch.Generator().manual_seed(s["seed"]))
    init_state = {k: v.clone() for k, v in model.state_dict().items()}
    del model
    data = batches(s["warmup"] + s["steps"], torch.Generator().manual_seed(s["seed"]))
    tokens = s["batch"] * s["seq_len"]
    print(
        f"GPT d {CONFIG['d_model']} × {CONFIG['n_layer']} layers × {CONFIG['n_head']} heads, T {s['seq_len']}, "
        f"{s['batch']} sequences ({tokens} tokens) a step, AdamW; {s['warmup']} warm-up steps, median of {s['steps']}"
    )

    results = {}
    for label, bf16 in (("f32", False), ("bf16 autocast", True)):
        seconds, losses = run(init_state, data, bf16)
        step = statistics.median(seconds[s["warmup"]:])
        results[label] = step
        print(
            f"  {label}: steps {' '.join(f'{1e3 * t:.0f}' for t in seconds)} ms; "
            f"loss {losses[0]:.4f} -> {losses[-1]:.4f}"
        )

    f32, bf16 = results["f32"], results["bf16 autocast"]
    print()
    print("| run | step ms | tokens/s | bf16 / f32 |")
    print("|---|---:|---:|---:|")
    print(f"| PyTorch f32 | {1e3 * f32:.0f} | {tokens / f32:.0f} | |")
    print(f"| PyTorch bf16 autocast | {1e3 * bf16:.0f} | {tokens / bf16:.0f} | {f32 / bf16:.2f} × |")

    if a.switchyard:
        preset, rows = switchyard_rows(a.switchyard)
        sy_tokens = preset.get("batch", 0) * preset.get("seq_len", 0)
        if sy_tokens and sy_tokens != tokens:
            print(f"| (switchyard's preset {preset.get('name')} has {sy_tokens} tokens a step, not {tokens}) | | | |")
        for label, row_name in (("switchyard f32", F32_ROW), ("switchyard bf16", BF16_ROW)):
            r = rows[row_name]
            if r is None:
                print(f"| {label} (\"{row_name}\") | missing | | |")
                continue
            ratio = ""
            if row_name == BF16_ROW and rows[F32_ROW] is not None:
                ratio = f"{r['tokens_per_s'] / rows[F32_ROW]['tokens_per_s']:.2f} ×"
            print(f"| {label} (\"{row_name}\") | {1e3 * r['step_s']:.0f} | {r['tokens_per_s']:.0f} | {ratio} |")
        if rows[F32_ROW] is not None:
            print(
                f"switchyard / PyTorch tokens/s: f32 {rows[F32_ROW]['tokens_per_s'] * f32 / tokens:.2f} ×"
                + (
                    f", bf16 {rows[BF16_ROW]['tokens_per_s'] * bf16 / tokens:.2f} ×"
                    if rows[BF16_ROW] is not None
                    else ""
                )
            )


if __name__ == "__main__":
    main()
