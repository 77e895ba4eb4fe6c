"""What the project draws and tabulates for people: training curves from metrics.jsonl (``curves``, ``orb-plot``)
and an evaluation's parity plots and errors by element (``evaluation``, ``orb-evaluate``)."""


def figure(**kwargs):
    """A matplotlib figure of its own (``matplotlib.figure.Figure``: ``savefig`` draws it on the Agg canvas), not
    pyplot's: pyplot's figure list and backend belong to the script or notebook that imports orb
    (``matplotlib.use("Agg")`` switched a notebook's backend, and every figure ``orb.reports.curves.plot`` returned
    stayed open in pyplot's list)."""
    from matplotlib.figure import Figure

    return Figure(**kwargs)
