"""Replay: structures of the foundation's own distribution beside the user's target (``replay:`` config block).

A fine-tune that sees only a narrow target forgets what made the foundation universal. Replay
structures are validated every epoch (``replay_val``: what fine-tuning costs) and, with
``fraction > 0``, trained on in every step (which prevents most of that cost). This module decides
which replay rows are used and with which labels; the data layer (:mod:`orb.data.mixture`) mixes
them into the steps.

* Held out: ``val_data_path``, else ``val_samples`` random rows of ``data_path`` that are never
  trained on (with ``fraction: 0`` every row of ``data_path`` is validated).
* Selection: ``num_samples`` of the remaining rows (0 = all), by farthest-point sampling in the
  starting model's descriptors (mean node latents: the model's own view of chemistry and
  structure) or at random.
* Labels: the file's (``data``) or the starting checkpoint's predictions (``model``,
  pseudo-labels: no DFT needed, and the replay loss measures and limits the drift from the
  foundation itself).

Descriptors and pseudo-labels cost a forward pass over the rows; both are computed once per
starting checkpoint and database and kept in the project's cache (``orb.cache``), so a resume or a
second run reads them back. In a data-parallel run each rank computes its part of every batch and
the parts are summed, so every rank holds the same result.
"""

import logging
from typing import Callable, Dict, Optional, Protocol, Tuple

import numpy as np

from orb import cache
from orb.data.dataset import AseDbDataset
from orb.data.row_results import LabelTable, Ranks
from orb.data.mixture import Source
from orb.data.selection import farthest_point_sampling, hold_out, random_sample
from orb.errors import ClusterError, ConfigError

log = logging.getLogger("orb")
# the code that chooses replay rows and runs the model over them (the model's own code: in its identity)
REPLAY_CODE = ("orb.training.replay", "orb.training.engine", "orb.training.distributed", "orb.data.dataset",
               "orb.data.sqlite_rows", "orb.data.selection", "orb.data.mixture", "orb.data.loader", "orb.data.plan",
               "orb.data.buckets", "orb.training.run_data")  # (the passes' batches: rows, heads, shapes)


class ModelOutputs(Protocol):
    """The starting model over a source (``orb.training.engine.ModelPass``)."""

    def labels(self, source: Source) -> Dict[str, np.ndarray]:
        """{"energy", "forces", "stress"} of every structure, in the source's order."""

    def descriptors(self, source: Source) -> Dict[str, np.ndarray]:
        """{"descriptors"}: each structure's descriptor, in the source's order."""

# () -> the starting model's identity (architecture, graph settings, weights, profile, precision), computed once
ModelKey = Callable[[], tuple]


def _entry(kind: str, *parts) -> cache.CacheEntry:
    return cache.CacheEntry(f"replay_{kind}", REPLAY_CODE, parts, ".npz")


def split(replay: AseDbDataset, replay_val: Optional[AseDbDataset], fraction: float, val_samples: int,
          seed: int) -> Tuple[np.ndarray, Optional[Tuple[AseDbDataset, np.ndarray]]]:
    """(positions of ``replay`` that may be trained on, (database, positions) validated every epoch or None)."""
    if replay_val is not None:
        return (np.arange(len(replay)) if fraction > 0 else np.zeros(0, np.int64)), \
            (replay_val, np.arange(len(replay_val)))
    if fraction == 0:  # only measured: every row is validated
        return np.zeros(0, np.int64), (replay, np.arange(len(replay)))
    if val_samples >= len(replay):
        raise ConfigError(f"config key 'replay.val_samples' ({val_samples}) leaves none of the {len(replay)} "
                          f"structures of {replay.source} to train on; lower it or set replay.val_data_path")
    kept, held = hold_out(len(replay), val_samples, seed)
    return kept, ((replay, held) if len(held) else None)


def select(replay: AseDbDataset, candidates: np.ndarray, count: int, method: str, seed: int, model: ModelOutputs,
           model_key: ModelKey, ranks: Ranks) -> np.ndarray:
    """``count`` of the ``candidates`` positions (all when 0 or more), ascending."""
    if count == 0 or count >= len(candidates):
        return candidates
    if method == "random":
        return random_sample(candidates, count, seed)
    entry = _entry("selection", replay.inputs_identity(), model_key(), candidates.tobytes(), count, seed)
    cached = entry.read(cache.load_arrays, lambda c: len(c["positions"]) == count
                        and bool(np.isin(c["positions"], candidates).all()))
    if cache.everyone_has(cached is not None, ranks):
        log.info("replay: %d of %d structures of %s chosen by farthest-point sampling, read from the cache", count,
                 len(candidates), replay.source)
        return cached["positions"]
    descriptors = model.descriptors(Source("replay_candidates", replay, candidates))
    chosen = np.sort(candidates[farthest_point_sampling(descriptors["descriptors"], count, seed)])
    if ranks.world_size > 1 and ranks.sum(np.array([chosen.sum()], np.float64))[0] != ranks.world_size * chosen.sum():
        raise ClusterError("replay: the ranks chose different structures (their descriptors differ)")
    entry.write(lambda tmp: np.savez(tmp, positions=chosen), "replay selection")
    log.info("replay: %d of %d structures of %s chosen by farthest-point sampling in the starting model's "
             "descriptors", count, len(candidates), replay.source)
    return chosen


def pseudo_labels(dataset: AseDbDataset, positions: np.ndarray, model: ModelOutputs, model_key: ModelKey,
                  with_stress: bool, ranks: Ranks, head: int = 0) -> LabelTable:
    """The starting model's energy, forces (and stress) for ``positions`` of ``dataset``, as labels, predicted by the
    heads that will predict those rows in training (``head`` 1: the separate replay heads, copies of the starting
    heads made before any reference fit), so that the replay loss starts at zero."""
    positions = np.sort(np.asarray(positions, np.int64))
    entry = _entry("labels", dataset.inputs_identity(), model_key(), positions.tobytes(), with_stress, head)
    keys = {"energy", "forces", "offsets"} | ({"stress"} if with_stress else set())
    offsets = np.concatenate([[0], np.cumsum(dataset.natoms[positions])]).astype(np.int64)
    cached = entry.read(cache.load_arrays, lambda c: keys <= set(c) and np.array_equal(c["offsets"], offsets)
                        and all(np.isfinite(c[k]).all() for k in keys))
    if cache.everyone_has(cached is not None, ranks):
        log.info("replay: pseudo-labels of %d structures of %s read from the cache", len(positions), dataset.source)
        arrays = cached
    else:
        out = model.labels(Source("replay_labels", dataset, positions, head=head))
        real = np.float64 if dataset.float64 else np.float32  # the cache entry's key includes the precision
        arrays = {"energy": out["energy"], "forces": out["forces"].astype(real), "offsets": offsets}
        if with_stress:
            arrays["stress"] = out["stress"].astype(real)
        entry.write(lambda tmp: np.savez(tmp, **arrays), "replay pseudo-labels")
        log.info("replay: pseudo-labels of %d structures of %s computed by the starting model", len(positions),
                 dataset.source)
    return LabelTable(positions, arrays["energy"], arrays["forces"], arrays["offsets"],
                      arrays["stress"] if with_stress else None)


def choose(cfg, databases: Dict[str, AseDbDataset], model: ModelOutputs, model_key: ModelKey, with_stress: bool,
           ranks: Ranks) -> Tuple[Optional[Source], Optional[Source]]:
    """The replay rows trained on and validated (``replay_train``, ``replay_val``; None when there are none), their
    labels set (``labels: model``: the starting model's, by the heads that predict them in training: shared heads
    after any fit of the reference energies, so that they share the fitted energy zero; separate replay heads
    as copied before the fit). The replay loss is zero at the first step either way."""
    replay = cfg.replay
    if not replay.enabled:
        return None, None
    data = databases["replay"]
    candidates, val = split(data, databases.get("replay_val"), replay.fraction, replay.val_samples, cfg.random_seed)
    chosen = select(data, candidates, replay.num_samples, replay.selection, cfg.random_seed, model, model_key,
                    ranks) if len(candidates) else candidates
    head = 1 if replay.head == "separate" else 0  # replay structures are predicted by the replay heads
    if replay.labels == "model":
        needed = {}  # database -> positions that need labels
        if len(chosen):
            needed[id(data)] = (data, chosen)
        if val is not None:
            db, positions = val
            previous = needed.get(id(db), (db, np.zeros(0, np.int64)))[1]
            needed[id(db)] = (db, np.union1d(previous, positions))
        for db, positions in needed.values():
            db.set_labels(pseudo_labels(db, positions, model, model_key, with_stress, ranks, head))
    train = Source("replay", data, chosen, replay.loss_weight, head) if len(chosen) else None
    return train, (Source("replay_val", *val, head=head) if val is not None else None)
