#!/usr/bin/env python3
"""Draws two or more loss curves of `switchyard train --metrics FILE` runs into one SVG.

    target/release/switchyard train --precision f32  --metrics /tmp/f32.jsonl
    target/release/switchyard train --precision bf16 --metrics /tmp/bf16.jsonl
    python3 scripts/plot-convergence.py /tmp/f32.jsonl:f32 /tmp/bf16.jsonl:bf16 \\
        -o docs/img/bf16-convergence.svg

Each argument is a metrics file (JSON lines with `step` and `loss`), optionally followed
by `:label`. The curves are smoothed with a moving average of `--window` steps (the raw
loss of one small batch is noisy); the legend gives each run's last smoothed loss and
its final raw loss, and the relative difference of the last smoothed losses to the
first run's. Standard library only, so that anyone can redraw the figure.
"""

import argparse
import json

COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd"]


def read(path):
    steps, losses = [], []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            r = json.loads(line)
            if "loss" in r and "step" in r:
                steps.append(r["step"])
                losses.append(r["loss"])
    return steps, losses


def smooth(v, w):
    out, acc = [], 0.0
    for i, x in enumerate(v):
        acc += x
        if i >= w:
            acc -= v[i - w]
        out.append(acc / min(i + 1, w))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("runs", nargs="+", help="FILE[:label]")
    ap.add_argument("-o", "--output", required=True)
    ap.add_argument("--window", type=int, default=25)
    ap.add_argument("--title", default="Loss of the README's default run, f32 and bf16")
    a = ap.parse_args()
    runs = []
    for spec in a.runs:
        path, _, label = spec.partition(":")
        s, l = read(path)
        runs.append((label or path, s, l, smooth(l, a.window)))
    W, H, L, R, T, B = 720, 420, 60, 20, 40, 50
    xmax = max(s[-1] for _, s, _, _ in runs) or 1
    ys = [y for _, _, _, sm in runs for y in sm]
    ymin, ymax = min(ys), max(ys)
    ymin = max(0.0, ymin - 0.05 * (ymax - ymin))
    px = lambda x: L + (W - L - R) * x / xmax
    py = lambda y: T + (H - T - B) * (ymax - y) / (ymax - ymin)
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" '
        f'font-family="sans-serif" font-size="12">',
        f'<rect width="{W}" height="{H}" fill="white"/>',
        f'<text x="{W / 2}" y="20" text-anchor="middle" font-size="14">{a.title}</text>',
        f'<line x1="{L}" y1="{H - B}" x2="{W - R}" y2="{H - B}" stroke="black"/>',
        f'<line x1="{L}" y1="{T}" x2="{L}" y2="{H - B}" stroke="black"/>',
        f'<text x="{W / 2}" y="{H - 12}" text-anchor="middle">step</text>',
        f'<text x="14" y="{H / 2}" text-anchor="middle" '
        f'transform="rotate(-90 14 {H / 2})">loss (nats per byte, moving average of {a.window})</text>',
    ]
    for i in range(6):
        x = xmax * i / 5
        out.append(f'<text x="{px(x):.1f}" y="{H - B + 16}" text-anchor="middle">{x:.0f}</text>')
        y = ymin + (ymax - ymin) * i / 5
        out.append(f'<text x="{L - 6}" y="{py(y) + 4:.1f}" text-anchor="end">{y:.2f}</text>')
        out.append(
            f'<line x1="{L}" y1="{py(y):.1f}" x2="{W - R}" y2="{py(y):.1f}" stroke="#ddd"/>'
        )
    first = runs[0][3][-1]
    for k, (label, s, l, sm) in enumerate(runs):
        c = COLORS[k % len(COLORS)]
        pts = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in zip(s, sm))
        out.append(f'<polyline fill="none" stroke="{c}" stroke-width="1.5" points="{pts}"/>')
        rel = 100.0 * (sm[-1] - first) / first
        text = f"{label}: last {a.window} steps {sm[-1]:.4f} ({rel:+.2f} %), final step {l[-1]:.4f}"
        y = T + 20 + 18 * k
        out.append(f'<line x1="{W - 380}" y1="{y - 4}" x2="{W - 360}" y2="{y - 4}" stroke="{c}" stroke-width="2"/>')
        out.append(f'<text x="{W - 354}" y="{y}">{text}</text>')
        print(text)
    out.append("</svg>")
    with open(a.output, "w") as f:
        f.write("\n".join(out) + "\n")


if __name__ == "__main__":
    main()
