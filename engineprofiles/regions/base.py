"""What a region is: its rounding sites, its formula variants, and its lattice of points.

A *site* is a named intermediate that an implementation keeps in FP32 (``fp32``) or rounds to the
activation dtype (``rounded``). A *variant* is a formula choice that is not a rounding site (e.g.
``x / sqrt(v)`` versus ``x * rsqrt(v)``). A *point* assigns every site and every variant one of its
options; the region's torch reference computes the region exactly at any point.

Some choices cannot change any output once other choices are fixed (for example, whether a
multiply-add is contracted into an FMA does not matter when the product is rounded before the
add). :meth:`RegionSpec.canonicalize` maps such points onto one representative, so that a probe
never reports an ambiguity between points that can never differ.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Callable, Iterator, Literal, Mapping

from ..errors import PointError

FP32 = "fp32"
ROUNDED = "rounded"
PRECISIONS = (FP32, ROUNDED)

MathMode = Literal["torch", "portable"]


@dataclass(frozen=True)
class Choice:
    """One site or variant: its name, allowed options and what it means."""

    name: str
    options: tuple[str, ...]
    doc: str
    kind: Literal["site", "variant"] = "site"
    # A site or variant added after profiles were shipped: the option a profile without it means (what
    # the region computed before it was told apart). Such a profile loads with it, and a profile holding
    # it is written without it, so shipped files keep their bytes. None: every profile names it.
    default: str | None = None

    def __post_init__(self) -> None:
        if self.default is not None and self.default not in self.options:
            raise PointError(f"{self.name}: default {self.default!r} is not one of its options {self.options}")


def site(name: str, doc: str, *, default: str | None = None) -> Choice:
    """A rounding site (``default``: see :class:`Choice`, for a site added after profiles were shipped)."""
    return Choice(name, PRECISIONS, doc, "site", default)


def variant(name: str, options: tuple[str, ...], doc: str, *, default: str | None = None) -> Choice:
    """A formula variant (``default``: see :class:`Choice`, for a variant added after profiles were shipped)."""
    return Choice(name, options, doc, "variant", default)


class Point(Mapping[str, str]):
    """An immutable, hashable assignment of every site and variant of one region."""

    __slots__ = ("region", "_items")

    def __init__(self, region: str, items: Mapping[str, str]):
        self.region = region
        self._items = tuple(items.items())

    def __getitem__(self, key: str) -> str:
        for k, v in self._items:
            if k == key:
                return v
        raise KeyError(key)

    def __iter__(self) -> Iterator[str]:
        return (k for k, _ in self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __hash__(self) -> int:
        return hash((self.region, self._items))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Point) and (self.region, self._items) == (other.region, other._items)

    def replace(self, **changes: str) -> "Point":
        d = dict(self._items)
        d.update(changes)
        return Point(self.region, d)

    def label(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self._items)

    def __repr__(self) -> str:
        return f"Point({self.region}: {self.label()})"


@dataclass(frozen=True)
class RegionSpec:
    """A region of the rounding model. One spec per region; the reference lives next to it."""

    name: str
    title: str
    doc: str
    sites: tuple[Choice, ...]
    variants: tuple[Choice, ...] = ()
    # Rules mapping points that can never produce different outputs onto one representative.
    canonical_rules: Callable[[dict[str, str]], dict[str, str]] = field(default=lambda d: d)

    @property
    def choices(self) -> tuple[Choice, ...]:
        return self.sites + self.variants

    @property
    def site_names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.sites)

    @property
    def variant_names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.variants)

    def choice(self, name: str) -> Choice:
        for c in self.choices:
            if c.name == name:
                return c
        raise PointError(f"{self.name} has no site or variant {name!r}; it has {', '.join(self.site_names + self.variant_names)}")

    def point(self, sites: Mapping[str, str] | None = None, variants: Mapping[str, str] | None = None, /, **kw: str) -> Point:
        """Build and check a point. Variants not given take their first option (the default)."""
        given: dict[str, str] = {}
        for src in (sites or {}, variants or {}, kw):
            given.update(src)
        for name, value in given.items():
            c = self.choice(name)
            if value not in c.options:
                raise PointError(f"{self.name}.{name} must be one of {', '.join(c.options)}; got {value!r}")
        missing = [c.name for c in self.sites if c.name not in given]
        if missing:
            raise PointError(f"{self.name} point is missing site(s) {', '.join(missing)}")
        values = {c.name: given.get(c.name, c.options[0]) for c in self.choices}
        return Point(self.name, values)

    def canonicalize(self, p: Point) -> Point:
        if p.region != self.name:
            raise PointError(f"point of region {p.region!r} given to region {self.name!r}")
        return Point(self.name, self.canonical_rules(dict(p)))

    def is_canonical(self, p: Point) -> bool:
        return self.canonicalize(p) == p

    def all_points(self, canonical: bool = True) -> list[Point]:
        """Every point of the lattice, in a stable order; only canonical ones by default."""
        names = [c.name for c in self.choices]
        out: list[Point] = []
        for combo in itertools.product(*(c.options for c in self.choices)):
            p = Point(self.name, dict(zip(names, combo)))
            if not canonical or self.is_canonical(p):
                out.append(p)
        return out

    def site_part(self, p: Point) -> dict[str, str]:
        return {k: p[k] for k in self.site_names}

    def variant_part(self, p: Point) -> dict[str, str]:
        return {k: p[k] for k in self.variant_names}
