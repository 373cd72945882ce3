"""Portable math: correctly rounded square roots, and the RMSNorm references in portable mode keep
their shapes (including zero rows)."""

import numpy as np
import pytest
import torch

from engineprofiles import portable
from engineprofiles.regions import ADD_SPEC, PLAIN_SPEC, add_rmsnorm_ref, rmsnorm_ref


def test_portable_sqrt_is_correctly_rounded_where_torch_sqrt_is_not():
    g = torch.Generator().manual_seed(0)
    bits = torch.randint(0, 2**31 - 1, (1 << 20,), generator=g, dtype=torch.int64).to(torch.int32)
    x = torch.cat([bits.view(torch.float32), torch.rand(1 << 18, generator=g) * 30,
                   torch.tensor([0.0, -0.0, -1.0, float("inf"), -float("inf"), float("nan"), 1e-45, 3.4028234663852886e38])])
    want = torch.from_numpy(np.sqrt(x.numpy()))  # IEEE sqrt
    got = portable.sqrt(x)
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan)
    assert torch.equal(got[~nan].view(torch.int32), want[~nan].view(torch.int32))


@pytest.mark.parametrize("shape", [(5, 151), (2, 3, 151), (0, 151)])
def test_portable_rmsnorm_references_keep_the_input_shape(shape):
    x = torch.randn(shape).bfloat16()
    w = torch.ones(shape[-1]).bfloat16()
    for p in PLAIN_SPEC.all_points():
        assert rmsnorm_ref(x, w, 1e-6, p, math="portable").shape == x.shape
    for p in ADD_SPEC.all_points()[:6]:
        out, res = add_rmsnorm_ref(x, x, w, 1e-6, p, math="portable")
        assert out.shape == x.shape and res.shape == x.shape
