"""Files named by their content: the key of an index of files other than ASE SQLite (``orb.data.formats``), so that
a copy of them in another folder (a job's scratch disk) finds the index made from the original."""

import hashlib
import os
from typing import List, Sequence

import numpy as np

from orb import cache
from orb.data.sqlite_rows import change_counters
from orb.errors import DatasetError


def files_identity(files: Sequence[str]) -> tuple:
    """What decides an index's content, wherever the files lie and whatever their names and times: each file's
    sha256, in order. A job that stages its data to a per-job scratch folder (``cp``, ``rsync``) finds the index an
    earlier job made (an MPtrj-sized extxyz takes ~6 minutes to index, and seconds to hash); messages then
    name the files as this run names them (``orb.data.sqlite_rows.name_sources``). The digests are kept per path,
    size and modification time (:func:`file_digests`), so a start at the same path reads none of the files."""
    return tuple(file_digests(files))


DIGEST_KIND = "file_digests"


def file_digests(files: Sequence[str]) -> List[str]:
    """The sha256 of each file, read back from the cache while the files are as they were when hashed
    (:func:`file_stamps`); the ranks of a node sharing a cache folder: one hashes, the others wait and read it."""
    entry = cache.CacheEntry(DIGEST_KIND, ("orb.data.digests",), file_stamps(files), ".npz")

    def found():
        values = entry.read(cache.load_values, lambda v: v.dtype == np.uint8 and v.shape == (len(files), 32))
        return None if values is None else [bytes(row).hex() for row in values]

    what = f"digests of {files[0]}" + (f" and {len(files) - 1} more file(s)" if len(files) > 1 else "")
    known = found()
    if known is None:
        with cache.one_builder(entry, what) as waited:  # (the ranks of a node: one reads the files, the others wait)
            known = found() if waited else None
            if known is None and not waited:
                known = _hash_and_keep(entry, files, what)
        if known is None:
            known = _hash_and_keep(entry, files, what)
    return known


def file_stamps(files: Sequence[str]) -> tuple:
    """Each file as it is now: its path, size, modification time and SQLite change counters (what the index was
    keyed by before it was keyed by content: a copy refreshed in the same place with its times kept, ``rsync -a`` to
    a node's scratch disk at every job, hashes nothing)."""
    return tuple((os.path.realpath(f), os.stat(f).st_size, os.stat(f).st_mtime_ns, change_counters(f)) for f in files)


def _hash_and_keep(entry, files, what) -> List[str]:
    digests = [_sha256(f) for f in files]
    entry.write(lambda tmp: np.savez(tmp, values=np.array([list(bytes.fromhex(d)) for d in digests], np.uint8)
                                     .reshape(len(files), 32)), what)
    return digests


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                digest.update(block)
    except OSError as exc:  # (as formats.is_sqlite: one line naming the file, not a traceback)
        raise DatasetError(path, f"cannot read it ({exc.strerror or exc})") from None
    return digest.hexdigest()
