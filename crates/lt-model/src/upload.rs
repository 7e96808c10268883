//! Host -> device tensors for streaming: a layer's host data in the backend's float dtype, handed to
//! the runtime with as few host copies as the runtime allows.
//!
//! A streamed layer is uploaded for its forward and again for its backward, twice per layer per step,
//! from the executor's h2d thread while the device computes. Two sources:
//! - **the optimizer's bf16 copy** ([`shared_bf16_data`]): on a bf16 device the AdamW update (8-bit
//!   or fp32) writes each parameter's bf16 bits in the same pass that writes the fp32 master
//!   (lt-optim's `update_with_copy`), so an upload converts nothing. The [`TensorData`] shares the copy's
//!   allocation, and the patched cubecl-runtime (docs/architecture.md, "Patched cubecl-runtime")
//!   hands it to the server as it is: no host copy of ours or cubecl's before the driver's own.
//!   On CUDA the copy is page-locked in place ([`CopyBuf`]), so the driver's own is one DMA;
//! - **the fp32 master, converted** ([`host_data`]): f32 devices (ndarray, wgpu on most adapters),
//!   and bf16 without a copy. One pass over several threads: each converts its own range (f32 ->
//!   bf16 or f16 with round-to-nearest-even, bit for bit what Burn's conversion through `half`
//!   gives, bf16 without branches so it vectorizes; a plain copy for f32 backends) straight into the
//!   output, so the first-touch page faults are spread over the threads too ([`PREP_THREADS`] at
//!   most, only for tensors of [`PAR_MIN`] elements or more). Burn's own path
//!   (`TensorData::new(data.clone())`, then a conversion inside `Tensor::from_data`) makes two
//!   single-threaded passes into freshly allocated memory.
//!
//! [`Backend::staging`] (cubecl's pinned host pool on burn-cuda) is off unless `LT_PINNED_UPLOADS=1`:
//! cubecl 0.10's `create` copies a pinned buffer into pageable memory before the DMA (it must: the
//! pinned block goes back to the pool on drop, while an asynchronous copy may still read it), so
//! staging added a single-threaded copy and a blocking round trip to the runtime and bought nothing
//! (cubecl-runtime 0.10.0 `client.rs`, `staging` and `do_create`).

use std::mem::MaybeUninit;
use std::sync::{Mutex, OnceLock};

use burn::tensor::backend::Backend;
use burn::tensor::{AllocationProperty, Bytes, DType, Element, Tensor, TensorData};

/// At most this many threads convert one tensor.
pub const PREP_THREADS: usize = 8;
/// Tensors with fewer elements are converted on the calling thread.
pub const PAR_MIN: usize = 1 << 20;

/// Whether uploads go through [`Backend::staging`] first: off by default (see the module docs for
/// why), on with `LT_PINNED_UPLOADS=1` (or `on`, `true`) for comparison. Read once per process.
pub fn pinned_uploads() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| env_switch("LT_PINNED_UPLOADS", false))
}

/// Whether bf16 uploads read the optimizer-written copy ([`shared_bf16_data`]): on by default, off
/// with `LT_UPLOAD_COPY=0` (or `off`, `false`), which converts the masters at every upload instead
/// (a fallback and a baseline). Read once per process.
pub fn upload_copy() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| env_switch("LT_UPLOAD_COPY", true))
}

/// Whether a bf16 device's decoder-layer gradients are kept on the host in bf16, as downloaded
/// (lt-exec's `GradBuf`; on by default): `LT_BF16_GRADS=0` keeps them in fp32 instead (the older
/// layout, 2 B/param more host memory; to compare against). Read once per process.
pub fn bf16_grads() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| env_switch("LT_BF16_GRADS", true))
}

/// An on/off environment switch: `default`, unless the variable says the opposite (`1`, `on`,
/// `true` turn it on; `0`, `off`, `false` turn it off; anything else keeps the default).
fn env_switch(name: &str, default: bool) -> bool {
    match std::env::var(name).ok().as_deref().map(str::trim) {
        Some("1" | "on" | "true") => true,
        Some("0" | "off" | "false") => false,
        _ => default,
    }
}

/// A bf16 copy of one fp32 master tensor, shared between the optimizer that keeps it up to date and
/// the uploads that read it.
pub type Bf16Copy = std::sync::Arc<CopyBuf>;

/// How a backend page-locks host memory for its DMA engine: on CUDA, `cuMemHostRegister` and
/// `cuMemHostUnregister` in the device's primary context (`device::cuda`). Installed once per
/// process by the code that creates the device; none on the CPU and wgpu backends.
#[derive(Clone, Copy, Debug)]
pub struct Pinner {
    /// Page-locks `len` bytes at `ptr`; `false` when the driver refuses (the buffer stays pageable).
    pub register: fn(*mut u8, usize) -> bool,
    /// Undoes a successful `register` of the buffer at `ptr`.
    pub unregister: fn(*mut u8),
}

static PINNER: OnceLock<Pinner> = OnceLock::new();

/// Installs the backend's [`Pinner`]: from then on [`CopyBuf::pin`] page-locks upload copies. Only
/// the first call counts. The device set-up installs it only when [`pin_copies`] is on, so that is
/// the one place the switch is read.
pub fn set_pinner(p: Pinner) {
    let _ = PINNER.set(p);
}

/// Whether upload copies are page-locked when a backend offers it: on by default, off with
/// `LT_PIN_COPY=0` (or `off`, `false`), for comparison and as a fallback. Read once per process.
pub fn pin_copies() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| env_switch("LT_PIN_COPY", true))
}

/// Copies smaller than this stay pageable: a norm weight's DMA costs less than locking its page.
pub const PIN_MIN_BYTES: usize = 1 << 20;

/// The bf16 upload copy of one master: a fixed-size buffer (no method can reallocate it, so it can
/// be page-locked in place) that [`pin`](Self::pin) registers with the backend's DMA engine once and
/// that unregisters itself when the last reference goes.
///
/// Page-locked, an upload is one DMA at the bus's speed. Pageable, the CUDA driver copies it through
/// its own bounce buffers first: on the first H200 run (2026-12-04) uploads from pageable memory ran
/// at 6.2 GB/s against 54.6 GB/s for downloads into cubecl's page-locked pool.
///
/// A clone (`Arc::make_mut` while an upload still holds the buffer) is pageable until it is pinned
/// in turn. Unregistration happens in `Drop`, that is after the last upload holding the buffer has
/// let it go (cubecl keeps it until the copy's stream has passed the DMA): freeing registered memory
/// would leave the driver a stale page list.
///
/// A copy large enough to be page-locked ([`PIN_MIN_BYTES`]) owns whole pages: its values start on a
/// page boundary inside a slightly larger allocation whose other bytes nobody uses, so no other
/// allocation shares a page with it. The driver locks whole pages; `malloc` places blocks of up to
/// its `mmap` threshold (32 MiB under `lt_core::hostmem::tune_malloc`, and as much once glibc's
/// adaptive threshold has risen) next to each other on its heap, as a 7B layer's attention copies
/// (3.7-26 MB) are. Whether CUDA locks and unlocks two disjoint ranges that share a page
/// independently is not established here (it refuses overlapping ones with
/// `CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED`; one public report has the driver accepting disjoint
/// ones on one page); owning the pages leaves nothing to find out on the first GPU run, for two
/// pages per copy, and puts the optimizer's 64-byte stores of the copy on cache-line boundaries.
pub struct CopyBuf {
    /// The allocation; the values are `buf[off..off + len]`.
    buf: Vec<half::bf16>,
    off: usize,
    len: usize,
    pin: Mutex<PinState>,
}

/// Where a [`CopyBuf`] stands with the backend's page-locking.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PinState {
    /// Not tried yet (no backend pinner installed when last asked, or never asked).
    Unpinned,
    /// Registered: uploads DMA straight from it.
    Pinned,
    /// Not eligible (smaller than [`PIN_MIN_BYTES`]) or refused by the driver: not tried again.
    Pageable,
}

impl CopyBuf {
    /// The values of `data` (pageable until [`pin`](Self::pin)). A copy that may be page-locked is
    /// moved into whole pages of its own (one copy of the values); a smaller one keeps `data`.
    pub fn new(data: Vec<half::bf16>) -> Self {
        if std::mem::size_of_val(data.as_slice()) < PIN_MIN_BYTES {
            return Self::unpaged(data);
        }
        Self::from_slice(&data)
    }

    /// A copy of `src`, on whole pages of its own when large enough to be page-locked.
    fn from_slice(src: &[half::bf16]) -> Self {
        if std::mem::size_of_val(src) < PIN_MIN_BYTES {
            return Self::unpaged(src.to_vec());
        }
        Self::paged(src.len(), |b| b.extend_from_slice(src))
    }

    /// `buf` as it is: a copy too small to be page-locked.
    fn unpaged(buf: Vec<half::bf16>) -> Self {
        let len = buf.len();
        Self { buf, off: 0, len, pin: Mutex::new(PinState::Unpinned) }
    }

    /// `len` zeros (to be written with [`as_mut_slice`](Self::as_mut_slice)), on whole pages of their
    /// own when large enough to be page-locked, on transparent huge pages where they span some.
    pub fn zeroed(len: usize) -> Self {
        if len.saturating_mul(std::mem::size_of::<half::bf16>()) < PIN_MIN_BYTES {
            return Self::unpaged(vec![half::bf16::ZERO; len]);
        }
        Self::paged(len, |b| b.resize(b.len() + len, half::bf16::ZERO))
    }

    /// `len` values on whole pages of their own: `fill` appends exactly `len` values to a vector
    /// that ends, when it is called, on a page boundary. The allocation holds two pages more than the values
    /// need (up to one before them, to reach a page boundary, and up to one after, to finish their
    /// last page), asked for huge pages before anything touches it.
    fn paged(len: usize, fill: impl FnOnce(&mut Vec<half::bf16>)) -> Self {
        let page = lt_core::hostmem::page_size();
        let mut buf = lt_core::hostmem::huge_with_capacity(len + page);
        let addr = buf.as_ptr() as usize;
        let off = (addr.next_multiple_of(page) - addr) / std::mem::size_of::<half::bf16>();
        buf.resize(off, half::bf16::ZERO);
        fill(&mut buf);
        debug_assert_eq!(buf.len(), off + len);
        buf.resize(len + page, half::bf16::ZERO);
        // Within the capacity throughout: the values never moved off the page boundary.
        debug_assert_eq!(buf.as_ptr() as usize, addr);
        Self { buf, off, len, pin: Mutex::new(PinState::Unpinned) }
    }

    /// The values.
    pub fn as_slice(&self) -> &[half::bf16] {
        &self.buf[self.off..self.off + self.len]
    }

    /// The values, to write in place (the buffer keeps its address: a registration stays valid).
    pub fn as_mut_slice(&mut self) -> &mut [half::bf16] {
        &mut self.buf[self.off..self.off + self.len]
    }

    /// Page-locks the buffer with the installed [`Pinner`] if it is large enough and was not tried
    /// before; returns the state after. Without a pinner (CPU, wgpu, `LT_PIN_COPY=0`, or before the
    /// CUDA device exists) it stays [`PinState::Unpinned`], to be tried again.
    pub fn pin(&self) -> PinState {
        let mut st = self.pin.lock().unwrap_or_else(|e| e.into_inner());
        if *st != PinState::Unpinned {
            return *st;
        }
        let Some(p) = PINNER.get() else { return *st };
        let bytes = std::mem::size_of_val(self.as_slice());
        *st = if bytes < PIN_MIN_BYTES {
            PinState::Pageable
        } else if (p.register)(self.as_slice().as_ptr().cast_mut().cast(), bytes) {
            PinState::Pinned
        } else {
            PinState::Pageable
        };
        *st
    }

    /// Where the buffer stands with page-locking.
    pub fn pin_state(&self) -> PinState {
        *self.pin.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl From<Vec<half::bf16>> for CopyBuf {
    fn from(data: Vec<half::bf16>) -> Self {
        Self::new(data)
    }
}

impl FromIterator<half::bf16> for CopyBuf {
    fn from_iter<I: IntoIterator<Item = half::bf16>>(iter: I) -> Self {
        Self::new(iter.into_iter().collect())
    }
}

impl std::ops::Deref for CopyBuf {
    type Target = [half::bf16];
    fn deref(&self) -> &[half::bf16] {
        self.as_slice()
    }
}

impl Clone for CopyBuf {
    /// A pageable copy of the values (see the type's docs).
    fn clone(&self) -> Self {
        Self::from_slice(self.as_slice())
    }
}

impl std::fmt::Debug for CopyBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CopyBuf").field("len", &self.len).field("pin", &self.pin_state()).finish()
    }
}

impl Drop for CopyBuf {
    fn drop(&mut self) {
        if *self.pin.get_mut().unwrap_or_else(|e| e.into_inner()) == PinState::Pinned
            && let Some(p) = PINNER.get()
        {
            (p.unregister)(self.as_mut_slice().as_mut_ptr().cast());
        }
    }
}

/// `copy` as bf16 [`TensorData`] of shape `shape`, sharing `copy`'s allocation: nothing is converted
/// or copied here. The data holds a reference to `copy` until the runtime is done with it (cubecl's
/// `create` on the patched runtime, a conversion on the CPU backends); a writer that wants the
/// buffer meanwhile gets a fresh one from `Arc::make_mut` instead of racing the upload.
///
/// Returns `None` when `shape` does not describe `copy.len()` elements.
pub fn shared_bf16_data(copy: &Bf16Copy, shape: &[usize]) -> Option<TensorData> {
    /// Lends the copy's bytes to [`bytes::Bytes`] for as long as the upload holds them.
    struct Lent(Bf16Copy);
    impl AsRef<[u8]> for Lent {
        fn as_ref(&self) -> &[u8] {
            bytemuck::cast_slice(self.0.as_slice())
        }
    }
    if shape.iter().product::<usize>() != copy.len() {
        return None;
    }
    // A copy made before the device existed, or a clone, is page-locked at its first upload.
    copy.pin();
    let bytes = bytes::Bytes::from_owner(Lent(std::sync::Arc::clone(copy)));
    Some(TensorData::from_bytes(Bytes::from_shared(bytes, AllocationProperty::Other), shape.to_vec(), DType::BF16))
}

/// The fp32 host values `x` as a [`TensorData`] of shape `shape` and dtype `dtype` (bf16, f16 or
/// f32; any other dtype gets f32 data, which `Tensor::from_data` converts).
pub fn host_data(x: &[f32], shape: &[usize], dtype: DType) -> TensorData {
    match dtype {
        DType::BF16 => TensorData::new(par_map(x, bf16_slice), shape.to_vec()),
        DType::F16 => TensorData::new(par_map(x, |src, dst| map_into(src, dst, half::f16::from_f32)), shape.to_vec()),
        _ => TensorData::new(par_map(x, |src, dst| map_into(src, dst, |v| v)), shape.to_vec()),
    }
}

/// Uploads fp32 host values as a device tensor of backend `B`: [`host_data`] in the backend's float
/// dtype, then [`Backend::staging`] (if enabled, see [`pinned_uploads`]), then `Tensor::from_data`.
///
/// # Panics
/// If `shape` has a rank other than `D` or a different number of elements than `x` (programmer
/// errors: host tensors are validated when they are loaded).
pub fn upload<B: Backend, const D: usize>(x: &[f32], shape: &[usize], device: &B::Device) -> Tensor<B, D> {
    assert_eq!(shape.len(), D, "rank mismatch binding a host tensor");
    assert_eq!(shape.iter().product::<usize>(), x.len(), "shape does not match the host data");
    upload_data(host_data(x, shape, <B::FloatElem as Element>::dtype()), device)
}

/// Uploads host data that is already in its device dtype (an offloaded activation coming back, or
/// the optimizer's bf16 copy): [`Backend::staging`] if enabled (see [`pinned_uploads`]), then
/// `Tensor::from_data`.
pub fn upload_data<B: Backend, const D: usize>(mut data: TensorData, device: &B::Device) -> Tensor<B, D> {
    if pinned_uploads() {
        B::staging(std::iter::once(&mut data), device);
    }
    Tensor::from_data(data, device)
}

/// f32 -> bf16, bit for bit `half::bf16::from_f32` (round to nearest even; a NaN keeps its top
/// mantissa bits and gets the quiet bit), written without branches so the conversion loop
/// vectorizes (`cargo bench -p benches --bench upload`: 4.57 GB/s against 3.00 with `half`).
#[inline(always)]
fn bf16_rne(v: f32) -> half::bf16 {
    let x = v.to_bits();
    // Adding 0x7fff plus the result's lowest bit carries into bit 16 exactly when the dropped half
    // is above one half, or equal to it with an odd result. It cannot overflow: only NaNs are
    // above 0xffff_8000, and they take the other arm.
    let rounded = (x.wrapping_add(0x7fff + ((x >> 16) & 1)) >> 16) as u16;
    let nan = ((x >> 16) | 0x0040) as u16;
    half::bf16::from_bits(if x & 0x7fff_ffff > 0x7f80_0000 { nan } else { rounded })
}

/// `dst[i] = f(src[i])` over the common length.
#[inline(always)]
fn map_into<T>(src: &[f32], dst: &mut [MaybeUninit<T>], f: impl Fn(f32) -> T) {
    for (d, &v) in dst.iter_mut().zip(src) {
        d.write(f(v));
    }
}

/// [`bf16_rne`] over a slice, compiled for AVX2 when the CPU has it (the baseline x86-64 target has
/// no 256-bit integer compares, and this loop runs at half the speed there).
fn bf16_slice(src: &[f32], dst: &mut [MaybeUninit<half::bf16>]) {
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx2")]
        fn avx2(src: &[f32], dst: &mut [MaybeUninit<half::bf16>]) {
            map_into(src, dst, bf16_rne);
        }
        static AVX2: OnceLock<bool> = OnceLock::new();
        if *AVX2.get_or_init(|| std::arch::is_x86_feature_detected!("avx2")) {
            // SAFETY: AVX2 was detected on this CPU.
            return unsafe { avx2(src, dst) };
        }
    }
    map_into(src, dst, bf16_rne);
}

/// `f` (which writes `dst[i]` from `src[i]` for a pair of equal-length slices) over `x` into a new
/// vector, split over up to [`PREP_THREADS`] scoped threads for large inputs.
fn par_map<T: Send>(x: &[f32], f: impl Fn(&[f32], &mut [MaybeUninit<T>]) + Sync) -> Vec<T> {
    let n = x.len();
    let cores = std::thread::available_parallelism().map_or(1, |c| c.get());
    let threads = if n < PAR_MIN { 1 } else { cores.min(PREP_THREADS).min(n / (PAR_MIN / 2)).max(1) };
    let mut out: Vec<T> = Vec::with_capacity(n);
    let chunk = n.div_ceil(threads).max(1);
    {
        let spare = &mut out.spare_capacity_mut()[..n];
        if threads == 1 {
            f(x, spare);
        } else {
            std::thread::scope(|s| {
                for (dst, src) in spare.chunks_mut(chunk).zip(x.chunks(chunk)) {
                    let f = &f;
                    s.spawn(move || f(src, dst));
                }
            });
        }
    }
    // SAFETY: `f` wrote every one of the first `n` elements: on one thread over the whole slice, or
    // over chunks of `spare` and `x` that pair up one to one and cover both exactly (the scoped
    // threads have all joined).
    unsafe { out.set_len(n) };
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::CpuBackend;

    /// Values that exercise rounding: ties, the largest finite values, subnormals, infinities, NaN.
    fn edge_values(n: usize) -> Vec<f32> {
        let special = [
            0.0,
            -0.0,
            1.0,
            f32::from_bits(0x3f80_8000), // a bf16 tie, rounds to even (down)
            f32::from_bits(0x3f81_8000), // a bf16 tie, rounds to even (up)
            f32::from_bits(0x3f80_8001),
            f32::MAX,
            f32::MIN,
            f32::MIN_POSITIVE,
            f32::from_bits(1),
            f32::from_bits(0x0040_8000),
            65504.0,
            65520.0, // rounds to f16 infinity
            1e-8,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
        ];
        let mut s = 0x9e37_79b9_7f4a_7c15u64;
        (0..n)
            .map(|i| {
                if i % 97 < special.len() {
                    special[i % 97]
                } else {
                    s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                    f32::from_bits((s >> 32) as u32)
                }
            })
            .collect()
    }

    /// The branch-free bf16 rounding equals `half`'s for every exponent and sign with the low 16
    /// bits at each rounding boundary (and random ones), which covers ties, carries into the
    /// exponent, overflow to infinity and every NaN payload class.
    #[test]
    fn bf16_rounding_equals_half() {
        let mut s = 0x2545_f491_4f6c_dd1du64;
        for hi in 0u32..=0xffff {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            for lo in [0u32, 1, 0x7fff, 0x8000, 0x8001, 0xffff, (s as u32) & 0xffff, (s >> 40) as u32 & 0xffff] {
                let v = f32::from_bits(hi << 16 | lo);
                assert_eq!(bf16_rne(v).to_bits(), half::bf16::from_f32(v).to_bits(), "{:#010x}", hi << 16 | lo);
            }
        }
    }

    /// The threaded conversion gives exactly Burn's own conversion, byte for byte, for bf16, f16
    /// and f32, on sizes below and above the threading threshold (including ragged chunks).
    #[test]
    fn host_data_equals_burns_conversion() {
        for n in [0, 5, 1000, PAR_MIN + 12_345] {
            let x = edge_values(n);
            let shape = vec![n];
            let burn = |dt: DType| TensorData::new(x.clone(), shape.clone()).convert_dtype(dt);
            let ours = |dt: DType| host_data(&x, &shape, dt);
            assert_eq!(ours(DType::BF16).dtype, DType::BF16);
            assert_eq!(ours(DType::BF16).as_bytes(), burn(DType::BF16).as_bytes(), "bf16, n = {n}");
            assert_eq!(ours(DType::F16).as_bytes(), burn(DType::F16).as_bytes(), "f16, n = {n}");
            let f32_data = ours(DType::F32);
            assert_eq!(f32_data.dtype, DType::F32);
            assert_eq!(f32_data.as_bytes(), TensorData::new(x.clone(), shape.clone()).as_bytes(), "f32, n = {n}");
        }
    }

    /// The optimizer's bf16 copy, shared into `TensorData`, is byte for byte the conversion of its
    /// master, shares the copy's memory instead of copying it, uploads like converted data, and is
    /// refused for a shape of another size.
    #[test]
    fn shared_copy_equals_the_conversion_and_shares_memory() {
        let x = edge_values(5000);
        let copy: Bf16Copy = std::sync::Arc::new(CopyBuf::new(x.iter().map(|&v| half::bf16::from_f32(v)).collect()));
        let data = shared_bf16_data(&copy, &[50, 100]).unwrap();
        assert_eq!(data.dtype, DType::BF16);
        assert_eq!(data.as_bytes(), host_data(&x, &[50, 100], DType::BF16).as_bytes());
        assert_eq!(data.as_bytes().as_ptr(), copy.as_ptr().cast::<u8>(), "the data copied the buffer");
        assert_eq!(std::sync::Arc::strong_count(&copy), 2);
        let t: Tensor<CpuBackend, 2> = upload_data(data, &Default::default());
        assert_eq!(std::sync::Arc::strong_count(&copy), 1, "the upload kept the copy");
        let want: Tensor<CpuBackend, 2> = upload_data(host_data(&x, &[50, 100], DType::BF16), &Default::default());
        let (got, want) = (t.into_data().to_vec::<f32>().unwrap(), want.into_data().to_vec::<f32>().unwrap());
        assert!(got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())));
        assert!(shared_bf16_data(&copy, &[50, 99]).is_none());
    }

    /// Page-locking follows the buffer's life: registered once at the first `pin` (or upload), never
    /// for small buffers, a clone (`Arc::make_mut` while an upload holds the buffer) starts pageable,
    /// and each registration is undone exactly once, when the last reference goes. A fake pinner
    /// stands in for CUDA's; it is the only one any test installs.
    #[test]
    fn pinned_copies_are_registered_once_and_unregistered_on_drop() {
        use std::collections::HashMap;
        static LIVE: Mutex<Option<HashMap<usize, usize>>> = Mutex::new(None);
        static EVENTS: Mutex<Vec<(bool, usize)>> = Mutex::new(Vec::new());
        fn register(ptr: *mut u8, len: usize) -> bool {
            let mut live = LIVE.lock().unwrap();
            // Stricter than CUDA may be: a range touching a page locked for another buffer is refused.
            let page = lt_core::hostmem::page_size();
            let pages = |p: usize, l: usize| (p / page, (p + l - 1) / page);
            let (a, b) = pages(ptr as usize, len);
            let shares =
                live.get_or_insert_with(HashMap::new).iter().any(|(&q, &l)| pages(q, l).0 <= b && a <= pages(q, l).1);
            if shares {
                return false;
            }
            let prev = live.get_or_insert_with(HashMap::new).insert(ptr as usize, len);
            assert!(prev.is_none(), "registered twice");
            EVENTS.lock().unwrap().push((true, ptr as usize));
            true
        }
        fn unregister(ptr: *mut u8) {
            let removed = LIVE.lock().unwrap().get_or_insert_with(HashMap::new).remove(&(ptr as usize));
            assert!(removed.is_some(), "unregistered a buffer that was not registered");
            EVENTS.lock().unwrap().push((false, ptr as usize));
        }
        set_pinner(Pinner { register, unregister });
        let ours = |p: usize| EVENTS.lock().unwrap().iter().filter(|e| e.1 == p).copied().collect::<Vec<_>>();

        let n = PIN_MIN_BYTES / 2; // exactly PIN_MIN_BYTES of bf16
        let mut copy: Bf16Copy = std::sync::Arc::new(CopyBuf::new(vec![half::bf16::ONE; n]));
        let p0 = copy.as_ptr() as usize;
        assert_eq!(copy.pin_state(), PinState::Unpinned);
        assert_eq!(copy.pin(), PinState::Pinned);
        assert_eq!(copy.pin(), PinState::Pinned, "pinning again is a no-op");
        assert_eq!(ours(p0), vec![(true, p0)]);

        // An upload holds the buffer while the optimizer writes: the writer gets a pageable clone.
        let held = shared_bf16_data(&copy, &[n]).unwrap();
        std::sync::Arc::make_mut(&mut copy).as_mut_slice()[0] = half::bf16::ZERO;
        let p1 = copy.as_ptr() as usize;
        assert_ne!(p0, p1);
        assert_eq!(copy.pin_state(), PinState::Unpinned);
        assert_eq!(ours(p0), vec![(true, p0)], "still registered while the upload holds it");
        drop(held);
        assert_eq!(ours(p0), vec![(true, p0), (false, p0)], "unregistered when the last holder let go");
        // The clone is pinned at its first upload.
        let again = shared_bf16_data(&copy, &[n]).unwrap();
        assert_eq!(copy.pin_state(), PinState::Pinned);
        assert_eq!(ours(p1), vec![(true, p1)]);
        drop(again);
        drop(copy);
        assert_eq!(ours(p1), vec![(true, p1), (false, p1)]);

        // Small buffers are never registered, and not tried again (the allocator may hand out a freed
        // address again, so count all events rather than this address's).
        let before = EVENTS.lock().unwrap().len();
        let small = CopyBuf::new(vec![half::bf16::ONE; n - 1]);
        assert_eq!(small.pin(), PinState::Pageable);
        assert_eq!(small.pin(), PinState::Pageable);
        drop(small);
        assert_eq!(EVENTS.lock().unwrap().len(), before, "a small buffer was registered or unregistered");

        // Large copies made one after the other, with the allocator tuned as `lt` runs it (blocks
        // under 32 MiB next to each other on the heap), each own their pages: every one is locked,
        // none refused for a page it would share, and each holds its values.
        lt_core::hostmem::tune_malloc();
        let page = lt_core::hostmem::page_size();
        let copies: Vec<CopyBuf> = (0..6)
            .map(|i| {
                let len = n + 1000 * i + 3;
                if i % 2 == 0 {
                    CopyBuf::new((0..len).map(|k| half::bf16::from_f32((k % 251) as f32)).collect())
                } else {
                    let mut c = CopyBuf::zeroed(len);
                    c.as_mut_slice()
                        .iter_mut()
                        .enumerate()
                        .for_each(|(k, x)| *x = half::bf16::from_f32((k % 251) as f32));
                    c
                }
            })
            .collect();
        for (i, c) in copies.iter().enumerate() {
            assert_eq!(c.len(), n + 1000 * i + 3);
            assert_eq!(c.as_ptr() as usize % page, 0, "copy {i} does not start a page");
            assert_eq!(c.pin(), PinState::Pinned, "copy {i} was refused: it shares a page");
            assert!(c.iter().enumerate().all(|(k, x)| x.to_f32() == (k % 251) as f32), "copy {i} values");
        }
        let twin = copies[1].clone();
        assert_eq!(twin.as_slice(), copies[1].as_slice());
        assert_eq!(twin.pin(), PinState::Pinned, "a clone owns its pages too");
    }

    /// An upload on the CPU backend returns the host values unchanged, in the given shape.
    #[test]
    fn upload_round_trips_on_cpu() {
        let x: Vec<f32> = (0..24).map(|i| i as f32 * 0.5 - 3.0).collect();
        let t = upload::<CpuBackend, 2>(&x, &[4, 6], &Default::default());
        assert_eq!(t.dims(), [4, 6]);
        assert_eq!(t.into_data().to_vec::<f32>().unwrap_or_default(), x);
    }
}
