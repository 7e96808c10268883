//! LazyTrain patch: a process-wide hook that `float_matmul` asks before its own kernels, so that a
//! runtime-specific library (cuBLAS on CUDA, set by lt-model) can compute the product. The hook
//! sees both operands as `&dyn Any` (each a `CubeTensor<R>` of the backend's runtime) and returns
//! the product as a boxed `CubeTensor<R>` of the same runtime, or `None` to leave the product to
//! the kernels (other runtimes, layouts or dtypes it does not take). Without a hook the cost is one
//! atomic load per product.

use crate::{CubeRuntime, tensor::CubeTensor};
use core::any::Any;
use std::sync::OnceLock;

/// The hook's signature: `(lhs, rhs) -> product`, see the module docs.
pub type MatmulHook = fn(&dyn Any, &dyn Any) -> Option<Box<dyn Any>>;

static HOOK: OnceLock<MatmulHook> = OnceLock::new();

/// Installs the hook for the rest of the process; `false` if one was installed already.
pub fn set_matmul_hook(hook: MatmulHook) -> bool {
    HOOK.set(hook).is_ok()
}

/// The hook's product, if a hook is installed and takes these operands.
pub(crate) fn hooked_matmul<R: CubeRuntime>(lhs: &CubeTensor<R>, rhs: &CubeTensor<R>) -> Option<CubeTensor<R>> {
    let hook = HOOK.get()?;
    hook(lhs, rhs)?.downcast::<CubeTensor<R>>().ok().map(|out| *out)
}
