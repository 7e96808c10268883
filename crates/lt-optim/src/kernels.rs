//! The update kernels: fp32 AdamW (PyTorch's arithmetic) and block-wise 8-bit AdamW.
//!
//! The fp32 kernel is one plain Rust body, compiled again for AVX2 and AVX-512 (auto-vectorised;
//! it does PyTorch's f32 operations in PyTorch's order with exact `sqrt` and division, so every
//! version gives bit-identical results).
//!
//! The 8-bit kernel has a plain Rust reference ([`q8_block_scalar`]) and hand-written AVX-512 and
//! AVX2 versions, chosen at run time ([`KernelPath`]). Its arithmetic is bitsandbytes' algorithm
//! arranged for throughput, because at 2 bytes of state per parameter the update is no longer
//! memory-bound: per 16 elements, 512-bit vector code has two ALU ports to share between
//! dequantization, the update, and finding each new code.
//! - `beta1` / `beta2` are folded into the block's dequantization scale and the clip scale into the
//!   gradient coefficients, so `m = fma(code_m, absmax_m * beta1, g * (scale * (1 - beta1)))` and
//!   `v = fma(code_v, absmax_v * beta2, g * (scale^2 * (1 - beta2)) * g)`;
//! - `denom = fma(sqrt(v), 1 / sqrt(1 - beta2^t), eps)` and the update
//!   `p = fma(p, 1 - lr * wd, (m * (-lr / (1 - beta1^t))) / denom)`, with a true division (the
//!   divider has room for it next to the square root: a reciprocal estimate measured no faster).
//! - Re-quantization multiplies by the block's reciprocal absmax (the rule of [`crate::qmap`]), then
//!   one table read and one integer compare per element find the exact nearest code of that value
//!   (for the default maps with the bucket shifts as immediates).
//! - Two AVX-512 kernels: the *plain* kernel (`x86::q8_blocks_avx512`, AVX-512 without VBMI)
//!   dequantizes with gathers and re-quantizes each block after its update with the bucket table;
//!   the *VBMI* kernel (`x86::q8_blocks_avx512_vbmi`) packs codes with byte permutes and, by
//!   default, finds the new codes with the rounding form of the affine code finder
//!   (`crate::affine::Rounded`: register permutes, one fixed-point estimate whose top bits are the
//!   code away from transitions, the exact finder for the rare blocks with a lane near one; no
//!   gather, no table compare; `LT_OPTIM_Q8_QUANT=table|affine|rounded` to override). It runs
//!   wherever the CPU has VBMI, and dequantizes with byte-plane permutes on AMD (one uop each on
//!   Zen 4, where gathers are slow) or with gathers elsewhere (`vpermi2b` is three uops on Intel
//!   and competes with the code finder's permutes for the shuffle port; 11% faster on Emerald
//!   Rapids, session 17 in `docs/benchmarks.md`): `crate::simd::q8_dequant`,
//!   `LT_OPTIM_Q8_DEQUANT=gather|permute` to override.
//! - Every SIMD kernel prefetches parameters, gradients and codes 512 elements ahead
//!   (`x86::PREFETCH_AHEAD`): with the quantization work filling the out-of-order window, the
//!   hardware prefetchers alone left the update waiting on memory at DRAM sizes.
//! - Optionally every kernel also writes the bf16 copy of each updated parameter (the copy that
//!   streaming uploads, see `crate::copy`) from the register it just stored: integer
//!   round-to-nearest-even, or `vcvtneps2bf16` where the CPU has AVX512-BF16 (it reads subnormal
//!   inputs as zero, so a group of 16 holding one takes the integer rounding). The copy's lines
//!   are prefetched for writing, since nothing ever reads them first; on AMD Zen 5 and later the
//!   AVX-512 8-bit kernels write a 64-byte-aligned copy with streaming stores instead (no read
//!   for ownership at all; `COPY_STREAM`, `crate::simd::stream_copy`).
//!
//! # Why the 8-bit kernels are slower on Intel cores, measured
//! Intel Xeon (family 6 model 207, AVX-512 with VBMI and BF16; 2 vCPUs under KVM at about
//! 2.9 GHz; the machine shared with other builds, so figures are CPU cycles of the updating
//! threads per 16 parameters, medians of interleaved runs, bf16 gradients, blocks of 256):
//! - Instruction throughput, in cycles: `vpgatherdd` zmm from L1 8-12, and gathers do not overlap
//!   with vector ALU work (a gather plus 8/16/24 FMAs took 13/17/23); `vpermi2b` zmm 2.0 (three
//!   uops; `vpermb` 1.0); `vdivps` zmm 10 and `vsqrtps` zmm 12, on the divider.
//! - Kernels, 1 thread, data in L2 / 64M parameters: permute kernel 64-70 / 62-72, gather kernel
//!   58-62 / 60-63 (55 / 57 with the immediate shifts), AVX2 72 / 76, scalar about 1070. With 2
//!   threads at 64M: 63-73 (gather) against 81-83 (permute) per thread.
//! - Where the gather kernel's 58 cycles go (in L2): re-quantization 27 (two 16-lane gathers
//!   into the 11 and 23 KB tables plus about 20 vector uops), dequantization gathers 6, division
//!   and square root 3 (they overlap with the gathers: alone, the update is divider-bound at 22).
//!   Prefetching: 256 to 2048 elements ahead within 1%, none 4% slower; not the cause.
//! - Cause: four 256+-entry table lookups per parameter (two to dequantize, two to re-quantize).
//!   On AMD Zen 4 `vpermi2b` is one uop, so the permute kernel's byte-plane dequantization is
//!   cheap; on this core it costs more than the gathers it replaces. Every exact lookup method
//!   measured costs about the same per 16 lookups here (gathers; four-plane `vpermi2b`; a
//!   computed nearest code per map segment with an exact fallback, prototyped at 25 against 27
//!   cycles for both moments), so the kernel stays compute-bound at about 3.5 cycles/parameter,
//!   short of the 14 bytes/parameter memory bound.
//! - The bf16 copy adds about 7% in L2 and 8% at 64M (11% before the copy's lines were
//!   prefetched; streaming stores were slower).
//! - Ablations of the gather kernel with the copy (same machine, no PMU counters in this VM, so
//!   CPU time of the updating thread from `/proc/self/task/*/schedstat`; 131072 parameters in L2,
//!   1 thread, best of 5 interleaved runs of 1000 steps, ns per 16 parameters; each ablation
//!   gives wrong results and was only timed): the kernel 19.4-19.7; without division and
//!   square root 18.3-19.0, so the divider is not the limit; without re-quantization 10.7, so
//!   the quantization phase is about 45%; each moment's lookup (`lookup`) 3.5-4 (10-11 cycles,
//!   about 11 uops plus one gather), of which its gather about 1.5; both dequantization gathers
//!   about 2.5; the per-block set-up of `quantize_pair` under 0.5. Tried, all bit-identical and
//!   none faster: two 8-lane gathers per lookup instead of one 16-lane gather (21.5, slower);
//!   the `m` and `v` codes packed with one `vpermt2b` instead of two `vpmovdb` (21.6, slower);
//!   the `v` scratch offset from `m`'s against 4K aliasing, and dropping the clamp to 1.0 (no
//!   change). So the kernel is throughput-bound on the vector ports plus gathers, with no
//!   single phase to overlap or instruction to swap out.
//!
//! # The AVX2 kernel on AMD Zen 3, measured
//! AMD EPYC (family 25 model 1, Zen 3, AVX2 only; 2 vCPUs under KVM, a noisy host: medians swing
//! 1.5x between runs, so only interleaved A/B figures mean anything). An 8-lane `vpgatherdd` from
//! an L1-resident table took 0.7-1.1 ns per lane, a scalar load plus `vinsertps` 0.4-0.5 ns. So on
//! AMD CPUs the AVX2 kernel reads all four tables with scalar loads (`table8`;
//! `crate::simd::q8_avx2_loads`, `LT_OPTIM_Q8_LOOKUP=gather|loads` overrides): at 64M parameters,
//! 2 threads, bf16 gradients with the bf16 copy, 1.44x, 1.17x and 1.20x the gather kernel in three
//! interleaved rounds (0.46-0.48 against 0.34-0.39 Gparam/s). Ablations in L2, 1 thread, best of
//! 2000 steps, ns per parameter (each ablation gives wrong results and was only timed): the kernel
//! 2.2; without re-quantization 1.04; without the dequantization lookups 1.6-1.8; without division
//! and square root 2.0-2.15; without all three 0.36. Re-quantization costs the same with gathered
//! or loaded table reads, so its vector work (about 25 uops per lookup of 8), not the table read,
//! sets its cost. The bf16 copy adds 10-15% here. Still about half of torch's fused fp32 AdamW on
//! this machine (memory-bound at 0.8-0.9 Gparam/s with 2 threads): the 8-bit update is
//! compute-bound at about 7 cycles per parameter.
//!
//! Re-measured on 2026-12-03, same CPU model (3.2 GHz by a dependent-add loop). torch's fused
//! AdamW now runs at 1.50 Gparam/s on 1 thread and 1.54-1.78 on 2 at 64M parameters (28 B/param,
//! 43-50 GB/s: the host's memory is faster than before), so reaching it would take 1.1 ns per
//! parameter per thread, 3.6 cycles. `vsqrtps` and `vdivps` ymm alone take 8.5 cycles per 8 lanes
//! (1.07 cycles/param) here. Ablations (128K parameters, 1 thread, medians of 1000 steps, each
//! ablation wrong and only timed), ns per parameter: the kernel 2.5; re-quantization 1.0, the
//! dequantization lookups 0.47, the bf16 copy's conversion 0.32, division and square root 0.2,
//! everything else 0.5-0.6. The update was one loop per block whose iterations each carried a
//! long chain (table loads, square root, division) and about 100 instructions, so few of them
//! fitted in the out-of-order window: splitting it into a moments loop and a weights loop made the
//! kernel 9% faster (128K, 1 thread), and checking the copy for NaN once per block instead of
//! blending every vector another 3%; at 64M with the copy, interleaved against the previous
//! binary, 0.451-0.454 against 0.411-0.424 Gparam/s on 1 thread and 0.882-0.888 against
//! 0.823-0.839 on 2. Tried and slower: block `k - 1`'s re-quantization pipelined into block `k`'s
//! update (10-20% slower: more live registers, longer iterations), the bucket indices moved to
//! the integer registers through a store and four 64-bit loads instead of `vpextrd` (15%),
//! separate `m` and `v` re-quantization loops (2%), and gathers for the `v` lookups, for the `v`
//! dequantization or both (3%, 8%, 13%). Also tried: finding each new code without a table. The
//! bitsandbytes maps are eight runs of evenly spaced values, so a code is the segment (seven
//! integer compares of the magnitude with the exact transition at each run's start, the sign in
//! the key's low bit to get ties right on both sides) plus `floor(fma(|x|, a, b))` with `a`, `b`
//! per run (`vpermps`), the table asked only within 5e-4 of a step of a transition (the map's
//! transitions lie within 6e-6 of a step of their lines). It matched the table on every f32 in
//! [-1, 1] and sent 0.1% of values to the table, but took about 37 vector operations per 8 values,
//! as many as the table lookup, and was 7-9% slower (also with `m` computed and `v` looked up in
//! the same loop): the kernel is bound by vector operations, about 15 per parameter at 2.9 per
//! cycle, and reaching torch here would need about 10.
//!
//! Tried on 2026-12-03, session 12 (same host; 128K parameters, 1 thread, A/B interleaved in one
//! run, median ms per step), none kept:
//! - Finding the new codes on the integer ports, idle during the vector update: the weights loop
//!   turned each moment into a table key (negative keys reflected, so that one table read, two
//!   shifts, a compare and an add give the code; exact on every probe of every map). As its own
//!   loop, 0.435 against 0.272: 2.3 ns per parameter for both codes against the vector lookups'
//!   1.0 (about 11 instructions per code at 3 per cycle), so overlapping it could not pay.
//! - Each dequantization index by its own byte load instead of a 64-bit load split by shifts:
//!   0.274-0.278 against 0.271-0.282.
//! - Re-quantizing inside the weights loop, 16 values per iteration: 0.278-0.279 (one outlier at
//!   0.311) against 0.273-0.281.
//! - Table reads by `vbroadcastss` loads merged by a tree of `vblendps` (no shuffle-port work)
//!   instead of `vinsertps`: 0.290-0.324 against 0.293-0.299 (both behind the same run-time switch).
//!
//! The core's vector throughput is not the limit: independent `vpaddd` ymm ran at 4.1 per cycle,
//! `vmulps` and `vpshufd` ymm at 2.2 (inline assembly, 12 and 8 independent chains). Table reads
//! cost, measured alone (C with intrinsics, 8 lanes from a 1 KB table per call, four independent
//! accumulators, 2.77 GHz by a dependent `add` chain): `vmovss` + `vinsertps` 2.24-2.27 ns per 8
//! lanes (0.78 cycles a lane), `vbroadcastss` + `vblendps` 2.52-2.67, `vpgatherdd` 3.71-4.35. The
//! kernel reads four tables per parameter (two codes to dequantize, two buckets to re-quantize), so
//! per parameter: table reads 1.13 ns, the rest of re-quantization about 0.45, division and square
//! root 0.2, the streaming part 0.36 (the ablation without all three); about 2.1 against the
//! kernel's 2.2-2.4 (clocks differ between days): the parts barely overlap, and none of the
//! rearrangements above made them overlap more. Table reads plus the streaming part alone,
//! without overlap, come to 1.5 ns, more than the 1.44 ns per parameter per thread that torch's
//! fused AdamW needs at 2 threads today (1.385 Gparam/s at 64M). Parity on AVX2-only cores needs
//! fewer or cheaper table reads than bitsandbytes' exact nearest-code rule allows (a change of the
//! optimizer's specification), or the AVX-512 kernels (Zen 4 and later, Intel).
//!
//! Session 13 (2026-12-03, same host, no PMU in this VM) mapped which resource each loop is short
//! of by adding, in turn, 8 independent instructions of one kind per 8 parameters to one loop
//! (inline assembly whose results nothing reads; 128K parameters, 1 thread, bf16 copy, 2000 steps,
//! medians of 5 interleaved rounds, base 0.300 ms per step): in the moments loop `lea` +0%,
//! `vpaddd` +1%, `vinsertps` with a load +2%; in the weights loop `lea` -3% (noise), `vpextrd`
//! +10%; in the re-quantization loop `vpaddd` +2%, `vinsertps` +7%, `lea` +8%. So the moments loop
//! has slack, the weights loop is bound on the vector side (the divider), and re-quantization on
//! the integer and load side, where its 16 `vpextrd`/`vmovd` index moves, 32 table loads and the
//! constants and pointers it reloads from the stack (register pressure) all land. Two changes aimed
//! there measured no faster, A/B against the kept kernel: the default maps' bucket shifts as
//! immediates, as in the AVX-512 kernel (frees four registers; 0.281-0.302 against 0.291-0.305 ms),
//! and 8 parameters per re-quantization iteration instead of 16 (half the live indices;
//! 0.307-0.328 against 0.295-0.418). The kernel is about 24 instructions per parameter (moments 11,
//! weights 2.6, re-quantization 10); at the same IPC, torch's 1.44 ns would need about 14, which is
//! close to the bare minimum of this scheme (four table reads of two instructions each, plus the
//! arithmetic), so no compiler-level rearrangement closes the gap on this core.
//!
//! # The AVX-512 permute kernel on AMD Zen 4, measured
//! AMD EPYC (family 25 model 17, Zen 4, AVX-512 with VBMI and BF16; 2 vCPUs under KVM; zmm
//! `vpaddd` 2 per cycle, `vpermi2b`/`vpermps`/`vfmadd` 1 per cycle by independent chains), 2026-12-03,
//! bf16 gradients with the copy. At 64M parameters on 2 threads the permute kernel with bucket-table
//! gathers ran at 0.47x torch's fused AdamW (`tools/bench_optimizer_vs_torch.sh 64M 2 3`: 0.82
//! against 1.76 Gparam/s), and the AVX2 kernel was as fast as it in L2 (0.227 against 0.233 ms
//! per step at 128K, 1 thread). Ablations (128K, 1 thread, best of interleaved runs): without
//! re-quantization 0.078 against 0.234 ms, so re-quantization was two thirds of the kernel; a
//! 16-lane `vpgatherdd` from an L1 table alone took 5.4 ns (about 19 cycles), the whole gathered
//! lookup 10.5-11 ns per 16 lanes; without division and square root no faster. The affine code
//! finder does the same 16 lanes in 4.2-4.7 ns (microbenchmark) and took the kernel to 0.174-0.19
//! ms against 0.236-0.26 with the table, same bits; re-quantizing each block right after its
//! update instead of pipelining it into the next block's update gave another 9% (0.161 against
//! 0.177 ms) and 44.5 against 54.8 ms per step at 64M on 2 threads; interleaving the two moments'
//! estimate, lookup and finish steps another 17% in L2 (0.149 against 0.179 ms; 43.6 against 45.8
//! at 64M). Now (0.158 ms in L2) finding codes is 56% of the kernel, dequantization 15%, division
//! and square root 5%; one thread runs 1.08-1.15 ns per parameter from 128K to 64M, two scale
//! 1.82-1.86x, and the acceptance script measures 0.82-0.93x torch fused. Tried and not kept:
//! re-quantizing a whole block per call (the loop inside one non-inlined function, tables hoisted):
//! 2-3% slower; software prefetch 256/384/768/1024/2048 ahead or into L2 only: no better than 512
//! (none: 57% slower at 8M on 1 thread).
//!
//! Session 15 (same core): on this core every zmm operation but the simple integer ones (add, and,
//! max, moves: 2 per cycle) issues at most once per cycle, multiplies and permutes compete for
//! the same pipes, `vreduceps` takes 2.5 cycles, `vsqrtps` 10 and `vdivps` 6 (independent chains,
//! inline-assembly loops), and mixed kernel code runs at about 1.1-1.4 instructions per cycle; so
//! the instruction count sets the speed. The rounding form (`crate::affine::Rounded`) finds a code
//! in about 17 instructions per 16 lanes (signed map; 15 unsigned) instead of about 26, with no
//! table compare: the slot from the binade and one switch compare (a rotate, a permute, three
//! integer operations), `H = min(fma(y, a, b), c)` in 2^-16 fixed point (three permutes), and a
//! truncation whose byte 2 is the code; a running minimum of the low 16 bits flags the few blocks
//! with a lane within about 2^-15 of a step from a transition, which the exact finder redoes
//! (proven at build time: `Rounded::verify`). Same bits on every path. Measured (16K parameters,
//! 1 thread, best of 7 interleaved runs): 0.0153 against 0.0176-0.0180 ms per step with the exact
//! finder (-14%); at 64M on 2 threads 47.2-50.4 against 51.1-55.4 ms (medians of 5 interleaved
//! runs). Tried and not kept: software-pipelining the rounding form into the next block's update
//! (-4% at 16K, +13% at 1M parameters), processing the eight groups of 16 stage by stage (no
//! change), and an ambiguity check by `vreduceps` (the integer low-16-bit check is cheaper).
//! Building a constant permute index with `std::array::from_fn` instead of a `const` compiled to a
//! 64-iteration scalar loop per call; keep index tables `const`.
//!
//! # The permute kernel on Intel Emerald Rapids, measured (session 16)
//! Intel Xeon, family 6 model 207 (AVX-512 with VBMI, VBMI2, BF16, FP16), 2 vCPUs under KVM at
//! about 2.9 GHz (a dependent `imul` chain), no PMU in this VM; 2026-12-03. The host was noisy in a
//! bimodal way (the same binary at 16K parameters ran 0.0195 or 0.025 ms per step, presumably the
//! physical core's other hyperthread), so figures are best-of interleaved runs.
//! - Throughput by independent chains, cycles per zmm instruction: `vpaddd`, `vfmadd`, `vmulps`,
//!   `vminps`, `vcvttps2dq`, `vpternlogd` 0.55-0.6 (two pipes); `vpermt2ps`, `vpermb`, `vprold`,
//!   `vpsrld`, `vpmaxud`, `vpminuw`, `vpunpcklbw`, `vpmovd2m` 1.0 (one pipe); `vpermt2b` 2.1;
//!   `vsqrtps` 12.1, `vdivps` 10.5, and a square root plus a division 23.2 per 16 lanes whether
//!   zmm or ymm, dependent or not: the divider alone bounds the update at 1.45 cycles/parameter.
//! - The kernel (rounding form, bf16 gradients, the copy; 16K parameters, 1 thread): 0.0193-0.0196
//!   ms per step, 3.4 cycles per parameter; the gather kernel 0.0197-0.0199, the permute kernel with
//!   the exact affine finder 0.0238-0.0251, with the bucket table 0.0215. Ablations (best, each
//!   wrong and only timed): without re-quantization 0.0117 (40% of the kernel), without the
//!   dequantization permutes 0.0165 (15%), without square root and division 0.0176 (10%), without
//!   re-quantization, square root and division 0.0094-0.011. Re-quantization alone (the rounding
//!   form over L1-resident blocks): 19.2 cycles per 16 parameters for both moments, the exact
//!   affine finder 34.1.
//! - The slot of the rounding form is now `(key - off[binade]) >> S` (one subtraction and a
//!   rotate, `crate::affine::Rounded`) instead of a compare of the key with the binade's switch
//!   (subtract, arithmetic shift, add); the signed map's clamp is one `vrangeps`, and the running
//!   minimum of the low 16 bits one unmasked `vpminuw` (the band check ignores the odd words):
//!   5 fewer vector operations per 16 parameters, same bits, 2% faster here (0.0193-0.0196
//!   against 0.0196-0.0200 ms).
//! - Tried and not kept, both bit-identical: re-quantizing block `k - 1` during block `k`'s update,
//!   so that the divider and the permutes overlap (0.0212-0.0221 against 0.0197-0.0201 ms; the
//!   loop spilled, about 100 more instructions per 64 elements), and two loops per block, the
//!   moments first and then the weights together with re-quantization (the absmax is known after
//!   the moments; 0.0197-0.0205 against 0.0192-0.0198): the divider is not what limits the kernel.
//!   Prefetching 1024 or 2048 elements ahead instead of 512: no difference beyond the noise at 64M
//!   parameters on 2 threads.
//!
//! Every SIMD kernel does the reference's f32 operations in the reference's order, so parameters,
//! codes and absmax are bit-identical on every path (tested on random data and on edge cases: every
//! map transition +-1 ulp, zeros, subnormals, NaN, overflow, ragged blocks). They differ from
//! bitsandbytes' op-by-op sequence by a few ulp of `m`, `v` and the update, which moves a code only
//! when a value sits within those ulps of a decision threshold; the bitsandbytes trajectory test
//! bounds the effect.
//!
//! The clip scale is folded in everywhere: the kernels read the raw gradient once, as
//! `clip_grad_norm_` followed by `step()` would, without the extra pass over the gradient.

use half::bf16;

use crate::config::{AdamWConfig, MAX_BLOCK};
use crate::copy::bf16_rne;
use crate::grad::{Grad, GradElem};
use crate::pool::{ThreadPool, run_tasks};
use crate::qmap::{QuantMaps, block_absmax};
use crate::simd::{Q8Dequant, Q8Quant, SimdLevel, simd_level};

/// Per-step constants, converted to f32 where PyTorch / bitsandbytes convert their Python floats.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Coeffs {
    /// Gradient clip scale, `min(1, max_norm / (norm + 1e-6))` or 1.
    pub scale: f32,
    /// `1 - lr * weight_decay` (exactly 1 when there is no decay, so multiplying is a no-op).
    pub decay: f32,
    /// PyTorch's `lerp_` weight `1 - beta1`, and whether it takes lerp's small-weight branch.
    pub lerp_w: f32,
    pub lerp_small: bool,
    /// `1 - lerp_w`, lerp's large-weight branch factor.
    pub lerp_1mw: f32,
    /// bitsandbytes' `mul_(beta1).add_(g, alpha=1 - beta1)`.
    pub beta1: f32,
    pub omb1: f32,
    pub beta2: f32,
    /// `1 - beta2`.
    pub omb2: f32,
    /// `sqrt(1 - beta2^t)`.
    pub bc2_sqrt: f32,
    pub eps: f32,
    /// `-lr / (1 - beta1^t)`.
    pub neg_step: f32,
    /// 8-bit kernel: `scale * (1 - beta1)`, `scale^2 * (1 - beta2)`, `1 / sqrt(1 - beta2^t)`.
    pub gm: f32,
    pub gv: f32,
    pub inv_bc2: f32,
    /// The step number `t` (the f8 codes' dithered rounding of `v` depends on it).
    pub step: u64,
}

impl Coeffs {
    pub(crate) fn new(cfg: &AdamWConfig, step: u64, scale: f32) -> Coeffs {
        let t = step as f64;
        // `powf` is libm's `pow`, what Python's `beta ** step` calls.
        let bc1 = 1.0 - cfg.beta1.powf(t);
        let bc2 = 1.0 - cfg.beta2.powf(t);
        let lerp_w = (1.0 - cfg.beta1) as f32;
        Coeffs {
            scale,
            decay: if cfg.weight_decay != 0.0 { (1.0 - cfg.lr * cfg.weight_decay) as f32 } else { 1.0 },
            lerp_w,
            lerp_small: lerp_w.abs() < 0.5,
            lerp_1mw: 1.0 - lerp_w,
            beta1: cfg.beta1 as f32,
            omb1: (1.0 - cfg.beta1) as f32,
            beta2: cfg.beta2 as f32,
            omb2: (1.0 - cfg.beta2) as f32,
            bc2_sqrt: bc2.sqrt() as f32,
            eps: cfg.eps as f32,
            neg_step: (-(cfg.lr / bc1)) as f32,
            gm: (scale as f64 * (1.0 - cfg.beta1)) as f32,
            gv: (scale as f64 * scale as f64 * (1.0 - cfg.beta2)) as f32,
            inv_bc2: (1.0 / bc2.sqrt()) as f32,
            step,
        }
    }
}

/// Elements per parallel task (rounded to whole blocks for the 8-bit kernel).
const TASK: usize = 1 << 15;
/// Below this many elements a tensor is updated on the calling thread only.
pub(crate) const PAR_MIN: usize = 1 << 16;

/// Which kernels run: the SIMD level, and for AVX-512 how the 8-bit kernel dequantizes and how the
/// bf16 copy is converted. [`KernelPath::detect`] picks the fastest for this CPU once; the tests run
/// every path the CPU supports, and all of them give the same bits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct KernelPath {
    pub level: SimdLevel,
    /// AVX-512: the VBMI kernel (codes packed with byte permutes; the affine and rounding code
    /// finders) instead of the plain gather-and-table kernel.
    pub vbmi: bool,
    /// AVX-512 VBMI kernel: how the old codes are dequantized (byte-plane permutes or gathers).
    pub dequant: Q8Dequant,
    /// AVX-512: the bf16 copy with `vcvtneps2bf16` (AVX512-BF16) instead of integer rounding.
    pub bf16_hw: bool,
    /// AVX2: the 8-bit kernel's table lookups with scalar loads instead of gathers.
    pub loads: bool,
    /// AVX-512 VBMI kernel: how the new codes are found (`crate::simd::Q8Quant`: the affine code
    /// finders of `crate::affine`, held in registers, for maps that have them, or gathers from the
    /// bucket table).
    pub quant: Q8Quant,
    /// AVX-512 with AVX512-BF16: the 8-bit kernels write a 64-byte-aligned bf16 copy with
    /// streaming stores (`crate::simd::stream_copy`).
    pub stream_copy: bool,
}

impl KernelPath {
    /// The path for this process: [`simd_level`], VBMI detection, `crate::simd::q8_dequant`,
    /// `crate::simd::q8_quant`, `crate::simd::q8_avx2_loads` and AVX512-BF16 detection.
    pub(crate) fn detect() -> KernelPath {
        let level = simd_level();
        let avx512 = level == SimdLevel::Avx512;
        let bf16_hw = avx512 && crate::simd::has_avx512bf16();
        KernelPath {
            level,
            vbmi: avx512 && crate::simd::has_vbmi(),
            dequant: crate::simd::q8_dequant(),
            bf16_hw,
            loads: level == SimdLevel::Avx2 && crate::simd::q8_avx2_loads(),
            quant: if avx512 { crate::simd::q8_quant() } else { Q8Quant::Table },
            stream_copy: bf16_hw && crate::simd::stream_copy(),
        }
    }

    /// The plain path of a level (gathers, integer bf16 rounding).
    #[cfg(test)]
    pub(crate) fn plain(level: SimdLevel) -> KernelPath {
        KernelPath {
            level,
            vbmi: false,
            dequant: Q8Dequant::Gather,
            bf16_hw: false,
            loads: false,
            quant: Q8Quant::Table,
            stream_copy: false,
        }
    }
}

/// How a SIMD kernel writes the bf16 copy of the updated parameters (a const parameter, so that
/// the update without a copy pays nothing for it).
pub(crate) const NO_COPY: u8 = 0;
/// Integer round-to-nearest-even (every AVX2 / AVX-512 CPU).
pub(crate) const COPY_INT: u8 = 1;
/// `vcvtneps2bf16` (AVX512-BF16), with the integer rounding for blocks of 16 holding a subnormal.
pub(crate) const COPY_HW: u8 = 2;
/// `COPY_HW`'s bits written 64 bytes at a time with streaming stores, for a 64-byte-aligned copy
/// (`crate::simd::stream_copy`); kernels without a streaming form take it as `COPY_HW`.
pub(crate) const COPY_STREAM: u8 = 3;

/// How the VBMI kernel finds new codes (a const parameter): gathers from the bucket tables, the
/// exact affine code finders, or the rounding forms with the exact finders as their fallback.
pub(crate) const QUANT_TABLE: u8 = 0;
pub(crate) const QUANT_AFFINE: u8 = 1;
pub(crate) const QUANT_ROUNDED: u8 = 2;

/// How the VBMI kernel dequantizes the old codes (a const parameter): byte-plane permutes
/// (`x86::dequant64`) or one 16-lane gather per moment and 16 elements.
pub(crate) const DEQ_PERMUTE: u8 = 0;
pub(crate) const DEQ_GATHER: u8 = 1;

/// The copy mode of a path for an optional copy.
pub(crate) fn copy_mode(path: KernelPath, cp: &[bf16]) -> u8 {
    match (cp.is_empty(), path.bf16_hw) {
        (true, _) => NO_COPY,
        (false, false) => COPY_INT,
        (false, true) if path.stream_copy && (cp.as_ptr() as usize).is_multiple_of(64) => COPY_STREAM,
        (false, true) => COPY_HW,
    }
}

/// Which 8-bit kernel updates whole blocks, for a path, a pair of maps and a block size: the one
/// rule behind `q8_run`'s dispatch and [`crate::q8_kernel_name`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Q8Kernel {
    /// `x86::q8_blocks_avx512_vbmi`: AVX-512 VBMI and blocks of a multiple of 64; `quant` is one
    /// of `QUANT_TABLE`, `QUANT_AFFINE`, `QUANT_ROUNDED`.
    Vbmi { dequant: Q8Dequant, quant: u8 },
    /// `x86::q8_blocks_avx512`: gathers and the bucket table.
    Avx512,
    /// `x86::q8_blocks_avx2`, its table reads by scalar loads or gathers.
    Avx2 { loads: bool },
    /// `q8_scalar_blocks`.
    Scalar,
}

impl Q8Kernel {
    /// The kernel for `path`, `maps` and `block`. The affine code finders need both maps in that
    /// form (the default maps are), the rounding forms both maps' rounding forms.
    pub(crate) fn select(path: KernelPath, maps: QuantMaps, block: usize) -> Q8Kernel {
        match path.level {
            SimdLevel::Avx512 if path.vbmi && block.is_multiple_of(64) => {
                let (sa, ua) = (maps.signed.affine(), maps.unsigned.affine());
                let affine = sa.is_some_and(|a| a.signed) && ua.is_some_and(|a| !a.signed);
                let rounded = sa.zip(ua).is_some_and(|(s, u)| s.rounded.is_some() && u.rounded.is_some());
                let quant = match path.quant {
                    _ if !affine => QUANT_TABLE,
                    Q8Quant::Table => QUANT_TABLE,
                    Q8Quant::Rounded if rounded => QUANT_ROUNDED,
                    _ => QUANT_AFFINE,
                };
                Q8Kernel::Vbmi { dequant: path.dequant, quant }
            }
            SimdLevel::Avx512 => Q8Kernel::Avx512,
            SimdLevel::Avx2 => Q8Kernel::Avx2 { loads: path.loads },
            SimdLevel::Scalar => Q8Kernel::Scalar,
        }
    }

    /// Its name in benchmark reports: `avx512-<permute|gather>-<rounded|affine|table>`,
    /// `avx512-gather`, `avx2-loads`, `avx2-gather` or `scalar`.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Q8Kernel::Vbmi { dequant: Q8Dequant::Permute, quant: QUANT_ROUNDED } => "avx512-permute-rounded",
            Q8Kernel::Vbmi { dequant: Q8Dequant::Permute, quant: QUANT_AFFINE } => "avx512-permute-affine",
            Q8Kernel::Vbmi { dequant: Q8Dequant::Permute, .. } => "avx512-permute-table",
            Q8Kernel::Vbmi { dequant: Q8Dequant::Gather, quant: QUANT_ROUNDED } => "avx512-gather-rounded",
            Q8Kernel::Vbmi { dequant: Q8Dequant::Gather, quant: QUANT_AFFINE } => "avx512-gather-affine",
            Q8Kernel::Vbmi { dequant: Q8Dequant::Gather, .. } => "avx512-gather-table",
            Q8Kernel::Avx512 => "avx512-gather",
            Q8Kernel::Avx2 { loads: true } => "avx2-loads",
            Q8Kernel::Avx2 { loads: false } => "avx2-gather",
            Q8Kernel::Scalar => "scalar",
        }
    }

    /// Whether it has a streaming form for `COPY_STREAM` (`vbmi_kernel`: the rounding forms);
    /// the others take that mode as `COPY_HW`.
    pub(crate) fn streams_copy(self) -> bool {
        matches!(self, Q8Kernel::Vbmi { quant: QUANT_ROUNDED, .. })
    }
}

/// Splits an optional bf16 copy like its parameters (`size` elements per task); without a copy,
/// every task gets an empty slice.
fn copy_chunks(cp: Option<&mut [bf16]>, size: usize) -> impl Iterator<Item = &mut [bf16]> + Send {
    cp.into_iter().flat_map(move |c| c.chunks_mut(size)).chain(std::iter::repeat_with(<&mut [bf16]>::default))
}

// ------------------------------------------------------------------------------------------------
// fp32 AdamW: torch.optim.AdamW's single-tensor path, operation for operation:
//   param.mul_(1 - lr*wd); exp_avg.lerp_(grad, 1 - beta1);
//   exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2);
//   denom = (exp_avg_sq.sqrt() / sqrt(bias_correction2)).add_(eps);
//   param.addcdiv_(exp_avg, denom, value=-lr / bias_correction1)
// ------------------------------------------------------------------------------------------------

#[inline(always)]
fn fp32_elem<G: GradElem, const SMALL: bool>(p: &mut f32, g: G, m: &mut f32, v: &mut f32, c: &Coeffs) {
    let g = g.to_f32() * c.scale;
    let pd = *p * c.decay;
    // torch's scalar-weight lerp: `self + w * (end - self)` for |w| < 0.5, else
    // `end - (end - self) * (1 - w)`.
    let m1 = if SMALL { *m + c.lerp_w * (g - *m) } else { g - (g - *m) * c.lerp_1mw };
    let v1 = *v * c.beta2 + c.omb2 * g * g;
    let denom = v1.sqrt() / c.bc2_sqrt + c.eps;
    *p = pd + c.neg_step * m1 / denom;
    *m = m1;
    *v = v1;
}

/// The fp32 update of a chunk; with `COPY`, also `cp[i] = bf16(p[i])` in the same pass (branch-free
/// rounding, so the loop still vectorizes).
#[inline(always)]
fn fp32_body<G: GradElem, const SMALL: bool, const COPY: bool>(
    p: &mut [f32],
    g: &[G],
    m: &mut [f32],
    v: &mut [f32],
    cp: &mut [bf16],
    c: &Coeffs,
) {
    if COPY {
        let it = p.iter_mut().zip(g).zip(m.iter_mut()).zip(v.iter_mut()).zip(cp.iter_mut());
        for ((((p, g), m), v), cp) in it {
            fp32_elem::<G, SMALL>(p, *g, m, v, c);
            *cp = bf16_rne(*p);
        }
    } else {
        for (((p, g), m), v) in p.iter_mut().zip(g).zip(m.iter_mut()).zip(v.iter_mut()) {
            fp32_elem::<G, SMALL>(p, *g, m, v, c);
        }
    }
}

/// `cp` is either empty (no copy) or as long as `p`.
#[inline(always)]
fn fp32_generic<G: GradElem>(p: &mut [f32], g: &[G], m: &mut [f32], v: &mut [f32], cp: &mut [bf16], c: &Coeffs) {
    match (c.lerp_small, cp.is_empty()) {
        (true, true) => fp32_body::<G, true, false>(p, g, m, v, cp, c),
        (true, false) => fp32_body::<G, true, true>(p, g, m, v, cp, c),
        (false, true) => fp32_body::<G, false, false>(p, g, m, v, cp, c),
        (false, false) => fp32_body::<G, false, true>(p, g, m, v, cp, c),
    }
}

/// One chunk of the fp32 update; `cp` is empty (no copy) or as long as `p`.
pub(crate) fn fp32_chunk<G: GradElem>(
    p: &mut [f32],
    g: &[G],
    m: &mut [f32],
    v: &mut [f32],
    cp: &mut [bf16],
    c: &Coeffs,
    level: SimdLevel,
) {
    match level {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: callers pass `simd_level()`, which reports AVX-512F only when the CPU has it.
        SimdLevel::Avx512 => unsafe { x86::fp32_avx512(p, g, m, v, cp, c) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above, for AVX2 + FMA.
        SimdLevel::Avx2 => unsafe { x86::fp32_avx2(p, g, m, v, cp, c) },
        _ => fp32_generic(p, g, m, v, cp, c),
    }
}

/// Updates one tensor with fp32 state, and writes its bf16 copy when `cp` is given. Lengths must be
/// equal (checked by the caller).
pub(crate) fn update_fp32(
    p: &mut [f32],
    g: Grad<'_>,
    m: &mut [f32],
    v: &mut [f32],
    cp: Option<&mut [bf16]>,
    c: &Coeffs,
    pool: &ThreadPool,
) {
    let level = simd_level();
    let n = p.len();
    let tasks =
        p.chunks_mut(TASK).zip(m.chunks_mut(TASK)).zip(v.chunks_mut(TASK)).zip(copy_chunks(cp, TASK)).enumerate();
    type Task<'t> = (usize, (((&'t mut [f32], &'t mut [f32]), &'t mut [f32]), &'t mut [bf16]));
    let work = |(i, (((p, m), v), cp)): Task<'_>| match g.slice(i * TASK, p.len()) {
        Grad::F32(g) => fp32_chunk(p, g, m, v, cp, c, level),
        Grad::Bf16(g) => fp32_chunk(p, g, m, v, cp, c, level),
    };
    if n < PAR_MIN || pool.threads() == 1 {
        tasks.for_each(work);
    } else {
        run_tasks(pool, tasks, work);
    }
}

// ------------------------------------------------------------------------------------------------
// 8-bit AdamW: bitsandbytes' CPU `optimizer_update_8bit_blockwise` ("adam"), per block:
//   m = dequant(qm) * beta1 + g * (1 - beta1);  v = dequant(qv) * beta2 + (1 - beta2) * g * g
//   denom = sqrt(v) / sqrt(bc2) + eps;  p = p * (1 - lr*wd) + (-lr / bc1) * m / denom
//   absmax = max|m| (resp. |v|) over the block *after* the update; q = nearest code of x / absmax
// ------------------------------------------------------------------------------------------------

/// One 8-bit block, plain Rust: the reference for the SIMD kernel (see the module docs).
/// `tm`/`tv` are scratch of at least the block's length. `cp` is empty (no copy) or as long as `p`:
/// then it receives `half::bf16::from_f32` of every updated parameter.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn q8_block_scalar<G: GradElem>(
    p: &mut [f32],
    cp: &mut [bf16],
    g: &[G],
    qm: &mut [u8],
    qv: &mut [u8],
    am: &mut f32,
    av: &mut f32,
    c: &Coeffs,
    maps: QuantMaps,
    tm: &mut [f32],
    tv: &mut [f32],
) {
    let (sm, um) = (maps.signed, maps.unsigned);
    let (scode, ucode) = (sm.code(), um.code());
    let (am_b1, av_b2) = (*am * c.beta1, *av * c.beta2);
    let n = p.len();
    let (tm, tv) = (&mut tm[..n], &mut tv[..n]);
    for i in 0..n {
        let g = g[i].to_f32();
        let m1 = scode[qm[i] as usize].mul_add(am_b1, g * c.gm);
        let v1 = ucode[qv[i] as usize].mul_add(av_b2, g * c.gv * g);
        let denom = v1.sqrt().mul_add(c.inv_bc2, c.eps);
        p[i] = p[i].mul_add(c.decay, m1 * c.neg_step / denom);
        tm[i] = m1;
        tv[i] = v1;
    }
    for (d, &x) in cp.iter_mut().zip(p.iter()) {
        *d = bf16::from_f32(x);
    }
    *am = block_absmax(tm);
    *av = block_absmax(tv);
    sm.quantize_block_with(tm, *am, qm);
    um.quantize_block_with(tv, *av, qv);
}

/// Blocks `done..` of a run with the scalar reference (`p.len()` need not be a whole block); `cp`
/// is empty (no copy) or as long as `p`.
#[inline(always)]
fn q8_scalar_blocks<G: GradElem>(
    p: &mut [f32],
    cp: &mut [bf16],
    g: &[G],
    s: &mut Q8Slices<'_>,
    c: &Coeffs,
    done: usize,
) {
    let b = s.block;
    if done >= s.am.len() {
        // Nothing left (the SIMD kernels call this for a short last block): skip zeroing the
        // scratch, 32 KiB per call (no change measurable beyond the noise at 64M parameters).
        return;
    }
    let mut tm = [0f32; MAX_BLOCK];
    let mut tv = [0f32; MAX_BLOCK];
    for k in done..s.am.len() {
        let lo = k * b;
        let hi = (lo + b).min(p.len());
        let cpb = if cp.is_empty() { &mut [][..] } else { &mut cp[lo..hi] };
        q8_block_scalar(
            &mut p[lo..hi],
            cpb,
            &g[lo..hi],
            &mut s.qm[lo..hi],
            &mut s.qv[lo..hi],
            &mut s.am[k],
            &mut s.av[k],
            c,
            s.maps,
            &mut tm,
            &mut tv,
        );
    }
}

/// The 8-bit state of one tensor, borrowed.
pub(crate) struct Q8Slices<'a> {
    pub qm: &'a mut [u8],
    pub qv: &'a mut [u8],
    pub am: &'a mut [f32],
    pub av: &'a mut [f32],
    pub block: usize,
    pub maps: QuantMaps,
}

/// Updates a run of consecutive blocks (the last may be short) on the calling thread; `cp` is
/// empty (no copy) or as long as `p`.
fn q8_run<G: GradElem>(p: &mut [f32], cp: &mut [bf16], g: &[G], mut s: Q8Slices<'_>, c: &Coeffs, path: KernelPath) {
    let copy = copy_mode(path, cp);
    match path.level {
        #[cfg(target_arch = "x86_64")]
        SimdLevel::Avx512 => {
            let b = s.block;
            let full = p.len() / b;
            let n = full * b;
            let kernel: Kernel<G> = match (Q8Kernel::select(path, s.maps, b), copy) {
                (Q8Kernel::Vbmi { dequant: Q8Dequant::Permute, quant }, _) => {
                    vbmi_kernel::<G, DEQ_PERMUTE>(quant, copy)
                }
                (Q8Kernel::Vbmi { dequant: Q8Dequant::Gather, quant }, _) => vbmi_kernel::<G, DEQ_GATHER>(quant, copy),
                (_, NO_COPY) => x86::q8_blocks_avx512::<G, NO_COPY>,
                (_, COPY_INT) => x86::q8_blocks_avx512::<G, COPY_INT>,
                (_, _) => x86::q8_blocks_avx512::<G, COPY_HW>,
            };
            let cpn = if cp.is_empty() { &mut [][..] } else { &mut cp[..n] };
            // SAFETY: AVX-512F/DQ/BW are present (`path.level` comes from `simd_level`), and VBMI
            // for the permute kernel and AVX512-BF16 for COPY_HW (`KernelPath::detect`); every
            // slice covers `full` whole blocks of `b` elements (the copy too, when there is one),
            // `b` is a multiple of 16 (of 64 for the permute kernel) and at most MAX_BLOCK
            // (validated by `Quant8Config::validate` before any state exists).
            unsafe {
                kernel(
                    &mut p[..n],
                    cpn,
                    &g[..n],
                    &mut s.qm[..n],
                    &mut s.qv[..n],
                    &mut s.am[..full],
                    &mut s.av[..full],
                    b,
                    c,
                    s.maps,
                );
                // The short last block, if any; the scalar body compiled with FMA.
                x86::q8_scalar_avx512(p, cp, g, &mut s, c, full);
            }
        }
        #[cfg(target_arch = "x86_64")]
        SimdLevel::Avx2 => {
            let b = s.block;
            let full = p.len() / b;
            let n = full * b;
            let kernel = match (path.loads, copy == NO_COPY) {
                (false, true) => x86::q8_blocks_avx2::<G, false, false>,
                (false, false) => x86::q8_blocks_avx2::<G, true, false>,
                (true, true) => x86::q8_blocks_avx2::<G, false, true>,
                (true, false) => x86::q8_blocks_avx2::<G, true, true>,
            };
            let cpn = if cp.is_empty() { &mut [][..] } else { &mut cp[..n] };
            // SAFETY: `simd_level` reports AVX2 only when the CPU has AVX2 and FMA; the slices
            // (the copy too, when there is one) cover `full` whole blocks of `b` elements, `b` a
            // multiple of 16 and at most MAX_BLOCK (validated by `Quant8Config::validate` before
            // any state exists).
            unsafe {
                kernel(
                    &mut p[..n],
                    cpn,
                    &g[..n],
                    &mut s.qm[..n],
                    &mut s.qv[..n],
                    &mut s.am[..full],
                    &mut s.av[..full],
                    b,
                    c,
                    s.maps,
                );
                // The short last block, if any.
                x86::q8_scalar_avx2(p, cp, g, &mut s, c, full);
            }
        }
        _ => q8_scalar_blocks(p, cp, g, &mut s, c, 0),
    }
}

/// An AVX-512 8-bit kernel's signature (`x86::q8_blocks_avx512` and its VBMI form).
#[cfg(target_arch = "x86_64")]
type Kernel<G> =
    unsafe fn(&mut [f32], &mut [bf16], &[G], &mut [u8], &mut [u8], &mut [f32], &mut [f32], usize, &Coeffs, QuantMaps);

/// The VBMI kernel with dequantization `DEQ` for a code finder and a copy mode.
#[cfg(target_arch = "x86_64")]
fn vbmi_kernel<G: GradElem, const DEQ: u8>(quant: u8, copy: u8) -> Kernel<G> {
    match (quant, copy) {
        (QUANT_TABLE, NO_COPY) => x86::q8_blocks_avx512_vbmi::<G, NO_COPY, QUANT_TABLE, DEQ>,
        (QUANT_TABLE, COPY_INT) => x86::q8_blocks_avx512_vbmi::<G, COPY_INT, QUANT_TABLE, DEQ>,
        (QUANT_TABLE, _) => x86::q8_blocks_avx512_vbmi::<G, COPY_HW, QUANT_TABLE, DEQ>,
        (QUANT_AFFINE, NO_COPY) => x86::q8_blocks_avx512_vbmi::<G, NO_COPY, QUANT_AFFINE, DEQ>,
        (QUANT_AFFINE, COPY_INT) => x86::q8_blocks_avx512_vbmi::<G, COPY_INT, QUANT_AFFINE, DEQ>,
        (QUANT_AFFINE, _) => x86::q8_blocks_avx512_vbmi::<G, COPY_HW, QUANT_AFFINE, DEQ>,
        (_, NO_COPY) => x86::q8_blocks_avx512_vbmi::<G, NO_COPY, QUANT_ROUNDED, DEQ>,
        (_, COPY_INT) => x86::q8_blocks_avx512_vbmi::<G, COPY_INT, QUANT_ROUNDED, DEQ>,
        (_, COPY_STREAM) => x86::q8_blocks_avx512_vbmi::<G, COPY_STREAM, QUANT_ROUNDED, DEQ>,
        (_, _) => x86::q8_blocks_avx512_vbmi::<G, COPY_HW, QUANT_ROUNDED, DEQ>,
    }
}

/// Updates one tensor with 8-bit state, and writes its bf16 copy when `cp` is given. Lengths must
/// be consistent (checked by the caller).
pub(crate) fn update_q8(
    p: &mut [f32],
    g: Grad<'_>,
    s: Q8Slices<'_>,
    cp: Option<&mut [bf16]>,
    c: &Coeffs,
    pool: &ThreadPool,
    path: KernelPath,
) {
    let (b, maps) = (s.block, s.maps);
    let whole = Q8Task { p, cp: cp.unwrap_or_default(), g, qm: s.qm, qv: s.qv, am: s.am, av: s.av };
    q8_tasks(whole, b, pool, |t| {
        let s = Q8Slices { qm: t.qm, qv: t.qv, am: t.am, av: t.av, block: b, maps };
        match t.g {
            Grad::F32(g) => q8_run(t.p, t.cp, g, s, c, path),
            Grad::Bf16(g) => q8_run(t.p, t.cp, g, s, c, path),
        }
    });
}

/// A block-wise 8-bit update's operands, for a whole tensor or one task's share of it: parameters,
/// their bf16 copy (empty: none), gradients, both moments' codes and per-block scales.
pub(crate) struct Q8Task<'a> {
    pub p: &'a mut [f32],
    pub cp: &'a mut [bf16],
    pub g: Grad<'a>,
    pub qm: &'a mut [u8],
    pub qv: &'a mut [u8],
    pub am: &'a mut [f32],
    pub av: &'a mut [f32],
}

/// Splits `t` into tasks of whole blocks of `block` elements (about `TASK` elements each, the last
/// block perhaps short) and runs `work` on each: on the pool's threads for large tensors, else
/// here. Both 8-bit code formats share it (`update_q8`, `crate::f8::update_f8`).
pub(crate) fn q8_tasks(t: Q8Task<'_>, block: usize, pool: &ThreadPool, work: impl Fn(Q8Task<'_>) + Sync) {
    let bpt = (TASK / block).max(1);
    let te = bpt * block;
    let (n, g) = (t.p.len(), t.g);
    let cp = (!t.cp.is_empty()).then_some(t.cp);
    let tasks =
        t.p.chunks_mut(te)
            .zip(copy_chunks(cp, te))
            .zip(t.qm.chunks_mut(te))
            .zip(t.qv.chunks_mut(te))
            .zip(t.am.chunks_mut(bpt))
            .zip(t.av.chunks_mut(bpt))
            .enumerate()
            .map(|(i, (((((p, cp), qm), qv), am), av))| Q8Task { g: g.slice(i * te, p.len()), p, cp, qm, qv, am, av });
    if n < PAR_MIN || pool.threads() == 1 {
        tasks.for_each(work);
    } else {
        run_tasks(pool, tasks, work);
    }
}

/// `half::bf16::from_f32` of `src` into `dst` (equal lengths) on the calling thread, with the
/// SIMD conversion of `path`.
pub(crate) fn bf16_chunk(src: &[f32], dst: &mut [bf16], path: KernelPath) {
    match path.level {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: AVX-512F/DQ are present (`simd_level`), and AVX512-BF16 when `bf16_hw` is set
        // (`KernelPath::detect`).
        SimdLevel::Avx512 => unsafe {
            if path.bf16_hw { x86::bf16_avx512::<COPY_HW>(src, dst) } else { x86::bf16_avx512::<COPY_INT>(src, dst) }
        },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `simd_level` reports AVX2 only when the CPU has it.
        SimdLevel::Avx2 => unsafe { x86::bf16_avx2(src, dst) },
        _ => {
            for (d, &x) in dst.iter_mut().zip(src) {
                *d = bf16_rne(x);
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod x86 {
    use std::arch::x86_64::*;
    use std::mem::MaybeUninit;

    use half::bf16;

    use super::{
        COPY_HW, COPY_STREAM, Coeffs, DEQ_PERMUTE, NO_COPY, Q8Slices, QUANT_ROUNDED, QUANT_TABLE, fp32_generic,
        q8_scalar_blocks,
    };
    use crate::affine::{AFFINE_LO_BITS, AffineCodes, Rounded};
    use crate::config::MAX_BLOCK;
    use crate::copy::bf16_rne;
    use crate::grad::GradElem;
    use crate::qmap::{LutParams, QuantMap, QuantMaps};

    /// One block's updated moments for the SIMD kernels, `m` in the first `MAX_BLOCK` floats
    /// (the VBMI kernel: the first `block`) and `v` after them, 64-byte aligned. Every vector of it
    /// is stored by the update and read back by the re-quantization, and on the plain stack array
    /// it replaces (8 bytes past a 64-byte boundary) every 64-byte access straddled two cache
    /// lines: aligned, the VBMI kernel took 36.1 against 36.8-37.4 ms per step at 64M parameters,
    /// 2 threads, same bits (session 19, `docs/benchmarks.md`).
    #[repr(C, align(64))]
    pub(crate) struct Scratch<T>(pub(crate) [T; 2 * MAX_BLOCK]);

    /// # Safety
    /// The CPU must support AVX-512F.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn fp32_avx512<G: GradElem>(
        p: &mut [f32],
        g: &[G],
        m: &mut [f32],
        v: &mut [f32],
        cp: &mut [bf16],
        c: &Coeffs,
    ) {
        fp32_generic(p, g, m, v, cp, c)
    }

    /// # Safety
    /// The CPU must support AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn fp32_avx2<G: GradElem>(
        p: &mut [f32],
        g: &[G],
        m: &mut [f32],
        v: &mut [f32],
        cp: &mut [bf16],
        c: &Coeffs,
    ) {
        fp32_generic(p, g, m, v, cp, c)
    }

    /// The scalar 8-bit body compiled with FMA (for the short last block of a run).
    ///
    /// # Safety
    /// The CPU must support AVX-512F.
    #[target_feature(enable = "avx512f,fma")]
    pub(super) unsafe fn q8_scalar_avx512<G: GradElem>(
        p: &mut [f32],
        cp: &mut [bf16],
        g: &[G],
        s: &mut Q8Slices<'_>,
        c: &Coeffs,
        done: usize,
    ) {
        q8_scalar_blocks(p, cp, g, s, c, done)
    }

    /// The scalar 8-bit body compiled with FMA (so `mul_add` is one instruction).
    ///
    /// # Safety
    /// The CPU must support AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn q8_scalar_avx2<G: GradElem>(
        p: &mut [f32],
        cp: &mut [bf16],
        g: &[G],
        s: &mut Q8Slices<'_>,
        c: &Coeffs,
        done: usize,
    ) {
        q8_scalar_blocks(p, cp, g, s, c, done)
    }

    /// The bf16 bits of 16 lanes, exactly `half::bf16::from_f32` (see `crate::copy::bf16_rne`):
    /// round to nearest even by adding `0x7fff` plus the kept half's lowest bit, and a NaN keeps its
    /// top half with the quiet bit set.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn bf16x16_int(x: __m512) -> __m256i {
        let b = _mm512_castps_si512(x);
        let top = _mm512_srli_epi32::<16>(b);
        let lsb = _mm512_and_si512(top, _mm512_set1_epi32(1));
        let rounded = _mm512_srli_epi32::<16>(_mm512_add_epi32(_mm512_add_epi32(b, _mm512_set1_epi32(0x7fff)), lsb));
        let nan = _mm512_cmpgt_epu32_mask(
            _mm512_and_si512(b, _mm512_set1_epi32(0x7fff_ffff)),
            _mm512_set1_epi32(0x7f80_0000),
        );
        _mm512_cvtepi32_epi16(_mm512_mask_or_epi32(rounded, nan, top, _mm512_set1_epi32(0x40)))
    }

    /// Stores the bf16 copy of 16 lanes at `dst`: with `vcvtneps2bf16` for `MODE == COPY_HW`
    /// (bit-identical to `half` for normal numbers, zeros, infinities and NaN; it reads subnormal
    /// inputs as zero, so a group of 16 holding one takes the integer rounding), else `bf16x16_int`.
    ///
    /// # Safety
    /// `dst` must be valid for writing 16 elements; for `COPY_HW` the CPU must have AVX512-BF16.
    #[inline]
    #[target_feature(enable = "avx512f,avx512dq")]
    pub(crate) unsafe fn store_bf16x16<const MODE: u8>(dst: *mut bf16, x: __m512) {
        let bits = if MODE == COPY_HW && _mm512_fpclass_ps_mask::<0x20>(x) == 0 {
            let r: __m256i;
            // SAFETY: the caller guarantees AVX512-BF16 for COPY_HW; the instruction only reads and
            // writes registers.
            unsafe {
                std::arch::asm!("vcvtneps2bf16 {r}, {x}", x = in(zmm_reg) x, r = out(ymm_reg) r, options(pure, nomem, nostack))
            };
            r
        } else {
            bf16x16_int(x)
        };
        // SAFETY: the caller guarantees 16 writable elements (32 bytes; bf16 is a transparent u16).
        unsafe { _mm256_storeu_si256(dst as *mut __m256i, bits) }
    }

    /// Stores the bf16 copy of 32 lanes (`lo`, then `hi`) at `dst`, the bits two `store_bf16x16`
    /// would store (`bf16x32`).
    ///
    /// # Safety
    /// `dst` must be valid for writing 32 elements; for `COPY_HW` the CPU must have AVX512-BF16.
    #[inline]
    #[target_feature(enable = "avx512f,avx512dq")]
    pub(crate) unsafe fn store_bf16x32<const MODE: u8>(dst: *mut bf16, lo: __m512, hi: __m512) {
        // SAFETY: the caller guarantees AVX512-BF16 for COPY_HW and 32 writable elements (64 bytes).
        unsafe { _mm512_storeu_si512(dst as *mut __m512i, bf16x32::<MODE>(lo, hi)) }
    }

    /// Stores the bf16 copy of 32 lanes (`lo`, then `hi`) at `dst` with one streaming
    /// (non-temporal) store: `store_bf16x32::<COPY_HW>`'s bits, without reading the line first.
    /// The kernel that uses it ends with `_mm_sfence`, so that the stores are visible before the
    /// update returns to its caller (who hands the copy to other threads).
    ///
    /// # Safety
    /// `dst` must be 64-byte aligned and valid for writing 32 elements; the CPU must have
    /// AVX512-BF16.
    #[inline]
    #[target_feature(enable = "avx512f,avx512dq")]
    pub(crate) unsafe fn stream_bf16x32(dst: *mut bf16, lo: __m512, hi: __m512) {
        // SAFETY: the caller's.
        unsafe { _mm512_stream_si512(dst as *mut __m512i, bf16x32::<COPY_HW>(lo, hi)) }
    }

    /// The bf16 bits of 32 lanes, `lo` in the lower half: one `vcvtne2ps2bf16` for `MODE ==
    /// COPY_HW` (32 lanes for the cost of the 16-lane form on AMD Zen 4) unless a lane is
    /// subnormal, else `bf16x16_int` per half (the same bits as `half`, for every input).
    ///
    /// # Safety
    /// For `COPY_HW` the CPU must have AVX512-BF16.
    #[inline]
    #[target_feature(enable = "avx512f,avx512dq")]
    unsafe fn bf16x32<const MODE: u8>(lo: __m512, hi: __m512) -> __m512i {
        if MODE == COPY_HW && _mm512_fpclass_ps_mask::<0x20>(lo) | _mm512_fpclass_ps_mask::<0x20>(hi) == 0 {
            let r: __m512i;
            // SAFETY: the caller guarantees AVX512-BF16; the instruction only reads and writes
            // registers. The first source fills the upper half.
            unsafe {
                std::arch::asm!("vcvtne2ps2bf16 {r}, {hi}, {lo}", hi = in(zmm_reg) hi, lo = in(zmm_reg) lo, r = out(zmm_reg) r, options(pure, nomem, nostack))
            };
            r
        } else {
            _mm512_inserti64x4::<1>(_mm512_castsi256_si512(bf16x16_int(lo)), bf16x16_int(hi))
        }
    }

    /// Stores the bf16 copy of 8 lanes at `dst` (AVX2; the rounding of `bf16x16_int`).
    ///
    /// # Safety
    /// `dst` must be valid for writing 8 elements, and the CPU must support AVX2.
    #[inline]
    #[target_feature(enable = "avx2")]
    pub(crate) unsafe fn store_bf16x8(dst: *mut bf16, x: __m256) {
        let b = _mm256_castps_si256(x);
        let top = _mm256_srli_epi32::<16>(b);
        // Both sides are below 2^31, so the signed compare is the unsigned one.
        let nan =
            _mm256_cmpgt_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x7fff_ffff)), _mm256_set1_epi32(0x7f80_0000));
        let bits = _mm256_blendv_epi8(rne_bits8(b), _mm256_or_si256(top, _mm256_set1_epi32(0x40)), nan);
        // SAFETY: the caller's.
        unsafe { store_words8(dst, bits) }
    }

    /// The bf16 bits of 8 non-NaN f32 lanes (as i32 lanes below 2^16): integer
    /// round-to-nearest-even.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn rne_bits8(b: __m256i) -> __m256i {
        let lsb = _mm256_and_si256(_mm256_srli_epi32::<16>(b), _mm256_set1_epi32(1));
        _mm256_srli_epi32::<16>(_mm256_add_epi32(_mm256_add_epi32(b, _mm256_set1_epi32(0x7fff)), lsb))
    }

    /// Stores 8 i32 lanes below 2^16 as 8 u16.
    ///
    /// # Safety
    /// `dst` must be valid for writing 8 elements.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn store_words8(dst: *mut bf16, bits: __m256i) {
        // Every lane is below 2^16, so the saturating pack is exact: words 0-3 of each 128-bit lane
        // are its four results; quadwords 0 and 2 hold all eight in order.
        let w = _mm256_permute4x64_epi64::<0b1000>(_mm256_packus_epi32(bits, bits));
        // SAFETY: the caller guarantees 8 writable elements (16 bytes).
        unsafe { _mm_storeu_si128(dst as *mut __m128i, _mm256_castsi256_si128(w)) }
    }

    /// `dst[i] = bf16(src[i])` (equal lengths) with `store_bf16x16`.
    ///
    /// # Safety
    /// AVX-512F and DQ must be available, and AVX512-BF16 for `COPY_HW`.
    #[target_feature(enable = "avx512f,avx512dq")]
    pub(super) unsafe fn bf16_avx512<const MODE: u8>(src: &[f32], dst: &mut [bf16]) {
        let n = src.len().min(dst.len());
        let mut i = 0;
        while i + 16 <= n {
            // SAFETY: i + 16 <= n, within both slices; the caller guarantees the CPU features.
            unsafe { store_bf16x16::<MODE>(dst.as_mut_ptr().add(i), _mm512_loadu_ps(src.as_ptr().add(i))) };
            i += 16;
        }
        for (d, &x) in dst[i..n].iter_mut().zip(&src[i..n]) {
            *d = bf16_rne(x);
        }
    }

    /// `dst[i] = bf16(src[i])` (equal lengths) with `store_bf16x8`.
    ///
    /// # Safety
    /// The CPU must support AVX2.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn bf16_avx2(src: &[f32], dst: &mut [bf16]) {
        let n = src.len().min(dst.len());
        let mut i = 0;
        while i + 8 <= n {
            // SAFETY: i + 8 <= n, within both slices; AVX2 is guaranteed by the caller.
            unsafe { store_bf16x8(dst.as_mut_ptr().add(i), _mm256_loadu_ps(src.as_ptr().add(i))) };
            i += 8;
        }
        for (d, &x) in dst[i..n].iter_mut().zip(&src[i..n]) {
            *d = bf16_rne(x);
        }
    }

    /// Codes (low byte of each i32 lane) of 16 normalised values in [-1, 1]; the lane-parallel form
    /// of `QuantMap::quantize` for tables in the unit-step format (`QuantMap::lut_params`).
    /// `SIGNED = false` assumes the sign bits are clear (the second moment is never negative).
    /// `SH` and `UP` are the table's bucket shift and `32 - shift` when known at compile time (the
    /// default maps, see `quantize_pair`), which saves the second uop of each shift by a register
    /// count; `SH = 0` reads both from `t`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512dq")]
    fn lookup<const SIGNED: bool, const SH: u32, const UP: u32>(q: __m512, t: &LutKernel) -> __m512i {
        // |q| clamped to [lo, 1.0]: `vrangeps` (max of magnitudes, sign cleared) does the absolute
        // value and the lower clamp in one instruction; the integer `min` bounds the index even for
        // a NaN lane (whose bits exceed 1.0's), which the callers never pass.
        let key = _mm512_min_epu32(_mm512_castps_si512(_mm512_range_ps::<0b1011>(q, t.lo)), t.one);
        let mut bucket = if SH == 0 { _mm512_srl_epi32(key, t.shift) } else { _mm512_srli_epi32::<SH>(key) };
        let neg = if SIGNED { _mm512_movepi32_mask(_mm512_castps_si512(q)) } else { 0 };
        if SIGNED {
            bucket = _mm512_mask_add_epi32(bucket, neg, bucket, t.buckets);
        }
        // SAFETY: `key` is in [lo, 1.0], so `bucket - lo_key` < buckets (+ buckets on the negative
        // side) <= lut.len(), and `t.base` points `lo_key` entries before the table (`LutKernel`).
        let e = unsafe { _mm512_i32gather_epi32::<4>(bucket, t.base) };
        let off = if SH == 0 { _mm512_sll_epi32(key, t.up) } else { _mm512_slli_epi32::<UP>(key) };
        let hit = _mm512_cmpgt_epu32_mask(off, e);
        let dir = if SIGNED { _mm512_mask_blend_epi32(neg, t.plus1, t.minus1) } else { t.plus1 };
        _mm512_mask_add_epi32(e, hit, e, dir)
    }

    /// `LutParams` in registers, with the table pointer pre-offset by `-lo_key` entries.
    #[derive(Clone, Copy)]
    struct LutKernel {
        base: *const i32,
        lo: __m512,
        one: __m512i,
        shift: __m128i,
        up: __m128i,
        buckets: __m512i,
        plus1: __m512i,
        minus1: __m512i,
    }

    impl LutKernel {
        #[inline]
        #[target_feature(enable = "avx512f")]
        fn new(t: &LutParams<'_>) -> LutKernel {
            LutKernel {
                // Only ever offset back by `>= lo_key` entries in `lookup` (a wrapping offset keeps
                // this pointer's provenance; every address read is inside the table).
                base: (t.lut.as_ptr() as *const i32).wrapping_sub(t.lo_key as usize),
                lo: _mm512_set1_ps(f32::from_bits(t.lo)),
                one: _mm512_set1_epi32(0x3f80_0000),
                shift: _mm_cvtsi32_si128(t.shift as i32),
                up: _mm_cvtsi32_si128(32 - t.shift as i32),
                buckets: _mm512_set1_epi32(t.buckets as i32),
                plus1: _mm512_set1_epi32(1),
                minus1: _mm512_set1_epi32(-1),
            }
        }
    }

    /// Quantizes one block of scratch values `x[..n]` against `absmax` into `out[..n]`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512dq")]
    fn quantize_block<const SIGNED: bool>(x: &[f32], absmax: f32, out: &mut [u8], map: &QuantMap) {
        let n = out.len();
        // Outside the fast range (an all-zero block, absurdly small or overflowed state) take the
        // scalar path, which also reproduces 0/0 -> code 0. See `fast_absmax`.
        let fast = fast_absmax(absmax);
        let Some(t) = map.lut_params().filter(|_| fast) else {
            map.quantize_block_with(&x[..n], absmax, out);
            return;
        };
        let t = LutKernel::new(&t);
        let r = _mm512_set1_ps(1.0 / absmax);
        let mut j = 0;
        while j + 16 <= n {
            // SAFETY: j + 16 <= n <= x.len(), and 16 bytes fit in out[j..].
            unsafe {
                let q = _mm512_mul_ps(_mm512_loadu_ps(x.as_ptr().add(j)), r);
                let idx = lookup::<SIGNED, 0, 0>(q, &t);
                _mm_storeu_si128(out.as_mut_ptr().add(j) as *mut __m128i, _mm512_cvtepi32_epi8(idx));
            }
            j += 16;
        }
    }

    /// `quantize_block` for the first and the second moment of one block in a single loop (two
    /// independent gathers in flight per iteration), falling back to the separate calls when either
    /// absmax is outside the fast range or a map lacks the SIMD table.
    #[inline]
    #[target_feature(enable = "avx512f,avx512dq,avx512bw")]
    #[allow(clippy::too_many_arguments)]
    fn quantize_pair(
        xm: &[f32],
        am: f32,
        qm: &mut [u8],
        sm: &QuantMap,
        xv: &[f32],
        av: f32,
        qv: &mut [u8],
        um: &QuantMap,
    ) {
        let (Some(ts), Some(tu)) = (sm.lut_params(), um.lut_params()) else {
            quantize_block::<true>(xm, am, qm, sm);
            quantize_block::<false>(xv, av, qv, um);
            return;
        };
        let n = qm.len();
        if !(fast_absmax(am) && fast_absmax(av)) || xm.len() < n || xv.len() < n || qv.len() != n {
            quantize_block::<true>(xm, am, qm, sm);
            quantize_block::<false>(xv, av, qv, um);
            return;
        }
        let (sh_m, sh_v) = (ts.shift, tu.shift);
        let (ts, tu) = (LutKernel::new(&ts), LutKernel::new(&tu));
        let (r_m, r_v) = (_mm512_set1_ps(1.0 / am), _mm512_set1_ps(1.0 / av));
        if (sh_m, sh_v) == (17, 16) {
            quantize_pair_loop::<17, 15, 16, 16>(xm, qm, &ts, r_m, xv, qv, &tu, r_v);
        } else {
            quantize_pair_loop::<0, 0, 0, 0>(xm, qm, &ts, r_m, xv, qv, &tu, r_v);
        }
    }

    /// The loop of `quantize_pair` (lengths checked there), with the bucket shifts of both tables
    /// as constants when they are the default maps' (see `lookup`).
    #[inline]
    #[target_feature(enable = "avx512f,avx512dq")]
    #[allow(clippy::too_many_arguments)]
    fn quantize_pair_loop<const SM: u32, const UM: u32, const SV: u32, const UV: u32>(
        xm: &[f32],
        qm: &mut [u8],
        ts: &LutKernel,
        r_m: __m512,
        xv: &[f32],
        qv: &mut [u8],
        tu: &LutKernel,
        r_v: __m512,
    ) {
        let n = qm.len();
        let mut j = 0;
        while j + 16 <= n {
            // SAFETY: j + 16 <= n <= xm.len(), xv.len(); 16 bytes fit in qm[j..] and qv[j..].
            unsafe {
                let im = lookup::<true, SM, UM>(_mm512_mul_ps(_mm512_loadu_ps(xm.as_ptr().add(j)), r_m), ts);
                let iv = lookup::<false, SV, UV>(_mm512_mul_ps(_mm512_loadu_ps(xv.as_ptr().add(j)), r_v), tu);
                _mm_storeu_si128(qm.as_mut_ptr().add(j) as *mut __m128i, _mm512_cvtepi32_epi8(im));
                _mm_storeu_si128(qv.as_mut_ptr().add(j) as *mut __m128i, _mm512_cvtepi32_epi8(iv));
            }
            j += 16;
        }
    }

    /// Updates `am.len()` whole blocks of `block` elements: the AVX-512 form of `q8_block_scalar`
    /// (see the module docs for the arithmetic), dequantizing with gathers. With `COPY != NO_COPY`
    /// it also writes the bf16 copy of every updated parameter into `cp` (`store_bf16x16`).
    ///
    /// # Safety
    /// AVX-512F, DQ and BW must be available, and AVX512-BF16 for `COPY == COPY_HW`. `block` must
    /// be a multiple of 16 and at most `MAX_BLOCK`, and `p`, `g`, `qm`, `qv` (and `cp` unless
    /// `COPY == NO_COPY`) must all have exactly `am.len() * block` elements, `av` as many as `am`.
    #[target_feature(enable = "avx512f,avx512dq,avx512bw")]
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn q8_blocks_avx512<G: GradElem, const COPY: u8>(
        p: &mut [f32],
        cp: &mut [bf16],
        g: &[G],
        qm: &mut [u8],
        qv: &mut [u8],
        am: &mut [f32],
        av: &mut [f32],
        block: usize,
        c: &Coeffs,
        maps: QuantMaps,
    ) {
        let (sm, um) = (maps.signed, maps.unsigned);
        let (scode, ucode) = (sm.code().as_ptr(), um.code().as_ptr());
        let mut scratch = Scratch([0f32; 2 * MAX_BLOCK]);
        let (tm, tv) = scratch.0.split_at_mut(MAX_BLOCK);
        let decay = _mm512_set1_ps(c.decay);
        let gm = _mm512_set1_ps(c.gm);
        let gv = _mm512_set1_ps(c.gv);
        let inv_bc2 = _mm512_set1_ps(c.inv_bc2);
        let eps = _mm512_set1_ps(c.eps);
        let neg_step = _mm512_set1_ps(c.neg_step);
        let mag = _mm512_set1_epi32(0x7fff_ffff);
        for k in 0..am.len() {
            let base = k * block;
            let am_b1 = _mm512_set1_ps(am[k] * c.beta1);
            let av_b2 = _mm512_set1_ps(av[k] * c.beta2);
            let mut maxm = _mm512_setzero_si512();
            let mut maxv = _mm512_setzero_si512();
            let mut j = 0;
            while j < block {
                let o = base + j;
                // SAFETY: o + 16 <= (k + 1) * block <= p.len() = g.len() = qm.len() = qv.len() (=
                // cp.len() with a copy), and j + 16 <= block <= MAX_BLOCK for the scratch arrays;
                // gather indices are u8 < 256, the length of both code tables.
                unsafe {
                    if j % 64 == 0 {
                        prefetch64(o + PREFETCH_AHEAD, p.as_ptr(), g.as_ptr(), qm.as_ptr(), qv.as_ptr());
                        if COPY != NO_COPY {
                            prefetch_copy64(o + PREFETCH_AHEAD, cp.as_ptr());
                        }
                    }
                    let im = _mm512_cvtepu8_epi32(_mm_loadu_si128(qm.as_ptr().add(o) as *const __m128i));
                    let iv = _mm512_cvtepu8_epi32(_mm_loadu_si128(qv.as_ptr().add(o) as *const __m128i));
                    let gr = G::load16(g.as_ptr().add(o));
                    let m1 = _mm512_fmadd_ps(_mm512_i32gather_ps::<4>(im, scode), am_b1, _mm512_mul_ps(gr, gm));
                    let v1 = _mm512_fmadd_ps(
                        _mm512_i32gather_ps::<4>(iv, ucode),
                        av_b2,
                        _mm512_mul_ps(_mm512_mul_ps(gr, gv), gr),
                    );
                    // A true division: the divider has room next to the square root (measured), and
                    // it keeps the parameters bit-identical to the scalar reference.
                    let denom = _mm512_fmadd_ps(_mm512_sqrt_ps(v1), inv_bc2, eps);
                    let pp = p.as_mut_ptr().add(o);
                    let upd = _mm512_div_ps(_mm512_mul_ps(m1, neg_step), denom);
                    let pn = _mm512_fmadd_ps(_mm512_loadu_ps(pp), decay, upd);
                    _mm512_storeu_ps(pp, pn);
                    if COPY != NO_COPY {
                        store_bf16x16::<COPY>(cp.as_mut_ptr().add(o), pn);
                    }
                    _mm512_storeu_ps(tm.as_mut_ptr().add(j), m1);
                    _mm512_storeu_ps(tv.as_mut_ptr().add(j), v1);
                    // Running max of |x| on the magnitude bits: integer order is float order there,
                    // and a NaN sorts above infinity, so it survives to the check after the loop and
                    // sends the block to the scalar path (`vrangeps`/`vmaxps` would drop it).
                    maxm = _mm512_max_epu32(maxm, _mm512_and_si512(_mm512_castps_si512(m1), mag));
                    // v is never negative (all three terms are >= +0), so its bits need no mask: a
                    // set sign bit (a default NaN) also lands above infinity and takes the exact path.
                    maxv = _mm512_max_epu32(maxv, _mm512_castps_si512(v1));
                }
                j += 16;
            }
            let (bm, bv) = (_mm512_reduce_max_epu32(maxm), _mm512_reduce_max_epu32(maxv));
            let nan = bm > 0x7f80_0000 || bv > 0x7f80_0000;
            let (tmb, tvb) = (&tm[..block], &tv[..block]);
            let (a_m, a_v) = if nan {
                (crate::qmap::block_absmax(tmb), crate::qmap::block_absmax(tvb))
            } else {
                (f32::from_bits(bm), f32::from_bits(bv))
            };
            am[k] = a_m;
            av[k] = a_v;
            let (qmb, qvb) = (&mut qm[base..base + block], &mut qv[base..base + block]);
            if nan {
                sm.quantize_block_with(tmb, a_m, qmb);
                um.quantize_block_with(tvb, a_v, qvb);
            } else {
                quantize_pair(tmb, a_m, qmb, sm, tvb, a_v, qvb, um);
            }
        }
    }

    /// Byte order that makes `dequant64`'s unpack sequence come out in element order: a 4x4
    /// transpose of 4-byte groups (`out[16L + 4k + i] = in[16k + 4L + i]`).
    const PREPERM: [u8; 64] = {
        let mut t = [0u8; 64];
        let mut p = 0;
        while p < 64 {
            let (l, k, i) = (p / 16, (p / 4) % 4, p % 4);
            t[p] = (16 * k + 4 * l + i) as u8;
            p += 1;
        }
        t
    };

    /// Dequantization table lookup for 64 codes at once, without gathers: each of the four bytes
    /// of the f32 code values is a 256-entry byte table, looked up with two 128-byte permutes
    /// (`vpermi2b`) selected by the index's top bit, and the four byte planes are interleaved back
    /// into f32 lanes. Returns the 64 map values in element order, 16 per register.
    ///
    /// # Safety
    /// `planes` must point to four readable 256-byte planes.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vbmi")]
    unsafe fn dequant64(codes: __m512i, planes: *const [u8; 256]) -> [__m512; 4] {
        // SAFETY: PREPERM holds 64 bytes.
        let idx = _mm512_permutexvar_epi8(unsafe { _mm512_loadu_si512(PREPERM.as_ptr() as *const __m512i) }, codes);
        let hi = _mm512_movepi8_mask(idx);
        let mut r = [_mm512_setzero_si512(); 4];
        for (b, rb) in r.iter_mut().enumerate() {
            // SAFETY: each of the four planes holds 256 bytes (caller), read as four 64-byte vectors.
            let t =
                |k: usize| unsafe { _mm512_loadu_si512((planes.add(b) as *const u8).add(64 * k) as *const __m512i) };
            let lo_half = _mm512_permutex2var_epi8(t(0), idx, t(1));
            let hi_half = _mm512_permutex2var_epi8(t(2), idx, t(3));
            *rb = _mm512_mask_blend_epi8(hi, lo_half, hi_half);
        }
        let w01l = _mm512_unpacklo_epi8(r[0], r[1]);
        let w01h = _mm512_unpackhi_epi8(r[0], r[1]);
        let w23l = _mm512_unpacklo_epi8(r[2], r[3]);
        let w23h = _mm512_unpackhi_epi8(r[2], r[3]);
        [
            _mm512_castsi512_ps(_mm512_unpacklo_epi16(w01l, w23l)),
            _mm512_castsi512_ps(_mm512_unpackhi_epi16(w01l, w23l)),
            _mm512_castsi512_ps(_mm512_unpacklo_epi16(w01h, w23h)),
            _mm512_castsi512_ps(_mm512_unpackhi_epi16(w01h, w23h)),
        ]
    }

    /// The map values of the 16 codes at `q`: one gather from the 256-entry table `code`.
    ///
    /// # Safety
    /// `q` must be readable for 16 bytes and `code` for 256 floats.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn gather16(q: *const u8, code: *const f32) -> __m512 {
        // SAFETY: 16 readable bytes at `q` (caller); every index is a u8, below 256.
        unsafe { _mm512_i32gather_ps::<4>(_mm512_cvtepu8_epi32(_mm_loadu_si128(q as *const __m128i)), code) }
    }

    /// 64 codes (the low byte of each i32 lane of `c[0..4]`, in order) packed into one vector.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vbmi")]
    fn pack64(c: [__m512i; 4]) -> __m512i {
        pack64_byte::<0>(c)
    }

    /// How far ahead of the update (in elements) `prefetch64` asks for the next data: two blocks of
    /// 256. Measured on the development machine (64M parameters, 2 threads, bf16 gradients): 512
    /// gave +12-18% over no prefetch; 256, 768 and 1024 less; extra L2-only prefetches further
    /// ahead did not help.
    pub(crate) const PREFETCH_AHEAD: usize = 512;

    /// Prefetches (into L1) the 64 parameters, gradients and codes at element `o`: once the
    /// re-quantization work fills the out-of-order window, the hardware prefetchers alone leave
    /// the streams short of requests in flight and the update waits on memory. Prefetching past the
    /// end of the slices is harmless (`prefetcht0` never faults; the addresses are only formed).
    #[inline(always)]
    pub(crate) fn prefetch64<G>(o: usize, p: *const f32, g: *const G, qm: *const u8, qv: *const u8) {
        let line = |a: *const u8| {
            // SAFETY: a prefetch is a hint: it never faults and reads nothing into the program.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(a as *const i8) }
        };
        let (pb, gb) = (p.wrapping_add(o) as *const u8, g.wrapping_add(o) as *const u8);
        for k in (0..64 * 4).step_by(64) {
            line(pb.wrapping_add(k));
        }
        for k in (0..64 * std::mem::size_of::<G>()).step_by(64) {
            line(gb.wrapping_add(k));
        }
        line(qm.wrapping_add(o));
        line(qv.wrapping_add(o));
    }

    /// Prefetches the two lines of the bf16 copy of the 64 parameters at element `o`, for writing
    /// (`prefetchw`): the copy is only ever stored to, so without this every line's
    /// read-for-ownership missed when the store retired and the store buffer filled up.
    #[inline(always)]
    fn prefetch_copy64(o: usize, cp: *const bf16) {
        let b = cp.wrapping_add(o) as *const i8;
        // SAFETY: a prefetch is a hint: it never faults and reads nothing into the program.
        unsafe {
            _mm_prefetch::<_MM_HINT_ET0>(b);
            _mm_prefetch::<_MM_HINT_ET0>(b.wrapping_add(64));
        }
    }

    /// `q8_blocks_avx512` with codes packed by byte permutes, dequantizing by byte-plane permutes
    /// (`dequant64`, `DEQ == DEQ_PERMUTE`) or by gathers (`gather16`, `DEQ == DEQ_GATHER`), and
    /// finding the new codes by `QUANT`: the rounding forms (`rounded_block`), the affine code
    /// finders (`affine64`) or the bucket tables. Per block: one loop updates the moments and the
    /// weights 64 elements at a time (the moments into an L1 scratch), then, once the block's
    /// absmax is known, one loop finds the new codes from the scratch. The arithmetic is exactly
    /// the scalar reference's (`q8_block_scalar`), so codes, absmax and parameters are
    /// bit-identical to it.
    ///
    /// The re-quantization used to be software-pipelined (block `k - 1`'s interleaved with block
    /// `k`'s update, to keep the memory streams busy); with the gathers gone, on Zen 4, the plain
    /// order is faster: 44.5 against 54.8 ms per step at 64M parameters on 2 threads, 0.161 against
    /// 0.177 ms at 128K on 1 (best of interleaved runs, bf16 gradients with the copy): the
    /// pipelined iteration was too long for the out-of-order window to overlap its two halves.
    ///
    /// # Safety
    /// As `q8_blocks_avx512`, plus AVX-512 VBMI, and `block` a multiple of 64; for `COPY_STREAM`,
    /// AVX512-BF16 and `cp` 64-byte aligned.
    #[target_feature(enable = "avx512f,avx512dq,avx512bw,avx512vbmi")]
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn q8_blocks_avx512_vbmi<G: GradElem, const COPY: u8, const QUANT: u8, const DEQ: u8>(
        p: &mut [f32],
        cp: &mut [bf16],
        g: &[G],
        qm: &mut [u8],
        qv: &mut [u8],
        am: &mut [f32],
        av: &mut [f32],
        block: usize,
        c: &Coeffs,
        maps: QuantMaps,
    ) {
        let (sm, um) = (maps.signed, maps.unsigned);
        let (splanes, uplanes) = (sm.planes().as_ptr(), um.planes().as_ptr());
        let (scode, ucode) = (sm.code().as_ptr(), um.code().as_ptr());
        // The codes come from the rounding forms (QUANT_ROUNDED, whole blocks at a time), else
        // from the affine code finders (QUANT_AFFINE, or QUANT_ROUNDED for maps without rounding
        // forms; the caller checked that both maps have the affine form), else from the bucket
        // tables; neither: the scalar rule for every block.
        let rounded = if QUANT == QUANT_ROUNDED {
            sm.affine().zip(um.affine()).and_then(|(s, u)| Rounded64x2::new(s, u))
        } else {
            None
        };
        let quant = match QUANT {
            _ if rounded.is_some() => None,
            QUANT_TABLE => sm
                .lut_params()
                .zip(um.lut_params())
                .map(|(s, u)| Quant64::Table(LutKernel::new(&s), LutKernel::new(&u))),
            _ => sm.affine().zip(um.affine()).map(|(s, u)| Quant64::Affine(Affine64::new(s), Affine64::new(u))),
        };
        // The block's m and v: `block` floats each. Uninitialised: every element is written by the
        // update before it is read.
        let mut scratch = Scratch([MaybeUninit::<f32>::uninit(); 2 * MAX_BLOCK]);
        let tm = scratch.0.as_mut_ptr() as *mut f32;
        let tv = tm.wrapping_add(block);
        let (pp, gp, qmp, qvp) = (p.as_mut_ptr(), g.as_ptr(), qm.as_mut_ptr(), qv.as_mut_ptr());
        let cpp = cp.as_mut_ptr();
        let decay = _mm512_set1_ps(c.decay);
        let gm = _mm512_set1_ps(c.gm);
        let gv = _mm512_set1_ps(c.gv);
        let inv_bc2 = _mm512_set1_ps(c.inv_bc2);
        let eps = _mm512_set1_ps(c.eps);
        let neg_step = _mm512_set1_ps(c.neg_step);
        let mag = _mm512_set1_epi32(0x7fff_ffff);
        for k in 0..am.len() {
            let base = k * block;
            let am_b1 = _mm512_set1_ps(am[k] * c.beta1);
            let av_b2 = _mm512_set1_ps(av[k] * c.beta2);
            let mut maxm = _mm512_setzero_si512();
            let mut maxv = _mm512_setzero_si512();
            for j in (0..block).step_by(64) {
                // SAFETY: base + j + 64 <= (k + 1) * block <= the length of p, g, qm and qv (and of
                // cp with a copy); the scratch has `block` <= MAX_BLOCK floats per moment,
                // j + 64 <= block.
                unsafe {
                    prefetch64(base + j + PREFETCH_AHEAD, pp, gp, qmp, qvp);
                    // A streamed copy is never read, so its lines need no prefetch for writing.
                    if COPY != NO_COPY && COPY != COPY_STREAM {
                        prefetch_copy64(base + j + PREFETCH_AHEAD, cpp);
                    }
                    // With permutes, all 64 old values of each moment at once; with gathers, 16 at
                    // a time in the loop below (its registers are then free for the gathers).
                    let (cm, cv) = if DEQ == DEQ_PERMUTE {
                        // The tables' addresses pass through `black_box` each iteration, so that
                        // LLVM reads the 32 table vectors where the permutes use them (as memory
                        // operands) instead of hoisting them out of this loop: with too few
                        // registers for them and the call to `rounded_block` clobbering all, it
                        // reloaded and spilled them to the stack once per block (2-3% of the step
                        // at 128K parameters on Zen 4, docs/benchmarks.md, session 21).
                        let (sp, up) = std::hint::black_box((splanes, uplanes));
                        (
                            dequant64(_mm512_loadu_si512(qmp.add(base + j) as *const __m512i), sp),
                            dequant64(_mm512_loadu_si512(qvp.add(base + j) as *const __m512i), up),
                        )
                    } else {
                        ([_mm512_setzero_ps(); 4], [_mm512_setzero_ps(); 4])
                    };
                    // The updated weights, for the streamed copy (64 bytes per store).
                    let mut pns = [_mm512_setzero_ps(); 4];
                    for s in 0..4 {
                        let o = base + j + 16 * s;
                        let (cms, cvs) = if DEQ == DEQ_PERMUTE {
                            (cm[s], cv[s])
                        } else {
                            (gather16(qmp.add(o), scode), gather16(qvp.add(o), ucode))
                        };
                        let gr = G::load16(gp.add(o));
                        let m1 = _mm512_fmadd_ps(cms, am_b1, _mm512_mul_ps(gr, gm));
                        let v1 = _mm512_fmadd_ps(cvs, av_b2, _mm512_mul_ps(_mm512_mul_ps(gr, gv), gr));
                        let denom = _mm512_fmadd_ps(_mm512_sqrt_ps(v1), inv_bc2, eps);
                        let upd = _mm512_div_ps(_mm512_mul_ps(m1, neg_step), denom);
                        let pn = _mm512_fmadd_ps(_mm512_loadu_ps(pp.add(o)), decay, upd);
                        _mm512_storeu_ps(pp.add(o), pn);
                        if COPY == COPY_STREAM {
                            pns[s] = pn;
                        } else if COPY != NO_COPY {
                            store_bf16x16::<COPY>(cpp.add(o), pn);
                        }
                        _mm512_storeu_ps(tm.add(j + 16 * s), m1);
                        _mm512_storeu_ps(tv.add(j + 16 * s), v1);
                        // Running max of |x| on the magnitude bits: integer order is float order there,
                        // and a NaN sorts above infinity, so it survives to the check after the loop and
                        // sends the block to the scalar path (`vrangeps`/`vmaxps` would drop it).
                        maxm = _mm512_max_epu32(maxm, _mm512_and_si512(_mm512_castps_si512(m1), mag));
                        // v is never negative (all three terms are >= +0), so its bits need no mask: a
                        // set sign bit (a default NaN) also lands above infinity and takes the exact path.
                        maxv = _mm512_max_epu32(maxv, _mm512_castps_si512(v1));
                    }
                    if COPY == COPY_STREAM {
                        // The caller's copy is 64-byte aligned (`copy_mode`) and j a multiple of 64.
                        stream_bf16x32(cpp.add(base + j), pns[0], pns[1]);
                        stream_bf16x32(cpp.add(base + j + 32), pns[2], pns[3]);
                    }
                }
            }
            // SAFETY: the loop above wrote all `block` floats of both moments.
            let (tmb, tvb) = unsafe { (std::slice::from_raw_parts(tm, block), std::slice::from_raw_parts(tv, block)) };
            let (bm, bv) = (_mm512_reduce_max_epu32(maxm), _mm512_reduce_max_epu32(maxv));
            let nan = bm > 0x7f80_0000 || bv > 0x7f80_0000;
            let (a_m, a_v) = if nan {
                (crate::qmap::block_absmax(tmb), crate::qmap::block_absmax(tvb))
            } else {
                (f32::from_bits(bm), f32::from_bits(bv))
            };
            am[k] = a_m;
            av[k] = a_v;
            let fast = !nan && fast_absmax(a_m) && fast_absmax(a_v);
            match (&rounded, &quant) {
                (Some(t), _) if fast => {
                    // SAFETY: the scratch holds `block` floats per moment, the codes `block` bytes
                    // from `base`; block is a multiple of 64.
                    unsafe { rounded_block(tm, tv, 1.0 / a_m, 1.0 / a_v, qmp.add(base), qvp.add(base), block, t) };
                }
                (_, Some(how)) if fast => {
                    let (rm, rv) = (_mm512_set1_ps(1.0 / a_m), _mm512_set1_ps(1.0 / a_v));
                    for j in (0..block).step_by(64) {
                        // SAFETY: j + 64 <= block: within the scratch and the block's codes.
                        unsafe { quant64(tm.add(j), tv.add(j), rm, rv, qmp.add(base + j), qvp.add(base + j), how) };
                    }
                }
                _ => {
                    // The scalar path (NaN, an absmax outside the fast range, or a map without the
                    // SIMD table).
                    sm.quantize_block_with(tmb, a_m, &mut qm[base..base + block]);
                    um.quantize_block_with(tvb, a_v, &mut qv[base..base + block]);
                }
            }
        }
        if COPY == COPY_STREAM {
            // Streaming stores are weakly ordered: make the copy visible before returning.
            _mm_sfence();
        }
    }

    /// Re-quantizes normalised values (`absmax` 1) of both moments with the VBMI kernel's code
    /// finder `QUANT` (`QUANT_AFFINE` or `QUANT_ROUNDED`), 256 lanes per block as the kernel does,
    /// so that tests can compare it with the rule value by value.
    ///
    /// # Safety
    /// The CPU must support AVX-512 F/DQ/BW/VBMI; the four slices have one length, a multiple of
    /// 256, and every value is at most a few ulp above 1 in magnitude (`xv` non-negative).
    #[cfg(test)]
    #[target_feature(enable = "avx512f,avx512dq,avx512bw,avx512vbmi")]
    pub(super) unsafe fn requant_normalised(xm: &[f32], xv: &[f32], qm: &mut [u8], qv: &mut [u8], quant: u8) {
        let (s, u) = (QuantMap::signed().affine().unwrap(), QuantMap::unsigned().affine().unwrap());
        let t = Rounded64x2::new(s, u).unwrap();
        let one = _mm512_set1_ps(1.0);
        for b in (0..xm.len()).step_by(256) {
            // SAFETY: b + 256 <= the common length (caller).
            unsafe {
                let (pm, pv) = (xm.as_ptr().add(b), xv.as_ptr().add(b));
                let (cm, cv) = (qm.as_mut_ptr().add(b), qv.as_mut_ptr().add(b));
                if quant == super::QUANT_ROUNDED {
                    rounded_block(pm, pv, 1.0, 1.0, cm, cv, 256, &t);
                } else {
                    for j in (0..256).step_by(64) {
                        quant64(pm.add(j), pv.add(j), one, one, cm.add(j), cv.add(j), &Quant64::Affine(t.em, t.ev));
                    }
                }
            }
        }
    }

    /// Whether the SIMD lookup may quantize against this absmax: its reciprocal is finite and
    /// normal and every normalised value `x * (1 / absmax)` is a number of magnitude <= ~1, never
    /// the NaN of an all-zero block (`0 * inf`), which only the scalar rule maps to code 0. The
    /// bounds [2^-60, 2^60] are generous; outside them the scalar path computes the same rule.
    #[inline(always)]
    fn fast_absmax(a: f32) -> bool {
        a >= f32::from_bits(0x2180_0000) && a <= f32::from_bits(0x5d80_0000)
    }

    /// How the VBMI kernel finds the new codes 64 lanes at a time: gathers from both maps' bucket
    /// tables, or both maps' affine code finders (the rounding forms work on whole blocks:
    /// `rounded_block`).
    #[derive(Clone, Copy)]
    enum Quant64 {
        Table(LutKernel, LutKernel),
        Affine(Affine64, Affine64),
    }

    /// Both maps' rounding forms, and their exact forms for blocks with an ambiguous lane.
    #[derive(Clone, Copy)]
    struct Rounded64x2 {
        m: Rounded64,
        v: Rounded64,
        em: Affine64,
        ev: Affine64,
    }

    impl Rounded64x2 {
        /// From the signed (`s`) and unsigned (`u`) maps' affine forms; `None` unless both have a
        /// rounding form.
        #[inline]
        #[target_feature(enable = "avx512f")]
        fn new(s: &AffineCodes, u: &AffineCodes) -> Option<Rounded64x2> {
            let (rs, ru) = (s.rounded.as_ref()?, u.rounded.as_ref()?);
            Some(Rounded64x2 {
                m: Rounded64::new(rs),
                v: Rounded64::new(ru),
                em: Affine64::new(s),
                ev: Affine64::new(u),
            })
        }
    }

    /// The codes of the 64 values at `xm` (first moment, times `rm`) and at `xv` (second moment,
    /// times `rv`), stored at `qm` and `qv`.
    ///
    /// # Safety
    /// 64 floats must be readable at `xm` and `xv` and 64 bytes writable at `qm` and `qv`; the
    /// reciprocals must pass `fast_absmax` for their moments' values (see `affine64`).
    #[inline]
    #[target_feature(enable = "avx512f,avx512dq,avx512bw,avx512vbmi")]
    unsafe fn quant64(xm: *const f32, xv: *const f32, rm: __m512, rv: __m512, qm: *mut u8, qv: *mut u8, how: &Quant64) {
        // SAFETY: the caller's.
        unsafe {
            let (cm, cv) = match how {
                Quant64::Table(ls, lu) => {
                    let mut cm = [_mm512_setzero_si512(); 4];
                    let mut cv = [_mm512_setzero_si512(); 4];
                    for s in 0..4 {
                        cm[s] = lookup::<true, 0, 0>(_mm512_mul_ps(_mm512_loadu_ps(xm.add(16 * s)), rm), ls);
                        cv[s] = lookup::<false, 0, 0>(_mm512_mul_ps(_mm512_loadu_ps(xv.add(16 * s)), rv), lu);
                    }
                    (pack64(cm), pack64(cv))
                }
                Quant64::Affine(am, av) => affine64(xm, rm, am, xv, rv, av),
            };
            _mm512_storeu_si512(qm as *mut __m512i, cm);
            _mm512_storeu_si512(qv as *mut __m512i, cv);
        }
    }

    /// An `AffineCodes` for the kernel: the binade and run tables in registers, the threshold
    /// planes read from the map (four 256-byte tables, L1-resident).
    #[derive(Clone, Copy)]
    struct Affine64 {
        switch: [__m512i; 2],
        a: __m512,
        b: __m512,
        planes: *const [u8; 256],
    }

    impl Affine64 {
        #[inline]
        #[target_feature(enable = "avx512f")]
        fn new(t: &AffineCodes) -> Affine64 {
            // SAFETY: each array holds 32 (or 16) 32-bit values, read as whole vectors.
            unsafe {
                let v = |p: *const u32| _mm512_loadu_si512(p as *const __m512i);
                Affine64 {
                    switch: [v(t.switch.as_ptr()), v(t.switch.as_ptr().add(16))],
                    a: _mm512_loadu_ps(t.a.as_ptr()),
                    b: _mm512_loadu_ps(t.b.as_ptr()),
                    planes: t.planes.as_ptr(),
                }
            }
        }
    }

    /// A `Rounded` in registers.
    #[derive(Clone, Copy)]
    struct Rounded64 {
        off: [__m512i; 2],
        a: [__m512; 2],
        b: [__m512; 2],
        c: [__m512; 2],
        /// `2 * d` in every even 16-bit word, 0 in the odd ones: a lane is decided iff its low 16
        /// bits are at least this.
        band: __m512i,
    }

    impl Rounded64 {
        #[inline]
        #[target_feature(enable = "avx512f")]
        fn new(t: &Rounded) -> Rounded64 {
            // SAFETY: each array holds 32 32-bit values, read as two vectors.
            unsafe {
                let i = |p: *const u32| {
                    [_mm512_loadu_si512(p as *const __m512i), _mm512_loadu_si512(p.add(16) as *const __m512i)]
                };
                let f = |p: *const f32| [_mm512_loadu_ps(p), _mm512_loadu_ps(p.add(16))];
                Rounded64 {
                    off: i(t.off.as_ptr()),
                    a: f(t.a.as_ptr()),
                    b: f(t.b.as_ptr()),
                    c: f(t.c.as_ptr()),
                    band: _mm512_set1_epi32(2 * t.d as i32),
                }
            }
        }
    }

    /// The codes of the 64 normalised values `x[0..64] * r` by the rounding form (`Rounded::fixed`
    /// and `Rounded::index`, lane-parallel: same operations, same bits), in element order. Lowers
    /// `least` to the smallest low-16-bit part seen: a lane below `t.band` there was ambiguous, and
    /// its codes must come from the exact form (the caller checks once per block).
    ///
    /// # Safety
    /// As `affine64`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512dq,avx512bw,avx512vbmi")]
    unsafe fn rounded64<const SIGNED: bool>(x: *const f32, r: __m512, t: &Rounded64, least: &mut __m512i) -> __m512i {
        let lo = _mm512_castsi512_ps(_mm512_set1_epi32(AFFINE_LO_BITS as i32));
        let mut v = [_mm512_setzero_si512(); 4];
        let mut neg = [0u16; 4];
        for (s, vs) in v.iter_mut().enumerate() {
            // SAFETY: s < 4, within the 64 readable floats (caller).
            let q = _mm512_mul_ps(unsafe { _mm512_loadu_ps(x.add(16 * s)) }, r);
            // |q| raised to 2^-31 (`Rounded::fixed`'s `m`): for the signed map one `vrangeps`
            // (the larger magnitude, sign cleared), else a max (q is a number >= +0 here).
            let mb = _mm512_castps_si512(if SIGNED { _mm512_range_ps::<0b1011>(q, lo) } else { _mm512_max_ps(q, lo) });
            // The slot: `(key - off[binade]) >> S`, the key raised to that of 2^-31 (for the
            // unsigned map that is `mb`). Only the low 5 bits matter to the permutes, so rotates
            // (on the multiply pipes on Zen 4) stand in for the shifts.
            let j = if SIGNED {
                let key = _mm512_max_epu32(
                    _mm512_rol_epi32::<1>(_mm512_castps_si512(q)),
                    _mm512_set1_epi32((AFFINE_LO_BITS << 1) as i32),
                );
                let off = _mm512_permutex2var_epi32(t.off[0], _mm512_ror_epi32::<24>(key), t.off[1]);
                _mm512_ror_epi32::<24>(_mm512_sub_epi32(key, off))
            } else {
                let off = _mm512_permutex2var_epi32(t.off[0], _mm512_ror_epi32::<23>(mb), t.off[1]);
                _mm512_ror_epi32::<23>(_mm512_sub_epi32(mb, off))
            };
            let a = _mm512_permutex2var_ps(t.a[0], j, t.a[1]);
            let b = _mm512_permutex2var_ps(t.b[0], j, t.b[1]);
            let c = _mm512_permutex2var_ps(t.c[0], j, t.c[1]);
            *vs = _mm512_cvttps_epi32(_mm512_min_ps(_mm512_fmadd_ps(_mm512_castsi512_ps(mb), a, b), c));
            // The low 16 bits are the even 16-bit words; a word minimum over all of them (the
            // band is 0 in the odd words, so those never flag the block).
            *least = _mm512_min_epu16(*least, *vs);
            if SIGNED {
                neg[s] = _mm512_movepi32_mask(_mm512_castps_si512(q));
            }
        }
        // The index is byte 2 of each lane; for the signed map the code is 127 + index, or
        // 127 - index on the negative side (index 128 there saturates to code 0).
        let u = pack64_byte::<2>(v);
        if SIGNED {
            let neg = _mm512_kunpackd(
                _mm512_kunpackw(neg[3].into(), neg[2].into()) as __mmask64,
                _mm512_kunpackw(neg[1].into(), neg[0].into()) as __mmask64,
            );
            let c127 = _mm512_set1_epi8(127);
            _mm512_mask_subs_epu8(_mm512_add_epi8(u, c127), neg, c127, u)
        } else {
            u
        }
    }

    /// Re-quantizes one block (`block` floats of each moment at `xm`, `xv`, times `rm`, `rv`) into
    /// `block` codes at `qm`, `qv` by the rounding forms, 64 lanes at a time, with the tables held
    /// in registers for the whole block.
    ///
    /// # Safety
    /// As `quant64`, for `block` (a multiple of 64) elements.
    #[inline(never)]
    #[target_feature(enable = "avx512f,avx512dq,avx512bw,avx512vbmi")]
    #[allow(clippy::too_many_arguments)]
    unsafe fn rounded_block(
        xm: *const f32,
        xv: *const f32,
        rm: f32,
        rv: f32,
        qm: *mut u8,
        qv: *mut u8,
        block: usize,
        t: &Rounded64x2,
    ) {
        let (rm, rv) = (_mm512_set1_ps(rm), _mm512_set1_ps(rv));
        let (tm, tv) = (t.m, t.v);
        // The smallest low-16-bit part of any lane of the block, per moment: if one is in the
        // ambiguity band (a few blocks in a thousand), the exact form redoes that moment's block.
        // Checking once per block keeps the loop free of calls and branches, with the tables in
        // registers.
        let (mut least_m, mut least_v) = (_mm512_set1_epi32(-1), _mm512_set1_epi32(-1));
        for j in (0..block).step_by(64) {
            // SAFETY: j + 64 <= block (caller).
            unsafe {
                _mm512_storeu_si512(qm.add(j) as *mut __m512i, rounded64::<true>(xm.add(j), rm, &tm, &mut least_m));
                _mm512_storeu_si512(qv.add(j) as *mut __m512i, rounded64::<false>(xv.add(j), rv, &tv, &mut least_v));
            }
        }
        if _mm512_cmplt_epu16_mask(least_m, tm.band) != 0 {
            for j in (0..block).step_by(64) {
                // SAFETY: as above.
                unsafe { _mm512_storeu_si512(qm.add(j) as *mut __m512i, exact64::<true>(xm.add(j), rm, &t.em)) };
            }
        }
        if _mm512_cmplt_epu16_mask(least_v, tv.band) != 0 {
            for j in (0..block).step_by(64) {
                // SAFETY: as above.
                unsafe { _mm512_storeu_si512(qv.add(j) as *mut __m512i, exact64::<false>(xv.add(j), rv, &t.ev)) };
            }
        }
    }

    /// Byte `B` of each i32 lane of `c[0..4]`, in order, as 64 bytes: two byte permutes and a
    /// blend (four `vpmovdb` would cost two uops each).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vbmi")]
    fn pack64_byte<const B: usize>(c: [__m512i; 4]) -> __m512i {
        const fn table(b: usize) -> [u8; 64] {
            let mut t = [0u8; 64];
            let mut i = 0;
            while i < 64 {
                t[i] = ((i % 32) * 4 + b) as u8;
                i += 1;
            }
            t
        }
        let idx: &[u8; 64] = &const { table(B) };
        // SAFETY: idx holds 64 bytes.
        let idx = unsafe { _mm512_loadu_si512(idx.as_ptr() as *const __m512i) };
        let a = _mm512_permutex2var_epi8(c[0], idx, c[1]);
        let b = _mm512_permutex2var_epi8(c[2], idx, c[3]);
        _mm512_mask_blend_epi8(0xffff_ffff_0000_0000, a, b)
    }

    /// The codes of `x[0..64] * r` by the exact form alone (`affine64` for one moment): the
    /// fallback of `rounded64` for a group with an ambiguous lane. Not inlined: it is rare, and
    /// inlined it would take registers from the fast path.
    ///
    /// # Safety
    /// As `affine64`.
    #[inline(never)]
    #[target_feature(enable = "avx512f,avx512dq,avx512bw,avx512vbmi")]
    unsafe fn exact64<const SIGNED: bool>(x: *const f32, r: __m512, t: &Affine64) -> __m512i {
        // SAFETY: the caller's.
        let e = unsafe { estimates::<SIGNED>(x, r, t) };
        finish::<SIGNED>(&e, thresholds::<SIGNED>(&e, t))
    }

    /// The first half of `affine64`: each lane's estimate, key and sign.
    struct Estimates {
        est: [__m512i; 4],
        key: [__m512i; 4],
        neg: [u16; 4],
    }

    /// The codes of the 64 normalised values `x[0..64] * r`, one byte each in element order: the
    /// lane-parallel form of `AffineCodes::code` (same operations in the same order, so the same
    /// bits), for both moments at once (`xm`, `rm` with the signed map `tm`; `xv`, `rv` with the
    /// unsigned map `tv`), their steps interleaved so that the two chains overlap. No table is
    /// gathered: the binade and run tables are register permutes, and the 64 thresholds are byte-
    /// plane permutes (`vpermi2b`, one per plane for the signed map's 128 entries, two and a blend
    /// for the unsigned map's 255), interleaved back into lanes by the unpacks that undo the
    /// packing.
    ///
    /// # Safety
    /// 64 floats must be readable at `xm` and `xv`; the normalised values must not be NaN and at
    /// most a few ulp above 1 in magnitude (`fast_absmax`), and the second moment's non-negative.
    #[inline]
    #[target_feature(enable = "avx512f,avx512dq,avx512bw,avx512vbmi")]
    unsafe fn affine64(
        xm: *const f32,
        rm: __m512,
        tm: &Affine64,
        xv: *const f32,
        rv: __m512,
        tv: &Affine64,
    ) -> (__m512i, __m512i) {
        // SAFETY: the caller's.
        let (em, ev) = unsafe { (estimates::<true>(xm, rm, tm), estimates::<false>(xv, rv, tv)) };
        let (hm, hv) = (thresholds::<true>(&em, tm), thresholds::<false>(&ev, tv));
        (finish::<true>(&em, hm), finish::<false>(&ev, hv))
    }

    /// Estimates, keys and signs of `x[0..64] * r` (see `affine64`).
    ///
    /// # Safety
    /// As `affine64`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512dq,avx512bw,avx512vbmi")]
    unsafe fn estimates<const SIGNED: bool>(x: *const f32, r: __m512, t: &Affine64) -> Estimates {
        let lo = _mm512_castsi512_ps(_mm512_set1_epi32(AFFINE_LO_BITS as i32));
        let one = _mm512_set1_epi32(1);
        let mut e = Estimates { est: [_mm512_setzero_si512(); 4], key: [_mm512_setzero_si512(); 4], neg: [0; 4] };
        for s in 0..4 {
            // SAFETY: s < 4, within the 64 readable floats (caller).
            let q = _mm512_mul_ps(unsafe { _mm512_loadu_ps(x.add(16 * s)) }, r);
            // |q| raised to 2^-31 (`vrangeps`: the larger magnitude, sign cleared).
            let mag = if SIGNED { _mm512_range_ps::<0b1011>(q, lo) } else { _mm512_max_ps(q, lo) };
            let mb = _mm512_castps_si512(mag);
            // The binade's entry (`vpermt2d` reads the index's low 5 bits: binades 96..=127).
            let sw = _mm512_permutex2var_epi32(t.switch[0], _mm512_srli_epi32::<23>(mb), t.switch[1]);
            let rl = _mm512_and_si512(sw, _mm512_set1_epi32(15));
            let run = _mm512_mask_add_epi32(rl, _mm512_cmpge_epu32_mask(mb, sw), rl, one);
            let f = _mm512_fmadd_ps(mag, _mm512_permutexvar_ps(run, t.a), _mm512_permutexvar_ps(run, t.b));
            e.est[s] = _mm512_cvt_roundps_epi32::<{ _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC }>(f);
            let bits = _mm512_castps_si512(q);
            e.key[s] = if SIGNED { _mm512_rol_epi32::<1>(bits) } else { bits };
            if SIGNED {
                e.neg[s] = _mm512_movepi32_mask(bits);
            }
        }
        e
    }

    /// The thresholds `thr[est]` of the 64 lanes, aligned with `e.est`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512dq,avx512bw,avx512vbmi")]
    fn thresholds<const SIGNED: bool>(e: &Estimates, t: &Affine64) -> [__m512i; 4] {
        // The 64 estimates (0..=254, proven at build time) as bytes: byte j of 128-bit lane l is
        // lane 4l + j % 4 of est[j / 4].
        let idx = _mm512_packus_epi16(_mm512_packus_epi32(e.est[0], e.est[1]), _mm512_packus_epi32(e.est[2], e.est[3]));
        let high = _mm512_movepi8_mask(idx);
        let plane = |k: usize| {
            // SAFETY: plane k < 4 of the map's four 256-byte planes, read as four 64-byte vectors.
            let v = |o: usize| unsafe { _mm512_loadu_si512(t.planes.add(k).cast::<u8>().add(o) as *const __m512i) };
            let low = _mm512_permutex2var_epi8(v(0), idx, v(64));
            if SIGNED { low } else { _mm512_mask_blend_epi8(high, low, _mm512_permutex2var_epi8(v(128), idx, v(192))) }
        };
        let (p0, p1, p2, p3) = (plane(0), plane(1), plane(2), plane(3));
        // These unpacks put the four bytes of lane i's threshold back into lane i.
        let w01l = _mm512_unpacklo_epi8(p0, p1);
        let w01h = _mm512_unpackhi_epi8(p0, p1);
        let w23l = _mm512_unpacklo_epi8(p2, p3);
        let w23h = _mm512_unpackhi_epi8(p2, p3);
        [
            _mm512_unpacklo_epi16(w01l, w23l),
            _mm512_unpackhi_epi16(w01l, w23l),
            _mm512_unpacklo_epi16(w01h, w23h),
            _mm512_unpackhi_epi16(w01h, w23h),
        ]
    }

    /// The 64 codes from the estimates and their thresholds, as bytes in element order.
    #[inline]
    #[target_feature(enable = "avx512f,avx512dq,avx512bw,avx512vbmi")]
    fn finish<const SIGNED: bool>(e: &Estimates, th: [__m512i; 4]) -> __m512i {
        let (one, c127) = (_mm512_set1_epi32(1), _mm512_set1_epi32(127));
        let mut code = [_mm512_setzero_si512(); 4];
        for s in 0..4 {
            let u = _mm512_mask_add_epi32(e.est[s], _mm512_cmpge_epu32_mask(e.key[s], th[s]), e.est[s], one);
            // Signed: 127 + u, or 127 - u on the negative side (-1 for u = 128 becomes 0, the
            // nearest negative code).
            code[s] = if SIGNED {
                _mm512_max_epi32(
                    _mm512_mask_sub_epi32(_mm512_add_epi32(u, c127), e.neg[s], c127, u),
                    _mm512_setzero_si512(),
                )
            } else {
                u
            };
        }
        pack64(code)
    }

    /// `LutParams` in AVX2 registers (see `LutKernel`).
    #[derive(Clone, Copy)]
    struct Lut8 {
        base: *const i32,
        lo: __m256i,
        one: __m256i,
        shift: __m128i,
        up: __m128i,
        buckets: __m256i,
        bias: __m256i,
    }

    impl Lut8 {
        #[inline]
        #[target_feature(enable = "avx2")]
        fn new(t: &LutParams<'_>) -> Lut8 {
            Lut8 {
                // As in `LutKernel::new`: offset back by `lo_key` entries, only ever read in bounds.
                base: (t.lut.as_ptr() as *const i32).wrapping_sub(t.lo_key as usize),
                lo: _mm256_set1_epi32(t.lo as i32),
                one: _mm256_set1_epi32(0x3f80_0000),
                shift: _mm_cvtsi32_si128(t.shift as i32),
                up: _mm_cvtsi32_si128(32 - t.shift as i32),
                buckets: _mm256_set1_epi32(t.buckets as i32),
                bias: _mm256_set1_epi32(i32::MIN),
            }
        }
    }

    /// A table index as read from memory: a code byte or a bucket lane.
    trait TableIndex: Copy {
        fn index(self) -> usize;
    }

    impl TableIndex for u8 {
        #[inline(always)]
        fn index(self) -> usize {
            self as usize
        }
    }

    impl TableIndex for u32 {
        #[inline(always)]
        fn index(self) -> usize {
            self as usize
        }
    }

    /// Eight entries of a 32-bit table, `t[i[0]], .., t[i[7]]`, with scalar loads (`vmovss` and
    /// `vinsertps` with a memory operand: bits are moved, never converted), for cores whose gathers
    /// are slow (see `crate::simd::q8_avx2_loads`).
    ///
    /// # Safety
    /// Every `t.wrapping_add(i[k])` must be readable.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn table8<I: TableIndex>(t: *const f32, i: [I; 8]) -> __m256 {
        // SAFETY: the caller's.
        unsafe {
            // `wrapping_add`: `t` itself may lie before the table (a LUT base offset back by its
            // lowest key); only the entries read are inside it.
            let e = |k: usize| *t.wrapping_add(i[k].index());
            _mm256_setr_ps(e(0), e(1), e(2), e(3), e(4), e(5), e(6), e(7))
        }
    }

    /// Dequantization lookup: `code[q[0..8]]`, gathered or loaded one by one (`LOADS`).
    ///
    /// # Safety
    /// `q..q + 8` must be readable and `code` must have 256 entries.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn dequant8<const LOADS: bool>(code: *const f32, q: *const u8) -> __m256 {
        // SAFETY: the caller's; indices are u8 < 256.
        unsafe {
            if LOADS {
                table8(code, *(q as *const [u8; 8]))
            } else {
                _mm256_i32gather_ps::<4>(code, _mm256_cvtepu8_epi32(_mm_loadl_epi64(q as *const __m128i)))
            }
        }
    }

    /// `lookup` for 8 lanes with AVX2 (no unsigned compare: both sides are biased by 2^31); the
    /// table read gathered, or loaded one by one (`LOADS`).
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn lookup8<const SIGNED: bool, const LOADS: bool>(q: __m256, t: &Lut8) -> __m256i {
        let bits = _mm256_castps_si256(q);
        let mag = if SIGNED { _mm256_and_si256(bits, _mm256_set1_epi32(0x7fff_ffff)) } else { bits };
        let key = _mm256_min_epu32(_mm256_max_epu32(mag, t.lo), t.one);
        let mut bucket = _mm256_srl_epi32(key, t.shift);
        // All ones on negative lanes.
        let neg = if SIGNED { _mm256_srai_epi32::<31>(bits) } else { _mm256_setzero_si256() };
        if SIGNED {
            bucket = _mm256_add_epi32(bucket, _mm256_and_si256(neg, t.buckets));
        }
        // SAFETY: `key` is clamped to [lo, 1.0], so `bucket` indexes inside the table from `t.base`
        // (see `lookup`); the loads read the same entries as the gather.
        let e = unsafe {
            if LOADS {
                let mut i = [0u32; 8];
                _mm256_storeu_si256(i.as_mut_ptr() as *mut __m256i, bucket);
                // The u32 lanes themselves: an `i.map(..)` to usize here was compiled as an
                // out-of-line call (with a `vzeroupper` and every live vector spilled around it).
                _mm256_castps_si256(table8(t.base as *const f32, i))
            } else {
                _mm256_i32gather_epi32::<4>(t.base, bucket)
            }
        };
        let off = _mm256_xor_si256(_mm256_sll_epi32(key, t.up), t.bias);
        let hit = _mm256_cmpgt_epi32(off, _mm256_xor_si256(e, t.bias));
        if SIGNED {
            // hit is 0 / -1: code = e + 1 on a positive hit, e - 1 on a negative one.
            _mm256_add_epi32(_mm256_sub_epi32(e, _mm256_xor_si256(hit, neg)), neg)
        } else {
            _mm256_sub_epi32(e, hit)
        }
    }

    /// The low bytes of 16 i32 lanes, in order.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn pack16(c0: __m256i, c1: __m256i) -> __m128i {
        let m = _mm256_set1_epi32(0xff);
        let w = _mm256_packus_epi32(_mm256_and_si256(c0, m), _mm256_and_si256(c1, m));
        let b = _mm256_packus_epi16(w, w);
        _mm256_castsi256_si128(_mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 0, 4, 1, 5)))
    }

    /// Horizontal max of 8 non-negative, non-NaN lanes.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn hmax8(x: __m256) -> f32 {
        let m = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps::<1>(x));
        let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)))
    }

    /// The 8-bit update for CPUs with AVX2 and FMA but no AVX-512: the scalar reference's
    /// arithmetic 8 lanes at a time (bit-identical to it), table reads for dequantization, and the
    /// same reciprocal multiply and exact table lookup as the AVX-512 kernels for re-quantization.
    /// Three short loops per block: the moments (with their absmax), the weights, the codes.
    ///
    /// With `COPY` it also writes the bf16 copy of every updated parameter into `cp` (integer
    /// rounding; a block whose weights hold a NaN is converted again with the NaN rule). With `LOADS`
    /// every table read is a scalar load instead of a gather (same entries, same bits).
    ///
    /// # Safety
    /// AVX2 and FMA must be available. `block` must be a multiple of 16 and at most `MAX_BLOCK`, and
    /// `p`, `g`, `qm`, `qv` (and `cp` with `COPY`) must all have exactly `am.len() * block`
    /// elements, `av` as many as `am`.
    #[target_feature(enable = "avx2,fma")]
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn q8_blocks_avx2<G: GradElem, const COPY: bool, const LOADS: bool>(
        p: &mut [f32],
        cp: &mut [bf16],
        g: &[G],
        qm: &mut [u8],
        qv: &mut [u8],
        am: &mut [f32],
        av: &mut [f32],
        block: usize,
        c: &Coeffs,
        maps: QuantMaps,
    ) {
        let (sm, um) = (maps.signed, maps.unsigned);
        let (scode, ucode) = (sm.code().as_ptr(), um.code().as_ptr());
        let luts = sm.lut_params().zip(um.lut_params()).map(|(s, u)| (Lut8::new(&s), Lut8::new(&u)));
        // Uninitialised: the update writes all `block` elements before anything reads them.
        let mut scratch = Scratch([MaybeUninit::<f32>::uninit(); 2 * MAX_BLOCK]);
        let tmp = scratch.0.as_mut_ptr() as *mut f32;
        let tvp = tmp.wrapping_add(MAX_BLOCK);
        let (pp, gp, qmp, qvp) = (p.as_mut_ptr(), g.as_ptr(), qm.as_mut_ptr(), qv.as_mut_ptr());
        let cpp = cp.as_mut_ptr();
        let decay = _mm256_set1_ps(c.decay);
        let gm = _mm256_set1_ps(c.gm);
        let gv = _mm256_set1_ps(c.gv);
        let inv_bc2 = _mm256_set1_ps(c.inv_bc2);
        let eps = _mm256_set1_ps(c.eps);
        let neg_step = _mm256_set1_ps(c.neg_step);
        let abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fff_ffff));
        for k in 0..am.len() {
            let base = k * block;
            let am_b1 = _mm256_set1_ps(am[k] * c.beta1);
            let av_b2 = _mm256_set1_ps(av[k] * c.beta2);
            let mut maxm = _mm256_setzero_ps();
            let mut maxv = _mm256_setzero_ps();
            let mut nan = _mm256_setzero_ps();
            // Three passes over the block (the moments, the weights, the codes), each a short loop:
            // one loop doing all of it was 9% slower on Zen 3, where each iteration's long chain
            // (table loads, square root, division) left too few iterations in flight.
            for j in (0..block).step_by(8) {
                let o = base + j;
                // SAFETY: o + 8 <= (k + 1) * block <= the length of p, g, qm and qv (and of cp
                // with a copy), and j + 8 <= block <= MAX_BLOCK for the scratch; table indices
                // are u8 < 256, the length of both code tables.
                unsafe {
                    if j % 64 == 0 {
                        prefetch64(o + PREFETCH_AHEAD, pp, gp, qmp, qvp);
                        if COPY {
                            prefetch_copy64(o + PREFETCH_AHEAD, cpp);
                        }
                    }
                    let gr = G::load8(gp.add(o));
                    let m1 = _mm256_fmadd_ps(dequant8::<LOADS>(scode, qmp.add(o)), am_b1, _mm256_mul_ps(gr, gm));
                    let v1 = _mm256_fmadd_ps(
                        dequant8::<LOADS>(ucode, qvp.add(o)),
                        av_b2,
                        _mm256_mul_ps(_mm256_mul_ps(gr, gv), gr),
                    );
                    _mm256_storeu_ps(tmp.add(j), m1);
                    _mm256_storeu_ps(tvp.add(j), v1);
                    // `max(a, acc)` is `a > acc ? a : acc` lane by lane, as `block_absmax`: a NaN
                    // is skipped here and noted separately.
                    maxm = _mm256_max_ps(_mm256_and_ps(m1, abs), maxm);
                    maxv = _mm256_max_ps(_mm256_and_ps(v1, abs), maxv);
                    nan = _mm256_or_ps(nan, _mm256_cmp_ps::<_CMP_UNORD_Q>(m1, v1));
                }
            }
            let mut nan_p = _mm256_setzero_ps();
            for j in (0..block).step_by(8) {
                let o = base + j;
                // SAFETY: as above; the first loop wrote scratch elements j..j + 8.
                unsafe {
                    let m1 = _mm256_loadu_ps(tmp.add(j));
                    let v1 = _mm256_loadu_ps(tvp.add(j));
                    let denom = _mm256_fmadd_ps(_mm256_sqrt_ps(v1), inv_bc2, eps);
                    let upd = _mm256_div_ps(_mm256_mul_ps(m1, neg_step), denom);
                    let pn = _mm256_fmadd_ps(_mm256_loadu_ps(pp.add(o)), decay, upd);
                    _mm256_storeu_ps(pp.add(o), pn);
                    if COPY {
                        store_bf16x8_finite(cpp.add(o), pn);
                        nan_p = _mm256_or_ps(nan_p, _mm256_cmp_ps::<_CMP_UNORD_Q>(pn, pn));
                    }
                }
            }
            if COPY && _mm256_movemask_ps(nan_p) != 0 {
                // A NaN weight: the copy's NaN rule, for the whole block (rare). Through the same
                // pointers as the loops, which go on using them.
                for o in base..base + block {
                    // SAFETY: o < (k + 1) * block <= the length of p and cp.
                    unsafe { *cpp.add(o) = bf16_rne(*pp.add(o)) };
                }
            }
            let (a_m, a_v) = (hmax8(maxm), hmax8(maxv));
            am[k] = a_m;
            av[k] = a_v;
            let (qmb, qvb) = (&mut qm[base..base + block], &mut qv[base..base + block]);
            // SAFETY: the loop above wrote the first `block` elements of both scratch arrays.
            let (tmb, tvb) =
                unsafe { (std::slice::from_raw_parts(tmp, block), std::slice::from_raw_parts(tvp, block)) };
            let Some((ls, lu)) = luts.filter(|_| _mm256_movemask_ps(nan) == 0 && fast_absmax(a_m) && fast_absmax(a_v))
            else {
                // The scalar path: NaN, an absmax outside the fast range, or a map without the
                // SIMD table.
                sm.quantize_block_with(tmb, a_m, qmb);
                um.quantize_block_with(tvb, a_v, qvb);
                continue;
            };
            let (vr_m, vr_v) = (_mm256_set1_ps(1.0 / a_m), _mm256_set1_ps(1.0 / a_v));
            for j in (0..block).step_by(16) {
                // SAFETY: j + 16 <= block: within the scratch and the block's codes.
                unsafe {
                    let x = |t: *const f32, s: usize| _mm256_loadu_ps(t.add(j + 8 * s));
                    let m0 = lookup8::<true, LOADS>(_mm256_mul_ps(x(tmp, 0), vr_m), &ls);
                    let m1 = lookup8::<true, LOADS>(_mm256_mul_ps(x(tmp, 1), vr_m), &ls);
                    let v0 = lookup8::<false, LOADS>(_mm256_mul_ps(x(tvp, 0), vr_v), &lu);
                    let v1 = lookup8::<false, LOADS>(_mm256_mul_ps(x(tvp, 1), vr_v), &lu);
                    _mm_storeu_si128(qmb.as_mut_ptr().add(j) as *mut __m128i, pack16(m0, m1));
                    _mm_storeu_si128(qvb.as_mut_ptr().add(j) as *mut __m128i, pack16(v0, v1));
                }
            }
        }
    }
    /// bf16 of 8 lanes by integer round-to-nearest-even, without `store_bf16x8`'s NaN blend: the
    /// caller redoes a block whose updated weights hold a NaN.
    ///
    /// # Safety
    /// `dst` must be valid for writing 8 elements.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn store_bf16x8_finite(dst: *mut bf16, x: __m256) {
        // SAFETY: the caller's.
        unsafe { store_words8(dst, rne_bits8(_mm256_castps_si256(x))) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::qmap::QuantMaps;
    use crate::testutil::SplitMix64;
    use half::bf16;

    fn coeffs(step: u64, scale: f32) -> Coeffs {
        Coeffs::new(&AdamWConfig { lr: 1e-2, weight_decay: 0.1, ..Default::default() }, step, scale)
    }

    /// Random 8-bit state with realistic spread: codes anywhere, absmax over many decades.
    fn random_q8(n: usize, block: usize, rng: &mut SplitMix64) -> (Vec<u8>, Vec<u8>, Vec<f32>, Vec<f32>) {
        let qm = (0..n).map(|_| rng.next_u64() as u8).collect();
        let qv = (0..n).map(|_| rng.next_u64() as u8).collect();
        let nb = n.div_ceil(block);
        let am =
            (0..nb).map(|i| if i % 9 == 4 { 0.0 } else { rng.uniform().abs() * 10f32.powi(-(i as i32 % 7)) }).collect();
        let av = (0..nb)
            .map(|i| if i % 11 == 3 { 0.0 } else { rng.uniform().abs() * 10f32.powi(-(i as i32 % 9)) })
            .collect();
        (qm, qv, am, av)
    }

    /// The VBMI kernel's code finders (the exact affine one and the rounding form with its
    /// fallback) give the rule's code for every normalised value within 64 ulp of every transition
    /// of both maps (both signs for the signed map), of every code value and midpoint, and for
    /// zero, subnormals and values just above 1: where the rounding form is ambiguous the fallback
    /// must take over, so this also checks that the band check fires there.
    #[test]
    fn vbmi_code_finders_match_the_rule_at_every_transition() {
        if simd_level() < SimdLevel::Avx512 || !crate::simd::has_vbmi() {
            eprintln!("skipped: this CPU has no AVX-512 VBMI (the other paths are covered by simd_q8_*)");
            return;
        }
        let (sm, um) = (crate::QuantMap::signed(), crate::QuantMap::unsigned());
        let around = |t: u32| (t.saturating_sub(64)..=t.saturating_add(64)).map(f32::from_bits);
        let mut mags: Vec<f32> = Vec::new();
        for map in [sm, um] {
            for w in map.code().windows(2) {
                for v in [w[0], w[1], (w[0] + w[1]) / 2.0] {
                    mags.extend(around(v.abs().to_bits()));
                }
            }
            for x in crate::qmap::transition_bits(map) {
                mags.extend(around(x));
            }
        }
        mags.extend((0..4096).map(f32::from_bits));
        mags.extend((0..8).map(|k| f32::from_bits(0x3f80_0000 + k)));
        mags.retain(|m| *m <= f32::from_bits(0x3f80_0008));
        let mut xm: Vec<f32> = mags.iter().flat_map(|&m| [m, -m]).collect();
        let mut xv: Vec<f32> = mags.iter().flat_map(|&m| [m, m]).collect();
        let n = xm.len().next_multiple_of(256);
        xm.resize(n, 0.5);
        xv.resize(n, 0.5);
        for quant in [QUANT_AFFINE, QUANT_ROUNDED] {
            let (mut qm, mut qv) = (vec![0u8; n], vec![0u8; n]);
            // SAFETY: VBMI checked above; equal lengths, a multiple of 256; |values| <= 1 + 8 ulp.
            unsafe { x86::requant_normalised(&xm, &xv, &mut qm, &mut qv, quant) };
            for i in 0..n {
                assert_eq!(qm[i], sm.quantize(xm[i]), "quant {quant}, m = {:e} ({:#x})", xm[i], xm[i].to_bits());
                assert_eq!(qv[i], um.quantize(xv[i]), "quant {quant}, v = {:e} ({:#x})", xv[i], xv[i].to_bits());
            }
        }
    }

    /// The SIMD paths this CPU can run: AVX-512 with the plain gather kernel and with the VBMI
    /// kernel (each dequantization with each code finder), each with integer and with
    /// `vcvtneps2bf16` bf16 rounding (AVX512-BF16; the rounding forms also with the copy's
    /// streaming stores), and AVX2.
    fn paths() -> Vec<KernelPath> {
        let mut v = Vec::new();
        if simd_level() >= SimdLevel::Avx512 {
            for bf16_hw in [false, true].into_iter().filter(|&h| !h || crate::simd::has_avx512bf16()) {
                let plain = KernelPath { bf16_hw, ..KernelPath::plain(SimdLevel::Avx512) };
                v.push(plain);
                if !crate::simd::has_vbmi() {
                    continue;
                }
                for dequant in [Q8Dequant::Permute, Q8Dequant::Gather] {
                    for quant in [Q8Quant::Table, Q8Quant::Affine, Q8Quant::Rounded] {
                        v.push(KernelPath { vbmi: true, dequant, quant, ..plain });
                    }
                    if bf16_hw {
                        let quant = Q8Quant::Rounded;
                        v.push(KernelPath { vbmi: true, dequant, quant, stream_copy: true, ..plain });
                    }
                }
            }
        }
        if simd_level() >= SimdLevel::Avx2 {
            v.push(KernelPath::plain(SimdLevel::Avx2));
            v.push(KernelPath { loads: true, ..KernelPath::plain(SimdLevel::Avx2) });
        }
        v
    }

    #[test]
    fn the_kernel_name_follows_the_dispatch_rule() {
        let maps = QuantMaps::default();
        assert_eq!(crate::q8_kernel_name(), Q8Kernel::select(KernelPath::detect(), maps, 256).name());
        let (mut kernels, mut names) = (Vec::new(), std::collections::BTreeSet::new());
        for path in paths().into_iter().chain([KernelPath::plain(SimdLevel::Scalar)]) {
            let k = Q8Kernel::select(path, maps, 256);
            if !kernels.contains(&k) {
                kernels.push(k);
            }
            names.insert(k.name());
            let vbmi = path.level == SimdLevel::Avx512 && path.vbmi;
            assert_eq!(matches!(k, Q8Kernel::Vbmi { .. }), vbmi, "{path:?}");
            if vbmi {
                // The VBMI kernel needs whole 64-lane groups: a block of 48 takes the plain one.
                assert_eq!(Q8Kernel::select(path, maps, 48), Q8Kernel::Avx512);
                let quant = match path.quant {
                    Q8Quant::Table => QUANT_TABLE,
                    Q8Quant::Affine => QUANT_AFFINE,
                    Q8Quant::Rounded => QUANT_ROUNDED,
                };
                assert_eq!(k, Q8Kernel::Vbmi { dequant: path.dequant, quant });
            }
        }
        // Every kernel this CPU can run has its own name.
        assert_eq!(names.len(), kernels.len(), "{names:?}");
    }

    /// Parameters, m codes, v codes, m absmax, v absmax.
    type Q8State = (Vec<f32>, Vec<u8>, Vec<u8>, Vec<f32>, Vec<f32>);

    /// Runs `update_q8` on `path` on copies of the given state, once without and twice with the
    /// bf16 copy (64-byte aligned, where a path may stream it, and not); asserts that the copy
    /// changes nothing else and equals `half::bf16::from_f32` of the updated parameters bit for bit.
    fn run_q8(
        path: KernelPath,
        block: usize,
        maps: QuantMaps,
        grad: Grad<'_>,
        c: &Coeffs,
        pool: &ThreadPool,
        state: &Q8State,
    ) -> Q8State {
        let (mut p, mut qm, mut qv, mut am, mut av) = state.clone();
        let s = Q8Slices { qm: &mut qm, qv: &mut qv, am: &mut am, av: &mut av, block, maps };
        update_q8(&mut p, grad, s, None, c, pool, path);
        let plain = (p, qm, qv, am, av);
        let mut buf = vec![bf16::from_bits(0x5555); plain.0.len() + 33];
        let aligned = buf.as_ptr().align_offset(64);
        for off in [aligned, aligned + 1] {
            let (mut p, mut qm, mut qv, mut am, mut av) = state.clone();
            let cp = &mut buf[off..off + p.len()];
            let s = Q8Slices { qm: &mut qm, qv: &mut qv, am: &mut am, av: &mut av, block, maps };
            update_q8(&mut p, grad, s, Some(&mut *cp), c, pool, path);
            let copied = (p, qm, qv, am, av);
            assert_same(&copied, &plain, &format!("{path:?} with the bf16 copy at offset {off}"));
            assert_copy(&copied.0, cp, &format!("{path:?}, offset {off}"));
        }
        plain
    }

    /// A path that streams the copy does so only where the copy is 64-byte aligned (the kernels
    /// store whole lines from there), and never without AVX512-BF16's conversion.
    #[test]
    fn the_copy_is_streamed_only_when_aligned() {
        let stream = KernelPath { bf16_hw: true, stream_copy: true, ..KernelPath::plain(SimdLevel::Avx512) };
        let buf = vec![bf16::ZERO; 256];
        let at = buf.as_ptr().align_offset(64);
        assert_eq!(copy_mode(stream, &buf[at..at + 64]), COPY_STREAM);
        assert_eq!(copy_mode(stream, &buf[at + 8..at + 72]), COPY_HW);
        assert_eq!(copy_mode(stream, &[]), NO_COPY);
        assert_eq!(copy_mode(KernelPath { stream_copy: false, ..stream }, &buf[at..at + 64]), COPY_HW);
        let int = KernelPath { bf16_hw: false, ..stream };
        assert_eq!(copy_mode(int, &buf[at..at + 64]), COPY_INT);
    }

    /// Asserts `cp[i] == bf16::from_f32(p[i])` bit for bit.
    fn assert_copy(p: &[f32], cp: &[bf16], what: &str) {
        assert_eq!(p.len(), cp.len());
        if let Some(i) = (0..p.len()).find(|&i| cp[i].to_bits() != bf16::from_f32(p[i]).to_bits()) {
            panic!(
                "{what}: copy [{i}] of {:08x} is {:04x}, want {:04x}",
                p[i].to_bits(),
                cp[i].to_bits(),
                bf16::from_f32(p[i]).to_bits()
            );
        }
    }

    /// Asserts bit equality of two update results (parameters, codes, absmax).
    fn assert_same(a: &Q8State, b: &Q8State, what: &str) {
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
        if let Some(i) = (0..a.0.len()).find(|&i| a.0[i].to_bits() != b.0[i].to_bits()) {
            panic!("{what}: p[{i}] {:e} vs {:e}", a.0[i], b.0[i]);
        }
        if let Some(i) = (0..a.1.len()).find(|&i| a.1[i] != b.1[i]) {
            panic!("{what}: m code [{i}] {} vs {}", a.1[i], b.1[i]);
        }
        if let Some(i) = (0..a.2.len()).find(|&i| a.2[i] != b.2[i]) {
            panic!("{what}: v code [{i}] {} vs {}", a.2[i], b.2[i]);
        }
        assert_eq!(bits(&a.3), bits(&b.3), "{what}: m absmax");
        assert_eq!(bits(&a.4), bits(&b.4), "{what}: v absmax");
    }

    /// Every SIMD 8-bit kernel (AVX-512 with and without VBMI, AVX2) equals the scalar reference
    /// bit for bit: parameters, codes and absmax. They do the reference's f32 operations (same FMAs,
    /// a true division for the update, the same `x * (1 / absmax)`) and the table lookup is exact, so no tolerance is
    /// needed. f32 and bf16 gradients, both maps (nearest and bitsandbytes' rule, which has no SIMD
    /// table), blocks 16..1024 (multiples of 64 take the VBMI kernel) and ragged last blocks.
    #[test]
    fn simd_q8_matches_scalar() {
        let pool = ThreadPool::new(2).unwrap();
        let mut rng = SplitMix64::new(99);
        for (block, n) in
            [(256usize, 256 * 300 + 77), (16, 16 * 40 + 5), (48, 48 * 30 + 17), (1024, 1024 * 70), (64, 64 * 3)]
        {
            let p0: Vec<f32> = rng.uniform_vec(n);
            let gf: Vec<f32> =
                rng.uniform_vec(n).iter().enumerate().map(|(i, g)| g * 10f32.powi(-((i / block) as i32 % 6))).collect();
            let gb: Vec<bf16> = gf.iter().map(|&x| bf16::from_f32(x)).collect();
            let (qm0, qv0, am0, av0) = random_q8(n, block, &mut rng);
            let state = (p0, qm0, qv0, am0, av0);
            for (step, scale) in [(1u64, 1.0f32), (7, 0.37)] {
                let c = coeffs(step, scale);
                for (grad, maps) in [
                    (Grad::F32(&gf), QuantMaps::default()),
                    (Grad::Bf16(&gb), QuantMaps::default()),
                    (Grad::F32(&gf), crate::qmap::tests::bnb_cpu_maps()),
                ] {
                    let want = run_q8(KernelPath::plain(SimdLevel::Scalar), block, maps, grad, &c, &pool, &state);
                    for path in paths() {
                        let got = run_q8(path, block, maps, grad, &c, &pool, &state);
                        assert_same(&got, &want, &format!("{path:?} block {block} step {step}"));
                    }
                }
            }
        }
    }

    /// The fast paths against the reference on edge cases, bit for bit. With `beta1 = beta2 = 0`
    /// and no clipping the new moments are exactly `m = g` and `v = g * g`, so the gradient places
    /// normalised first moments exactly where we want them: on every transition point of the
    /// signed map and one ulp either side (blocks whose absmax is a power of two, so `g * (1 / absmax)`
    /// is exact), on the map values and midpoints between them; plus zeros, negative zeros,
    /// subnormals, values that overflow `v` to infinity, NaN (the block takes the scalar path:
    /// NaN codes 0, absmax ignores it), all-zero blocks (`0 / 0`), tiny and huge absmax outside
    /// the fast range, and short last blocks.
    #[test]
    fn simd_q8_edge_cases_match_reference() {
        let pool = ThreadPool::new(2).unwrap();
        let sm = crate::QuantMap::signed();
        // Normalised probes: transitions of the signed map (both signs) +-1 ulp, codes, midpoints.
        let mut probes: Vec<f32> = Vec::new();
        let mut transitions = 0;
        for w in sm.code().windows(2) {
            let (lo, hi) = (w[0], w[1]);
            probes.extend([lo, hi, (lo + hi) / 2.0]);
            // The transition between lo and hi: the smallest float in (lo, hi] whose code is above
            // lo's, by bisection (on values; the last steps walk single ulps).
            let (mut a, mut b) = (lo, hi);
            while next_up(a) < b {
                let m = a + (b - a) / 2.0;
                let m = if m <= a || m >= b { next_up(a) } else { m };
                if sm.quantize(m) > sm.quantize(lo) { b = m } else { a = m }
            }
            probes.extend([next_down(b), b, next_up(b)]);
            transitions += 1;
        }
        assert_eq!(transitions, 255);
        probes.extend([0.0, -0.0, f32::from_bits(1), -f32::from_bits(1), f32::MIN_POSITIVE, 1e-30, -1e-30]);
        let probes: Vec<f32> = probes.into_iter().filter(|p| p.abs() <= 1.0).collect();

        for block in [256usize, 64, 16, 48] {
            let mut g: Vec<f32> = Vec::new();
            // Blocks of probes scaled by a power of two, each block led by +absmax.
            for (i, chunk) in probes.chunks(block - 1).enumerate() {
                let a = 2f32.powi(i as i32 % 40 - 20);
                g.push(a);
                g.extend(chunk.iter().map(|&p| p * a));
                g.resize(g.len().next_multiple_of(block), 0.0);
            }
            // Special blocks: zeros (with a negative zero), subnormals only, a NaN, an infinity
            // after squaring, huge and tiny magnitudes (absmax outside [2^-60, 2^60]).
            let special: [&dyn Fn(usize) -> f32; 7] = [
                &|i| if i == 3 { -0.0 } else { 0.0 },
                &|i| f32::from_bits(1 + i as u32 * 7),
                &|i| if i == 5 { f32::NAN } else { i as f32 * 0.01 - 0.3 },
                &|i| if i == 1 { 3e19 } else { i as f32 },
                &|i| (i as f32 - 7.5) * 1e18,
                &|i| (i as f32 - 7.5) * 1e-20,
                &|i| -(i as f32) * 1e-3,
            ];
            for f in special {
                g.extend((0..block).map(f));
            }
            g.extend((0..block / 2 + 3).map(|i| i as f32 * 0.1 - 1.0)); // short last block
            let n = g.len();
            let gb: Vec<bf16> = g.iter().map(|&x| bf16::from_f32(x)).collect();
            let cfg = AdamWConfig { beta1: 0.0, beta2: 0.0, lr: 1e-2, weight_decay: 0.1, ..Default::default() };
            let mut rng = SplitMix64::new(block as u64);
            let (qm0, qv0, am0, av0) = random_q8(n, block, &mut rng);
            let state = (rng.uniform_vec(n), qm0, qv0, am0, av0);
            for c in [Coeffs::new(&cfg, 1, 1.0), coeffs(3, 0.5)] {
                for grad in [Grad::F32(&g), Grad::Bf16(&gb)] {
                    let maps = QuantMaps::default();
                    let want = run_q8(KernelPath::plain(SimdLevel::Scalar), block, maps, grad, &c, &pool, &state);
                    if c.beta1 == 0.0 && matches!(grad, Grad::F32(_)) {
                        // The first block's absmax is its leading +absmax: the probes really are
                        // the normalised moments.
                        assert_eq!(want.3[0], g[0]);
                    }
                    for path in paths() {
                        let got = run_q8(path, block, maps, grad, &c, &pool, &state);
                        assert_same(&got, &want, &format!("{path:?} block {block}"));
                    }
                }
            }
        }
    }

    fn next_up(x: f32) -> f32 {
        if x == 0.0 {
            f32::from_bits(1)
        } else if x > 0.0 {
            f32::from_bits(x.to_bits() + 1)
        } else {
            f32::from_bits(x.to_bits() - 1)
        }
    }

    fn next_down(x: f32) -> f32 {
        -next_up(-x)
    }

    /// The bf16 copy on parameters that stress the rounding, through both kernels on every path:
    /// with `lr = 0` (and no decay) the update leaves every parameter as it was (`p * 1 + 0`), so
    /// NaNs with any payload, infinities, zeros, subnormals, exact ties and values that round up to
    /// infinity reach the copy unchanged; a second step with a real update covers ordinary values.
    /// Tensors below and above the 8-bit threshold, ragged last blocks, and both thread splits.
    #[test]
    fn bf16_copy_matches_half_on_edge_cases_and_every_path() {
        let pool = ThreadPool::new(2).unwrap();
        let mut p0: Vec<f32> = crate::copy::tests::bf16_probe_bits().into_iter().map(f32::from_bits).collect();
        let n = PAR_MIN + 3 * 256 + 37;
        let mut rng = SplitMix64::new(77);
        while p0.len() < n {
            p0.push(rng.uniform());
        }
        let g: Vec<f32> = rng.uniform_vec(n);
        let gb: Vec<bf16> = g.iter().map(|&x| bf16::from_f32(x)).collect();
        let zeros = vec![0f32; n];
        for (cfg, grad) in [
            (AdamWConfig { lr: 0.0, weight_decay: 0.0, ..Default::default() }, Grad::F32(&zeros)),
            (AdamWConfig { lr: 1e-2, weight_decay: 0.1, ..Default::default() }, Grad::Bf16(&gb)),
        ] {
            let c = Coeffs::new(&cfg, 1, 1.0);
            for len in [n, 1000 + 5] {
                // 8-bit state (zero moments, as after `add_group`).
                let nb = len.div_ceil(256);
                let state = (p0[..len].to_vec(), vec![127u8; len], vec![0u8; len], vec![0f32; nb], vec![0f32; nb]);
                let maps = QuantMaps::default();
                let want =
                    run_q8(KernelPath::plain(SimdLevel::Scalar), 256, maps, grad.slice(0, len), &c, &pool, &state);
                for path in paths() {
                    let got = run_q8(path, 256, maps, grad.slice(0, len), &c, &pool, &state);
                    assert_same(&got, &want, &format!("{path:?} len {len}"));
                }
                // fp32 state.
                for level in
                    [SimdLevel::Scalar, SimdLevel::Avx2, SimdLevel::Avx512].into_iter().filter(|&l| l <= simd_level())
                {
                    let (mut p, mut m, mut v) = (p0[..len].to_vec(), vec![0f32; len], vec![0f32; len]);
                    let mut cp = vec![bf16::ZERO; len];
                    match grad.slice(0, len) {
                        Grad::F32(g) => fp32_chunk(&mut p, g, &mut m, &mut v, &mut cp, &c, level),
                        Grad::Bf16(g) => fp32_chunk(&mut p, g, &mut m, &mut v, &mut cp, &c, level),
                    }
                    assert_copy(&p, &cp, &format!("fp32 {level:?} len {len}"));
                }
                let (mut p, mut m, mut v) = (p0[..len].to_vec(), vec![0f32; len], vec![0f32; len]);
                let mut cp = vec![bf16::ZERO; len];
                update_fp32(&mut p, grad.slice(0, len), &mut m, &mut v, Some(&mut cp), &c, &pool);
                assert_copy(&p, &cp, &format!("update_fp32 len {len}"));
            }
        }
        // The lr = 0 pass really kept the special values.
        assert!(
            p0.iter().any(|x| x.is_nan()) && p0.iter().any(|x| x.is_subnormal()) && p0.iter().any(|x| x.is_infinite())
        );
    }

    #[test]
    fn simd_fp32_matches_scalar_bit_for_bit() {
        let pool = ThreadPool::new(2).unwrap();
        let mut rng = SplitMix64::new(5);
        let n = 100_003;
        let p0 = rng.uniform_vec(n);
        let g = rng.uniform_vec(n);
        let m0: Vec<f32> = rng.uniform_vec(n).iter().map(|x| x * 0.1).collect();
        let v0: Vec<f32> = rng.uniform_vec(n).iter().map(|x| x * x * 0.01).collect();
        for beta1 in [0.9, 0.3] {
            let cfg = AdamWConfig { beta1, weight_decay: 0.05, ..Default::default() };
            let c = Coeffs::new(&cfg, 3, 0.5);
            let (mut p, mut m, mut v) = (p0.clone(), m0.clone(), v0.clone());
            update_fp32(&mut p, Grad::F32(&g), &mut m, &mut v, None, &c, &pool);
            let (mut p2, mut m2, mut v2) = (p0.clone(), m0.clone(), v0.clone());
            fp32_chunk(&mut p2, &g, &mut m2, &mut v2, &mut [], &c, SimdLevel::Scalar);
            let same = |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
            assert!(same(&p, &p2) && same(&m, &m2) && same(&v, &v2), "beta1 {beta1}");
            // With the copy, on every level: the same update, and the copy is `half`'s rounding.
            for level in
                [SimdLevel::Scalar, SimdLevel::Avx2, SimdLevel::Avx512].into_iter().filter(|&l| l <= simd_level())
            {
                let (mut p3, mut m3, mut v3) = (p0.clone(), m0.clone(), v0.clone());
                let mut cp = vec![bf16::ZERO; n];
                fp32_chunk(&mut p3, &g, &mut m3, &mut v3, &mut cp, &c, level);
                assert!(same(&p3, &p2) && same(&m3, &m2) && same(&v3, &v2), "{level:?} with copy");
                assert_copy(&p3, &cp, &format!("fp32 {level:?}"));
            }
        }
    }
}
