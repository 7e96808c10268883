#!/usr/bin/env python3
"""Baseline for `lt bench layer`: one transformers decoder layer (Qwen3.5/3.6 `Qwen3_5DecoderLayer`,
or the Qwen2/Qwen3 layer) with random weights, forward and forward + backward in f32 on the CPU, on
the same number of threads. Package versions: torch 2.15.0, transformers 5.24.0. transformers'
Gated DeltaNet runs its pure-PyTorch chunked path (`torch_chunk_gated_delta_rule`) unless the
flash-linear-attention kernels are installed; this script refuses to run if they are.

    python3 tools/bench/torch_layer.py --config configs/models/qwen3.6-27b.json --layer linear \
        --batch 1 --seq 1024 --steps 3 --warmup 1 --threads 2

Prints one JSON line: {"fwd_seconds", "fwd_bwd_seconds", ...} (medians over the timed rounds). The
forward + backward round is what `lt bench layer` times: a forward that records the graph, then
`backward` of `(y * g).sum()` for a random upstream gradient g.
"""
import argparse
import importlib.util
import json
import statistics
import time

import torch
from transformers import AutoConfig


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--layer", choices=["linear", "full"], default=None)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    for mod in ("fla", "kernels"):
        if importlib.util.find_spec(mod) is not None:
            raise SystemExit(f"{mod} is installed: transformers would not run its pure-PyTorch path")
    torch.set_num_threads(a.threads)
    torch.manual_seed(7)
    cfg = AutoConfig.from_pretrained(a.config)
    text = getattr(cfg, "text_config", cfg)
    text._attn_implementation = "eager"
    types = getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers
    want = a.layer or ("linear" if "linear_attention" in types else "full")
    idx = types.index("linear_attention" if want == "linear" else "full_attention")
    mt = text.model_type
    if mt in ("qwen3_5_text", "qwen3_5"):
        from transformers.models.qwen3_5 import modeling_qwen3_5 as m
        layer = m.Qwen3_5DecoderLayer(text, idx)
        rope = m.Qwen3_5TextRotaryEmbedding(text)
    elif mt == "qwen3":
        from transformers.models.qwen3 import modeling_qwen3 as m
        layer = m.Qwen3DecoderLayer(text, idx)
        rope = m.Qwen3RotaryEmbedding(text)
    else:
        from transformers.models.qwen2 import modeling_qwen2 as m
        layer = m.Qwen2DecoderLayer(text, idx)
        rope = m.Qwen2RotaryEmbedding(text)
    layer = layer.float().train()
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.02) if p.dim() > 1 else None
    b, t, h = a.batch, a.seq, text.hidden_size
    x = torch.randn(b, t, h)
    g = torch.randn(b, t, h) * 1e-3
    pos = torch.arange(t).unsqueeze(0).expand(b, t)
    pe = rope(x, pos)
    # Causal mask for the eager attention path ([B, 1, T, T] additive); linear attention ignores it.
    mask = torch.full((t, t), float("-inf")).triu(1).expand(b, 1, t, t)
    kw = dict(position_embeddings=pe, position_ids=pos)
    if types[idx] == "full_attention":
        kw["attention_mask"] = mask

    def fwd():
        with torch.no_grad():
            return layer(x, **kw)

    def fwd_bwd():
        xi = x.clone().requires_grad_(True)
        y = layer(xi, **kw)
        y = y[0] if isinstance(y, tuple) else y
        (y * g).sum().backward()
        layer.zero_grad(set_to_none=True)

    tf, tb = [], []
    for r in range(a.warmup + a.steps):
        s = time.perf_counter()
        fwd()
        f = time.perf_counter() - s
        s = time.perf_counter()
        fwd_bwd()
        fb = time.perf_counter() - s
        if r >= a.warmup:
            tf.append(f)
            tb.append(fb)
    print(json.dumps({
        "impl": "transformers", "layer": idx, "layer_type": types[idx], "batch_size": b, "seq_len": t,
        "threads": a.threads, "params": sum(p.numel() for p in layer.parameters()),
        "fwd_seconds": statistics.median(tf), "fwd_bwd_seconds": statistics.median(tb),
        "fwd_seconds_all": tf, "fwd_bwd_seconds_all": tb,
        "torch": torch.__version__,
    }))


if __name__ == "__main__":
    main()
