"""A stand-in for SGLang's ``sgl_kernel`` package, so that SGLang's offline engine starts on a CPU.

Installed into SGLang's environment (never anywhere else) by ``scripts/engine_env.sh sglang VERSION``,
which copies this folder into that venv's site-packages. Not part of the ``engineprofiles`` package.

Why: SGLang 0.5.23's engine imports ``sgl_kernel`` unconditionally when it runs on CPU
(``SGLANG_USE_CPU_ENGINE=1``): its KV-cache, allocation and speculative-decoding modules do
``from sgl_kernel import <name>_cpu`` at import time. The CPU build of ``sgl_kernel`` is compiled from
SGLang's source tree and is not on PyPI; PyPI's ``sgl-kernel`` / ``sglang-kernel`` wheels are CUDA
builds. Without any ``sgl_kernel`` the engine does not start.

What this module is: exactly the names those imports ask for (found by starting the engine on tiny
Qwen2 model with a recording module in its place;
Qwen3 and Llama start with exactly these), each a function that raises
``NotImplementedError`` naming itself if it is ever called. None of them is called when the engine
serves a plain dense model on a CPU without AMX (the path ``probe-engine sglang`` runs): the
allocation and cache-move helpers are taken only with speculative decoding or hierarchical caching.

What it deliberately is not: it registers no ``torch.ops.sgl_kernel`` operator. SGLang decides
whether to use its Intel AMX kernels by looking for ``torch.ops.sgl_kernel.convert_weight_packed``
(``sglang.srt.utils.common._is_intel_amx_backend_available``); with this stand-in that check is
false, so every layer runs ``forward_native`` (eager torch), the same code the op-level probe
measures, and the attention backend falls back from ``intel_amx`` to ``torch_native``, as SGLang
itself decides on a host without AMX. A name not listed here raises ``ImportError`` when imported
from it (``from sgl_kernel import x``), which SGLang's optional imports already handle.
"""

__version__ = "0.0.0+engineprofiles.standin"
STANDIN = "sgl_kernel stand-in (engineprofiles, scripts/sgl_kernel_standin)"

# The names SGLang 0.5.23 imports from sgl_kernel at import time on its CPU engine path.
_NAMES = (
    "assign_draft_cache_locs_contiguous_cpu",  # sglang/kernels/ops/speculative/cache_locs.py
    "assign_extend_cache_locs_cpu",  # sglang/kernels/ops/speculative/cache_locs.py
    "assign_req_to_token_pool_cpu",  # sglang/srt/mem_cache/allocation.py
    "build_tree_kernel_efficient_cpu",  # sglang/kernels/ops/speculative/spec_tree.py
    "copy_all_layer_kv_cache_cpu",  # sglang/kernels/ops/kvcache/cache_move.py
    "fill_accept_out_cache_loc_cpu",  # sglang/kernels/ops/speculative/eagle.py
    "fill_bonus_tokens_cpu",  # sglang/kernels/ops/speculative/eagle.py
    "verify_tree_greedy_cpu",  # sglang/kernels/ops/speculative/spec_tree.py
)


def _missing(name):
    def kernel(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{name} was called, but this is engineprofiles' sgl_kernel stand-in "
            "(scripts/sgl_kernel_standin), which only lets SGLang's CPU engine import: this engine "
            "path needs SGLang's real sgl_kernel CPU build (compiled from SGLang's source)"
        )

    kernel.__name__ = kernel.__qualname__ = name
    return kernel


for _name in _NAMES:
    globals()[_name] = _missing(_name)
del _name


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    raise AttributeError(
        f"module 'sgl_kernel' (engineprofiles' CPU stand-in, scripts/sgl_kernel_standin) has no {name!r}: "
        "the stand-in holds only the names SGLang's CPU engine imports for dense models; this path needs "
        "SGLang's real sgl_kernel CPU build"
    )
