"""``[checkpoint] keep_latest_k``: the newest k complete checkpoints stay, older go.

Run by rank 0 only right after a save completed, so the newest checkpoint it counts is
one it has just finished: an incomplete newer save (killed while writing) is never
counted, and the complete checkpoint before it is never deleted for its sake. Leftovers
of killed saves older than the newest complete checkpoint (``step-N.partial``, a
``step-N`` without ``.metadata``) are removed with them.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

STEP_DIR = re.compile(r"^step-(\d+)(\.partial|\.old)?$")
DELETING = ".deleting"


def _complete(path: Path) -> bool:
    return path.is_dir() and (path / ".metadata").exists()


def purge(root: Path, keep: int) -> list[Path]:
    """Delete what ``keep`` (>= 1) does not keep under ``root``; the paths deleted."""
    if keep < 1:
        raise ValueError(f"keep_latest_k = {keep}: purge needs at least 1")
    found = [
        (int(m.group(1)), m.group(2), p) for p in root.iterdir() if (m := STEP_DIR.match(p.name))
    ]
    complete = sorted(
        (step for step, suffix, p in found if suffix is None and _complete(p)), reverse=True
    )
    if not complete:
        return []
    kept = set(complete[:keep])
    oldest_kept = min(kept)
    doomed = [
        p
        for step, suffix, p in found
        if (suffix is None and _complete(p) and step not in kept)
        or (step < oldest_kept and (suffix is not None or not _complete(p)))
    ]
    for path in sorted(doomed):
        # renamed first (one atomic step), so a purge killed half-way never leaves a
        # half-deleted folder that still looks like a checkpoint
        gone = path.with_name(path.name + DELETING)
        path.rename(gone)
        shutil.rmtree(gone)
    for gone in root.glob(f"*{DELETING}"):  # from a purge that was killed
        shutil.rmtree(gone, ignore_errors=True)
    return sorted(doomed)
