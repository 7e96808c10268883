#!/usr/bin/env python3
"""Baselines for `lt bench optimizer`: PyTorch's fused CPU AdamW and bitsandbytes' AdamW8bit on CPU.

Tested with: python 3.11.7, torch 2.15.0, bitsandbytes 0.50.2 (CPU only).

    python3 tools/bench/torch_adamw.py --impl torch-fused --params 64M --threads 2
    python3 tools/bench/torch_adamw.py --impl bnb-8bit --params 64M --threads 2 --steps 2 --warmup 1
    python3 tools/bench/torch_adamw.py --impl mem-scale --params 64M --threads 2

One parameter tensor of N fp32 weights with an fp32 gradient (PyTorch's fused AdamW requires the
gradient dtype to match the weights), clipping off (its cost is not part of `step()` here), the
same hyper-parameters as `lt bench optimizer`. Prints one JSON line with the same keys as
`lt bench optimizer --json`. `bytes_per_param` counts the same way: weight read + write (8),
gradient read (4), state read + write (16 for fp32 m and v; 4 + 16/256 for 8-bit blocks of 256).

`--impl mem-scale` is the memory bus's reference in the same run, not an optimizer: an in-place
scale (`x.mul_(0.999)`, vectorized and parallel in torch) of one fp32 tensor of 2N elements on the
same threads, 16 bytes moved per "parameter" (8 read, 8 written back to lines already read, as the
optimizers' state and weights are), so its `gbytes_per_s` is what a plain read-modify-write stream
gets from the bus, and an optimizer's GB/s over it is its fraction of that limit. (A copy into a
second buffer is slower per byte counted: its written lines are read first.)

`--turns IN,OUT` takes turns with `lt bench optimizer --turns OUT,IN` through two named pipes (the
protocol is documented there: a start-up lap, then `--turn-steps` timed steps per token), so that
the two processes' timed steps alternate and see the same background load.
"""
import argparse
import json
import os
import time


def count(s):
    s = s.strip()
    mult = {"K": 1e3, "M": 1e6, "G": 1e9}.get(s[-1:].upper(), 1.0)
    return int(round(float(s[:-1] if mult != 1.0 else s) * mult))


class Baton:
    """One end of the token ring of `lt bench optimizer --turns` (see its docs): both named pipes
    opened read-write, so that opening never blocks and reads never see end-of-file."""

    def __init__(self, spec):
        inp, sep, out = spec.partition(",")
        if not sep or not inp or not out:
            raise SystemExit(f"--turns: expected IN,OUT (two pipe paths separated by a comma), got {spec!r}")
        self.names = (inp, out)
        self.inp = os.open(inp, os.O_RDWR)
        self.out = os.open(out, os.O_RDWR)

    def wait(self):
        if len(os.read(self.inp, 1)) != 1:
            raise SystemExit(f"{self.names[0]}: closed before the token came")

    def pass_on(self):
        os.write(self.out, b"t")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--impl", choices=["torch-fused", "torch-foreach", "bnb-8bit", "mem-scale"], required=True)
    ap.add_argument("--params", type=count, default=count("64M"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument(
        "--thp",
        action="store_true",
        help="allocate through PyTorch's huge-page path (THP_MEM_ALLOC_ENABLE=1), as lt backs its host "
        "buffers with transparent huge pages; reported as '<impl>-thp'",
    )
    ap.add_argument(
        "--turns",
        metavar="IN,OUT",
        help="take turns with another benchmark process through two named pipes, as `lt bench optimizer "
        "--turns` does (same protocol: a start-up lap, then --turn-steps timed steps per token)",
    )
    ap.add_argument("--turn-steps", type=int, default=5)
    ap.add_argument(
        "--turn-settle-ms",
        type=float,
        default=0.0,
        help="with --turns, milliseconds to wait after taking the token before the turn's first timed step "
        "(as `lt bench optimizer --turn-settle-ms`)",
    )
    a = ap.parse_args()
    baton = Baton(a.turns) if a.turns else None

    if a.thp:
        # Read by c10's CPU allocator when torch is first imported: set it before that.
        os.environ["THP_MEM_ALLOC_ENABLE"] = "1"
    import torch

    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    n = a.params
    p = None
    if a.impl == "mem-scale":
        buf = torch.empty(2 * n).uniform_(-1, 1)

        class Scale:
            state = {}

            def step(self):
                buf.mul_(0.999)

        opt = Scale()
        bpp, state = 16.0, "none"
    else:
        p = torch.nn.Parameter(torch.empty(n).uniform_(-0.05, 0.05))
        p.grad = torch.empty(n).uniform_(-1, 1)
        kw = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
        if a.impl == "torch-fused":
            opt = torch.optim.AdamW([p], fused=True, **kw)
            bpp, state = 28.0, "fp32"
        elif a.impl == "torch-foreach":
            opt = torch.optim.AdamW([p], foreach=True, **kw)
            bpp, state = 28.0, "fp32"
        else:
            import bitsandbytes as bnb

            opt = bnb.optim.AdamW8bit([p], **kw)
            bpp, state = 8.0 + 4.0 + 4.0 + 16.0 / 256, "8bit"
    times = []
    end = a.warmup + a.steps
    for s in range(end):
        if baton and s >= a.warmup and (s - a.warmup) % a.turn_steps == 0:
            if s == a.warmup:
                baton.wait()
                baton.pass_on()
            baton.wait()
            time.sleep(a.turn_settle_ms / 1000.0)
        t0 = time.perf_counter()
        opt.step()
        dt = time.perf_counter() - t0
        if s >= a.warmup:
            times.append(dt)
            if baton and ((s + 1 - a.warmup) % a.turn_steps == 0 or s + 1 == end):
                baton.pass_on()
    st = opt.state.get(p, {})
    state_bytes = sum(v.numel() * v.element_size() for k, v in st.items() if torch.is_tensor(v) and v.numel() > 1)
    in_order = list(times)
    times.sort()
    med = times[len(times) // 2]
    out = {
        "optimizer": a.impl + ("-thp" if a.thp else ""),
        "params": n,
        "threads": a.threads,
        "grad_dtype": "f32" if a.impl != "mem-scale" else "none",
        "state": state,
        "torch": torch.__version__,
        "warmup": a.warmup,
        "steps": a.steps,
        "turn_steps": a.turn_steps if baton else None,
        "seconds_per_step_median": med,
        "seconds_per_step_best": times[0],
        "seconds_per_step": in_order,
        "gparams_per_s": n / med / 1e9,
        "gparams_per_s_best": n / times[0] / 1e9,
        "bytes_per_param": bpp,
        "gbytes_per_s": n / med / 1e9 * bpp,
        "state_bytes_per_param": state_bytes / n,
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
