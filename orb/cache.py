"""The project's on-disk cache: what is costly to recompute and safe to keep between runs.

Compiled native code (``orb.native``) and each database's neighbour counts
(``orb.data.dataset``) live in ``ORB_CACHE_DIR`` (default ``~/.cache/orb_mindspore``), or in a
per-user temporary folder when that is not writable (a read-only home on a cluster node). Files
are written under a temporary name and renamed, so concurrent processes (data-parallel workers,
data workers) never read a half-written file.
"""

import os
import tempfile
from typing import Callable, List, Optional

import numpy as np


def cache_dirs(subfolder: str = "") -> List[str]:
    """Candidate cache folders, preferred first."""
    configured = os.environ.get("ORB_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "orb_mindspore")
    fallback = os.path.join(tempfile.gettempdir(), f"orb_mindspore-{os.getuid()}")
    return [os.path.join(folder, subfolder) if subfolder else folder for folder in (configured, fallback)]


def writable_dir(subfolder: str = "") -> Optional[str]:
    """The first cache folder that exists or can be made and is writable, or None."""
    for folder in cache_dirs(subfolder):
        try:
            os.makedirs(folder, exist_ok=True)
            if os.access(folder, os.W_OK):
                return folder
        except OSError:
            continue
    return None


def find(name: str, subfolder: str = "") -> Optional[str]:
    """Path of a cached file ``name`` in any cache folder, or None."""
    for folder in cache_dirs(subfolder):
        path = os.path.join(folder, name)
        if os.path.exists(path):
            return path
    return None


def write_atomically(path: str, write: Callable[[str], None], suffix: str = "") -> None:
    """Call ``write(temporary_path)`` in ``path``'s folder, then rename the result to ``path``."""
    fd, tmp = tempfile.mkstemp(suffix=suffix, dir=os.path.dirname(path))
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def everyone_has(found: bool, ranks) -> bool:
    """Whether every data-parallel rank (``ranks``: rank, world_size, sum) found its cached file: a cache is used
    only then, so all ranks take the same path and their collectives match."""
    return ranks.sum(np.array([found], np.float64))[0] == ranks.world_size
