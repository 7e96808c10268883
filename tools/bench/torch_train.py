#!/usr/bin/env python3
"""Baseline for `lt train` throughput: PyTorch (transformers) training the same HF model on the same
pre-tokenized batch, on the same number of CPU threads. Package versions: torch 2.15.0,
transformers 5.24.0.

    python3 tools/bench/torch_train.py --make DIR      # write a random tiny Qwen3 + data.jsonl into DIR
    python3 tools/bench/torch_train.py --make DIR --config configs/bench/hybrid-h256.json --seq 1024
                                                       # the same from a config.json (random weights)
    python3 tools/bench/torch_train.py --model DIR/model --data DIR/data.jsonl --steps 8 --threads 2

Prints one JSON line: {"tokens_per_s", "step_seconds_median", ...} (warm-up steps excluded).
"""
import argparse
import json
import os
import statistics
import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM


def make(d, seq, rows, seed=0, config=None):
    if config:
        cfg = AutoConfig.from_pretrained(config)
        cfg.use_cache = False
    else:
        cfg = AutoConfig.for_model("qwen3", vocab_size=2048, hidden_size=256, intermediate_size=768,
                                   num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=2,
                                   head_dim=32, rms_norm_eps=1e-6, tie_word_embeddings=True,
                                   max_position_embeddings=4096, use_cache=False)
    torch.manual_seed(seed)
    m = AutoModelForCausalLM.from_config(cfg).float()
    m.save_pretrained(os.path.join(d, "model"))
    g = torch.Generator().manual_seed(seed)
    with open(os.path.join(d, "data.jsonl"), "w") as f:
        for _ in range(rows):
            ids = torch.randint(0, cfg.vocab_size, (seq,), generator=g).tolist()
            f.write(json.dumps({"input_ids": ids}) + "\n")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--make")
    ap.add_argument("--config")
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--model")
    ap.add_argument("--data")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    if a.make:
        os.makedirs(a.make, exist_ok=True)
        make(a.make, a.seq, a.rows, config=a.config)
        return
    torch.set_num_threads(a.threads)
    m = AutoModelForCausalLM.from_pretrained(a.model, attn_implementation="eager", dtype=torch.float32)
    m.train()
    rows = [json.loads(l)["input_ids"] for l in open(a.data)]
    opt = torch.optim.AdamW(m.parameters(), lr=1e-5, weight_decay=0.01, fused=True)
    times = []
    for step in range(a.warmup + a.steps):
        k = (step * a.batch) % len(rows)
        ids = torch.tensor([rows[(k + i) % len(rows)] for i in range(a.batch)])
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        opt.step()
        dt = time.perf_counter() - t0
        if step >= a.warmup:
            times.append(dt)
    med = statistics.median(times)
    toks = a.batch * len(rows[0])
    print(json.dumps({"baseline": "torch", "threads": a.threads, "tokens_per_step": toks,
                      "step_seconds_median": med, "tokens_per_s": toks / med}))


if __name__ == "__main__":
    main()
