"""Files named by their content: the key of an index of files other than ASE SQLite (``orb.data.formats``), so that
a copy of them in another folder (a job's scratch disk) finds the index made from the original."""

import hashlib
import os
from typing import List, Sequence

import numpy as np

from orb import cache
from orb.data.sqlite_rows import change_counters


def files_identity(files: Sequence[str]) -> tuple:
    """What decides an index's content, wherever the files lie and whatever their names and times: each file's
    sha256, in order. A job that stages its data to a per-job scratch folder (``cp``, ``rsync``) finds the index an
    earlier job made (an MPtrj-sized extxyz takes ~5 minutes to index; hashing it, ~1 GB/s, seconds); messages then
    name the files as this run names them (``orb.data.sqlite_rows.name_sources``). The digests are kept per path,
    size, times and inode (:func:`file_digests`), so a start at the same path reads none of the files."""
    return tuple(file_digests(files))


DIGEST_KIND = "file_digests"


def file_digests(files: Sequence[str]) -> List[str]:
    """The sha256 of each file, read back from the cache while the files are as they were when hashed: the same
    path, size, modification and status-change times, inode and SQLite change counters (a rewrite, a restored copy
    or a file replaced at the same path changes the inode or the status-change time, which no tool sets back)."""
    stamps = []
    for f in files:
        stat = os.stat(f)
        stamps.append((os.path.realpath(f), stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_ino,
                       change_counters(f)))
    entry = cache.CacheEntry(DIGEST_KIND, ("orb.data.digests",), tuple(stamps), ".npz")
    found = entry.read(cache.load_values, lambda v: v.dtype == np.uint8 and v.shape == (len(files), 32))
    if found is not None:
        return [bytes(row).hex() for row in found]
    digests = [_sha256(f) for f in files]
    entry.write(lambda tmp: np.savez(tmp, values=np.array([list(bytes.fromhex(d)) for d in digests], np.uint8)
                                     .reshape(len(files), 32)), "digests of " + ", ".join(files))
    return digests


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()
