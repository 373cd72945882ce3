"""engineprofiles.machine: what a profile records of the machine, and when two machines differ.

Expectations come from this machine (its /proc/cpuinfo and torch's answers), never from the machine
the tests were written on; the comparison is checked on machines drawn at random (seeded)."""

from __future__ import annotations

import random

import pytest
import torch

from engineprofiles import machine as M
from engineprofiles.machine import KERNEL_FLAGS, Machine, differences, this_machine


def cpuinfo_flags() -> set[str]:
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    return set()


def test_this_machine_is_what_cpuinfo_and_torch_say():
    m = this_machine()
    assert m.known
    assert set(m.flags) == cpuinfo_flags() & set(KERNEL_FLAGS)
    assert m.capability == torch.backends.cpu.get_cpu_capability()
    assert ("avx512" in m.isa) == torch.cpu._is_avx512_supported()
    assert ("amx_tile" in m.isa) == torch.cpu._is_amx_tile_supported() == m.amx
    assert not differences(m, this_machine())
    assert Machine.of(m.settings()) == m  # what a profile writes reads back as the same machine


def test_an_emulated_capability_is_what_the_engine_process_sees():
    m = this_machine(emulate="avx2")
    assert m.capability == "AVX2" and set(m.isa) <= {"avx2"} and m.flags == this_machine().flags
    # the host and its emulation are two machines, unless the host is itself AVX2 (then it is the host)
    assert bool(differences(this_machine(), m)) == (this_machine().capability != "AVX2")


def test_a_profile_without_a_machine_record_differs_from_every_machine():
    (d,) = differences(Machine(capability="AVX512"), this_machine())
    assert "records no CPU features" in d
    assert "unrecorded" in Machine().describe()


def test_amx_is_told_apart_and_named(monkeypatch):
    here = this_machine()
    amx = Machine(vendor="GenuineIntel", flags=tuple(sorted({*here.flags, "amx_tile", "amx_bf16"})),
                  isa=tuple(sorted({*here.isa, "amx_tile"})), capability=here.capability)
    diffs = differences(amx, here)
    text = " ".join(diffs)
    assert "amx_tile" in text
    assert ("vendor" in text) == (here.vendor != "GenuineIntel")
    assert amx.amx and "AMX" in amx.describe()
    # NOAMX (shared/tools/noamx): AMX in the flags, torch answering no: not the AMX machine, not a plain one
    noamx = Machine(vendor=amx.vendor, flags=amx.flags, isa=here.isa, capability=here.capability)
    assert differences(amx, noamx) and "not used" in noamx.describe()


@pytest.mark.parametrize("seed", range(5))
def test_two_machines_differ_exactly_when_a_kernel_selecting_feature_does(seed):
    rng = random.Random(seed)
    isas = [q for q, _ in M.ISA_QUERIES]

    def draw() -> Machine:
        return Machine(vendor=rng.choice(["GenuineIntel", "AuthenticAMD"]),
                       flags=tuple(sorted(f for f in KERNEL_FLAGS if rng.random() < 0.5)),
                       isa=tuple(sorted(i for i in isas if rng.random() < 0.5)),
                       capability=rng.choice(["AVX2", "AVX512"]))

    for _ in range(200):
        a = draw()
        b = draw() if rng.random() < 0.7 else Machine.of(a.settings())
        assert (not differences(a, b)) == (a == b)
        for d in differences(a, b):
            assert d.split(":")[0] in ("vendor", "vector ISA", "torch's ISA answers", "cpuinfo flags")
