"""Read and write PyTorch ``torch.save`` files (zip format) without importing torch.

A zip-format checkpoint holds ``<root>/data.pkl`` (a pickle whose tensors point to storages by
persistent id) and one raw little-endian file per storage, ``<root>/data/<key>``. The reader
unpickles with an allow-list: an ``OrderedDict`` or ``dict`` of tensors (``_rebuild_tensor_v2``,
``_rebuild_parameter``) and the typed storage classes. Anything else is refused, so no
arbitrary object is ever constructed. Views (strides, storage offsets) and storages shared
between tensors are honoured. The writer produces the same layout (64-byte aligned storages),
which ``torch.load`` and ``load_state_dict(strict=True)`` accept.
"""

import io
import os
import pickle
import zipfile
from collections import OrderedDict
from typing import Dict

import numpy as np

from orb.errors import CheckpointError
from orb.files import write_atomically

_STORAGE_DTYPES = {
    "FloatStorage": np.dtype("<f4"), "DoubleStorage": np.dtype("<f8"), "HalfStorage": np.dtype("<f2"),
    "BFloat16Storage": np.dtype("<u2"), "LongStorage": np.dtype("<i8"), "IntStorage": np.dtype("<i4"),
    "ShortStorage": np.dtype("<i2"), "CharStorage": np.dtype("i1"), "ByteStorage": np.dtype("u1"),
    "BoolStorage": np.dtype("?"),
}
_DTYPE_STORAGES = {np.dtype("float32"): "FloatStorage", np.dtype("float64"): "DoubleStorage",
                   np.dtype("float16"): "HalfStorage", np.dtype("int64"): "LongStorage",
                   np.dtype("int32"): "IntStorage", np.dtype("int16"): "ShortStorage",
                   np.dtype("int8"): "CharStorage", np.dtype("uint8"): "ByteStorage", np.dtype("bool"): "BoolStorage"}
ZIP_MAGIC = b"PK\x03\x04"


class _StorageType:
    def __init__(self, name: str):
        self.name = name
        self.dtype = _STORAGE_DTYPES[name]


def _bfloat16_to_float32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def _rebuild_tensor(storage, storage_offset, size, stride, requires_grad=False, backward_hooks=None, metadata=None):
    array, is_bf16 = storage
    size, stride = tuple(int(s) for s in size), tuple(int(s) for s in stride)
    needed = storage_offset + sum((n - 1) * s for n, s in zip(size, stride)) + 1 if all(size) else storage_offset
    if needed > len(array):
        raise CheckpointError(f"tensor view of size {size} at offset {storage_offset} exceeds its storage")
    if size == ():
        out = np.array(array[storage_offset])
    else:
        view = np.lib.stride_tricks.as_strided(
            array[storage_offset:], shape=size, strides=tuple(s * array.itemsize for s in stride), writeable=False)
        out = np.array(view)  # own, C-contiguous copy
    return _bfloat16_to_float32(out) if is_bf16 else out


def _rebuild_parameter(data, requires_grad=False, backward_hooks=None):
    return data


def is_torch_zip(path: str) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == ZIP_MAGIC


def read_torch_checkpoint(path: str) -> Dict[str, np.ndarray]:
    """``{key: numpy array}`` of a ``torch.save`` state dict, read without torch.

    Accepts a state dict at the top level or under a ``state_dict`` / ``model`` key.
    """
    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: checkpoint file does not exist")
    if not is_torch_zip(path):
        raise CheckpointError(f"{path}: not a zip-format torch.save file (legacy pre-1.6 files are not supported; "
                              "re-save it with torch.save in a recent PyTorch)")
    try:
        archive = zipfile.ZipFile(path)
    except zipfile.BadZipFile as exc:
        raise CheckpointError(f"{path}: damaged zip archive ({exc})") from None
    with archive:
        pickles = [n for n in archive.namelist() if n.endswith("data.pkl")]
        if len(pickles) != 1:
            raise CheckpointError(f"{path}: expected one data.pkl in the archive, found {len(pickles)}")
        root = pickles[0][: -len("data.pkl")]
        storages = {}

        def load_storage(saved_id):
            if not (isinstance(saved_id, tuple) and len(saved_id) == 5 and saved_id[0] == "storage"):
                raise CheckpointError(f"{path}: unsupported persistent id {saved_id!r}")
            _, storage_type, key, _location, numel = saved_id
            if not isinstance(storage_type, _StorageType):
                raise CheckpointError(f"{path}: unsupported storage type {storage_type!r}")
            if key not in storages:
                try:
                    raw = archive.read(f"{root}data/{key}")
                except KeyError:
                    raise CheckpointError(f"{path}: storage {key} is missing from the archive") from None
                array = np.frombuffer(raw, dtype=storage_type.dtype)
                if len(array) < numel:
                    raise CheckpointError(f"{path}: storage {key} holds {len(array)} values, expected {numel}")
                storages[key] = (array, storage_type.name == "BFloat16Storage")
            return storages[key]

        allowed = {
            ("collections", "OrderedDict"): OrderedDict,
            ("builtins", "dict"): dict,
            ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
            ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
        }

        class Unpickler(pickle.Unpickler):
            def find_class(self, module, name):
                if module == "torch" and name in _STORAGE_DTYPES:
                    return _StorageType(name)
                if (module, name) in allowed:
                    return allowed[(module, name)]
                raise CheckpointError(
                    f"{path}: refusing to unpickle '{module}.{name}'; only a state dict of tensors is read "
                    "(save model.state_dict(), not the model or a training-framework checkpoint)")

            def persistent_load(self, saved_id):
                return load_storage(saved_id)

        try:
            obj = Unpickler(io.BytesIO(archive.read(pickles[0]))).load()
        except CheckpointError:
            raise
        except Exception as exc:  # malformed pickle
            raise CheckpointError(f"{path}: cannot read data.pkl ({type(exc).__name__}: {exc})") from None
    for wrapper in ("state_dict", "model"):
        if isinstance(obj, dict) and set(obj) == {wrapper}:
            obj = obj[wrapper]
    if not isinstance(obj, dict) or not all(isinstance(v, np.ndarray) for v in obj.values()):
        raise CheckpointError(f"{path}: expected a dict of tensors (a state dict)")
    return OrderedDict(obj)


class _Global:
    """Stands for a module-level name (emitted as a GLOBAL opcode without importing it)."""

    def __init__(self, module: str, name: str):
        self.module, self.name = module, name

    def __call__(self, *args):  # pickle requires reduce functions to be callable
        raise RuntimeError("placeholder")


class _Storage:
    def __init__(self, key: str, array: np.ndarray):
        self.key, self.array = key, array


class _Tensor:
    _REBUILD = _Global("torch._utils", "_rebuild_tensor_v2")

    def __init__(self, storage: _Storage):
        self.storage = storage

    def __reduce__(self):
        a = self.storage.array
        strides = tuple(s // a.itemsize for s in a.strides)
        return self._REBUILD, (self.storage, 0, tuple(a.shape), strides, False, OrderedDict())


class _Pickler(pickle._Pickler):
    dispatch = pickle._Pickler.dispatch.copy()

    def save_global_ref(self, obj):
        self.write(pickle.GLOBAL + f"{obj.module}\n{obj.name}\n".encode())
        self.memoize(obj)

    dispatch[_Global] = save_global_ref

    def persistent_id(self, obj):
        if isinstance(obj, _Storage):
            storage_type = _Global("torch", _DTYPE_STORAGES[obj.array.dtype])
            return ("storage", storage_type, obj.key, "cpu", int(obj.array.size))
        return None


def _aligned_info(name: str, offset: int, alignment: int = 64) -> zipfile.ZipInfo:
    """A stored (uncompressed) entry whose data starts on an ``alignment`` boundary, like torch's writer."""
    info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
    info.compress_type = zipfile.ZIP_STORED
    start = offset + 30 + len(name.encode())
    pad = (-(start + 4)) % alignment
    info.extra = b"FB" + pad.to_bytes(2, "little") + b"Z" * pad
    return info


def write_torch_checkpoint(state_dict: Dict[str, np.ndarray], path: str) -> None:
    """Write ``{key: array}`` as a zip-format ``torch.save`` file, atomically (temp file, then rename)."""
    root = os.path.splitext(os.path.basename(path))[0] or "archive"
    storages = OrderedDict()
    tensors = OrderedDict()
    for i, (key, value) in enumerate(state_dict.items()):
        array = np.array(value, order="C")  # (ascontiguousarray would make 0-d arrays 1-d)
        if array.dtype not in _DTYPE_STORAGES:
            raise CheckpointError(f"{key}: dtype {array.dtype} has no torch storage type")
        storages[str(i)] = _Storage(str(i), array.astype(array.dtype.newbyteorder("<")))
        tensors[key] = _Tensor(storages[str(i)])
    buffer = io.BytesIO()
    _Pickler(buffer, protocol=2).dump(tensors)

    def write(tmp: str) -> None:
        with open(tmp, "wb") as raw, zipfile.ZipFile(raw, "w", zipfile.ZIP_STORED) as zf:
            records = [("data.pkl", buffer.getvalue()), (".format_version", b"1"), (".storage_alignment", b"64"),
                       ("byteorder", b"little")]
            records += [(f"data/{k}", s.array.tobytes()) for k, s in storages.items()]
            records += [("version", b"3\n"), (".data/serialization_id", b"0" * 40)]
            for name, data in records:
                zf.writestr(_aligned_info(f"{root}/{name}", raw.tell()), data)

    write_atomically(path, write)
