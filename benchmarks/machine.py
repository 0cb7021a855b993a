"""Which machine a measurement ran on: the processor beyond its model name, its vector
extensions, the vector width torch's compiler picks on it, and the record a benchmark keeps.

Virtual machines often report only "AMD EPYC" or "Intel(R) Xeon(R) Processor", and two that say
the same can be different generations at different clocks; the record tells them apart by the
fields of ``/proc/cpuinfo`` (:func:`lowprec_demo.results.cpuinfo`) and by what torch sees.

Example:
    ``machine_record("cpu")["cpu"]`` -> ``{"vendor": "AuthenticAMD", "family": 23, "model": 1, ...}``
"""

from __future__ import annotations

import os
from typing import List, Optional

import torch

from lowprec_demo.book.results import atomic_write_json, cpuinfo, provenance

__all__ = ["VECTOR_FLAGS", "CPU_FIELDS", "cpu_identity", "cpu_label", "cpu_vector_extensions",
           "compiler_vector_width", "load_average", "machine_record"]

#: the CPU flags that name vector extensions (x86: /proc/cpuinfo; Arm: "asimd" is NEON)
VECTOR_FLAGS = ("sse4_2", "avx", "avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
                "amx_tile", "asimd", "sve", "sve2")


#: the /proc/cpuinfo fields that tell one processor of the same model name from another (virtual
#: machines often report only "AMD EPYC" or "Intel(R) Xeon(R) Processor"): the name each takes and
#: how its value is read
CPU_FIELDS = {"vendor_id": ("vendor", str), "cpu family": ("family", int), "model": ("model", int),
              "stepping": ("stepping", int), "cpu MHz": ("mhz", float), "cache size": ("cache", str)}


def cpu_identity() -> dict:
    """Which processor this is beyond its model name: vendor, family, model and stepping, clock
    (MHz, as the kernel reports it) and the cache size ``/proc/cpuinfo`` gives for its first
    processor (:func:`lowprec_demo.results.cpuinfo`; empty where there is no such file; a value
    that does not read as its type is kept as written). Two virtual machines that both say
    "AMD EPYC" can be different generations at different clocks.

    Example: ``cpu_identity()`` -> ``{"vendor": "AuthenticAMD", "family": 23, "model": 1, ...}``."""
    found = {}
    for key, value in cpuinfo().items():
        if key in CPU_FIELDS:
            name, read = CPU_FIELDS[key]
            try:
                found[name] = read(value)
            except ValueError:
                found[name] = value
    return found


def cpu_label(identity: dict) -> str:
    """:func:`cpu_identity` in a few words: ``"family 23 model 1 stepping 2, 1996 MHz, cache 512 KB"``."""
    parts = [" ".join(f"{k} {identity[k]}" for k in ("family", "model", "stepping") if k in identity)]
    if "mhz" in identity:
        parts.append(f"{identity['mhz']:.0f} MHz")
    if "cache" in identity:
        parts.append(f"cache {identity['cache']}")
    return ", ".join(p for p in parts if p)


def cpu_vector_extensions() -> dict:
    """The CPU's vector extensions: the flags of :data:`VECTOR_FLAGS` its ``/proc/cpuinfo``
    lists for the first processor (x86 "flags", Arm "Features"; empty where there is no such
    file) and the widest instruction set torch's own CPU kernels use
    (``torch.backends.cpu.get_cpu_capability()``, e.g. ``"AVX2"``).

    Example: ``cpu_vector_extensions()["torch_capability"]`` -> ``"AVX2"``."""
    fields = cpuinfo()
    flags = set((fields.get("flags") or fields.get("Features") or "").split())
    try:
        capability = torch.backends.cpu.get_cpu_capability()
    except Exception:   # older torch
        capability = None
    return {"flags": [f for f in VECTOR_FLAGS if f in flags], "torch_capability": capability}


def compiler_vector_width() -> Optional[str]:
    """The vector instruction set torch's compiler (inductor) compiles CPU kernels for here, with
    its width in bits, ``"none (scalar loops)"`` where it picks none, or None where it cannot say.

    Example: ``compiler_vector_width()`` -> ``"avx2 (256 bits)"``."""
    try:
        from torch._inductor import cpu_vec_isa
        isa = cpu_vec_isa.pick_vec_isa()
        return f"{isa} ({isa.bit_width()} bits)" if isa else "none (scalar loops)"
    except Exception:
        return None


def load_average() -> Optional[List[float]]:
    """The system's load average over 1, 5 and 15 minutes (``os.getloadavg()``), each rounded to
    two decimals; None where the system keeps none.

    Example: ``load_average()`` -> ``[1.02, 0.87, 0.64]``."""
    if not hasattr(os, "getloadavg"):
        return None
    return [round(v, 2) for v in os.getloadavg()]


def machine_record(device: str) -> dict:
    """The machine a benchmark runs on: :func:`lowprec_demo.results.provenance` (versions, device
    and CPU model, commit, date) with the CPU's identity (:func:`cpu_identity`, on the CPU only)
    and vector extensions, the core and thread counts and the load average now
    (``load_average_start``).

    Example: ``machine_record("cpu")["threads"]`` -> ``1`` (after ``torch.set_num_threads(1)``)."""
    p = provenance(device)
    return {"date": p["date"], "device": device, "package_version": p["package_version"],
            "git_commit": p["git_commit"], "device_name": p["device_name"], "cpu_count": os.cpu_count(),
            "cpu_vector_extensions": cpu_vector_extensions(), "cpu": cpu_identity() if device == "cpu" else None,
            "threads": torch.get_num_threads(), "torch": p["torch_version"], "python": p["python_version"],
            "platform": p["hostname_platform"], "load_average_start": load_average()}


def save_run(prefix: str, result: dict, text: str) -> None:
    """A stored benchmark run: ``result`` as PREFIX.json (atomically), its table ``text`` as PREFIX.md."""
    atomic_write_json(prefix + ".json", result)
    with open(prefix + ".md", "w") as f:
        f.write(text)
