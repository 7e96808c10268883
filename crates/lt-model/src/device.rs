//! What the executor needs to know about a device runtime beyond Burn's `Backend` trait: which
//! kind of runtime it is, how its streams map onto threads, and how much memory it has reserved.
//!
//! **Streams are threads.** cubecl (the runtime under burn-wgpu and burn-cuda) gives every thread
//! its own stream (`cubecl-common` `stream_id.rs`: a thread-local id taken from a global counter the
//! first time a thread touches the device), and each stream has its own memory pools. A thread
//! started per micro-batch is therefore a new stream, with new pools, every micro-batch: the
//! executor keeps one long-lived thread per stream instead.
//!
//! **Cross-stream safety differs by runtime** ([`StreamMode`]). On burn-cuda, a tensor made on one
//! stream and used on another is ordered with CUDA events, and its memory is kept out of reuse until
//! the consuming stream's event completes (cubecl-runtime `stream/event.rs`, `MultiStream::resolve`
//! and its garbage-collection thread), so the upload stream can really run beside compute. cubecl's
//! wgpu server has no such guard: it drops a kernel's bindings as soon as the kernel is queued on its
//! stream (`cubecl-wgpu` `compute/server.rs`, `launch` -> `prepare_bindings` keeps only the buffer and
//! offset), registers a write on the writing stream without aligning any other stream
//! (`server.rs`, `write`: `self.scheduler.register(stream_id, task, &[])`), and a write goes to the
//! queue (`queue.write_buffer`), which wgpu applies before every command buffer of the next submit
//! (`compute/stream.rs`, `enqueue_task` flushes only the writing stream's encoder). So when a tensor
//! uploaded on the h2d stream is dropped by compute while compute's kernel that reads it is still
//! unsubmitted, the next upload can reuse that memory and overwrite it before the kernel runs. wgpu
//! has one queue, so separate streams buy no concurrency there anyway: on wgpu every device call of
//! the executor's threads is issued on the compute thread's stream.

use std::any::Any;
use std::future::Future;
use std::pin::Pin;
use std::sync::OnceLock;
use std::task::{Context, Poll, Waker};

use burn::tensor::backend::{Backend, ExecutionError};
use burn::tensor::{StreamId, Tensor, TensorData};

/// The kind of device runtime behind a Burn device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceKind {
    /// A CPU backend (ndarray): no streams, no device memory pools.
    Cpu,
    /// burn-wgpu (Vulkan, Metal, DX12; lavapipe on a machine without a GPU).
    Wgpu,
    /// burn-cuda.
    Cuda,
}

/// How the executor's h2d and d2h threads issue their device calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamMode {
    /// On the compute thread's stream (wgpu: one queue, and no cross-stream memory guard).
    Shared,
    /// Each thread on its own stream, ordered by the runtime's events (CUDA: copies overlap compute).
    Separate,
}

/// Which runtime `device` belongs to.
pub fn kind<D: Any>(device: &D) -> DeviceKind {
    let any = device as &dyn Any;
    #[cfg(feature = "wgpu")]
    if any.is::<burn_wgpu::WgpuDevice>() {
        return DeviceKind::Wgpu;
    }
    #[cfg(feature = "cuda")]
    if any.is::<burn_cuda::CudaDevice>() {
        return DeviceKind::Cuda;
    }
    let _ = any;
    DeviceKind::Cpu
}

/// The stream mode for `device`: [`StreamMode::Shared`] on wgpu, [`StreamMode::Separate`] elsewhere.
/// `LT_DEVICE_STREAMS=shared` or `separate` overrides it (read once per process), to compare the two.
pub fn stream_mode<D: Any>(device: &D) -> StreamMode {
    static OVERRIDE: OnceLock<Option<StreamMode>> = OnceLock::new();
    let forced = *OVERRIDE.get_or_init(|| match std::env::var("LT_DEVICE_STREAMS").ok().as_deref().map(str::trim) {
        Some("shared") => Some(StreamMode::Shared),
        Some("separate") => Some(StreamMode::Separate),
        _ => None,
    });
    forced.unwrap_or(match kind(device) {
        DeviceKind::Wgpu => StreamMode::Shared,
        DeviceKind::Cpu | DeviceKind::Cuda => StreamMode::Separate,
    })
}

/// The device-runtime stream of the calling thread (cubecl's thread-local stream id).
pub fn current_stream() -> u64 {
    StreamId::current().value
}

/// Run `f` with the calling thread's device calls issued on stream `stream` (see [`current_stream`]).
pub fn on_stream<T>(stream: u64, f: impl FnOnce() -> T) -> T {
    StreamId { value: stream }.executes(f)
}

/// A device-to-host read issued on one thread and completed on another.
///
/// [`start_read`] issues the read on the calling thread's stream, in order with that thread's other
/// device calls (on wgpu: the compute thread's kernels), and returns at once; [`PendingRead::wait`]
/// blocks until the bytes are on the host, on whatever thread calls it. So with
/// [`StreamMode::Shared`] the d2h thread waits and converts while compute keeps queueing work,
/// without itself issuing any device call.
pub struct PendingRead(Pin<Box<dyn Future<Output = Result<TensorData, ExecutionError>> + Send>>);

impl std::fmt::Debug for PendingRead {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PendingRead")
    }
}

/// Issue the read of `t` now, on the calling thread (see [`PendingRead`]).
///
/// Burn's read is an `async fn` chain whose first poll drains the tensor's pending operations and
/// enqueues the copy (burn-fusion `read_tensor_float` runs eagerly inside it), then waits for the
/// copy: polling it once here with a no-op waker issues everything; whoever waits polls again with a
/// real waker.
pub fn start_read<B: Backend, const D: usize>(t: Tensor<B, D>) -> PendingRead {
    let mut fut: Pin<Box<dyn Future<Output = Result<TensorData, ExecutionError>> + Send>> =
        Box::pin(t.into_data_async());
    let mut cx = Context::from_waker(Waker::noop());
    match fut.as_mut().poll(&mut cx) {
        Poll::Ready(r) => PendingRead(Box::pin(std::future::ready(r))),
        Poll::Pending => PendingRead(fut),
    }
}

impl PendingRead {
    /// Block until the data is on the host.
    pub fn wait(self) -> Result<TensorData, String> {
        match burn::tensor::try_read_sync(self.0) {
            Some(Ok(d)) => Ok(d),
            Some(Err(e)) => Err(format!("{e:?}").lines().next().unwrap_or_default().to_string()),
            None => Err("this platform cannot wait for a device read".into()),
        }
    }
}

/// Device memory the runtime has reserved for the calling thread's stream (bytes of its memory
/// pools, used or free), or `None` on a CPU backend.
pub fn reserved_bytes<D: Any>(device: &D) -> Option<u64> {
    let any = device as &dyn Any;
    #[cfg(feature = "wgpu")]
    if let Some(d) = any.downcast_ref::<burn_wgpu::WgpuDevice>() {
        use cubecl::Runtime as _;
        return cubecl::wgpu::WgpuRuntime::client(d).memory_usage().ok().map(|u| u.bytes_reserved);
    }
    #[cfg(feature = "cuda")]
    if let Some(d) = any.downcast_ref::<burn_cuda::CudaDevice>() {
        use cubecl::Runtime as _;
        return cubecl::cuda::CudaRuntime::client(d).memory_usage().ok().map(|u| u.bytes_reserved);
    }
    let _ = any;
    None
}

/// Runs `f`, turning a panic into `Err` with the first line of its message (`otherwise` when it
/// carries none) and keeping the panic's multi-line report off stderr: for the runtimes and
/// libraries that panic when a driver or shared library is missing (cubecl's wgpu setup, cudarc's
/// loaders).
#[cfg(any(feature = "wgpu", feature = "cuda"))]
pub(crate) fn catch_quietly<T>(f: impl FnOnce() -> T + std::panic::UnwindSafe, otherwise: &str) -> Result<T, String> {
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let r = std::panic::catch_unwind(f);
    std::panic::set_hook(hook);
    r.map_err(|p| panic_line(p.as_ref(), otherwise))
}

/// The first line of a caught panic's message, or `otherwise` when it carries no text.
#[cfg(any(feature = "wgpu", feature = "cuda"))]
fn panic_line(p: &(dyn Any + Send), otherwise: &str) -> String {
    p.downcast_ref::<String>()
        .map(String::as_str)
        .or_else(|| p.downcast_ref::<&str>().copied())
        .unwrap_or(otherwise)
        .lines()
        .next()
        .unwrap_or_default()
        .to_string()
}

/// The default wgpu device, with its runtime initialised: `Err` with one line that says how to get
/// an adapter when there is none (cubecl panics deep inside its setup otherwise).
#[cfg(feature = "wgpu")]
pub fn wgpu_device() -> Result<burn_wgpu::WgpuDevice, String> {
    static INIT: OnceLock<Result<(), String>> = OnceLock::new();
    let init = INIT.get_or_init(|| {
        // The runtime's setup panics without an adapter.
        let r = catch_quietly(
            || {
                use cubecl::Runtime as _;
                drop(cubecl::wgpu::WgpuRuntime::client(&burn_wgpu::WgpuDevice::default()));
            },
            "the runtime panicked",
        );
        r.map_err(|why| {
            format!(
                "no wgpu adapter ({why}): install a Vulkan driver, e.g. `apt-get install -y mesa-vulkan-drivers \
                 libvulkan1` (lavapipe, which runs on the CPU)"
            )
        })
    });
    init.clone().map(|()| burn_wgpu::WgpuDevice::default())
}

/// Device memory reserved by every stream of the wgpu runtime (cubecl keeps at most
/// `max_streams` = 128 of them, indexed by stream id modulo 128), so memory held by streams that
/// no live thread uses any more is counted too. On lavapipe this is host memory.
#[cfg(feature = "wgpu")]
pub fn wgpu_total_reserved_bytes(device: &burn_wgpu::WgpuDevice) -> u64 {
    use cubecl::Runtime as _;
    let client = cubecl::wgpu::WgpuRuntime::client(device);
    (0..128u64).map(|v| on_stream(v, || client.memory_usage().map(|u| u.bytes_reserved).unwrap_or(0))).sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ndarray_is_a_cpu_device_without_reserved_memory() {
        let d = burn::backend::ndarray::NdArrayDevice::default();
        assert_eq!(kind(&d), DeviceKind::Cpu);
        assert_eq!(reserved_bytes(&d), None);
    }

    /// A thread keeps its stream id; a new thread gets a new one; `on_stream` switches and restores.
    #[test]
    fn streams_follow_threads() {
        let here = current_stream();
        assert_eq!(current_stream(), here);
        let there = std::thread::spawn(current_stream).join().unwrap();
        assert_ne!(there, here);
        let inside = std::thread::spawn(move || on_stream(here, current_stream)).join().unwrap();
        assert_eq!(inside, here);
        assert_eq!(current_stream(), here);
    }
}

/// CUDA set-up that Burn and cubecl leave to the application, done once before the first client:
/// the on-disk kernel cache, and page-locking for the optimizer's bf16 upload copies.
#[cfg(feature = "cuda")]
pub mod cuda {
    use std::path::PathBuf;
    use std::sync::OnceLock;

    use cudarc::driver::{result, sys};

    /// What [`setup`] did.
    #[derive(Clone, Debug)]
    pub struct Setup {
        /// Device 0's compute capability.
        pub compute_capability: (i32, i32),
        /// Where compiled kernels (PTX) are kept between runs; `None` when switched off
        /// (`LT_KERNEL_CACHE=off`) or when a `cubecl.toml` had already configured the runtime.
        pub kernel_cache: Option<PathBuf>,
        /// Whether upload copies are page-locked (`LT_PIN_COPY`, on by default).
        pub pinning: bool,
        /// Which library computes the matrix products: `"cubecl"` (its kernels, the default) or
        /// `"cublas"` (`LT_GEMM=cublas`: one cuBLAS call per product, [`crate::gemm::cuda`]).
        pub gemm: &'static str,
    }

    /// The primary context of device 0, the one cubecl-cuda runs in.
    struct Primary(sys::CUcontext);
    // SAFETY: a context handle is a process-wide driver object; the driver accepts it on any thread.
    unsafe impl Send for Primary {}
    // SAFETY: as above; the handle is only read.
    unsafe impl Sync for Primary {}

    /// Device 0's primary context and its compute capability.
    type Found = (Primary, (i32, i32));

    /// Device 0's primary context and compute capability; `Err` with one line when there is no
    /// driver or no device (cudarc panics when `libcuda` cannot be loaded: caught here).
    fn primary() -> Result<&'static Found, String> {
        static P: OnceLock<Result<Found, String>> = OnceLock::new();
        P.get_or_init(|| {
            // cudarc panics when libcuda cannot be loaded: one line instead.
            let found = super::catch_quietly(
                || -> Result<Found, String> {
                    result::init().map_err(|e| format!("cuInit: {e:?}"))?;
                    let dev = result::device::get(0).map_err(|e| format!("no CUDA device 0: {e:?}"))?;
                    let attr = |a| {
                        // SAFETY: `dev` came from `device::get`.
                        unsafe { result::device::get_attribute(dev, a) }.map_err(|e| format!("{e:?}"))
                    };
                    let cc = (
                        attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
                        attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
                    );
                    // SAFETY: `dev` came from `device::get`; the primary context is retained for the
                    // process's life, as cubecl-cuda retains it.
                    let ctx = unsafe { result::primary_ctx::retain(dev) }.map_err(|e| format!("{e:?}"))?;
                    Ok((Primary(ctx), cc))
                },
                "the CUDA driver could not be loaded",
            );
            found.and_then(|r| r)
        })
        .as_ref()
        .map_err(Clone::clone)
    }

    /// Makes the primary context current on this thread (page-locking acts in the current context).
    fn make_current() -> bool {
        match primary() {
            // SAFETY: a valid context handle, retained for the process's life.
            Ok((ctx, _)) => unsafe { result::ctx::set_current(ctx.0) }.is_ok(),
            Err(_) => false,
        }
    }

    fn register(ptr: *mut u8, len: usize) -> bool {
        static WARNED: OnceLock<()> = OnceLock::new();
        if !make_current() {
            return false;
        }
        // SAFETY: `ptr..ptr + len` is one live allocation owned by a `CopyBuf`, which neither moves
        // nor frees it before unregistering it (its `Drop`). PORTABLE: locked for every context.
        let r = unsafe { sys::cuMemHostRegister_v2(ptr.cast(), len, sys::CU_MEMHOSTREGISTER_PORTABLE) }.result();
        if let Err(e) = &r {
            WARNED.get_or_init(|| {
                eprintln!("warning: page-locking a {len}-byte upload copy failed ({e:?}); such copies upload from pageable memory")
            });
        }
        r.is_ok()
    }

    fn unregister(ptr: *mut u8) {
        if make_current() {
            // SAFETY: `ptr` was registered by `register` and is still allocated (called from the
            // owner's `Drop`, before the free). A failure leaves the pages locked: nothing to do.
            let _ = unsafe { sys::cuMemHostUnregister(ptr.cast()) };
        }
    }

    /// The kernel cache folder for compute capability `cc`: `LT_KERNEL_CACHE` if set (`off` or `0`
    /// switches the cache off), else `$XDG_CACHE_HOME/lazytrain/kernels`, else
    /// `$HOME/.cache/lazytrain/kernels`; one sub-folder per capability, because cubecl keys its
    /// cache by kernel alone and PTX built for `sm_90a` does not load on another GPU.
    pub fn kernel_cache_dir(cc: (i32, i32)) -> Option<PathBuf> {
        let var = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty());
        let root = match var("LT_KERNEL_CACHE") {
            Some(v) if v == "off" || v == "0" => return None,
            Some(v) => PathBuf::from(v),
            None => var("XDG_CACHE_HOME")
                .map(PathBuf::from)
                .or_else(|| var("HOME").map(|h| PathBuf::from(h).join(".cache")))?
                .join("lazytrain")
                .join("kernels"),
        };
        Some(root.join(format!("sm_{}{}", cc.0, cc.1)))
    }

    /// Once per process, before the first CUDA client: finds device 0, points cubecl's PTX cache
    /// at [`kernel_cache_dir`] (the first run on a GPU compiles every kernel with NVRTC on one host
    /// thread: minutes on the first H200 run, 2026-12-04; later runs load them) unless a
    /// `cubecl.toml` configured one, and installs page-locking for upload copies unless
    /// `LT_PIN_COPY=0`, and with `LT_GEMM=cublas` routes matrix products to cuBLAS
    /// ([`crate::gemm::cuda`]). `Err` with one line when there is no usable driver or device, or
    /// cuBLAS was asked for and cannot be loaded.
    pub fn setup() -> Result<Setup, String> {
        static DONE: OnceLock<Result<Setup, String>> = OnceLock::new();
        DONE.get_or_init(|| {
            let (_, cc) = primary()?;
            let kernel_cache = configure_kernel_cache(*cc);
            let pinning = crate::upload::pin_copies();
            if pinning {
                crate::upload::set_pinner(crate::upload::Pinner { register, unregister });
            }
            let gemm = match std::env::var("LT_GEMM").as_deref() {
                Ok("cublas") => {
                    crate::gemm::cuda::install().map_err(|e| format!("LT_GEMM=cublas: {e}"))?;
                    "cublas"
                }
                Ok("cubecl") | Ok("") | Err(_) => "cubecl",
                Ok(other) => return Err(format!("LT_GEMM={other}: expected cubecl or cublas")),
            };
            Ok(Setup { compute_capability: *cc, kernel_cache, pinning, gemm })
        })
        .clone()
    }

    /// Sets cubecl's runtime configuration (its `cubecl.toml`, environment overrides included)
    /// with the PTX cache at [`kernel_cache_dir`] when the file names none; returns the folder used.
    fn configure_kernel_cache(cc: (i32, i32)) -> Option<PathBuf> {
        use cubecl::config::{CubeClRuntimeConfig, RuntimeConfig, cache::CacheConfig};
        if CubeClRuntimeConfig::storage().lock().is_some() {
            return None; // already read: a client exists; leave it as it is
        }
        let mut config = CubeClRuntimeConfig::from_current_dir().override_from_env();
        let dir = match &config.compilation.cache {
            Some(_) => None,
            None => kernel_cache_dir(cc).filter(|d| std::fs::create_dir_all(d).is_ok()),
        };
        if let Some(d) = &dir {
            config.compilation.cache = Some(CacheConfig::File(d.clone()));
        }
        // `set` panics if another thread read the configuration since the check above.
        std::panic::catch_unwind(|| CubeClRuntimeConfig::set(config)).ok().and(dir)
    }
}
