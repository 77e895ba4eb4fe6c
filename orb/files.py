"""Writing files that must survive a kill, a full disk or a power loss: the one way every output of the project
(checkpoints, caches, indexes, summaries, record files) is written.

* :func:`write_atomically`: the content goes to a temporary beside the target
  (``.<name>.tmp-<pid>-<random><suffix>``), is synced to the disk, renamed over the target and the rename
  synced: a reader sees the old file or the new one, never half of one. A write that fails removes
  its temporary and whatever a library made of it (MindSpore writes its own ``...tmp-<pid>.tmp``
  beside the name it is given), then raises.
* :func:`remove_stale_temporaries`: temporaries of writers that were killed, removed at the next start.
* :func:`append_record`: one JSON line per call, complete or absent (a line cut short by a kill is skipped
  by :func:`read_records`).
* :func:`check_run_settings`: the settings a resumable run (orb-md, orb-relax) started with, kept beside its
  output, and a resume with other settings refused (read through :mod:`orb.records`, the one reader of what a
  resume reads).
* :func:`refuse_overwriting_inputs`: every command's outputs compared with its inputs (the same file through any
  path) before anything is written.
* :func:`free_port`: a free TCP port for a launcher's scheduler.
* :func:`exclusive`: one process at a time through a block (a download, a cache entry's build).
"""

import contextlib
import errno
import json
import logging
import os
import re
import secrets
import socket
import time
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

log = logging.getLogger("orb")
_TEMPORARY = re.compile(r"^\..+\.tmp-(\d+)(?:@([0-9a-f]{8}))?(-[0-9a-f]+)?(\..*)?$")
_UNSYNCABLE_WARNED = set()


def temporary_prefix(path: str) -> str:
    """A name for one write's temporaries of ``path``: this process's id (for stale clean-up) and a random part, so
    that concurrent writers of one file (data-parallel ranks keeping the same cache entry, threads, processes of
    another node with the same id on a shared file system) never share a temporary."""
    token = secrets.token_hex(4)
    return os.path.join(os.path.dirname(os.path.abspath(path)),
                        f".{os.path.basename(path)}.tmp-{os.getpid()}@{_HOST}-{token}")


def _host_tag() -> str:
    """This kernel's boot and this process's id namespace, hashed: a temporary named with it whose process id is not
    alive here is surely stale (a host name is not: containers on two nodes may share one)."""
    import hashlib
    import socket

    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            where = f.read().strip() + os.readlink("/proc/self/ns/pid")
    except OSError:  # not Linux: the host name, as good as it gets
        where = socket.gethostname()
    return hashlib.sha256(where.encode()).hexdigest()[:8]


_HOST = _host_tag()


def _remove_temporaries(prefix: str) -> None:
    folder, stem = os.path.split(prefix)
    try:
        names = os.listdir(folder)
    except OSError:
        return
    for name in names:
        if name.startswith(stem):
            try:
                os.remove(os.path.join(folder, name))
            except OSError:
                pass


def fsync_file(path: str) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def fsync_directory(folder: str) -> None:
    """Make a rename in ``folder`` durable. File systems that cannot sync a folder (some FUSE and object-store
    mounts) get one warning per folder; the file itself was synced."""
    try:
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EBADF, errno.EACCES, errno.EPERM):
            raise
        if folder not in _UNSYNCABLE_WARNED:
            _UNSYNCABLE_WARNED.add(folder)
            log.warning("the file system of %s cannot sync a folder (%s): a power loss right after a save could "
                        "lose its last rename; the run goes on", folder, exc.strerror)


def write_atomically(path: str, write: Callable[[str], None], suffix: str = "") -> None:
    """Call ``write(temporary)``, then sync and rename the temporary to ``path`` (see the module's docstring).
    ``suffix`` ends the temporary's name, for writers that insist on an extension (``np.save`` adds ``.npy``)."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    prefix = temporary_prefix(path)
    tmp = prefix + suffix
    try:
        write(tmp)
        fsync_file(tmp)
        os.replace(tmp, path)
    except BaseException:
        _remove_temporaries(prefix)
        raise
    fsync_directory(folder)


def write_text(path: str, text: str) -> None:
    def write(tmp: str) -> None:
        with open(tmp, "w") as f:
            f.write(text)

    write_atomically(path, write)


def write_json(path: str, value) -> None:
    write_text(path, json.dumps(value, indent=2) + "\n")


def write_csv(path: str, fields: List[str], rows: Iterable[Dict]) -> None:
    """A CSV file (header ``fields``; a row's missing fields empty), written atomically: a kill or a full disk
    never leaves a table cut short that looks like a result."""
    import csv

    def write(tmp: str) -> None:
        with open(tmp, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=fields, restval="")
            writer.writeheader()
            writer.writerows(rows)

    write_atomically(path, write)


def remove_stale_temporaries(folder: str, min_age: float = 0.0) -> List[str]:
    """Delete the temporaries in ``folder`` whose writer is gone (a save that was killed); returns their names.
    ``min_age`` (seconds since the file last changed): for folders that processes of other nodes may share, where
    a process id that is not alive here may be alive there; a temporary this host's process made (its name says
    so) is removed at once when that process is gone (a killed export's 9 MB stayed until a run 10 minutes later)."""
    removed = []
    try:
        names = os.listdir(folder)
    except OSError:
        return removed
    now = time.time()
    for name in names:
        match = _TEMPORARY.match(name)
        if match and int(match.group(1)) != os.getpid() and not process_alive(int(match.group(1))):
            path = os.path.join(folder, name)
            try:
                if min_age and match.group(2) != _HOST and now - os.path.getmtime(path) < min_age:
                    continue
                os.remove(path)
                removed.append(name)
            except OSError:
                pass
    if removed:
        log.info("removed %d temporary file(s) of an interrupted save: %s", len(removed), ", ".join(sorted(removed)))
    return removed


def owner_tag() -> str:
    """This process as a folder's or file's name carries it (``<pid>@<host>``, :func:`owner_gone`)."""
    return f"{os.getpid()}@{_HOST}"


def owner_gone(tag: str) -> bool:
    """Whether the process an :func:`owner_tag` names is surely gone: this host's, and not alive (another node's
    process, on a shared file system, may be)."""
    pid, _, host = tag.partition("@")
    return host == _HOST and pid.isdigit() and int(pid) != os.getpid() and not process_alive(int(pid))


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def append_record(path: str, record: Dict) -> None:
    """One JSON line appended in one write (a kill leaves the line whole or cut short, never interleaved)."""
    append_whole(path, (json.dumps(record) + "\n").encode())


def append_whole(path: str, data: bytes, fsync: bool = False) -> None:
    """``data`` appended whole or not at all: a write the disk (or a file size limit) cut short raised nothing and
    left part of a line, to which the next append was glued (both unreadable). The rest is written; if that fails,
    the file is cut back to where it began (or, after another appender's bytes, the cut line ended) and the write's
    own error (ENOSPC, EFBIG) raised naming the file."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        start = os.fstat(fd).st_size
        written = os.write(fd, data)  # (one that raises wrote nothing)
        if written < len(data):
            try:
                written += os.write(fd, data[written:])  # the rest: whole after all, or the reason it is not
            except OSError as exc:
                if os.fstat(fd).st_size == start + written:  # (no other appender's bytes after it)
                    os.ftruncate(fd, start)
                else:
                    os.write(fd, b"\n")  # (the cut line ends: readers skip it)
                raise OSError(exc.errno, exc.strerror, path) from None
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)


def read_records(path: str) -> Iterator[Dict]:
    """The records of a JSON-lines file (none if it is not there); a line cut short by a kill is skipped."""
    return (record for _, record in numbered_records(path)) if os.path.exists(path) else iter(())


def numbered_records(path: str, skipped: Optional[List[int]] = None) -> Iterator[Tuple[int, object]]:
    """(line number, record) of a JSON-lines file. A line that is not complete JSON (cut short by a kill, or by a full
    disk: :func:`append_whole` ends it) is skipped, its number added to ``skipped`` for a reader that says so."""
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            try:
                yield number, json.loads(line)
            except json.JSONDecodeError:
                if line.strip() and skipped is not None:
                    skipped.append(number)


def keep_records_up_to(path: str, step: int) -> int:
    """Drop the records of a JSON-lines file written after global ``step`` (a resumed run writes them again);
    rewritten atomically. Returns how many were dropped (cut lines included)."""
    if not os.path.exists(path):
        return 0
    with open(path) as f:
        lines = f.readlines()
    kept = []
    for line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if int(record.get("step", 0)) <= step:
            kept.append(line if line.endswith("\n") else line + "\n")
    if len(kept) == len(lines):
        return 0
    write_text(path, "".join(kept))
    return len(lines) - len(kept)


def check_run_settings(path: str, settings: Dict, resume: bool, output: str, informational: Iterable[str] = (),
                       may_grow: Iterable[str] = (), said: Iterable[str] = (), required: bool = False
                       ) -> Optional[Dict]:
    """``path`` (JSON): the settings a fresh run of a command with ``--output`` and ``--resume`` (orb-md, orb-relax)
    started with; a resume whose ``settings`` differ from it is refused with one line naming each change. Keys in
    ``informational`` (a checkpoint's path) are recorded, not compared (the weights' digest is); those in
    ``may_grow`` (``steps``) may grow, not shrink (structures already past it would keep longer runs than the output
    says); those in ``said`` (what only rounds the work still to do otherwise, such as orb-relax's batch size) may
    change, said in one line. A setting the file lacks (an older version wrote it) cannot be compared: it is recorded
    for the next resume. ``required``: the output holds earlier work, so a resume without the record (deleted, never
    written) is refused rather than continued with settings nobody compared. Returns what to record at ``path``
    (None: as it is), which the caller writes once everything else a resume reads is checked."""
    import sys

    from orb.errors import OrbInputError
    from orb.records import read_record

    if not resume or not os.path.exists(path):
        if resume and required:
            raise OrbInputError(f"--resume {output}: its run's settings {path} are missing, so they cannot be "
                                "compared with this run's: restore the file, or start a new run in another --output")
        return settings
    saved = read_record(path, {}, advice="; restore it, or start a new run in another --output")
    skip, grow, note = set(informational), set(may_grow), set(said)

    def differs(key) -> bool:
        if key in grow and all(isinstance(v, (int, float)) and not isinstance(v, bool)
                               for v in (saved[key], settings[key])):
            return settings[key] < saved[key]
        return saved[key] != settings[key]

    changed = [k for k in settings if k not in skip and k in saved and differs(k)]
    refused = [f"{k}: {saved[k]!r} -> {settings[k]!r}" + (" (it may grow, not shrink)" if k in grow else "")
               for k in changed if k not in note]
    if refused:
        raise OrbInputError(f"--resume {output}: these settings differ from the run's: {'; '.join(refused)}. "
                            "Restore them, or start a new run in another --output")
    if changed:  # allowed: the work still to do rounds otherwise than the uninterrupted run's would have
        print(f"note: --resume {output} continues with " + "; ".join(f"{k}: {saved[k]!r} -> {settings[k]!r}"
                                                                      for k in changed)
              + ": what is computed from now on rounds differently from an uninterrupted run", file=sys.stderr)
    if all(k in saved and saved[k] == settings[k] for k in settings if k not in skip):
        return None
    return {**saved, **settings}  # the new values, and what an older version did not record


# (flag, path, names): a file the command writes, replaces or deletes (names None), or a folder in which it does so to
# the files whose path relative to it ``names(relative)`` accepts
Output = Tuple[str, str, Optional[Callable[[str], bool]]]
Input = Tuple[str, Union[str, Sequence[str], None]]  # (flag, a path or a list of paths; folders: the files in them)


def same_path(a: str, b: str) -> bool:
    """Whether two paths name one file or folder: through symlinks, ``./x``, absolute or relative, hard links."""
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist (yet): the same place once every symlink is resolved
        return os.path.realpath(a) == os.path.realpath(b)


def _relative_inside(path: str, folder: str) -> Optional[str]:
    """``path`` relative to ``folder`` when it lies inside it (through symlinks), else None."""
    inner, outer = os.path.realpath(path), os.path.realpath(folder)
    if inner == outer or not inner.startswith(outer.rstrip(os.sep) + os.sep):
        return None
    return os.path.relpath(inner, outer)


def _collision(output: Output, flag: str, source: str) -> Optional[str]:
    """Why writing ``output`` would change the input ``source`` (one file or folder a command reads), or None."""
    out_flag, out, names = output
    source_is_folder = os.path.isdir(source)
    if names is None:  # one file
        if same_path(out, source):
            return f"{out_flag} {out} is {flag} {source}"
        if source_is_folder and same_path(os.path.dirname(os.path.abspath(out)), source):
            return f"{out_flag} {out} would be written into {flag} {source}, a folder whose files are read as input"
        return None
    if same_path(out, source):
        return f"{out_flag} {out} is {flag} {source}" + (", a folder whose files are read as input"
                                                           if source_is_folder else "")
    inputs = [source]
    if source_is_folder:  # its files, as the data readers list them (only those directly in it)
        inputs = [os.path.join(source, name) for name in os.listdir(source)]
    for path in inputs:
        relative = _relative_inside(path, out)
        if relative is not None and names(relative):
            shown = f"{flag} {source}" + ("" if path == source else f" (its file {os.path.basename(path)})")
            return f"{out_flag} {out} would write or remove {relative} there, which is {shown}"
    return None


def refuse_overwriting_inputs(outputs: Sequence[Output], inputs: Sequence[Input]) -> None:
    """Before anything is written: refuse, in one line naming both paths, an output that is one of the command's
    inputs however it is spelt (a symlink, ``./x``, an absolute or relative path, a hard link), a file it would
    write into a folder of input files, or a file it would replace or delete in its output folder that is an input
    (``--resume`` appended relaxed rows to the data read; ``--overwrite`` deleted the checkpoint a run started
    from; an evaluation removed the ``uncertain.extxyz`` it read)."""
    from orb.errors import OrbInputError

    for flag, given in inputs:
        for source in ([given] if isinstance(given, str) else list(given or [])):
            if not source or not os.path.exists(source):
                continue
            for output in outputs:
                if not output[1]:
                    continue
                why = _collision(output, flag, source)
                if why is not None:
                    flag_of = re.match(r"[-\w.]+", output[0]).group(0)  # ("--output's record": --output)
                    raise OrbInputError(f"{why}: the command would write over its own input; choose another {flag_of}")


def free_port() -> int:
    """A TCP port no process listens on now (for msrun's scheduler)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


LOCK_POLL = 0.2  # s between a waiting process's looks at a held lock
LOCK_MAX_WAIT = 1800.0  # s: then the block runs without the lock (a holder stopped, or a crashed NFSv3 client's lock)


@contextlib.contextmanager
def sole_writer(output: str, flag: str) -> Iterator[None]:
    """This process alone writes ``output`` (a file or a folder) during the block: another command writing it at the
    same time (the same job submitted twice, a requeue while the first still runs) is refused in one line naming the
    holder (:class:`~orb.errors.OutputBusy`), instead of both writing (one run's checkpoints over the other's,
    relaxed rows twice, one study's results over the other's). The lock is a file beside the output,
    ``.<name>.writer`` (an exclusive ``fcntl.flock``, which the kernel or the file server releases when its holder
    ends, killed or not; its folder is made if missing), removed when the block ends. Where it cannot be made (a
    read-only folder) or the file system has no locks, the output is not guarded."""
    path = os.path.abspath(output)
    lock_path = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.writer")
    handle = _held_lock(lock_path, output, flag)
    if handle is None:
        yield
        return
    try:
        yield
    finally:
        try:  # removed while still held (the block has written all it writes); a taker checks it locked the file
            if os.path.samestat(os.fstat(handle.fileno()), os.stat(lock_path)):  # that is there (_held_lock)
                os.remove(lock_path)
        except OSError:
            pass
        handle.close()


def _held_lock(lock_path: str, output: str, flag: str):
    """The open lock file, locked by this process (None: not guarded); :class:`OutputBusy` when another holds it."""
    import fcntl

    from orb.errors import OutputBusy

    for _ in range(20):  # (a holder that removed the file between this open and this lock: open the new one)
        try:
            os.makedirs(os.path.dirname(lock_path), exist_ok=True)
            try:
                handle, mine = open(lock_path, "a+"), True
            except PermissionError:  # another user's lock file: flock needs no write access
                handle, mine = open(lock_path, "r"), False
        except OSError:
            return None
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "another process"
            handle.close()
            raise OutputBusy(f"{flag} {output} is being written by another command ({holder}, which holds "
                             f"{lock_path}): wait for it to end, or choose another {flag} (if that node is down, "
                             f"remove {lock_path})") from None
        except OSError:  # ENOLCK, EINVAL: a file system without locks
            handle.close()
            if mine:
                with contextlib.suppress(OSError):
                    os.remove(lock_path)
            return None
        try:
            if not os.path.samestat(os.fstat(handle.fileno()), os.stat(lock_path)):
                handle.close()
                continue
            if mine:
                handle.seek(0)
                handle.truncate()
                handle.write(f"process {owner_tag()}")
                handle.flush()
        except FileNotFoundError:  # (removed by its holder as it ended)
            handle.close()
            continue
        except BaseException:
            handle.close()
            raise
        return handle
    return None


@contextlib.contextmanager
def exclusive(lock_path: str, waiting: str, say: Callable[[str], None] = log.info,
              give_up: Callable[[], bool] = lambda: False, max_wait: Optional[float] = None) -> Iterator[bool]:
    """The block run by one process at a time among those that take ``lock_path`` (an empty file, made if missing,
    never removed: removing one races a taker): an exclusive ``fcntl.flock``, which the kernel (or the file server)
    releases when its holder ends, killed or not, so no clock decides. A process that waits says ``waiting`` once and
    polls; it stops waiting and runs the block without the lock when ``give_up()`` (a stop signal noted meanwhile)
    or after ``max_wait`` seconds (default :data:`LOCK_MAX_WAIT`: a holder suspended, or an NFSv3 lock of a crashed
    node, kept until it reboots; infinite for a block two processes must never run at once).
    Where the file cannot be opened or the file system has no locks (or, as Lustre's ``localflock``, locks per node
    only), nobody waits. Yields whether this process waited for another (the caller looks again for what that one
    made)."""
    import fcntl

    try:
        handle = open(lock_path, "a")
    except OSError:
        try:
            handle = open(lock_path, "r")  # (another user's lock file in a shared folder: flock needs no write access)
        except OSError:
            yield False
            return
    with handle:  # (closing it releases the lock)
        waited, deadline = False, time.monotonic() + (LOCK_MAX_WAIT if max_wait is None else max_wait)
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if not waited:
                    say(waiting)
                    waited = True
                if give_up() or time.monotonic() > deadline:
                    break
                time.sleep(LOCK_POLL)
            except OSError:  # ENOLCK, EINVAL: a file system without locks
                break
        yield waited
