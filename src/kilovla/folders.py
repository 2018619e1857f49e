"""Output folders: kilovla replaces or writes into a folder only when it holds nothing but its own kind.

Every writer that can replace a folder (`data synth|convert --overwrite`, `collect --overwrite`,
`kilovla demo --out`, a training or RL `run_dir`) first asks `check_replaceable`: the folder must be
absent, empty, or hold nothing but the entries that kind of folder is made of (a LeRobot dataset:
meta/, data/, videos/, ...; a run: checkpoints/, metrics.jsonl, config.yaml, ...), plus the hidden
temporary names kilovla itself derives from those entries (`.metrics.jsonl.tmp`). Anything else
belongs to the user, and the writer stops with one line naming the first stray entry, before it has
written or removed anything:

    >>> check_replaceable(Path("d"), DATASET)  # d/precious.txt exists  # doctest: +SKIP
    KilovlaError: d: holds precious.txt, which is not part of a LeRobot dataset; not replacing it ...

`claim_run_dir` is what a run_dir needs instead: a run writes its own entries beside whatever else is
there (a log the shell opened, notes), but a folder that already holds a run is continued only with
`--resume`, never silently mixed with a new one.
"""

from __future__ import annotations

import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from kilovla.errors import KilovlaError


@dataclass(frozen=True)
class FolderKind:
    name: str  # for messages: "a LeRobot dataset"
    entries: frozenset[str]  # the top-level names such a folder is made of
    marker: tuple[str, ...] = ()  # a non-empty folder of this kind has at least one of these


# LeRobot v2.1 / v3.0 as written by LeRobot or kilovla, plus what a Hugging Face Hub download adds.
DATASET = FolderKind("a LeRobot dataset", frozenset({"meta", "data", "videos", "images", "README.md", ".gitattributes",
                                                     ".cache"}), marker=("meta",))
# What `kilovla train` and `kilovla rl` write into run_dir (other files beside them are left alone).
RUN = FolderKind("a kilovla run", frozenset({"checkpoints", "metrics.jsonl", "config.yaml", "summary.json",
                                             "learning_curve.png", "tensorboard", "eval", "elastic.json"}),
                 marker=("checkpoints", "metrics.jsonl", "config.yaml", "summary.json"))
# What `kilovla demo` writes into its --out folder; DEMO_MARKER is written first, so a demo that died
# half-way is still recognised as one.
DEMO_MARKER = ".kilovla-demo"
DEMO = FolderKind("a kilovla demo output", frozenset({DEMO_MARKER, "dataset", "run", "eval-policy", "eval-expert",
                                                      "report.json", "report.md", "learning_curve.png",
                                                      "success_per_task.png"}), marker=(DEMO_MARKER, "report.json"))

# What `kilovla eval` (and every caller of `evaluate(out_dir=...)`) writes into its output folder.
EVALUATION = FolderKind("a kilovla evaluation", frozenset({"report.json", "report.md", "videos"}),
                        marker=("report.json", "report.md", "videos"))

# The temporary names kilovla writes beside an entry before renaming it into place:
# `.metrics.jsonl.tmp`, `.report.json.0123abcd`, `.success_per_task.0123ab.png`.
_TEMP = re.compile(r"\.(?P<stem>.+?)(?:\.tmp|\.[0-9a-f]{6,8})(?P<suffix>\.png)?")


def _ours(name: str, kind: FolderKind) -> bool:
    if name in kind.entries:
        return True
    m = _TEMP.fullmatch(name)
    return m is not None and m["stem"] + (m["suffix"] or "") in kind.entries


def stray_entries(folder: Path, kind: FolderKind) -> list[str]:
    """Top-level names in `folder` that are not part of `kind`, sorted."""
    return sorted(p.name for p in folder.iterdir() if not _ours(p.name, kind))


def check_replaceable(folder: str | Path, kind: FolderKind) -> None:
    """Refuse (KilovlaError) unless `folder` is absent, an empty folder, or a folder of `kind`."""
    folder = Path(folder)
    if not folder.exists() and not folder.is_symlink():
        return
    if not folder.is_dir():
        raise KilovlaError(f"{folder}: exists and is not a folder; not replacing it with {kind.name}")
    if not any(folder.iterdir()):
        return
    stray = stray_entries(folder, kind)
    if stray:
        more = f" (and {len(stray) - 1} more)" if len(stray) > 1 else ""
        raise KilovlaError(f"{folder}: holds {stray[0]}{more}, which is not part of {kind.name}; not replacing it: "
                           "use a new folder, or empty this one")
    if kind.marker and not any((folder / m).exists() for m in kind.marker):
        raise KilovlaError(f"{folder}: is not {kind.name} (no {' or '.join(kind.marker)}); not replacing it: "
                           "use a new folder, or empty this one")


def clear(folder: str | Path, kind: FolderKind) -> None:
    """Remove the entries of `kind` (and kilovla's temporary names) from `folder`; nothing else."""
    folder = Path(folder)
    if folder.is_dir():
        for entry in folder.iterdir():
            if not _ours(entry.name, kind):
                continue
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()


def _failed_start(run_dir: Path) -> bool:
    """A run that stopped before its first step: it wrote config.yaml (perhaps an empty metrics.jsonl and
    tensorboard/) but no metrics row, no checkpoint and no summary, so there is nothing to continue or lose.
    (A run still busy with its first step looks the same: two runs in one run_dir are the user's to avoid.)"""
    metrics = run_dir / "metrics.jsonl"
    checkpoints = run_dir / "checkpoints"
    if not (run_dir / "config.yaml").is_file() or (run_dir / "summary.json").exists():
        return False
    if checkpoints.is_dir() and any(not p.name.startswith(".") for p in checkpoints.iterdir()):
        return False
    if metrics.is_file():
        with metrics.open() as f:
            return not f.read(4096).strip()
    return True


def claim_run_dir(run_dir: str | Path, resume: str | None, checkpoint: Path | None, main: bool = True) -> str:
    """Decide how a run uses `run_dir`, before anything is read or written: 'resume', 'fresh', or
    'replace' (the caller `clear`s the earlier run's entries right before it writes, after its own
    checks passed). Files of other kinds beside a run (a log, notes) are never touched.

    `resume` is the --resume flag (None, 'auto' or a folder) and `checkpoint` the folder it resolved
    to (None: none found). A run_dir holding a run is refused without --resume, unless that run stopped
    before its first step (`_failed_start`): then it is replaced, said in one line; `--resume auto` on a
    run_dir without a checkpoint starts fresh, replacing what the earlier run logged, and says so
    (on the `main` rank); a checkpoints/ folder with step folders but no `latest` pointer is refused
    rather than replaced."""
    run_dir = Path(run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise KilovlaError(f"{run_dir}: exists and is not a folder; run_dir must be a folder")
    has_run = run_dir.is_dir() and any((run_dir / m).exists() for m in RUN.marker)
    if checkpoint is not None:
        inside = Path(checkpoint).resolve().is_relative_to((run_dir / "checkpoints").resolve())
        if has_run and not inside and not _failed_start(run_dir):
            raise KilovlaError(f"{run_dir}: holds another run; resuming {checkpoint} there would mix the two: "
                               "use a new run_dir")
        return "resume"
    if has_run and resume is None and _failed_start(run_dir):
        if main:
            print(f"{run_dir}: holds a run that stopped before its first step (config.yaml, no metrics, no "
                  "checkpoint): starting over there", flush=True)
        return "replace"
    if has_run and resume is None:
        raise KilovlaError(f"{run_dir}: run_dir holds a run: pass --resume auto or use a new run_dir")
    steps = sorted(p.name for p in (run_dir / "checkpoints").glob("step_*") if p.is_dir()) if has_run else []
    if steps:
        raise KilovlaError(f"{run_dir / 'checkpoints'}: holds {', '.join(steps)} but {_no_latest(run_dir / 'checkpoints')}: "
                           f"pass --resume {run_dir / 'checkpoints' / steps[-1]} to continue it, or use a new run_dir")
    if resume == "auto" and main:
        print(f"no checkpoint in {run_dir / 'checkpoints'}: starting fresh"
              + (" (replacing the earlier run's logs)" if has_run else ""), flush=True)
    return "replace" if has_run else "fresh"


def holds_evaluation(folder: str | Path) -> bool:
    """Whether `folder` holds an evaluation's report or videos (what `evaluate` would replace)."""
    return Path(folder).is_dir() and any((Path(folder) / m).exists() for m in EVALUATION.marker)


def check_parent(dst: str | Path, flag: str = "") -> None:
    """Refuse (KilovlaError) a `dst` that cannot be created as a folder because a file lies on its path
    (`afile/sub`): said before any work, not when the first write fails."""
    existing = next(p for p in Path(dst).absolute().parents if p.exists())
    if not existing.is_dir():
        raise KilovlaError(f"{flag + ' ' if flag else ''}{dst}: cannot create it: {existing} is a file, not a folder")


def check_output_folder(folder: str | Path, flag: str) -> None:
    """Refuse (KilovlaError) an output `folder` that is a file or has a file on its path, before any work."""
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise KilovlaError(f"{flag} {folder}: exists and is not a folder")
    check_parent(folder, flag)


def check_new_evaluation(folder: str | Path, flag: str = "--out") -> None:
    """Refuse (KilovlaError) a `folder` that is a file or already holds an evaluation, so that a
    second evaluation never overwrites the first's report or mixes its videos in."""
    folder = Path(folder)
    check_output_folder(folder, flag)  # refused now, not after every episode has run
    other = next(((kind, m) for kind in (DATASET, RUN, DEMO) for m in kind.marker
                  if m not in EVALUATION.entries and (folder / m).exists()), None)
    if folder.is_dir() and other is not None:  # a dataset's videos/ is not an evaluation's
        raise KilovlaError(f"{flag} {folder}: holds {other[0].name} ({other[1]}), not an evaluation; not writing "
                           f"into it: use a new folder, or leave out {flag} for a fresh one under eval-output/")
    if holds_evaluation(folder):
        found = next(m for m in EVALUATION.marker if (folder / m).exists())
        raise KilovlaError(f"{flag} {folder}: already holds an evaluation ({found}); not overwriting it: "
                           f"use a new folder, or leave out {flag} for a fresh one under eval-output/")


# The names a user may give after a run's checkpoints/ folder for its newest checkpoint: kilovla's
# pointer file, and LeRobot's `last`.
LATEST_NAMES = ("latest", "last")


def _no_latest(root: Path) -> str:
    """Why `root/latest` gave no checkpoint, for messages."""
    pointer = root / "latest"
    named = pointer.read_text().strip() if pointer.is_file() else ""
    return f"`latest` names {named}, which is not there" if named else "no `latest` pointer to a complete one"


def latest_checkpoint(root: str | Path) -> Path | None:
    """The checkpoint `root/latest` names (the pointer a run moves to a checkpoint once it is complete),
    or None when there is no pointer, it is empty, or its folder is gone."""
    pointer = Path(root) / "latest"
    name = pointer.read_text().strip() if pointer.is_file() else ""
    return Path(root) / name if name and (Path(root) / name).is_dir() else None


def policy_folder(path: str | Path) -> Path:
    """The checkpoint folder a policy path means: a run folder, `<run>/checkpoints`,
    `<run>/checkpoints/latest` or `<run>/checkpoints/last` -> the run's newest complete checkpoint
    (what checkpoints/latest names); any other path is returned as given (a policy folder, or an
    openpi / LeRobot checkpoint its loader reads).

        >>> policy_folder("runs/a")  # runs/a/checkpoints/latest says step_000120  # doctest: +SKIP
        PosixPath('runs/a/checkpoints/step_000120')
    """
    path = Path(path)
    if (path / "policy.json").is_file():
        return path
    if path.name in LATEST_NAMES and path.parent.name == "checkpoints" and path.parent.is_dir() and not path.is_dir():
        root = path.parent
    elif path.name == "checkpoints" and path.is_dir():
        root = path
    elif path.is_dir() and ((path / "checkpoints").is_dir() or (path / "metrics.jsonl").is_file()
                            or (path / "config.yaml").is_file() and not any(path.glob("*.safetensors"))):
        root = path / "checkpoints"  # a run (a checkpoint of another layout with a config.yaml is not one)
    else:
        return path
    newest = latest_checkpoint(root)
    if newest is not None:
        return newest
    if (root / "last").is_dir():  # a LeRobot run: its own loader reads checkpoints/last
        return root / "last"
    steps = sorted(p.name for p in root.glob("step_*") if p.is_dir())
    if steps:
        raise KilovlaError(f"{path}: {root} holds {', '.join(steps)} but {_no_latest(root)}: pass "
                           f"{root / steps[-1]} if it is whole")
    missing = f"{_no_latest(root)}" if (root / "latest").is_file() else f"no {root / 'latest'}"
    raise KilovlaError(f"{path}: a kilovla run without a complete checkpoint ({missing}): "
                       "pass a checkpoint folder, or let the run save one")
