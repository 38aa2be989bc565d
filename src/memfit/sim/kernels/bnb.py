"""bitsandbytes' CUDA kernels as the simulator runs them: their exact allocations, on fake tensors.

The quantized layers run their real Python code (bitsandbytes 0.50 `Linear4bit.forward` ->
`matmul_4bit` -> `MatMul4Bit` autograd function; `Linear8bitLt.forward` -> `matmul` -> `MatMul8bitLt`), so
what autograd saves and every cast in Python are the real ones. The custom ops below them have
`register_fake` shapes (bitsandbytes/_ops.py) that allocate only their outputs; where the CUDA kernel
allocates more, `BnbCudaKernels` (a dispatch mode above the tracker) runs the CUDA kernel's own allocations:

* `gemm_4bit` (backends/cuda/ops.py, the `register_kernel("bitsandbytes::gemm_4bit", "cuda")` function):
  past `_gemm_4bit_custom_max_m = 1536` rows (M = tokens), or with K not a multiple of the blocksize, it is
  `_dequant_linear_fallback`: with double quant a float32 absmax (`torch.empty_like(absmax_8bit,
  dtype=float32)`) and `absmax_dq + absmax_offset`, then the whole weight dequantized to the input dtype
  (`B_dq = torch.empty(shapeB, dtype=A.dtype)`) and `F.linear`. At most 4 rows
  (`_GEMM_4BIT_CUSTOM_FLOOR_M`) it is the fused kernel: the output only. In between the choice depends on
  the GPU's compute capability, SM count and the shape: memfit runs bitsandbytes' own heuristic
  (`_gemm_4bit_use_custom_cuda`, compiled from the installed backends/cuda/ops.py, whose module does not import
  without CUDA) with the target GPU's figures; without an SM count it takes the fallback (the larger) and says so.
* MatMul4Bit.backward: `F.dequantize_4bit(B, ctx.state).to(grad_output.dtype)` — the fake kernels of
  `dequantize_blockwise` / `dequantize_4bit` allocate what the CUDA kernels allocate (their outputs).
* `int8_scaled_mm` / `int8_mixed_scaled_mm` have no CUDA kernel of their own: CUDA runs the "default"
  composites (backends/default/ops.py): an int32 `int8_linear_matmul` result, then `int8_mm_dequant`
  (`A_calc * (row_stats * col_stats) * c`, `+= bias`, `.to(dtype)`).
* `int8_vectorwise_quant` / `int8_double_quant` with a threshold return the outlier columns, a number that
  depends on the values: memfit assumes none (their `subA` copy is then empty).

`bnb.matmul` picks `MatMul8bitFp` for CPU tensors (autograd/_functions.py `matmul`); `cuda_int8_matmul`
routes to `MatMul8bitLt`, the CUDA path.

All allocations inside a bitsandbytes op are recorded under the module label `DEQUANT_LABEL`.
"""

from __future__ import annotations

import ast
import contextlib
import functools
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.nn.functional as F

from memfit.sim import _torch_adapter as adapter

__all__ = ["BnbCudaKernels", "cuda_int8_matmul", "gemm_4bit_use_custom", "GEMM_4BIT_CUSTOM_MAX_M", "GEMM_4BIT_CUSTOM_FLOOR_M",
           "DEQUANT_LABEL", "bnb_cuda_patches"]

#: backends/cuda/ops.py `_gemm_4bit_custom_max_m` (CUDA): past this many rows gemm_4bit always dequantizes.
GEMM_4BIT_CUSTOM_MAX_M = 1536
#: backends/cuda/ops.py `_GEMM_4BIT_CUSTOM_FLOOR_M`: at most this many rows the fused kernel always runs.
GEMM_4BIT_CUSTOM_FLOOR_M = 4
#: Module label of the allocations made inside bitsandbytes ops (the dequantization temporaries).
DEQUANT_LABEL = "bitsandbytes"


class BnbCudaKernels(adapter.TorchDispatchMode):
    """Dispatch mode: bitsandbytes custom ops with the allocations of their CUDA implementations."""

    def __init__(self, tracker: Any = None, *, autocast_dtype: torch.dtype | None = None,
                 compute_capability: tuple[int, int] = (8, 0), sm_count: int | None = None) -> None:
        super().__init__()
        self.tracker = tracker
        self.autocast_dtype = autocast_dtype
        self.compute_capability = tuple(compute_capability)
        self.sm_count = sm_count
        self.gemm_paths: set[str] = set()

    @contextlib.contextmanager
    def _label(self, name: str) -> Iterator[None]:
        tr = self.tracker
        if tr is None:
            yield
            return
        prev = tr.module
        tr.module = f"{DEQUANT_LABEL}::{name}"
        try:
            yield
        finally:
            tr.module = prev

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        ns = getattr(func, "namespace", "")
        if ns != "bitsandbytes":
            return func(*args, **kwargs)
        name = func._schema.name.split("::")[-1]
        with self._label(name):
            impl = _EMULATED.get(name)
            if impl is not None:
                return impl(self, *args, **kwargs)
            return func(*args, **kwargs)

    # -- emulations ---------------------------------------------------------------------------------------
    def gemm_4bit(self, A, B, shapeB, absmax, blocksize, quant_type, bias=None, absmax_8bit=None, absmax_code=None,
                  absmax_offset=None):
        K = A.shape[-1]
        M = A.numel() // K
        N = shapeB[0]
        if M > GEMM_4BIT_CUSTOM_MAX_M or K % blocksize != 0:
            use_custom, path = False, "fallback"
        elif self.sm_count:
            use_custom = gemm_4bit_use_custom(self.sm_count, self.compute_capability, A.dtype, M, N, K)
            path = "fused" if use_custom else "fallback"
        elif M <= GEMM_4BIT_CUSTOM_FLOOR_M:
            use_custom, path = True, "fused"
        else:
            use_custom, path = False, "fallback-assumed"
        self.gemm_paths.add(path)
        if use_custom:  # the fused kernel (`_gemm_4bit_kernel_impl`) writes the output only
            return torch.empty((*A.shape[:-1], N), dtype=A.dtype, device=A.device)
        # backends/cuda/ops.py `_dequant_linear_fallback`
        if absmax_8bit is not None:
            absmax_dq = torch.empty_like(absmax_8bit, dtype=torch.float32)
            absmax = absmax_dq + absmax_offset  # noqa: F841  (alive, as in bnb, until the function returns)
        B_dq = torch.empty(list(shapeB), dtype=A.dtype, device=A.device)
        return _autocast_linear(A, B_dq, bias, self.autocast_dtype)

    def int8_scaled_mm(self, A, B, row_stats, col_stats, bias=None, dtype=None):
        # backends/default/ops.py `int8_scaled_mm` -> int8_linear_matmul (int32) -> int8_mm_dequant
        out_i32 = torch.empty((*A.shape[:-1], B.shape[0]), dtype=torch.int32, device=A.device)
        return self.int8_mm_dequant(out_i32, row_stats, col_stats, dtype=dtype or torch.float16, bias=bias)

    def int8_mm_dequant(self, A, row_stats, col_stats, dtype=None, bias=None):
        # backends/default/ops.py `int8_mm_dequant`
        A_calc = A.view(-1, A.shape[-1])
        out = A_calc * (row_stats.reshape(-1).unsqueeze(-1) * col_stats.reshape(-1).unsqueeze(0)) * 6.200124e-05
        if bias is not None:
            out += bias
        return out.to(dtype or torch.float16)

    def int8_mixed_scaled_mm(self, A, CA, CB, SCA, SCB, outlier_cols=None, bias=None):
        # backends/default/ops.py `int8_mixed_scaled_mm`, with no outlier columns
        subA = torch.empty(0, device=A.device, dtype=A.dtype)
        output = self.int8_scaled_mm(CA, CB, SCA, SCB, bias=bias, dtype=A.dtype)
        return output, subA

    def int8_vectorwise_quant(self, A, threshold=0.0):
        out_row = torch.empty(A.shape, device=A.device, dtype=torch.int8)
        row_stats = torch.empty(A.numel() // A.shape[-1], device=A.device, dtype=torch.float32)
        if threshold == 0.0:
            return out_row, row_stats, None
        return out_row, row_stats, torch.empty(0, device=A.device, dtype=torch.int64)  # no outliers assumed

    def int8_double_quant(self, A, threshold=0.0):
        out_row = torch.empty_like(A, dtype=torch.int8)
        out_col = torch.empty_like(A, dtype=torch.int8)
        row_stats = torch.empty(A.numel() // A.shape[-1], device=A.device, dtype=torch.float32)
        col_stats = torch.empty(A.shape[-1], device=A.device, dtype=torch.float32)
        return out_row, out_col, row_stats, col_stats, torch.empty(0, device=A.device, dtype=torch.int64)


@functools.lru_cache(maxsize=1)
def _heuristic_source() -> tuple[str, int]:
    """bitsandbytes' `_gemm_4bit_use_custom_cuda` source (undecorated) and `_GEMM_4BIT_CUSTOM_FLOOR_M`."""
    from memfit.models.quantization import quiet_bnb_logs

    with quiet_bnb_logs():
        import bitsandbytes

    path = Path(bitsandbytes.__file__).parent / "backends" / "cuda" / "ops.py"
    src = path.read_text(encoding="utf-8")
    tree = ast.parse(src)
    floor = None
    func = None
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "_GEMM_4BIT_CUSTOM_FLOOR_M"
                                                for t in node.targets):
            floor = ast.literal_eval(node.value)
        if isinstance(node, ast.FunctionDef) and node.name == "_gemm_4bit_use_custom_cuda":
            node.decorator_list = []
            func = ast.unparse(node)
    if func is None or floor is None:
        raise RuntimeError(f"bitsandbytes {bitsandbytes.__version__}: no `_gemm_4bit_use_custom_cuda` / "
                           f"`_GEMM_4BIT_CUSTOM_FLOOR_M` in {path}; memfit.sim.kernels.bnb needs updating")
    return func, floor


@functools.lru_cache(maxsize=4096)
def gemm_4bit_use_custom(sm_count: int, compute_capability: tuple[int, int], dtype: torch.dtype, M: int, N: int,
                         K: int) -> bool:
    """bitsandbytes' own choice between the fused 4-bit GEMM and dequantize + F.linear on a CUDA GPU
    (backends/cuda/ops.py `_gemm_4bit_use_custom_cuda`), run with this GPU's SM count and compute capability.

    Args:
        sm_count: the GPU's multiprocessors (`props.multi_processor_count`).
        compute_capability: (major, minor).
        dtype: the input's dtype.
        M, N, K: rows of the input (tokens), output features, input features.
    """
    func, floor = _heuristic_source()
    namespace: dict[str, Any] = {
        "torch": torch, "_GEMM_4BIT_CUSTOM_FLOOR_M": floor,
        "_gpu_dispatch_props": lambda _index: (sm_count, compute_capability[0], compute_capability[1]),
    }
    exec(compile(func, "<bitsandbytes _gemm_4bit_use_custom_cuda>", "exec"), namespace)  # noqa: S102 (installed source)
    return bool(namespace["_gemm_4bit_use_custom_cuda"](0, dtype, M, N, K))


def _autocast_linear(A, B, bias, low):
    """`F.linear` as called inside a CUDA custom-op kernel: the op's Autocast key is a fallthrough, so the inner
    call goes through CUDA autocast (`linear` is a lower-precision op: every eligible input is cast, autocast_mode.h
    `AT_FORALL_LOWER_PRECISION_FP`; B_dq is no weight, so no cast cache). Inside a dispatch mode autocast is
    off (`torch.is_autocast_enabled()` is False there), so the casts are made here with `low`, the run's autocast
    dtype: gemm_4bit only runs in forward passes, which are all under autocast (training, evaluation, and the
    recomputation of checkpointing, which restores the forward's autocast state)."""
    if low is not None:

        def cast(t):
            if t is None or not t.is_floating_point() or t.dtype in (low, torch.float64):
                return t
            return t.to(low)

        A, B, bias = cast(A), cast(B), cast(bias)
    return F.linear(A, B, bias)


_EMULATED = {
    "gemm_4bit": BnbCudaKernels.gemm_4bit,
    "int8_scaled_mm": BnbCudaKernels.int8_scaled_mm,
    "int8_mm_dequant": BnbCudaKernels.int8_mm_dequant,
    "int8_mixed_scaled_mm": BnbCudaKernels.int8_mixed_scaled_mm,
    "int8_vectorwise_quant": BnbCudaKernels.int8_vectorwise_quant,
    "int8_double_quant": BnbCudaKernels.int8_double_quant,
}


def cuda_int8_matmul(A, B, out=None, state=None, threshold=0.0, bias=None):
    """`bitsandbytes.matmul` as it runs on CUDA tensors (autograd/_functions.py `matmul`: MatMul8bitLt)."""
    from bitsandbytes.autograd._functions import MatMul8bitLt, MatmulLtState

    state = state or MatmulLtState()
    if threshold > 0.0:
        state.threshold = threshold
    return MatMul8bitLt.apply(A, B, out, bias, state)


def fix_4bit_weight_quant_state_from_module(module) -> None:
    """bitsandbytes' `fix_4bit_weight_quant_state_from_module` (nn/modules.py, called first by `Linear4bit.forward`)
    for a weight FSDP has made a plain tensor (FSDP2's all-gathered parameter, FSDP1's FlatParameter view): bnb
    wraps it as `Params4bit(module.weight, ...)` (`_make_subclass`: the same storage, no allocation) to hang the
    module's quantization state on it, which a FakeTensor cannot be; the state is hung on the tensor itself, all
    that `forward` reads of it (`self.weight.quant_state`)."""
    if getattr(module.weight, "quant_state", None) is not None:
        return
    module.weight.quant_state = module.quant_state


@contextlib.contextmanager
def bnb_cuda_patches() -> Iterator[None]:
    """`bnb.matmul` -> its CUDA path for the simulation, and a sharded 4-bit weight given its quantization state
    without the bnb subclass (`fix_4bit_weight_quant_state_from_module`); undone on exit."""
    import bitsandbytes as bnb
    from bitsandbytes.nn import modules

    from memfit.sim.patching import patched

    with patched(bnb, "matmul", cuda_int8_matmul), \
            patched(modules, "fix_4bit_weight_quant_state_from_module", fix_4bit_weight_quant_state_from_module):
        yield
