"""Host-side helpers shared by the ops: how tensors are handed to kernels, launch options, and the
torch mirror of the kernels' fixed-order reductions."""

from __future__ import annotations

import contextlib
import functools

import torch
import triton

from engineprofiles import portable
from engineprofiles.regions import Point
from engineprofiles.rounding import act_dtype, round_to

# Kernels are compiled with multiply-add contraction off, so a*b + c is two roundings on every
# backend, as in the references (the option is `enable_fp_fusion`, triton >= 3.0; the interpreter
# ignores it and never contracts).
LAUNCH = {"enable_fp_fusion": False}

LANES = portable.REDUCE_LANES
LOG2_LANES = LANES.bit_length() - 1
assert 1 << LOG2_LANES == LANES

KIND_FP32, KIND_BF16, KIND_FP16 = 0, 1, 2
_KINDS = {torch.float32: KIND_FP32, torch.bfloat16: KIND_BF16, torch.float16: KIND_FP16}


def kind(t: torch.Tensor | torch.dtype) -> int:
    """The KIND constexpr of a tensor (or dtype): how kernels load and store it."""
    dt = t if isinstance(t, torch.dtype) else t.dtype
    try:
        return _KINDS[dt]
    except KeyError:
        raise TypeError(f"kernels take float32, bfloat16 or float16 tensors, got {dt}") from None


def kview(t: torch.Tensor) -> torch.Tensor:
    """The tensor as a kernel sees it: BF16 as int16 bits (see tl_rounding.load), others unchanged."""
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


def is_fp16(act: torch.dtype) -> bool:
    return act_dtype(act) == torch.float16


# Tile sizes are chosen for the device a launch runs on: a GPU, or the interpreter (where every
# operation costs ~0.1 ms of Python, so tiles are as large as fit). Tiles never change a bit of
# any result. tests/emulator/ptx_check.py sets this to compile the GPU configuration on a CPU.
FORCE_GPU_TILES = False


def gpu_tiles(t: torch.Tensor) -> bool:
    return t.is_cuda or FORCE_GPU_TILES


def interpreted(kernel: object) -> bool:
    """Whether a @triton.jit kernel runs in the Triton interpreter (TRITON_INTERPRET=1 was set
    when it was defined, i.e. when emulator.ops was first imported)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(kernel, InterpretedFunction)


def rows(x: torch.Tensor) -> torch.Tensor:
    """[*lead, N] -> [M, N], a view when the lead dims can be merged, else a copy."""
    return x.reshape(-1, x.shape[-1])


def cast_like(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An FP32 result in ``dtype``, rounded to nearest even (what kernels' round_store does)."""
    if dtype == torch.float32:
        return y
    return round_to(y, dtype).to(dtype)


def next_pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


# -- torch mirrors of the kernels' reductions ---------------------------------------------------


def lane_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim in the kernels' order (portable.mean_of_squares' lanes, then its
    pairwise tree); keeps the dim with size 1."""
    n = t.shape[-1]
    pad = (-n) % LANES
    if pad:
        t = torch.nn.functional.pad(t, (0, pad))
    chunks = t.reshape(*t.shape[:-1], (n + pad) // LANES, LANES)
    # The lanes start at +0, as in the kernels (for sums of squares, never -0, this is
    # portable.mean_of_squares' acc = chunk 0 exactly).
    acc = chunks.new_zeros((*chunks.shape[:-2], LANES))  # no chunk 0 when the rows are empty
    for k in range(chunks.shape[-2]):
        acc = acc + chunks[..., k, :]
    while acc.shape[-1] > 1:
        acc = acc[..., 0::2] + acc[..., 1::2]
    return acc


# Weight gradients are summed over rows in a fixed order that depends on the number of rows only
# (never on the device): rows are cut into P contiguous groups of G rows; each group is summed in
# row order (one program per group and column block, no atomics), then the P group sums in order.
MAX_GROUPS = 256


def row_groups(m: int) -> tuple[int, int]:
    """(rows per group G, number of groups P) for ``m`` rows."""
    g = max(1, triton.cdiv(m, MAX_GROUPS))
    return g, triton.cdiv(m, g)


def grouped_row_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum [M, N] over rows in the order of :func:`row_groups` (the kernels' order)."""
    m, n = t.shape
    g, p = row_groups(m)
    pad = p * g - m
    if pad:
        t = torch.nn.functional.pad(t, (0, 0, 0, pad))
    t3 = t.reshape(p, g, n)
    acc = torch.zeros(p, n, dtype=t.dtype, device=t.device)
    for i in range(g):
        acc = acc + t3[:, i]
    total = torch.zeros(n, dtype=t.dtype, device=t.device)
    for j in range(p):
        total = total + acc[j]
    return total


# -- torch.compile: the regions as custom ops ---------------------------------------------------
# Each region is also registered as a torch.library custom op (namespace ``emulator``), forward and
# backward, so that torch.compile calls it as one opaque operation: Inductor can neither drop its
# internal roundings nor fuse other code into it. Custom ops take strings, not Points: a point
# travels as its key, which names every site and variant in order.


def point_key(point: Point) -> str:
    """``"region:site=value,..."``; :func:`point_from_key` gives the same point back."""
    return point.region + ":" + ",".join(f"{k}={v}" for k, v in point._items)


@functools.lru_cache(maxsize=None)
def point_from_key(key: str) -> Point:
    region, _, items = key.partition(":")
    return Point(region, dict(kv.split("=", 1) for kv in items.split(",") if kv))


def owned(t: torch.Tensor, *inputs: torch.Tensor | None) -> torch.Tensor:
    """A custom op's output: contiguous (its fake says so) and sharing no memory with an input
    (custom ops may not alias). Neither changes a bit."""
    t = t.contiguous()
    for i in inputs:
        if i is not None and i.untyped_storage().data_ptr() == t.untyped_storage().data_ptr() and t.numel():
            return t.clone()
    return t


@contextlib.contextmanager
def autograd_in_op():
    """Record autograd inside a custom op's implementation (a backward computed as the gradient of
    an FP32 function, exactly as eager autograd computes it). The dispatcher runs implementations
    below the autograd keys, where nothing is recorded; this lets them through for the block."""
    exclude = torch._C._dispatch_tls_local_exclude_set().remove(torch._C.DispatchKey.AutogradFunctionality)
    with torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude), torch.enable_grad():
        yield
