"""Each structure's share of the loss: its ``weight`` (a key-value pair, or an entry of ``row.data``), checked: a
number, finite and >= 0 (1 where absent). Read for an :class:`orb.data.dataset.AseDbDataset` (``dataset``)."""

import numpy as np


def stored_weights(dataset) -> np.ndarray:
    """Each row's ``weight`` key-value pair (1 where absent), checked: a number, finite and >= 0."""
    weights = np.ones(len(dataset.ids))
    position = {int(i): k for k, i in enumerate(dataset.ids)}
    text = dataset._read("SELECT id, value FROM text_key_values WHERE key = 'weight' LIMIT 1", [])
    if text:
        raise dataset.error_at(f"weight must be a number, got {text[0][1]!r}", text[0][0], "weight")
    for row, value in dataset._read_table("weights"):
        if value is None or not np.isfinite(value) or value < 0:
            raise dataset.error_at(f"weight must be a finite number >= 0, got {value!r}", row, "weight")
        weights[position[int(row)]] = float(value)
    return weights


def read_weights_in_data(dataset, positions: np.ndarray) -> None:
    """The weights of the rows at ``positions`` that keep theirs in ``row.data`` (as an ASE-LMDB, or a database
    indexed in a list, keeps it: read alike whatever the path given; it was ignored in a database alone), found
    by the census (which reads every row once), read into ``dataset.weights``, checked."""
    for position, row in zip(positions, dataset.rows.read_many(dataset.ids[positions])):
        value = row.data["weight"]
        try:  # as the index of a list reads it: anything that is one number ("2.0", [2.0], np.array(2.0))
            array = np.asarray(value, dtype=np.float64)
        except (TypeError, ValueError):
            array = np.zeros(0)
        if array.size != 1:
            raise dataset.error_at(f"weight must be a number, got {str(value)[:40]!r}", row.id, "weight")
        weight = float(array.reshape(-1)[0])
        if not np.isfinite(weight) or weight < 0:
            raise dataset.error_at(f"weight must be a finite number >= 0, got {weight!r}", row.id, "weight")
        dataset.weights[position] = weight
