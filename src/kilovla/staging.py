"""Staging folders: a writer builds its output in a hidden sibling and renames it into place, so a reader
never sees half a dataset or half a policy folder.

    staging_path(Path("out/ds")) -> out/.ds.tmp-myhost-4242-0123abcd   (this host, this process)

A writer killed mid-way (SIGKILL, a lost node) leaves its staging folder behind, possibly gigabytes.
The next write of the same destination calls `remove_stale_staging` first: it removes the staging
folders of that destination whose writer is gone, that is, whose name carries this host and the pid of
no live process. A live writer's folder (two writes of one destination at once) and a folder of
another host (a shared filesystem, whose processes this host cannot see) are left alone, as are
folders named before names carried a pid (`.ds.tmp-0123abcd`), whose writer cannot be told.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import uuid
from pathlib import Path


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9]", "", socket.gethostname())[:32] or "host"


def staging_path(dest: Path) -> Path:
    """The hidden sibling this process builds `dest` in (`dest` absolute or relative; "." has no name,
    so the caller passes an absolute path)."""
    dest = Path(dest)
    return dest.parent / f".{dest.name}.tmp-{_host()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def remove_stale_staging(dest: Path) -> list[Path]:
    """Remove the staging folders of `dest` left by dead writers on this host; returns them."""
    dest = Path(dest)
    if not dest.parent.is_dir():
        return []
    name = re.compile(rf"\.{re.escape(dest.name)}\.tmp-(?P<host>[A-Za-z0-9]+)-(?P<pid>\d+)-[0-9a-f]{{8}}")
    removed = []
    for p in dest.parent.iterdir():
        m = name.fullmatch(p.name)
        if m is None or m["host"] != _host() or _alive(int(m["pid"])) or p.is_symlink():
            continue
        shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
        removed.append(p)
    return removed
