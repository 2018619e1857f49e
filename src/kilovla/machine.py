"""The machine a figure was measured on: CPU, cores, GPU, torch and Python, and the load average.
Bench suites and the demo's report record them beside their figures. And the device a command runs on
(`resolve_device`)."""

from __future__ import annotations

import os
import platform

from kilovla.errors import KilovlaError


def machine_info() -> dict:
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"cpu": cpu, "cores": os.cpu_count(), "gpu": gpu, "torch": torch.__version__.split("+")[0],
            "python": platform.python_version()}


def load_average() -> float | None:
    """The 1-minute load average (None where the OS has none): a rate measured on 2 shared cores
    means little without it."""
    try:
        return round(os.getloadavg()[0], 2)
    except (OSError, AttributeError):
        return None


def resolve_device(device: str, flag: str):
    """A device flag's value as a torch device: ``auto``, the GPU when there is one, else the CPU; an explicit
    CUDA device must exist (KilovlaError naming `flag` otherwise)."""
    import torch

    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError as e:
        raise KilovlaError(f"{flag} {device!r}: {e}") from None
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise KilovlaError(f"{flag} {device}: this machine has no CUDA GPU torch can use (use cpu or auto)")
    return resolved
