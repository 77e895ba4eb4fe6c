"""Checkpoints: PyTorch state dicts <-> the MindSpore model, and atomic MindSpore checkpoint files.

MindSpore parameter paths equal orb-models' state_dict keys (``model.gnn_stacks.3._edge_mlp.mlp.NN-0.weight``,
``graph_head.normalizer.bn.running_mean``, ...), so the mapping is one to one, strict and shape-checked.
"""

import difflib
import json
import os
from collections import OrderedDict
from typing import Dict, Iterable, Optional, Tuple

import mindspore as ms
import numpy as np
from mindspore import Tensor, nn

from orb.errors import CheckpointError, SaveError
from orb.models import build, config_from_state_dict
from orb.models.adapters import merge_arrays, merged_state
from orb.models.config import ModelConfig
from orb.models.gns import REPLAY_HEADS
from orb.files import write_atomically
from orb.io.torch_format import is_torch_zip, read_torch_checkpoint, write_torch_checkpoint
from orb.pretrained import PUBLISHED, published_name
from orb.signals import STOP

__all__ = [
    "read_torch_checkpoint", "write_torch_checkpoint", "load_torch_state_dict", "to_torch_state_dict",
    "read_weights", "save_checkpoint", "load_checkpoint", "META_KEY",
]

META_KEY = "orb_meta_json"
OPTIMIZER_PREFIX = "optimizer."
TRAINING_ONLY = (OPTIMIZER_PREFIX, REPLAY_HEADS + ".")  # in training checkpoints, never in exported weights


def named_parameters(cell: nn.Cell, exported: bool = False) -> "OrderedDict[str, ms.Parameter]":
    """Parameters (normaliser buffers included) by their PyTorch-compatible path; ``exported``: without the
    training-only replay heads (what orb-models and the calculator load)."""
    return OrderedDict((name, p) for name, p in cell.parameters_and_names()
                       if not (exported and name.startswith(TRAINING_ONLY)))


def to_torch_state_dict(model: nn.Cell) -> "OrderedDict[str, np.ndarray]":
    """The model's weights and buffers as a PyTorch-compatible ``{key: numpy array}``: no replay heads, low-rank
    adapters merged into their layers' weights."""
    return merged_state(model, lambda name: not name.startswith(TRAINING_ONLY))


def _check_keys(expected: Dict[str, Tuple[int, ...]], given: Dict[str, np.ndarray], source: str) -> None:
    missing = [k for k in expected if k not in given]
    unexpected = [k for k in given if k not in expected]
    wrong = [f"{k}: checkpoint {tuple(np.shape(given[k]))} vs model {expected[k]}"
             for k in expected if k in given and tuple(np.shape(given[k])) != expected[k]]
    problems = []
    if missing:
        problems.append(f"missing keys {missing[:8]}{' ...' if len(missing) > 8 else ''} ({len(missing)})")
    if unexpected:
        problems.append(f"unexpected keys {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''} ({len(unexpected)})")
    if wrong:
        problems.append(f"wrong shapes [{'; '.join(wrong[:8])}]{' ...' if len(wrong) > 8 else ''}")
    if problems:
        raise CheckpointError(f"{source} does not fit the model: " + "; ".join(problems) +
                              " (is the 'model:' config block the architecture the checkpoint was trained with?)")


def load_torch_state_dict(model: nn.Cell, state_dict: Dict[str, np.ndarray], source: str = "state dict") -> None:
    """Copy a PyTorch-keyed state dict into the model; strict about keys and shapes."""
    params = named_parameters(model)
    _check_keys({k: tuple(p.shape) for k, p in params.items()}, state_dict, source)
    for name, param in params.items():
        value = np.asarray(state_dict[name])
        if not np.issubdtype(value.dtype, np.number):
            raise CheckpointError(f"{source}: {name} has non-numeric dtype {value.dtype}")
        param.set_data(Tensor(value.astype(param.asnumpy().dtype)))


def _ms_checkpoint_arrays(path: str) -> Tuple[Dict[str, np.ndarray], Dict]:
    """Arrays and metadata of a MindSpore checkpoint; one this program wrote carries a CRC, checked here (a file a
    shared file system damaged is refused, not loaded; one written without a CRC is read as before)."""
    raw = _read_ms_checkpoint(path)
    arrays = {key: value.asnumpy() for key, value in raw.items() if isinstance(value, (ms.Parameter, Tensor))}
    return arrays, _meta_of(raw)


def _read_ms_checkpoint(path: str, only: Optional[str] = None) -> Dict:
    """MindSpore's entries of a checkpoint (``only``: that entry alone, the arrays left unread)."""
    choose = None if only is None else (lambda name: name == only)
    try:
        with STOP.held():  # (MindSpore's reader turns a stop raised inside into "Failed to read")
            return ms.load_checkpoint(path, crc_check=True, choice_func=choose)
    except Exception as exc:  # MindSpore raises ValueError/RuntimeError on damaged files
        raise CheckpointError(f"{path}: cannot read MindSpore checkpoint ({exc})") from None


def _meta_of(raw: Dict) -> Dict:
    value = raw.get(META_KEY)
    if value is None:
        return {}
    return json.loads(value if isinstance(value, str) else str(value.asnumpy()))


def stored_settings(path: str) -> Optional[Dict]:
    """The model settings a MindSpore checkpoint of this program stores, read without its arrays (None: a PyTorch
    file or published weights, whose names or tensors tell their architecture, or a file storing none)."""
    if published_name(path) is not None:
        return None
    check_checkpoint_file(path)
    if is_torch_zip(path):
        return None
    stored = stored_architecture(_meta_of(_read_ms_checkpoint(path, only=META_KEY)))
    return {k: v for k, v in (stored or {}).items() if k in ModelConfig.__dataclass_fields__} or None


def check_checkpoint_file(path: str, flag: str = "") -> None:
    """Refuse, in one line (``flag``: the option that named it), a checkpoint path that is neither a file nor the name
    of published weights (:mod:`orb.pretrained`)."""
    name = f"{flag + ' ' if flag else ''}{path}"
    if published_name(path) is not None:
        return
    if os.path.isdir(path):
        raise CheckpointError(f"{name}: is a folder, not a checkpoint file")
    if not os.path.isfile(path):
        close = difflib.get_close_matches(os.path.basename(str(path)).replace("-", "_"), list(PUBLISHED), n=1)
        hint = (f" (did you mean the published weights {close[0]}? names: {', '.join(PUBLISHED)})" if close else "")
        raise CheckpointError(f"{name}: checkpoint file does not exist{hint}")
    if os.path.getsize(path) == 0:
        raise CheckpointError(f"{name}: checkpoint file is empty")
    if not str(path).endswith(".ckpt") and not is_torch_zip(path):  # (MindSpore reads .ckpt files only)
        data = str(path).lower().endswith((".xyz", ".extxyz", ".db", ".traj", ".cif", ".aselmdb", ".json", ".vasp"))
        raise CheckpointError(f"{name}: not a checkpoint (a PyTorch zip, or a MindSpore file ending in .ckpt)"
                              + ("; structures like these go to --data" if data else ""))


def averaged_weights(arrays: Dict[str, np.ndarray], weights: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
    """A training checkpoint's EMA of its trained weights (``ema_decay``), where it holds one: what its run validated
    and saved as ``best_weights.ckpt``, so that evaluating or starting from ``best.ckpt`` or ``last.ckpt`` uses the
    weights the metrics are of (its raw weights are for a resume only)."""
    prefix, averaged = OPTIMIZER_PREFIX + "ema.", {}
    for key, value in arrays.items():
        name = key[len(prefix):]
        if key.startswith(prefix) and name in weights:
            averaged[name] = np.asarray(value, weights[name].dtype).reshape(weights[name].shape)
    return averaged


def read_weights(path: str) -> Tuple["OrderedDict[str, np.ndarray]", Dict]:
    """Model weights from a PyTorch ``.ckpt`` (zip), a MindSpore checkpoint or published weights by name
    (:func:`published_weights`), plus any stored metadata.

    Of a training checkpoint: the EMA of its trained weights where it holds one (:func:`averaged_weights`), optimizer
    state and replay heads left out, and low-rank adapters merged into their layers' weights (see
    :func:`load_checkpoint` for everything a resume needs).
    """
    name = published_name(path)
    if name is not None:
        arrays, meta = published_weights(name)
    else:
        check_checkpoint_file(path)
        if is_torch_zip(path):
            return read_torch_checkpoint(path), {}
        arrays, meta = _ms_checkpoint_arrays(path)
    weights = OrderedDict((k, v) for k, v in arrays.items() if not k.startswith(TRAINING_ONLY))
    weights.update(averaged_weights(arrays, weights))
    alpha = (meta.get("config") or {}).get("lora", {}).get("alpha")
    return OrderedDict(merge_arrays(weights, alpha)), meta


def save_checkpoint(path: str, model: nn.Cell, meta: Optional[Dict] = None,
                    extra: Optional[Iterable[Tuple[str, Tensor]]] = None, exported: bool = False) -> None:
    """Write a MindSpore checkpoint atomically: a temporary file in the same folder, then rename.

    ``extra`` adds named tensors (e.g. optimizer state under ``optimizer.``); ``meta`` is stored as JSON;
    ``exported``: the model's weights without training-only replay heads. A crash at any point leaves
    either the previous file or the complete new one.
    """
    state = to_torch_state_dict(model) if exported else {n: p.asnumpy() for n, p in named_parameters(model).items()}
    entries = [{"name": name, "data": Tensor(value)} for name, value in state.items()]
    entries += [{"name": name, "data": Tensor(t.asnumpy() if hasattr(t, "asnumpy") else np.asarray(t))}
                for name, t in (extra or [])]

    def write(tmp: str) -> None:
        with STOP.held():  # (MindSpore's writer turns a stop raised inside into a failed write)
            ms.save_checkpoint(entries, tmp, append_dict={META_KEY: json.dumps(meta or {})}, crc_check=True)
        os.chmod(tmp, 0o644)  # MindSpore writes checkpoints read-only

    try:
        write_atomically(path, write, suffix=".ckpt")
    except (OSError, RuntimeError) as exc:  # MindSpore reports a failed write (e.g. a full disk) as RuntimeError
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc).strip().splitlines()[0]
        raise SaveError(f"could not write {path} ({reason}); the previous checkpoint there is unchanged") from None


def load_checkpoint(path: str) -> Tuple[Dict[str, np.ndarray], Dict[str, np.ndarray], Dict]:
    """(model weights, optimizer state with the ``optimizer.`` prefix removed, metadata) of a checkpoint."""
    check_checkpoint_file(path)
    if is_torch_zip(path):
        return read_torch_checkpoint(path), {}, {}
    arrays, meta = _ms_checkpoint_arrays(path)
    weights = {k: v for k, v in arrays.items() if not k.startswith(OPTIMIZER_PREFIX)}
    optimizer = {k[len(OPTIMIZER_PREFIX):]: v for k, v in arrays.items() if k.startswith(OPTIMIZER_PREFIX)}
    return weights, optimizer, meta


def describe(cfg: ModelConfig) -> str:
    return (f"{cfg.name} (latent_dim {cfg.latent_dim}, mlp_hidden_dim {cfg.mlp_hidden_dim}, "
            f"{cfg.num_message_passing_steps} message-passing layers, head_mlp_hidden_dim {cfg.head_mlp_hidden_dim})")


def stored_architecture(meta: Dict) -> Optional[Dict]:
    """The model settings this program stored in a checkpoint's metadata (a converted or a training checkpoint)."""
    return meta.get("model") or meta.get("config", {}).get("model")


def architecture(weights: Dict[str, np.ndarray], meta: Dict, name: Optional[str] = None) -> ModelConfig:
    """The architecture of a checkpoint: stored by this program, else read from the tensor shapes
    (``name``: the model name when the shapes cannot tell, e.g. orb-v3's 20 or unlimited neighbours)."""
    stored = stored_architecture(meta)
    if stored and (name is None or stored.get("name", "orb_v2") == name):
        return ModelConfig.from_dict(stored)
    return config_from_state_dict(weights, name=name)


def settings_a_state_dict_loses(cfg: ModelConfig, weights: Dict[str, np.ndarray]) -> Tuple[Dict[str, Tuple], str]:
    """What a reader of ``weights`` alone (a PyTorch state dict: tensors, no name, no settings) cannot know of the
    model ``cfg``: {key: (cfg's value, the reader's)} for the settings no tensor shape shows (the graph's radius and
    neighbours, the radial basis) where ``cfg`` is not its name's, even when told the name; and the name the tensors
    read as without it (orb-v3's 20- and unlimited-neighbour models, and the D3 orb-v2 models, look alike)."""
    lost = differences(cfg, config_from_state_dict(weights, name=cfg.name))
    lost.pop("name", None)
    return lost, config_from_state_dict(weights).name


def differences(ours: ModelConfig, theirs: ModelConfig) -> Dict[str, Tuple]:
    """{key: (ours, theirs)} for every setting in which two model configurations differ."""
    mine, other = ours.to_dict(), theirs.to_dict()
    return {key: (value, other[key]) for key, value in mine.items() if other[key] != value}


def settings_unlike_the_trained(cfg: ModelConfig, weights: Dict[str, np.ndarray], meta: Dict) -> Dict[str, Tuple]:
    """{key: (cfg's value, the checkpoint's)} where ``cfg`` differs from the model ``weights`` were trained as (its
    stored settings, else its tensors read under ``cfg``'s name): the name and the settings no tensor shape shows
    (the graph's radius and neighbours, the radial basis), which a strict load cannot catch."""
    stored = stored_architecture(meta)
    if stored:  # (settings a later version may add are not this version's to compare)
        theirs = ModelConfig.from_dict({k: v for k, v in stored.items() if k in ModelConfig.__dataclass_fields__})
    else:
        theirs = config_from_state_dict(weights, name=cfg.name)
    return differences(cfg, theirs)


def load_weights_into(model: nn.Cell, path: str) -> Dict[str, Tuple]:
    """Load a PyTorch or MindSpore checkpoint's weights into ``model`` (strict); returns the settings in which
    ``model`` differs from the model the weights were trained as (:func:`settings_unlike_the_trained`).

    If the architectures differ, the error says what the checkpoint holds.
    """
    weights, meta = read_weights(path)
    try:
        load_torch_state_dict(model, weights, source=path)
    except CheckpointError as exc:
        try:
            held = describe(architecture(weights, meta))
        except (CheckpointError, TypeError):
            raise exc from None
        raise CheckpointError(f"{path} holds {held}, which does not match the config's 'model:' block "
                              f"({describe(model.cfg)}); set the model block to the checkpoint's architecture") from None
    return settings_unlike_the_trained(model.cfg, weights, meta)


def model_from_checkpoint(path: str, name: Optional[str] = None):
    """The model stored in a PyTorch or MindSpore checkpoint, its architecture read from the checkpoint."""
    weights, meta = read_weights(path)
    stored = (stored_architecture(meta) or {}).get("name")
    if name is not None and stored is not None and stored != name:  # (its graph settings would go unsaid)
        raise CheckpointError(f"{path} stores the model {stored}, not {name}: leave out the model's name (the "
                              "checkpoint tells it)")
    try:
        cfg = architecture(weights, meta, name)
    except CheckpointError as exc:  # which file it is about
        if str(path) in str(exc):
            raise
        raise CheckpointError(f"{path}: {exc}") from None
    return model_from_state_dict(cfg, weights, source=path)


def model_from_state_dict(cfg, weights: Dict[str, np.ndarray], source: str):
    """A model of architecture ``cfg`` (in the precision in force) holding ``weights`` (PyTorch keys), for use."""
    model = build(cfg)
    load_torch_state_dict(model, weights, source=source)
    model.set_train(False)
    return model


def published_weights(name: str, progress: Optional[bool] = None) -> Tuple[Dict[str, np.ndarray], Dict]:
    """(arrays, metadata) of the published weights ``name`` (:mod:`orb.pretrained`), read from their MindSpore copy in
    the cache: made at the first use from the verified download, keyed by its sha256 and this code, its CRC checked at
    every read (a damaged copy is made again). The metadata names the model, which the tensors of orb-v3's 20- and
    unlimited-neighbour models (and of the D3 orb-v2 models) cannot tell."""
    from orb import pretrained
    from orb.cache import CacheEntry

    def copy_of(record: Dict) -> CacheEntry:
        return CacheEntry(pretrained.SUBFOLDER, ("orb.io.checkpoint", "orb.io.torch_format", "orb.models.config"),
                          (name, record["sha256"]), ".ckpt", libraries=("mindspore",))

    record = pretrained.cached_record(name)
    if record is not None:  # the copy alone will do: the download is not read (nor hashed) again
        found = copy_of(record).read(_ms_checkpoint_arrays)
        if found is not None:
            return found
    source = pretrained.fetch(name, progress)
    entry = copy_of(pretrained.read_record(source))
    found = entry.read(_ms_checkpoint_arrays)
    if found is not None:
        return found
    weights = read_torch_checkpoint(source)
    try:
        _check_published_architecture(name, weights, source)
    except CheckpointError as exc:
        raise CheckpointError(f"{exc}: {pretrained.discarded(source)}") from None
    meta = {"model": ModelConfig.from_dict({"name": name}).to_dict(), "published": name,
            "converted_from": pretrained.weights_url(name)}

    def save(tmp: str) -> None:
        entries = [{"name": key, "data": Tensor(value)} for key, value in weights.items()]
        with STOP.held():
            ms.save_checkpoint(entries, tmp, append_dict={META_KEY: json.dumps(meta)}, crc_check=True)
        os.chmod(tmp, 0o644)

    entry.write(save, f"MindSpore copy of the published {name}")  # when it cannot be kept: made again next time
    return weights, meta


def _check_published_architecture(name: str, weights: Dict[str, np.ndarray], source: str) -> None:
    """A file served for ``name`` whose tensors are another architecture (a mirror's wrong file) is refused here,
    naming both, before it is converted or cached."""
    try:
        held = config_from_state_dict(weights, name=name)
    except CheckpointError as exc:
        raise CheckpointError(f"{source} (served as {name}): {exc}") from None
    expected = ModelConfig.from_dict({"name": name})
    if differences(held, expected):
        raise CheckpointError(f"{source} (served as {name}) holds {describe(held)}, not {describe(expected)}")
