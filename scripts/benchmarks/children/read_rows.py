"""One reader's row reads for ``benchmark.py rows`` and ``formats`` (a process of its own; ``rows`` also counts its
file-lock system calls under strace): ``count`` ids of rows 1..``rows`` of ASE database ``path`` in random order
(seed 0), read 8 at a time with ``reader`` -- ``ase.db``, ase.db's own reader, or ``RowReader``, the project's --
each row's positions, numbers, cell, forces, stress and energy touched. Prints microseconds per row."""

import argparse
import os
import sys
import time

# Module level, not a function: the timed loop below looks its names up as the program it replaces did.
if __name__ == "__main__":
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__)
    parser.add_argument("reader", choices=("ase.db", "RowReader"))
    parser.add_argument("path", help="ASE SQLite database (or the index of another format)")
    parser.add_argument("rows", type=int, help="rows in the database (ids 1..rows)")
    parser.add_argument("count", type=int, help="rows to read")
    args = parser.parse_args()
    PATH, ROWS, COUNT = args.path, args.rows, args.count
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))
    if args.reader == "ase.db":  # read(ids) -> rows
        import ase.db
        db = ase.db.connect(PATH, type='db', serial=True)
        db.__enter__()
        read = lambda ids: [db._get_row(int(i)) for i in ids]  # noqa: E731
    else:
        from orb.data.sqlite_rows import RowReader
        read = RowReader(PATH).read_many
    import numpy as np
    ids = np.random.default_rng(0).permutation(np.arange(1, ROWS + 1))[:COUNT]
    start = time.perf_counter()
    for step in range(0, len(ids), 8):
        for row in read(ids[step:step + 8]):
            row.positions, row.numbers, row.cell, row.get("forces"), row.get("stress"), row.get("energy")
    print((time.perf_counter() - start) / len(ids) * 1e6)
