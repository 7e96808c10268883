//! Matrix products through a BLAS library: how a row-major product of two strided tensors maps
//! onto one column-major strided-batched GEMM call (cuBLAS's `cublasGemmStridedBatchedEx`), and,
//! with the `cuda` feature, the hook that makes burn-cubecl's `float_matmul` run it with cuBLAS.
//!
//! cubecl's own matmul kernels reached 213.7 TFLOPS on an 8192^3 bf16 product on the first H200
//! run (2026-12-04), against about 790 for cuBLAS through PyTorch on those machines: every GEMM of
//! a streamed step ran at about a quarter of what the card can do. The mapping below is pure
//! arithmetic on shapes and strides, tested on the CPU against a reference that computes exactly
//! what the BLAS call is specified to compute ([`reference_gemm`]), so that only the library call
//! itself is left to a GPU run to check.
//!
//! The mapping: the product `C[M, N] = L[M, K] R[K, N]` (row-major, `C` contiguous) is, read
//! column-major, `C^T = R^T L^T`, an `N x M` result with leading dimension `N`. So the BLAS `A` is
//! `R` and the BLAS `B` is `L`. A row-major operand (unit stride along its columns) read
//! column-major is its own transpose, so it is passed untransposed; an operand whose unit stride is
//! along its rows (a transposed view, as autodiff's backward makes) is passed transposed. Batch
//! dimensions are broadcast as in Burn and must collapse into one stride per operand (zero for an
//! operand broadcast over every batch); anything else (permuted batches, non-unit inner strides,
//! sizes beyond `i32`, empty products) is left to the kernels (`None`).

/// One column-major strided-batched GEMM: `C_b = op(A_b) op(B_b)` for `b < batch`, with `op(A)`
/// `m x k`, `op(B)` `k x n`, `C` `m x n`, and `X_b` at element offset `b * stride_x`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GemmCall {
    /// `A` is used transposed (`op(A) = A^T`, stored `k x m`) rather than as stored (`m x k`).
    pub trans_a: bool,
    /// `B` is used transposed (`op(B) = B^T`, stored `n x k`) rather than as stored (`k x n`).
    pub trans_b: bool,
    /// Rows of `op(A)` and `C`.
    pub m: i32,
    /// Columns of `op(B)` and `C`.
    pub n: i32,
    /// Columns of `op(A)`, rows of `op(B)`.
    pub k: i32,
    /// Leading dimensions (column strides) of the stored `A`, `B`, `C`.
    pub lda: i32,
    /// See `lda`.
    pub ldb: i32,
    /// See `lda`.
    pub ldc: i32,
    /// Element strides between consecutive batches (0: the same matrix for every batch).
    pub stride_a: i64,
    /// See `stride_a`.
    pub stride_b: i64,
    /// See `stride_a`.
    pub stride_c: i64,
    /// Number of products.
    pub batch: i32,
}

/// A product planned for a BLAS call: the call, with `A = rhs` and `B = lhs` (see the module docs),
/// and the shape of the contiguous row-major output it writes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlannedGemm {
    /// The call.
    pub call: GemmCall,
    /// `[batch dims..., M, N]`, contiguous.
    pub out_shape: Vec<usize>,
}

/// How one operand's matrix is stored, read column-major: untransposed with leading dimension
/// `ld`, or transposed.
struct Stored {
    trans: bool,
    ld: usize,
}

/// Operand `X[rows, cols]` with strides `(sr, sc)` is to be used as `X^T` (the row-major trick,
/// module docs). Returns how to pass it: unit column stride -> as stored (its column-major reading
/// *is* `X^T`, `cols x rows`, leading dimension `sr`); unit row stride -> transposed (its
/// column-major reading is `X`, leading dimension `sc`). A dimension of size 1 has no meaningful
/// stride, so its stride is taken as whatever makes the layout valid.
fn stored_for_transpose(rows: usize, cols: usize, sr: usize, sc: usize) -> Option<Stored> {
    let sc = if cols == 1 { 1 } else { sc };
    let sr_unit = rows == 1 || sr == 1;
    if sc == 1 && (rows == 1 || sr >= cols) {
        // Column-major `cols x rows` with leading dimension sr (>= cols).
        Some(Stored { trans: false, ld: if rows == 1 { cols.max(1) } else { sr } })
    } else if sr_unit && (cols == 1 || sc >= rows) {
        // Column-major `rows x cols` with leading dimension sc (>= rows), used transposed.
        Some(Stored { trans: true, ld: if cols == 1 { rows.max(1) } else { sc } })
    } else {
        None
    }
}

/// The per-operand batch stride over the broadcast batch `dims`, if its offsets are linear in the
/// flattened (row-major) batch index: `offset(b) = b * stride`. `shape`/`strides` are the
/// operand's batch dimensions (fewer than `dims` when it is broadcast over leading ones).
fn batch_stride(dims: &[usize], shape: &[usize], strides: &[usize]) -> Option<i64> {
    let lead = dims.len() - shape.len();
    // Effective stride per output batch dim: 0 where the operand has no such dim or has size 1.
    let eff = |i: usize| if i < lead || shape[i - lead] == 1 { 0 } else { strides[i - lead] };
    let mut stride: Option<usize> = None;
    let mut place = 1usize; // elements of the flattened index per step of dim i
    for i in (0..dims.len()).rev() {
        if dims[i] > 1 {
            let s = eff(i);
            match stride {
                None => {
                    // The innermost non-trivial dim fixes the stride per flattened step.
                    if s % place != 0 {
                        return None;
                    }
                    stride = Some(s / place);
                }
                Some(b) => {
                    if s != b.checked_mul(place)? {
                        return None;
                    }
                }
            }
        }
        place = place.checked_mul(dims[i])?;
    }
    i64::try_from(stride.unwrap_or(0)).ok()
}

/// Plans `lhs [.., M, K] x rhs [.., K, N]` (Burn's matmul, batch dims broadcast) as one call, or
/// `None` when it does not fit one (see the module docs). Strides are in elements.
pub fn plan_gemm(
    lhs_shape: &[usize],
    lhs_strides: &[usize],
    rhs_shape: &[usize],
    rhs_strides: &[usize],
) -> Option<PlannedGemm> {
    let (lr, rr) = (lhs_shape.len(), rhs_shape.len());
    if lr < 2 || rr < 2 || lhs_strides.len() != lr || rhs_strides.len() != rr {
        return None;
    }
    let (m, k) = (lhs_shape[lr - 2], lhs_shape[lr - 1]);
    let (k2, n) = (rhs_shape[rr - 2], rhs_shape[rr - 1]);
    if k != k2 || m == 0 || n == 0 || k == 0 {
        return None;
    }
    // Broadcast batch dims, aligned at the right.
    let (lb, rb) = (&lhs_shape[..lr - 2], &rhs_shape[..rr - 2]);
    let nb = lb.len().max(rb.len());
    let mut dims = vec![1usize; nb];
    for (i, d) in dims.iter_mut().enumerate() {
        let at = |b: &[usize]| if i + b.len() >= nb { b[i + b.len() - nb] } else { 1 };
        let (a, b) = (at(lb), at(rb));
        *d = match (a, b) {
            (a, b) if a == b => a,
            (1, b) => b,
            (a, 1) => a,
            _ => return None,
        };
    }
    let batch: usize = dims.iter().product();
    if batch == 0 {
        return None;
    }
    let stride_l = batch_stride(&dims, lb, &lhs_strides[..lr - 2])?;
    let stride_r = batch_stride(&dims, rb, &rhs_strides[..rr - 2])?;
    // A = rhs (K x N, used as R^T), B = lhs (M x K, used as L^T).
    let a = stored_for_transpose(k, n, rhs_strides[rr - 2], rhs_strides[rr - 1])?;
    let b = stored_for_transpose(m, k, lhs_strides[lr - 2], lhs_strides[lr - 1])?;
    let i32_of = |x: usize| i32::try_from(x).ok();
    let call = GemmCall {
        trans_a: a.trans,
        trans_b: b.trans,
        m: i32_of(n)?,
        n: i32_of(m)?,
        k: i32_of(k)?,
        lda: i32_of(a.ld)?,
        ldb: i32_of(b.ld)?,
        ldc: i32_of(n)?,
        stride_a: stride_r,
        stride_b: stride_l,
        stride_c: i64::try_from(m.checked_mul(n)?).ok()?,
        batch: i32_of(batch)?,
    };
    let mut out_shape = dims;
    out_shape.extend([m, n]);
    Some(PlannedGemm { call, out_shape })
}

/// What the call computes, by the BLAS specification (column-major, `alpha = 1`, `beta = 0`): for
/// each batch `b`, `C_b[i + j * ldc] = sum_p opA(i, p) * opB(p, j)` where `opA(i, p)` is
/// `A_b[i + p * lda]` (or `A_b[p + i * lda]` transposed) and likewise for `B`. The test oracle for
/// [`plan_gemm`]; `a`, `b`, `c` are the buffers the call's pointers address.
pub fn reference_gemm(call: &GemmCall, a: &[f32], b: &[f32], c: &mut [f32]) {
    let (m, n, k) = (call.m as usize, call.n as usize, call.k as usize);
    let (lda, ldb, ldc) = (call.lda as usize, call.ldb as usize, call.ldc as usize);
    for bi in 0..call.batch as usize {
        let (oa, ob, oc) = (bi * call.stride_a as usize, bi * call.stride_b as usize, bi * call.stride_c as usize);
        for j in 0..n {
            for i in 0..m {
                let mut acc = 0f64;
                for p in 0..k {
                    let x = if call.trans_a { a[oa + p + i * lda] } else { a[oa + i + p * lda] };
                    let y = if call.trans_b { b[ob + j + p * ldb] } else { b[ob + p + j * ldb] };
                    acc += f64::from(x) * f64::from(y);
                }
                c[oc + i + j * ldc] = acc as f32;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A tiny deterministic generator (xorshift), so the test needs no dependency.
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
        fn below(&mut self, n: usize) -> usize {
            (self.next() % n as u64) as usize
        }
    }

    /// A strided view: shape, strides (elements) and the buffer, with values that identify each
    /// element. The view is made by laying out a permutation of the dims contiguously (with an
    /// optional padded leading dimension), then giving the logical dims their strides, and
    /// optionally broadcasting some batch dims (stride 0).
    fn view(shape: &[usize], rng: &mut Rng, layout: usize) -> (Vec<usize>, Vec<f32>) {
        let r = shape.len();
        let mut order: Vec<usize> = (0..r).collect(); // memory order, outermost first
        match layout % 4 {
            1 => order.swap(r - 2, r - 1),       // transposed matrix
            2 if r >= 3 => order.rotate_left(1), // batch dim innermost-but-matrix (permuted)
            _ => {}
        }
        let pad = if layout % 3 == 2 { 3 } else { 0 }; // padded innermost row
        let mut strides = vec![0usize; r];
        let mut size = 1usize;
        for (pos, &d) in order.iter().enumerate().rev() {
            strides[d] = size;
            size *= shape[d] + if pos == r - 1 { pad } else { 0 };
        }
        // A dim of size 1 may carry any stride (broadcast batch dims, unsqueezed rows): a random one.
        for d in 0..r {
            if shape[d] == 1 && rng.below(2) == 0 {
                strides[d] = rng.below(7);
            }
        }
        let buf = (0..size.max(1)).map(|_| (rng.below(2001) as f32 - 1000.0) / 256.0).collect();
        (strides, buf)
    }

    fn at(shape: &[usize], strides: &[usize], idx: &[usize]) -> usize {
        // idx aligned at the right with broadcasting: size-1 dims read index 0.
        let off = idx.len() - shape.len();
        shape.iter().zip(strides).enumerate().map(|(i, (&d, &s))| if d == 1 { 0 } else { idx[i + off] * s }).sum()
    }

    /// Burn's matmul by definition: broadcast batch dims, `out[.., i, j] = sum_p l[.., i, p] r[.., p, j]`.
    fn naive(
        ls: &[usize],
        lst: &[usize],
        lb: &[f32],
        rs: &[usize],
        rst: &[usize],
        rb: &[f32],
        out_shape: &[usize],
    ) -> Vec<f32> {
        let r = out_shape.len();
        let k = ls[ls.len() - 1];
        let total: usize = out_shape.iter().product();
        let mut out = vec![0f32; total];
        let mut idx = vec![0usize; r];
        for (o, v) in out.iter_mut().enumerate() {
            let mut rem = o;
            for d in (0..r).rev() {
                idx[d] = rem % out_shape[d];
                rem /= out_shape[d];
            }
            let (i, j) = (idx[r - 2], idx[r - 1]);
            let mut acc = 0f64;
            for p in 0..k {
                let mut li = idx.clone();
                li[r - 2] = i;
                li[r - 1] = p;
                let mut ri = idx.clone();
                ri[r - 2] = p;
                ri[r - 1] = j;
                let x = lb[at(ls, lst, &li[r - ls.len()..])];
                let y = rb[at(rs, rst, &ri[r - rs.len()..])];
                acc += f64::from(x) * f64::from(y);
            }
            *v = acc as f32;
        }
        out
    }

    /// Every planned call computes Burn's product exactly (values are multiples of 1/256 with small
    /// integers, so f64 sums are exact and the two orders agree bit for bit), over random shapes
    /// with transposed, padded, broadcast and permuted operands; and the planner declines only
    /// layouts one call cannot express (permuted batch dims), never a plain or transposed one.
    #[test]
    fn planned_calls_compute_burns_product() {
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
        let (mut planned, mut declined) = (0, 0);
        for case in 0..600 {
            let (m, n, k) = (1 + rng.below(6), 1 + rng.below(6), 1 + rng.below(6));
            let nb = rng.below(3);
            let dims: Vec<usize> = (0..nb).map(|_| 1 + rng.below(3)).collect();
            // Each operand: all batch dims, fewer (leading broadcast), or some set to 1.
            let batch_of = |rng: &mut Rng| -> Vec<usize> {
                let keep = nb - rng.below(nb + 1).min(nb);
                dims[nb - keep..].iter().map(|&d| if rng.below(4) == 0 { 1 } else { d }).collect()
            };
            let mut ls = batch_of(&mut rng);
            ls.extend([m, k]);
            let mut rs = batch_of(&mut rng);
            rs.extend([k, n]);
            let (lst, lb) = view(&ls, &mut rng, case);
            let rl = case / 4 + rng.below(4);
            let (rst, rb) = view(&rs, &mut rng, rl);
            let Some(p) = plan_gemm(&ls, &lst, &rs, &rst) else {
                declined += 1;
                // Only permuted batch layouts may be declined.
                let plain = |st: &[usize], s: &[usize]| {
                    let r = s.len();
                    (st[r - 1] == 1 || st[r - 2] == 1 || s[r - 1] == 1 || s[r - 2] == 1)
                        && (0..r.saturating_sub(2)).all(|d| s[d] == 1 || st[d] >= s[r - 1] * s[r - 2])
                };
                assert!(
                    !(plain(&lst, &ls) && plain(&rst, &rs) && ls.len() <= 3 && rs.len() <= 3 && nb <= 1),
                    "declined a plain layout: {ls:?} {lst:?} x {rs:?} {rst:?}"
                );
                continue;
            };
            planned += 1;
            // cuBLAS rejects a leading dimension below the stored matrix's row count.
            let c = p.call;
            assert!(c.lda >= if c.trans_a { c.k } else { c.m }.max(1), "lda: {c:?}");
            assert!(c.ldb >= if c.trans_b { c.n } else { c.k }.max(1), "ldb: {c:?}");
            assert!(c.ldc >= c.m.max(1), "ldc: {c:?}");
            let want = naive(&ls, &lst, &lb, &rs, &rst, &rb, &p.out_shape);
            let mut got = vec![f32::NAN; want.len()];
            reference_gemm(&p.call, &rb, &lb, &mut got);
            assert_eq!(got, want, "case {case}: {ls:?} {lst:?} x {rs:?} {rst:?} -> {:?}", p.call);
        }
        eprintln!("planned {planned}, declined {declined}");
        assert!(planned > 400, "planned {planned}, declined {declined}");
    }

    /// The shapes a streamed layer's products take: `x W^T` (W stored `[out, in]`, used through a
    /// transposed view), and autodiff's two backward products, and attention's batched products.
    #[test]
    fn layer_products_map_to_the_expected_calls() {
        // x [B, S, in] contiguous times W^T, W [out, in] contiguous -> W^T has strides (1, in).
        let p = plan_gemm(&[2, 8, 16], &[128, 16, 1], &[16, 32], &[1, 16]).expect("planned");
        assert_eq!(p.out_shape, vec![2, 8, 32]);
        let c = p.call;
        // A = W^T (K=16 x N=32), unit row stride: stored W column-major is W^T... passed transposed.
        assert_eq!((c.trans_a, c.trans_b, c.m, c.n, c.k), (true, false, 32, 8, 16));
        assert_eq!((c.lda, c.ldb, c.ldc), (16, 16, 32));
        assert_eq!((c.stride_a, c.stride_b, c.stride_c, c.batch), (0, 128, 256, 2));
        // Attention scores: q [B, H, S, D] x k^T [B, H, D, S] (a transposed view of k).
        let p = plan_gemm(&[2, 4, 8, 16], &[512, 128, 16, 1], &[2, 4, 16, 8], &[512, 128, 1, 16]).expect("planned");
        assert_eq!((p.call.batch, p.call.stride_a, p.call.stride_b, p.call.stride_c), (8, 128, 128, 64));
        // Heads permuted in memory ([B, S, H, D] viewed as [B, H, S, D]) do not collapse.
        assert_eq!(plan_gemm(&[2, 4, 8, 16], &[512, 16, 64, 1], &[16, 8], &[8, 1]), None);
    }
}

/// The runtime side shared by every hook: from burn-cubecl's operands to a planned call, with the
/// operands it must read (made contiguous where one call cannot express their batch layout).
#[cfg(any(feature = "cuda", feature = "wgpu"))]
pub mod hook {
    use burn::tensor::DType;
    use burn_cubecl::CubeRuntime;
    use burn_cubecl::tensor::CubeTensor;

    use super::{GemmCall, plan_gemm};

    /// A product ready for one call: BLAS `A` is `a` (the right operand), `B` is `b` (the left).
    pub struct Prepared<R: CubeRuntime> {
        /// The call (offsets are relative to each operand's handle).
        pub call: GemmCall,
        /// The right operand, BLAS `A`.
        pub a: CubeTensor<R>,
        /// The left operand, BLAS `B`.
        pub b: CubeTensor<R>,
        /// The contiguous output's shape.
        pub out_shape: Vec<usize>,
        /// The operands' and the output's dtype.
        pub dtype: DType,
    }

    /// The call for `lhs x rhs`, or `None` when a library call does not take it: quantized
    /// operands, mixed dtypes, dtypes other than f32/bf16/f16, empty or oversized products.
    pub fn prepare<R: CubeRuntime>(lhs: &CubeTensor<R>, rhs: &CubeTensor<R>) -> Option<Prepared<R>> {
        if lhs.qparams.is_some() || rhs.qparams.is_some() || lhs.dtype != rhs.dtype {
            return None;
        }
        if !matches!(lhs.dtype, DType::F32 | DType::BF16 | DType::F16) {
            return None;
        }
        let plan = |l: &CubeTensor<R>, r: &CubeTensor<R>| {
            plan_gemm(l.meta.shape(), l.meta.strides(), r.meta.shape(), r.meta.strides())
        };
        let (b, a, planned) = match plan(lhs, rhs) {
            Some(p) => (lhs.clone(), rhs.clone(), p),
            None => {
                // Permuted batch dims: contiguous copies first, as cubecl's own matmul would.
                let l = burn_cubecl::kernel::into_contiguous(lhs.clone());
                let r = burn_cubecl::kernel::into_contiguous(rhs.clone());
                let p = plan(&l, &r)?;
                (l, r, p)
            }
        };
        Some(Prepared { call: planned.call, a, b, out_shape: planned.out_shape, dtype: lhs.dtype })
    }
}

/// The cuBLAS hook for burn-cubecl's `float_matmul` on CUDA (`LT_GEMM=cublas`).
#[cfg(feature = "cuda")]
pub mod cuda {
    use std::any::Any;
    use std::sync::Mutex;
    use std::sync::atomic::{AtomicBool, Ordering};

    use burn::tensor::DType;
    use burn_cubecl::tensor::CubeTensor;
    use cubecl::cuda::CudaRuntime;
    use cudarc::cublas::sys as cb;

    use super::GemmCall;
    use super::hook::prepare;

    type T = CubeTensor<CudaRuntime>;

    /// The library handle, made on first use in the device's context (inside a native call).
    struct Handle(cb::cublasHandle_t);
    // SAFETY: a cuBLAS handle may be used from any thread, one call at a time: the mutex below
    // serialises its users (and every use is inside the device's server exclusion as well).
    unsafe impl Send for Handle {}
    static HANDLE: Mutex<Option<Handle>> = Mutex::new(None);
    /// Cleared after a failed call: the rest of the run uses cubecl's kernels.
    static ENABLED: AtomicBool = AtomicBool::new(true);

    /// Loads libcublas and installs the hook; `Err` with one line when the library cannot be
    /// loaded (cudarc panics then: caught here) or a hook was installed already.
    pub fn install() -> Result<(), String> {
        // SAFETY: loads the shared library (cudarc's lazy loader, which panics when it is missing)
        // and looks a symbol up; nothing is called, and the symbol is read as an untyped pointer.
        let loaded = crate::device::catch_quietly(
            || unsafe { cb::culib().get::<*const ()>(b"cublasGemmStridedBatchedEx") }.is_ok(),
            "libcublas could not be loaded",
        )?;
        if !loaded {
            return Err("libcublas has no cublasGemmStridedBatchedEx".into());
        }
        if burn_cubecl::matmul_hook::set_matmul_hook(hook_fn) {
            Ok(())
        } else {
            Err("a matmul hook was already installed".into())
        }
    }

    fn data_type(dtype: DType) -> Option<cb::cudaDataType> {
        Some(match dtype {
            DType::F32 => cb::cudaDataType::CUDA_R_32F,
            DType::BF16 => cb::cudaDataType::CUDA_R_16BF,
            DType::F16 => cb::cudaDataType::CUDA_R_16F,
            _ => return None,
        })
    }

    /// The hook: the product by one cuBLAS call, or `None` (cubecl's kernels) for other runtimes,
    /// what [`prepare`] declines, and after a failed call.
    fn hook_fn(lhs: &dyn Any, rhs: &dyn Any) -> Option<Box<dyn Any>> {
        let (lhs, rhs) = (lhs.downcast_ref::<T>()?, rhs.downcast_ref::<T>()?);
        if !ENABLED.load(Ordering::Relaxed) {
            return None;
        }
        let p = prepare(lhs, rhs)?;
        let ty = data_type(p.dtype)?;
        let elems: usize = p.out_shape.iter().product();
        let client = p.b.client.clone();
        let out_handle = client.empty(elems * p.dtype.size());
        let out =
            T::new_contiguous(client.clone(), p.b.device.clone(), p.out_shape.clone().into(), out_handle, p.dtype);
        let bindings = vec![p.a.handle.clone().binding(), p.b.handle.clone().binding(), out.handle.clone().binding()];
        let call = p.call;
        let result = client
            .with_server(move |server, stream_id| {
                server.native_call(stream_id, bindings, |stream, ptrs| gemm(stream, ptrs, &call, ty))
            })
            .map_err(|e| e.to_string())
            .and_then(|r| r);
        match result {
            Ok(()) => Some(Box::new(out)),
            Err(e) => {
                let e = e.lines().next().unwrap_or_default();
                if ENABLED.swap(false, Ordering::Relaxed) {
                    eprintln!("warning: cuBLAS GEMM failed ({e}); the rest of the run uses cubecl's matmul kernels");
                }
                None
            }
        }
    }
    /// Enqueues `call` on `stream` with `A`, `B`, `C` at `ptrs[0..3]` (`alpha = 1`, `beta = 0`,
    /// fp32 accumulation).
    fn gemm(stream: *mut std::ffi::c_void, ptrs: &[u64], call: &GemmCall, ty: cb::cudaDataType) -> Result<(), String> {
        let mut handle = HANDLE.lock().map_err(|_| "cuBLAS handle lock poisoned".to_string())?;
        if handle.is_none() {
            let mut h: cb::cublasHandle_t = std::ptr::null_mut();
            // SAFETY: writes a new handle into `h`; the device's context is current (native call).
            check(unsafe { cb::cublasCreate_v2(&mut h) }, "cublasCreate")?;
            *handle = Some(Handle(h));
        }
        let Some(Handle(h)) = handle.as_ref() else { return Err("no cuBLAS handle".into()) };
        // SAFETY: `h` is a live handle; `stream` is the server's stream for this call.
        check(unsafe { cb::cublasSetStream_v2(*h, stream.cast()) }, "cublasSetStream")?;
        let op = |t: bool| if t { cb::cublasOperation_t::CUBLAS_OP_T } else { cb::cublasOperation_t::CUBLAS_OP_N };
        let (alpha, beta) = (1f32, 0f32);
        // SAFETY: the pointers are the device addresses of the three bindings, resolved by the
        // server for this stream; `plan_gemm` keeps every index the call makes inside each
        // operand's strided view (tested against `reference_gemm`), and `C` is a fresh
        // contiguous buffer of `batch * m * n` elements. alpha/beta are fp32 as the compute type
        // requires and outlive the (host-side) call.
        let status = unsafe {
            cb::cublasGemmStridedBatchedEx(
                *h,
                op(call.trans_a),
                op(call.trans_b),
                call.m,
                call.n,
                call.k,
                (&alpha as *const f32).cast(),
                ptrs[0] as *const std::ffi::c_void,
                ty,
                call.lda,
                call.stride_a,
                ptrs[1] as *const std::ffi::c_void,
                ty,
                call.ldb,
                call.stride_b,
                (&beta as *const f32).cast(),
                ptrs[2] as *mut std::ffi::c_void,
                ty,
                call.ldc,
                call.stride_c,
                call.batch,
                cb::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cb::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        };
        check(status, "cublasGemmStridedBatchedEx")
    }

    fn check(status: cb::cublasStatus_t, what: &str) -> Result<(), String> {
        if status == cb::cublasStatus_t::CUBLAS_STATUS_SUCCESS { Ok(()) } else { Err(format!("{what}: {status:?}")) }
    }
}
