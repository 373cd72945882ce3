"""Error bounds for the backward tests, derived from FP32 rounding, not picked to pass.

The kernels' backward computes the gradient of the FP32 function in FP32. The tests compare it
with FP64 autograd of the same function, element by element, against a bound obtained by running
error analysis of the kernel's own formula: :class:`Bounded` carries, next to the exact value
(in FP64), a first-order bound on how far the FP32 evaluation can be from it, and each FP32
operation adds what IEEE arithmetic allows:

    a + b, a * b, a / b, sqrt(a):  |fl(op) - op| <= u * |op|  (+ eta for an underflowing result)

with u = 2**-24 (round to nearest) and eta = 2**-150 (half the smallest FP32 subnormal); input
errors propagate by the usual first-order rules (|a| eb + |b| ea for a product, ...). A sum
of n terms added along a path of at most d additions (the lane order: ceil(n/256) additions in a
lane, then 8 tree levels; rows: G in a group, then P groups) is bounded by d * u * sum |terms|.
For exp, the portable polynomial's relative error is bounded by :data:`EXP_REL_BOUND`, derived
below from its reduction, truncation and Horner rounding. Second-order terms (u**2) are covered by
a 1% margin in :func:`check_within`.

For scale: one BF16 ulp is 2**-8 relative, i.e. 65536 u; every bound here is a few dozen u
times the magnitude of the terms, so a single rounding site left in the backward (the difference
this project exists to get right) is far outside it; each test also checks that.
"""

from __future__ import annotations

import math

import torch

U = 2.0**-24
ETA = 2.0**-150


def _exp_rel_bound() -> float:
    """Relative error bound of engineprofiles.portable.exp for |x| <= 104 (its whole finite range).

    r = (x - n*LN2_HI) - n*LN2_LO with |n| <= 150: n*LN2_HI is exact (8 x 9 significant bits) and
    x - n*LN2_HI is exact (Sterbenz); rounding n*LN2_LO and the last subtraction err by at most
    u*(150*|LN2_LO| + |r|), and LN2_HI + fl32(LN2_LO) misses ln 2 by c per unit of n. An absolute
    error d in r is a relative error d in exp(r). The degree-7 Taylor polynomial on
    |r| <= ln2/2 (+1e-3 for the rounding of n) truncates by at most |r|^8/8! e^|r|; Horner's
    rounding (7 multiply-adds) by gamma_14 * sum |r|^k/k! <= gamma_14 e^|r| (Higham, Thm 5.1), plus
    u e^|r| for the FP32 coefficients 1/k!; relative to e^r >= e^-|r| that is a factor e^(2|r|).
    Scaling by 2**n1 * 2**n2 is exact for normal results (subnormal ones get eta, below).
    """
    ln2_lo32 = float(torch.tensor(-2.12194440e-4, dtype=torch.float32))
    c = abs(0.693359375 + ln2_lo32 - math.log(2.0))
    rmax = math.log(2.0) / 2 + 1e-3
    reduction = U * (150 * abs(ln2_lo32) + rmax) + 150 * c
    gamma14 = 14 * U / (1 - 14 * U)
    poly = (rmax**8 / math.factorial(8) * math.exp(rmax) + (gamma14 + U) * math.exp(rmax)) * math.exp(rmax)
    return reduction + poly


EXP_REL_BOUND = _exp_rel_bound()


class Bounded:
    """An FP32 computation's exact value ``v`` (FP64) and a first-order bound ``e`` on its error."""

    __slots__ = ("v", "e")

    def __init__(self, v: torch.Tensor, e: torch.Tensor | float = 0.0):
        self.v = v.double()
        self.e = torch.as_tensor(e, dtype=torch.float64).expand_as(self.v) if not isinstance(e, torch.Tensor) else e

    @staticmethod
    def exact(t: torch.Tensor) -> "Bounded":
        """An input: FP32-representable, so exact."""
        return Bounded(t.double(), torch.zeros_like(t, dtype=torch.float64))

    @staticmethod
    def _lift(x) -> "Bounded":
        if isinstance(x, Bounded):
            return x
        t = torch.as_tensor(float(x), dtype=torch.float64)
        assert float(torch.tensor(float(x), dtype=torch.float32)) == float(x), "constants must be exact in FP32"
        return Bounded(t, torch.zeros((), dtype=torch.float64))

    @staticmethod
    def _round(v: torch.Tensor, e: torch.Tensor) -> "Bounded":
        return Bounded(v, e + U * v.abs() + ETA)

    def __add__(self, o):
        o = Bounded._lift(o)
        return Bounded._round(self.v + o.v, self.e + o.e)

    __radd__ = __add__

    def __neg__(self):
        return Bounded(-self.v, self.e)

    def __sub__(self, o):
        return self + (-Bounded._lift(o))

    def __rsub__(self, o):
        return Bounded._lift(o) + (-self)

    def __mul__(self, o):
        o = Bounded._lift(o)
        return Bounded._round(self.v * o.v, self.v.abs() * o.e + o.v.abs() * self.e + self.e * o.e)

    __rmul__ = __mul__

    def __truediv__(self, o):
        o = Bounded._lift(o)
        q = self.v / o.v
        denom = o.v.abs() - o.e
        assert bool((denom > 0).all()), "divisor's error bound reaches zero"
        return Bounded._round(q, (self.e + q.abs() * o.e) / denom)

    def __rtruediv__(self, o):
        return Bounded._lift(o) / self

    def sqrt(self) -> "Bounded":
        r = self.v.sqrt()
        lo = (self.v - self.e).clamp(min=0).sqrt()
        return Bounded._round(r, self.e / (r + lo).clamp(min=1e-300))

    def exp(self) -> "Bounded":
        """portable.exp: relative error EXP_REL_BOUND, plus the input's error times exp."""
        v = self.v.exp()
        e = v * (torch.expm1(self.e) + EXP_REL_BOUND * torch.exp(self.e)) + ETA
        return Bounded(v, e)

    def sum(self, dim: int, depth: int) -> "Bounded":
        """A sum along ``dim`` whose every term goes through at most ``depth`` FP32 additions."""
        v = self.v.sum(dim)
        e = self.e.sum(dim) + depth * U * self.v.abs().sum(dim) + depth * ETA
        return Bounded(v, e)

    def unsqueeze(self, dim: int) -> "Bounded":
        return Bounded(self.v.unsqueeze(dim), self.e.unsqueeze(dim))


def lane_depth(n: int, lanes: int = 256) -> int:
    """Additions on the path of one term of the kernels' lane sum over n columns."""
    return math.ceil(n / lanes) + int(math.log2(lanes))


def check_within(got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor, what: str) -> float:
    """|got - want| <= bound (+1% for second-order terms) everywhere; returns the largest ratio
    of error to bound, which the tests print so that a too-loose bound is visible."""
    err = (got.double() - want.double()).abs()
    limit = bound * 1.01 + 1e-300
    ratio = (err / limit)
    worst = float(ratio.max()) if ratio.numel() else 0.0
    if worst > 1.0:
        i = int(ratio.flatten().argmax())
        raise AssertionError(
            f"{what}: error {err.flatten()[i].item():.3e} exceeds the FP32 bound {limit.flatten()[i].item():.3e} "
            f"(got {got.flatten()[i].item()!r}, FP64 {want.flatten()[i].item()!r}); "
            f"{int((ratio > 1).sum())} of {ratio.numel()} elements outside"
        )
    return worst
