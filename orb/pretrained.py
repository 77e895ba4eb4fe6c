"""Published orb weights by name: downloaded once, verified at every use, never fetched again.

    checkpoint_path: orb_v3_conservative_inf_omat          # a config; or --checkpoint NAME; or
    ORBCalculator.from_pretrained("orb_v3_conservative_inf_omat")

Every name of :data:`orb.models.config.MODEL_NAMES` is the file orb-models' own ``pretrained.py`` downloads (the
same addresses; orb-models' hyphenated names and the published file names are accepted too). The file is kept in
``$ORB_CACHE_DIR/weights/`` (default ``~/.cache/orb_mindspore/weights``) beside a record of its address, size and
sha256. A download goes to ``<file>.part`` (kept when the process is stopped or killed, so the next attempt
continues it with an HTTP range request), is checked (the announced length; every member's CRC of the zip file
PyTorch writes) and renamed into place once whole. A file whose size or sha256 no longer matches its record (a
shared file system that damaged it) is removed and fetched again; it is never loaded. A process that finds the
file in the cache does not touch the network.

``ORB_WEIGHTS_URL`` replaces the scheme and host of orb-models' address and keeps its path
(``<ORB_WEIGHTS_URL>/forcefields/...``): a mirror, an internal HTTP server or a ``file://`` folder laid out the same
way serves every name. Compute nodes without internet read a cache that ``orb-download NAME ...`` filled on a
login node (``ORB_CACHE_DIR`` on a shared file system).

MindSpore is not imported here: the converted MindSpore copy of each file is made by
:func:`orb.io.checkpoint.published_checkpoint`.
"""

import contextlib
import difflib
import hashlib
import json
import logging
import os
import sys
import zipfile
from typing import Dict, List, Optional

from orb.cache import cache_dirs, writable_dir
from orb.errors import CheckpointError, ConfigError, StartupError
from orb.files import exclusive, fsync_directory, fsync_file, write_json
from orb.models.config import MODEL_NAMES

log = logging.getLogger("orb")

ORB_MODELS_HOST = "https://orbitalmaterials-public-models.s3.us-west-1.amazonaws.com"
URL_VARIABLE = "ORB_WEIGHTS_URL"
SUBFOLDER = "weights"
# orb-models' pretrained.py: each loader's default weights_path, less the host (orb-models 0.5.5 to 0.7.0)
PUBLISHED: Dict[str, str] = {
    "orb_v2": "forcefields/orb-v2-20241011.ckpt",
    "orb_mptraj_only_v2": "forcefields/orb-mptraj-only-v2-20241014.ckpt",
    "orb_d3_v2": "forcefields/orb-d3-v2-20241011.ckpt",
    "orb_d3_sm_v2": "forcefields/orb-d3-sm-v2-20241011.ckpt",
    "orb_d3_xs_v2": "forcefields/orb-d3-xs-v2-20241011.ckpt",
    "orb_v3_conservative_20_omat": "forcefields/orb-v3/orb-v3-conservative-20-omat-20250404.ckpt",
    "orb_v3_conservative_inf_omat": "forcefields/orb-v3/orb-v3-conservative-inf-omat-20250404.ckpt",
    "orb_v3_direct_20_omat": "forcefields/orb-v3/orb-v3-direct-20-omat-20250404.ckpt",
    "orb_v3_direct_inf_omat": "forcefields/orb-v3/orb-v3-direct-inf-omat-20250404.ckpt",
    "orb_v3_conservative_omol": "forcefields/orb-v3-conservative-omol-20250820.ckpt",
    "orb_v3_direct_omol": "forcefields/orb-v3-direct-omol-20250820.ckpt",
    "orb_v3_conservative_20_mpa": "forcefields/orb-v3/orb-v3-conservative-20-mpa-20250404.ckpt",
    "orb_v3_conservative_inf_mpa": "forcefields/orb-v3/orb-v3-conservative-inf-mpa-20250404.ckpt",
    "orb_v3_direct_20_mpa": "forcefields/orb-v3/orb-v3-direct-20-mpa-20250404.ckpt",
    "orb_v3_direct_inf_mpa": "forcefields/orb-v3/orb-v3-direct-inf-mpa-20250404.ckpt",
}
ATTEMPTS = 5  # connections per download: a cut connection continues where it stopped
TIMEOUT = 60.0  # seconds without a byte before a connection counts as cut
CHUNK = 1 << 20


class DownloadError(StartupError):
    """Published weights that could not be fetched or verified (no network, an HTTP error, a damaged file)."""


def published_name(value: str) -> Optional[str]:
    """The model name ``value`` stands for -- ours (``orb_v3_direct_20_omat``), orb-models' (``orb-v3-direct-20-omat``)
    or a published file's name (``orb-v3-direct-20-omat-20250404.ckpt``) -- or None. A file or folder of that name
    in the working folder is the user's, not a name."""
    value = str(value).strip()
    if not value or os.path.exists(value):
        return None
    underscored = value.replace("-", "_")
    if underscored in PUBLISHED:
        return underscored
    for name, path in PUBLISHED.items():
        if value == os.path.basename(path):
            return name
    return None


def require_name(value: str, what: str = "model name") -> str:
    """:func:`published_name` of ``value``, or a one-line error listing the names (with the closest one)."""
    name = published_name(value)
    if name is None:
        close = difflib.get_close_matches(str(value).replace("-", "_"), MODEL_NAMES, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise CheckpointError(f"unknown {what} {value!r}{hint}; published names: {', '.join(MODEL_NAMES)}")
    return name


def base_url() -> str:
    """Where the files are served from: ``ORB_WEIGHTS_URL`` (checked) or orb-models' host."""
    base = os.environ.get(URL_VARIABLE, "").strip() or ORB_MODELS_HOST
    if not base.startswith(("http://", "https://", "file://")):
        raise ConfigError(f"{URL_VARIABLE}={base!r} must start with http://, https:// or file:// (a mirror of "
                            f"{ORB_MODELS_HOST} laid out the same way: <{URL_VARIABLE}>/{PUBLISHED['orb_v2']})")
    return base.rstrip("/")


def weights_url(name: str) -> str:
    return f"{base_url()}/{PUBLISHED[name]}"


def file_name(name: str) -> str:
    return os.path.basename(PUBLISHED[name])


def sha256_of(path: str) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(CHUNK), b""):
            sha.update(block)
    return sha.hexdigest()


def read_record(path: str) -> Optional[Dict]:
    """The record kept beside a downloaded file (``<file>.json``: url, size, sha256), or None if absent or unreadable."""
    try:
        with open(path + ".json") as f:
            record = json.load(f)
        if isinstance(record, dict) and isinstance(record.get("size"), int) and isinstance(record.get("sha256"), str):
            return record
    except (OSError, ValueError):
        pass
    return None


def matches_record(path: str, record: Dict) -> bool:
    """Whether the file at ``path`` is the one its record describes (size, then sha256: a damaged copy fails)."""
    try:
        return os.path.getsize(path) == record["size"] and sha256_of(path) == record["sha256"]
    except OSError:
        return False


def discarded(path: str) -> str:
    """Remove a cached download that is not the weights it was served as (a mirror's wrong file, which its record
    would verify at every use, blocking every later use of the name); what became of it, for the error."""
    served = (read_record(path) or {}).get("url", "its address")
    try:
        remove_quietly(path, path + ".json")
    except OSError as exc:
        return f"delete it and its .json record ({exc.strerror}), and check the copy at {served}"
    return f"it was removed from the cache: check the copy at {served}, then fetch it again"


def remove_quietly(*paths: str) -> None:
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)


def cached_record(name: str) -> Optional[Dict]:
    """The record of ``name``'s file in the first cache folder holding one (with ``path`` added), without reading
    the file: a converted copy keyed by its sha256 may be all a process needs."""
    for folder in cache_dirs(SUBFOLDER):
        path = os.path.join(folder, file_name(name))
        record = read_record(path)
        if record is not None:
            return dict(record, path=path)
    return None


def verified_file(name: str) -> Optional[str]:
    """``name``'s downloaded file in a cache folder, checked against its record; a copy that fails the check is
    removed (or, in a read-only folder, passed over) with one warning."""
    for folder in cache_dirs(SUBFOLDER):
        path = os.path.join(folder, file_name(name))
        if not os.path.isfile(path):
            continue
        record = read_record(path)
        if record is not None and matches_record(path, record):
            return path
        log.warning("%s: the cached weights %s %s: removing it and fetching the file again", name, path,
                    "have no record of their size and sha256" if record is None else "no longer match their record "
                    f"(size {record['size']}, sha256 {record['sha256'][:12]}...)")
        try:
            remove_quietly(path, path + ".json")
        except OSError:
            continue  # a read-only copy: the next folder, or a download into a writable one
    return None


def fetch(name: str, progress: Optional[bool] = None) -> str:
    """The verified local file of the published weights ``name``: from the cache, else downloaded into it. Ranks of a
    job on one node (or on a shared file system that locks) download it once, the others wait for it."""
    found = verified_file(name)
    if found:
        return found
    folder = writable_dir(SUBFOLDER)
    if folder is None:
        looked = " and ".join(cache_dirs(SUBFOLDER))
        raise DownloadError(f"{name}: no cached copy and no writable cache folder to download it into (looked in "
                            f"{looked}); set ORB_CACHE_DIR to a writable folder, or fill it with `orb-download {name}` "
                            "where one is writable")
    target = os.path.join(folder, file_name(name))
    lock = os.path.join(folder, f".{file_name(name)}.lock")
    with exclusive(lock, f"{name}: another process is downloading it into {folder}: waiting for it", say,
                   max_wait=float("inf")):  # (two writers of one .part file: never)
        found = verified_file(name)  # another process may have fetched it meanwhile
        if found:
            return found
        url = weights_url(name)
        say(f"{name}: downloading {url} into {folder}")
        download(url, target, name, progress)
        say(f"{name}: downloaded ({os.path.getsize(target) / 2 ** 20:.1f} MiB)")
    return target


def say(message: str) -> None:
    """A line for the user: into the run's log when a command set one up (training), else on stderr (a script using
    the calculator, orb-md ...): a download of hundreds of MB without a word looks like a hang."""
    if log.handlers:
        log.info(message)
    else:
        print(message, file=sys.stderr)


def download(url: str, target: str, name: str, progress: Optional[bool] = None) -> None:
    """``url`` into ``target`` through ``<target>.part``: continued by range requests after a cut connection (within
    :data:`ATTEMPTS`, and in a later process after a kill), checked, recorded, then renamed into place."""
    part = target + ".part"
    total = None
    for attempt in range(1, ATTEMPTS + 1):
        try:
            total = _transfer(url, part, name, progress)
            break
        except _CutConnection as cut:
            if attempt == ATTEMPTS:
                raise DownloadError(f"{name}: the connection to {url} was cut {ATTEMPTS} times ({cut}); run the "
                                    "same command again to continue the download") from None
            log.warning("%s: the connection was cut (%s): continuing the download (attempt %d of %d)", name, cut,
                        attempt + 1, ATTEMPTS)
    size = os.path.getsize(part)
    if total is not None and size != total:
        remove_quietly(part)
        raise DownloadError(f"{name}: {url} gave {size} bytes where it announced {total}; the partial file was "
                            "removed: run the same command again")
    problem = damaged_zip(part)
    if problem:
        remove_quietly(part)
        raise DownloadError(f"{name}: the file downloaded from {url} is damaged ({problem}) and was removed; run the "
                            "same command again, or check the mirror's copy")
    fsync_file(part)
    write_json(target + ".json", {"name": name, "url": url, "size": size, "sha256": sha256_of(part)})
    os.replace(part, target)
    fsync_directory(os.path.dirname(target))


class _CutConnection(Exception):
    pass


def _transfer(url: str, part: str, name: str, progress: Optional[bool]) -> Optional[int]:
    """One connection: append to ``part`` from where it ends (a range request; a server that ignores it sends the
    whole file again, which replaces ``part``). Returns the file's announced total size, or None."""
    import http.client
    import socket
    import urllib.error
    import urllib.request

    have = os.path.getsize(part) if os.path.exists(part) else 0
    request = urllib.request.Request(url, headers={"Range": f"bytes={have}-"} if have else {})
    try:
        response = urllib.request.urlopen(request, timeout=TIMEOUT)
    except urllib.error.HTTPError as exc:
        if exc.code == 416 and have:  # the part is complete already (or longer than the file): start again
            remove_quietly(part)
            raise _CutConnection(f"HTTP 416 for a range from byte {have}") from None
        raise DownloadError(f"{name}: HTTP {exc.code} {exc.reason} from {url}{_mirror_hint()}") from None
    except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
        reason = getattr(exc, "reason", None) or exc
        if url.startswith("file://"):  # a folder mirror that lacks the file: no network to advise about
            raise DownloadError(f"{name}: {url} is not in the mirror folder ({reason}); put orb-models' file there "
                                f"(<{URL_VARIABLE}>/{PUBLISHED[name]}), or run `orb-download {name}` on a machine with "
                                "internet access with ORB_CACHE_DIR set to a folder this machine shares") from None
        raise DownloadError(f"{name}: cannot reach {url} ({reason}){_offline_hint(name)}") from None
    with response:
        resumed = have and getattr(response, "status", None) == 206
        if not resumed:
            have = 0
        length = response.headers.get("Content-Length")
        total = have + int(length) if length and length.isdigit() else None
        try:
            _copy(response, part, "ab" if resumed else "wb", have, total, name, progress)
        except (socket.timeout, ConnectionError, http.client.HTTPException) as exc:
            raise _CutConnection(str(exc) or type(exc).__name__) from None
        if total is not None and os.path.getsize(part) < total:
            raise _CutConnection(f"{os.path.getsize(part)} of {total} bytes")
    return total


def _copy(response, part: str, mode: str, have: int, total: Optional[int], name: str,
          progress: Optional[bool]) -> None:
    from tqdm import tqdm

    show = sys.stderr.isatty() if progress is None else progress
    with open(part, mode) as out, tqdm(total=total, initial=have, unit="B", unit_scale=True, unit_divisor=1024,
                                       desc=name, disable=not show, file=sys.stderr) as bar:
        for block in iter(lambda: response.read(CHUNK), b""):
            out.write(block)
            bar.update(len(block))


def damaged_zip(path: str) -> str:
    """What is wrong with the zip file PyTorch's ``torch.save`` writes (every member's CRC is read), or ''."""
    try:
        with zipfile.ZipFile(path) as z:
            bad = z.testzip()
        return f"member {bad} fails its CRC" if bad else ""
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as exc:
        return f"not a complete zip file: {exc}"


def _offline_hint(name: str) -> str:
    return (f"; on a machine with internet access run `orb-download {name}` with ORB_CACHE_DIR set to a folder this "
            f"machine shares, or set {URL_VARIABLE} to a mirror{_mirror_hint()}")


def _mirror_hint() -> str:
    base = os.environ.get(URL_VARIABLE, "").strip()
    return f" ({URL_VARIABLE}={base})" if base else ""


def cached_names() -> List[str]:
    """The published names whose file is in a cache folder (recorded; not verified)."""
    return [name for name in PUBLISHED if cached_record(name) is not None]
