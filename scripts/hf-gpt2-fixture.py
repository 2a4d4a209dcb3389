#!/usr/bin/env python3
"""Hugging Face `transformers` fixtures for `tests/hf_gpt2.rs` (issue 20).

    python3 -m venv .venv && .venv/bin/pip install torch safetensors numpy transformers
    .venv/bin/python scripts/hf-gpt2-fixture.py make     # rewrites tests/fixtures/hf-gpt2-tiny*
    .venv/bin/python scripts/hf-gpt2-fixture.py check    # loads switchyard's exports

CI runs no Python: it runs the Rust tests against the files this script wrote, which are
committed. Rerun `make` to change the model, and `check` whenever switchyard's exports in
tests/fixtures/hf-export-* change (tests/hf_gpt2.rs says how to remake them).

`make`: a tiny randomly initialised `GPT2LMHeadModel` (vocabulary 256, 16 positions,
width 16, 2 layers, 2 heads, gelu_new, LayerNorm eps 1e-5, no dropout, tied head), saved
with `save_pretrained` into tests/fixtures/hf-gpt2-tiny/, and its logits and mean
cross-entropy on three windows of 8 tokens into tests/fixtures/hf-gpt2-tiny.json.

`check`: loads each switchyard export in tests/fixtures/hf-export-*/ with
`GPT2LMHeadModel.from_pretrained(..., output_loading_info=True)`, fails on any missing,
unexpected or mismatched key (or a warning), and writes the logits and loss of the model
as transformers computes them on the same windows to tests/fixtures/hf-export-*.json,
which the Rust test compares with switchyard's own forward pass of the export.
"""

import json
import pathlib
import sys
import warnings

import torch
from transformers import GPT2Config, GPT2LMHeadModel

FIXTURES = pathlib.Path(__file__).resolve().parent.parent / "tests" / "fixtures"
SEQ = 8
# Three windows of SEQ + 1 token ids: inputs are the first SEQ, targets the last SEQ.
WINDOWS = [
    [(7 * i + 3) % 256 for i in range(SEQ + 1)],
    [(31 * i * i + 11) % 256 for i in range(SEQ + 1)],
    [ord(c) for c in "switchyar"],
]


def score(model):
    ids = torch.tensor(WINDOWS, dtype=torch.long)
    x, y = ids[:, :SEQ], ids[:, 1:]
    with torch.no_grad():
        logits = model(x).logits
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), y.reshape(-1)
        )
    return {
        "inputs": x.tolist(),
        "targets": y.tolist(),
        "logits_shape": list(logits.shape),
        "logits": [float(v) for v in logits.reshape(-1)],
        "loss": float(loss),
        "transformers": __import__("transformers").__version__,
        "torch": torch.__version__,
    }


def make():
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=256,
        n_positions=16,
        n_embd=16,
        n_layer=2,
        n_head=2,
        activation_function="gelu_new",
        layer_norm_epsilon=1e-5,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=None,
    )
    model = GPT2LMHeadModel(config).eval()
    # GPT-2 initialises biases and LayerNorms to 0 and 1: perturb them, so that a bias or
    # a LayerNorm parameter read into the wrong place shows in the logits.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(0.05 * torch.randn_like(p))
    out = FIXTURES / "hf-gpt2-tiny"
    model.save_pretrained(out, safe_serialization=True)
    (FIXTURES / "hf-gpt2-tiny.json").write_text(json.dumps(score(model)) + "\n")
    print(f"wrote {out} and {out}.json")


def check():
    exports = sorted(p for p in FIXTURES.glob("hf-export-*") if p.is_dir())
    if not exports:
        sys.exit("no tests/fixtures/hf-export-*/ directories: see tests/hf_gpt2.rs")
    for d in exports:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            model, info = GPT2LMHeadModel.from_pretrained(d, output_loading_info=True)
        bad = {k: v for k, v in info.items() if v}
        if bad:
            sys.exit(f"{d}: transformers reports {bad}")
        model.eval()
        (d.parent / f"{d.name}.json").write_text(json.dumps(score(model)) + "\n")
        print(f"{d}: loads cleanly (tied head: {model.config.tie_word_embeddings})")


if __name__ == "__main__":
    {"make": make, "check": check}[sys.argv[1] if len(sys.argv) > 1 else "make"]()
