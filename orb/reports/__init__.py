"""What the project draws and tabulates for people: training curves from metrics.jsonl (``curves``, ``orb-plot``)
and an evaluation's parity plots and errors by element (``evaluation``, ``orb-evaluate``)."""
