"""The machine a profile was probed on, and whether this machine would run the same kernels.

The bits an engine computes follow the CPU as much as the engine: vLLM's CPU attention picks its
``amx`` or ``vec`` ISA by AMX support, its GEMMs go to oneDNN, sgl ``weight_packed_linear`` or torch
by shape and CPU, torch's and Inductor's kernels dispatch by vector ISA. A profile therefore records
the CPU features that select kernels (:func:`record`, written into ``engine.settings`` by every
probe), and exact mode, which claims the engine's bits, refuses where this machine's record
differs (:func:`differences`).

What is recorded (``engine.settings`` keys):

``cpu_vendor``    ``vendor_id`` of /proc/cpuinfo (GenuineIntel, AuthenticAMD, ...)
``cpu_flags``     the kernel-selecting flags /proc/cpuinfo lists (:data:`KERNEL_FLAGS`): the hardware
``cpu_isa``       what torch in the probing process answers (``torch.cpu._is_*_supported``), which is
                  what the engines ask: an AMX machine run with ``NOAMX=1`` (shared/tools/noamx) or
                  an emulated AVX2 (``scripts/emulate_cpu.sh``) answers less than its flags
``cpu_capability`` torch's vector ISA (existing key)

A profile written before these keys existed records none of them: it is "unknown", and exact mode
refuses it like a different machine (fail closed).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Mapping, Optional

# /proc/cpuinfo flags that select a kernel path in torch, oneDNN, Inductor or the engines' CPU builds.
KERNEL_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
                "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8", "amx_fp16")
# torch's answers to the questions engines ask (vLLM's attention ISA, SGLang's AMX path), by name.
ISA_QUERIES = (("avx2", "_is_avx2_supported"), ("avx512", "_is_avx512_supported"),
               ("avx512_vnni", "_is_vnni_supported"), ("avx512_bf16", "_is_avx512_bf16_supported"),
               ("amx_tile", "_is_amx_tile_supported"), ("amx_fp16", "_is_amx_fp16_supported"))
# What an emulated capability (scripts/emulate_cpu.sh: ENGINEPROFILES_EMULATE_CPU) leaves of torch's
# answers (engineloop.capture.emulate_cpu answers False to the rest in the engine's process).
EMULATED_ISA = {"avx2": ("avx2",)}
KEYS = ("cpu_vendor", "cpu_flags", "cpu_isa", "cpu_capability")


@dataclass(frozen=True)
class Machine:
    """The kernel-selecting description of one CPU machine (all fields None: not recorded)."""

    vendor: Optional[str] = None
    flags: Optional[tuple[str, ...]] = None
    isa: Optional[tuple[str, ...]] = None
    capability: Optional[str] = None

    @property
    def known(self) -> bool:
        return self.flags is not None and self.isa is not None

    @property
    def amx(self) -> bool:
        """Whether the engines see AMX here (vLLM's CPU attention then runs its ``amx`` ISA)."""
        return bool(self.isa and "amx_tile" in self.isa)

    def settings(self) -> dict[str, Any]:
        """The ``engine.settings`` entries of this machine."""
        return {"cpu_vendor": self.vendor, "cpu_flags": list(self.flags or ()), "cpu_isa": list(self.isa or ()),
                "cpu_capability": self.capability}

    @classmethod
    def of(cls, settings: Mapping[str, Any]) -> "Machine":
        """The machine a profile's (or capture's) ``engine.settings`` records."""
        def tup(v: Any) -> Optional[tuple[str, ...]]:
            return None if v is None else tuple(sorted(str(x) for x in (v if isinstance(v, (list, tuple)) else [v])))

        cap = settings.get("cpu_capability")
        vendor = settings.get("cpu_vendor")
        return cls(vendor=None if vendor is None else str(vendor), flags=tup(settings.get("cpu_flags")),
                   isa=tup(settings.get("cpu_isa")), capability=None if cap is None else str(cap))

    def describe(self) -> str:
        """One line for messages: vendor, capability, AMX or not, and the ISA torch answers."""
        if not self.known:
            return f"an unrecorded machine (cpu_capability {self.capability or '?'})"
        amx = "AMX" if self.amx else ("AMX present but not used" if "amx_tile" in (self.flags or ()) else "no AMX")
        return f"{self.vendor or '?'} {self.capability or '?'}, {amx} (torch answers: {', '.join(self.isa or ()) or 'none'})"


def _cpuinfo() -> dict[str, str]:
    out: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    if out:
                        break  # the first processor is enough
                    continue
                k, _, v = line.partition(":")
                out.setdefault(k.strip(), v.strip())
    except OSError:
        pass
    return out


def this_machine(emulate: Optional[str] = None) -> Machine:
    """This process's machine: /proc/cpuinfo's vendor and kernel flags, torch's answers, torch's
    capability. Under an emulated capability (``emulate``, else ``$ENGINEPROFILES_EMULATE_CPU`` as
    scripts/emulate_cpu.sh sets it) torch's answers and capability are the emulated ones, as the
    engine's process sees them (engineloop.capture.emulate_cpu)."""
    import torch

    info = _cpuinfo()
    present = set(info.get("flags", "").split())
    flags = tuple(sorted(f for f in KERNEL_FLAGS if f in present))
    isa = [name for name, fn in ISA_QUERIES if hasattr(torch.cpu, fn) and bool(getattr(torch.cpu, fn)())]
    capability = torch.backends.cpu.get_cpu_capability()
    emulate = emulate or os.environ.get("ENGINEPROFILES_EMULATE_CPU")
    if emulate in EMULATED_ISA:
        isa = [i for i in isa if i in EMULATED_ISA[emulate]]
        capability = emulate.upper()
    return Machine(vendor=info.get("vendor_id") or None, flags=flags, isa=tuple(sorted(isa)), capability=capability)


def record() -> dict[str, Any]:
    """The ``engine.settings`` entries a probe on this machine writes."""
    return this_machine().settings()


def differences(recorded: Machine, here: Machine) -> list[str]:
    """What differs between the machine a profile records and this one, in words; empty when this
    machine would select the same kernels. An unrecorded machine differs from every machine."""
    if not recorded.known:
        return ["the profile records no CPU features (written before engineprofiles recorded them, or not on a CPU)"]
    out = []
    for what, a, b in (("vendor", recorded.vendor, here.vendor), ("vector ISA", recorded.capability, here.capability),
                       ("torch's ISA answers", recorded.isa, here.isa), ("cpuinfo flags", recorded.flags, here.flags)):
        if a != b:
            if isinstance(a, tuple) and isinstance(b, tuple):
                gone, new = sorted(set(a) - set(b)), sorted(set(b) - set(a))
                diff = "; ".join(p for p in (f"missing here: {' '.join(gone)}" if gone else "",
                                             f"only here: {' '.join(new)}" if new else "") if p)
                out.append(f"{what}: {diff}")
            else:
                out.append(f"{what}: profile {a}, here {b}")
    return out


def probe_command(engine: str) -> str:
    """The command that probes ``engine`` on this machine."""
    return f"scripts/probe.sh {engine}"
