"""Joining a Ray cluster for the data layer (the Ray loader and `kilovla data cache`).

`connect_ray(address)` picks, in this order:

- a Ray already initialised in this process (the caller's `ray.init`) is used as it is;
- an explicit address (`"auto"`, `"ray://head:10001"`, `"10.0.0.1:6379"`), else the `RAY_ADDRESS`
  environment variable: Ray connects there, and fails with one clear line when nothing answers;
- otherwise a local Ray is started in this process, and one log line says so, since a silent local
  start on a cluster node would quietly leave the cluster idle.
"""

from __future__ import annotations

import logging
import os

from kilovla.errors import KilovlaError

log = logging.getLogger(__name__)


def import_ray(what: str):
    try:
        import ray
    except ImportError:
        raise KilovlaError(f"{what} needs Ray: pip install 'kilovla[rl]'") from None
    return ray


def connect_ray(address: str | None = None, *, num_cpus: int | None = None, what: str = "the Ray loader"):
    """Initialise Ray (see the module docstring); returns the `ray` module."""
    ray = import_ray(what)
    if ray.is_initialized():
        return ray
    address = address or os.environ.get("RAY_ADDRESS") or None
    if address:
        try:
            ray.init(address=address, log_to_driver=False)
        except (ConnectionError, RuntimeError, ValueError) as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise KilovlaError(f"cannot connect to the Ray cluster at {address!r}: {first}") from None
        log.info("%s: connected to the Ray cluster at %s", what, address)
        return ray
    cpus = num_cpus or len(os.sched_getaffinity(0))
    log.warning("%s: no Ray cluster given (no address, RAY_ADDRESS unset); starting a local Ray with %d CPUs "
                "in this process", what, cpus)
    # address="local": a new instance even when another Ray runs on this machine (ray.init() alone
    # may attach to it through Ray's current-cluster file).
    ray.init(address="local", num_cpus=cpus, include_dashboard=False, log_to_driver=False)
    return ray
