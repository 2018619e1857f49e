"""Elastic training under torchrun's own agent: how a start knows it is a restart, and what it records.

    torchrun --nnodes=2:4 --nproc-per-node=8 --max-restarts=3 --rdzv-backend=c10d \\
        --rdzv-endpoint=node0:29400 --rdzv-id=job-42 -m kilovla train --config run.yaml

torchrun gives every worker of a launch TORCHELASTIC_RUN_ID: the --rdzv-id ('none' without one, a
random uuid with --standalone). The first start into a run_dir records it in run_dir/elastic.json; a
later start whose id matches is a restart of the same job (a lost worker or node, a scale-down, a
scale-up: torchrun's TORCHELASTIC_RESTART_COUNT stays 0 on membership changes, so it cannot tell) and
continues from the newest complete checkpoint, as `--resume auto` would, on the world size it now
has. Any other start into a used run_dir meets the usual rules (`folders.claim_run_dir`): the id is
recorded only once a start has claimed the run_dir, so a refused start stays refused on every retry.

Each restart logs one metrics record; the steps after the checkpoint are recomputed and their first
records dropped (`MetricsLogger`), so every step appears once:

    {"kind": "restart", "step": 2, "world_size_before": 2, "world_size_after": 1,
     "steps_recomputed": 1, "seconds_lost": 21.4, "restart_count": 1}
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import time
from pathlib import Path

from kilovla.data.writer import _atomic_write_text
from kilovla.errors import KilovlaError

log = logging.getLogger(__name__)
FILE = "elastic.json"
# Without parallel.timeout_s an elastic run's step deadline follows its own step time: a hung rank
# ends (and torchrun restarts the group) after STEP_DEADLINE_FACTOR median steps, never sooner than
# STEP_DEADLINE_MIN_S, nor before UNMEASURED_DEADLINE_S while no step has been timed.
STEP_DEADLINE_FACTOR = 10.0
STEP_DEADLINE_MIN_S = 300.0
UNMEASURED_DEADLINE_S = 1800.0


def job_id() -> str | None:
    """The elastic job's id (torchrun's --rdzv-id), or None outside an elastic launch."""
    value = os.environ.get("TORCHELASTIC_RUN_ID", "")
    return None if value in ("", "none") else value


def recorded(run_dir: Path) -> dict | None:
    """run_dir/elastic.json as written by `record_start` (None where there is none)."""
    path = Path(run_dir) / FILE
    if not path.is_file():
        return None
    try:
        found = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise KilovlaError(f"{path}: not kilovla's elastic record ({e}): remove it or use a new run_dir") from None
    if not isinstance(found, dict) or not isinstance(found.get("run_id"), str):
        raise KilovlaError(f"{path}: not kilovla's elastic record (no run_id): remove it or use a new run_dir")
    return found


def restart_of(run_dir: Path) -> dict | None:
    """The previous start's record when this start restarts the same elastic job, else None. Read
    before the process group forms, so every rank sees the record the previous start left."""
    mine = job_id()
    previous = recorded(run_dir) if mine is not None else None
    return previous if previous is not None and previous["run_id"] == mine else None


def warn_shared_store(world_size: int) -> None:
    """Say once (rank 0) when torchrun may restart this group through its shared rendezvous store: a
    restarted group can read the previous attempt's addresses from it and fail to connect (gloo and
    NCCL alike; pytorch/pytorch#135712), so every restart would fail until --max-restarts runs out."""
    shared = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    if shared and world_size > 1 and int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0:
        log.warning("torchrun shares its rendezvous store with the workers: a restarted group may fail to connect "
                    "(pytorch/pytorch#135712); launch torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in its "
                    "environment so that restarts work")


def check_world(tp: int, pp: int, world_size: int, previous: dict | None, ep: int = 1) -> None:
    """Refuse, in one line, a restart onto a world size the run's tensor x pipeline x expert degree does not
    divide (validate_config says the same of a first start)."""
    if previous is not None and world_size % (tp * pp * ep):
        raise KilovlaError(f"elastic restart onto {world_size} ranks (was {previous.get('world_size')}): "
                           f"parallel.tp={tp} x parallel.pp={pp} x parallel.ep={ep} does not divide it; torchrun's "
                           "retries end the job: relaunch it with --resume auto on a world size that tp x pp x ep "
                           "divides (torchrun --nnodes and --nproc-per-node)")


def record_start(run_dir: Path, world_size: int) -> None:
    """Rank 0, once the run_dir is claimed: this start's job id and world size (nothing outside elastic)."""
    mine = job_id()
    if mine is not None:
        record = {"run_id": mine, "world_size": world_size, "started_at": time.time()}
        _atomic_write_text(Path(run_dir) / FILE, json.dumps(record, indent=2))


def restart_record(previous: dict, checkpoint: Path | None, world_size: int, last_logged: int) -> dict:
    """The metrics record of a restart that resumes `checkpoint` (None: from step 0). `seconds_lost`:
    from the later of the checkpoint's writing and the previous start to now (called at the first
    step): the work recomputed plus detection, rendezvous, start-up and load."""
    at, since = 0, float(previous.get("started_at", time.time()))
    if checkpoint is not None:
        state = Path(checkpoint) / "trainer_state.json"
        at = json.loads(state.read_text())["step"]
        since = max(since, state.stat().st_mtime)
    return {"kind": "restart", "step": at, "world_size_before": previous.get("world_size"),
            "world_size_after": world_size, "steps_recomputed": max(0, last_logged - at),
            "seconds_lost": round(time.time() - since, 3),
            "restart_count": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))}


def step_deadline(timeout_s: float | None, step_times: list[float]) -> float:
    """Seconds a step may take before the watchdog ends the rank: parallel.timeout_s where set; else,
    under elastic, 10x the median step so far (at least 5 minutes), so torchrun replaces a hung rank
    within minutes; otherwise 30 minutes.

        under elastic, steps of 40, 50 and 900 s -> 500 s; steps of 2 s -> 300 s
    """
    if timeout_s is not None:
        return timeout_s
    if job_id() is None or not step_times:
        return UNMEASURED_DEADLINE_S
    return max(STEP_DEADLINE_MIN_S, STEP_DEADLINE_FACTOR * statistics.median(step_times))
