"""The trade-off between what fine-tuning gains on the user's target and what it costs the foundation, over a grid
of fine-tuning settings (``scripts/compare_strategies.py``): each setting summarised by two numbers, the settings
no other beats on both, and the one to use.

A setting is judged by its worst case over the weights a run leaves (``best_weights.ckpt`` and the last epoch's):
its foundation drift is the largest change of the foundation's energy-per-atom or force MAE against the starting
model (in %; lower is better, a fall counts as no drift), its target gain the smallest improvement of the target's
force MAE (in %), and ``kept`` that gain as a share of plain fine-tuning's. Pure Python: no model is loaded here.
"""

from dataclasses import asdict, dataclass
from typing import Dict, List, Optional, Sequence, Tuple

KEYS = ("energy_per_atom_mae", "forces_mae")
GAIN_KEY = "forces_mae"  # the target gain the goal is stated in (issue 53: "of plain fine-tuning's force gain")
KINDS = ("best", "final")
PLAIN = "none"


def change(now: float, start: float) -> float:
    """``now`` against ``start`` in % (positive: larger)."""
    return 100.0 * (now - start) / start


@dataclass
class Setting:
    """One setting of the grid, summarised (see the module's docstring)."""

    name: str
    drift: float  # worst foundation change over KEYS and KINDS, %
    gain: float  # smallest target improvement of GAIN_KEY over KINDS, %
    kept: Optional[float]  # gain as % of plain fine-tuning's (None without a plain run that gained)
    energy_gain: float  # smallest target energy-per-atom improvement over KINDS, %
    changes: Dict[str, Dict[str, Dict[str, float]]]  # kind -> "target"/"foundation" -> key -> change %


def summarise(results: Dict[str, Dict], start_key: str = "starting model") -> List[Setting]:
    """Settings from ``results`` (``"<name>, best"`` / ``"<name>, final"`` -> {"target": {key: MAE}, "foundation":
    {key: MAE}}, and ``start_key``: the starting model's), in the order first seen; a setting lacking one of its
    runs' weights is left out (a study still running)."""
    start = results[start_key]
    names = list(dict.fromkeys(k.rsplit(", ", 1)[0] for k in results if k != start_key))
    changes = {}
    for name in names:
        if not all(f"{name}, {kind}" in results for kind in KINDS):
            continue
        changes[name] = {kind: {part: {k: change(results[f"{name}, {kind}"][part][k], start[part][k]) for k in KEYS}
                                for part in ("target", "foundation")} for kind in KINDS}
    plain_gain = -max(changes[PLAIN][kind]["target"][GAIN_KEY] for kind in KINDS) if PLAIN in changes else None
    settings = []
    for name, c in changes.items():
        gain = -max(c[kind]["target"][GAIN_KEY] for kind in KINDS)
        settings.append(Setting(
            name=name, drift=max(c[kind]["foundation"][k] for kind in KINDS for k in KEYS), gain=gain,
            kept=100.0 * gain / plain_gain if plain_gain and plain_gain > 0 else None,
            energy_gain=-max(c[kind]["target"]["energy_per_atom_mae"] for kind in KINDS), changes=c))
    return settings


def frontier(settings: Sequence[Setting]) -> List[Setting]:
    """The settings no other beats on both counts (no more drift and no less gain, one of them strictly), by
    drift."""
    def beaten(s: Setting) -> bool:
        return any(o.drift <= s.drift and o.gain >= s.gain and (o.drift < s.drift or o.gain > s.gain)
                   for o in settings)

    return sorted((s for s in settings if not beaten(s)), key=lambda s: (s.drift, -s.gain))


def recommend(settings: Sequence[Setting], tolerance: float = 5.0, min_kept: float = 80.0
              ) -> Tuple[Optional[Setting], str]:
    """(the setting to use, why). The largest target gain among those whose foundation drift is within
    ``tolerance`` %; when none is, the best compromise: the least drift among those keeping ``min_kept`` % of
    plain fine-tuning's gain, else the least drift of all -- said as such."""
    if not settings:
        return None, "no setting has finished yet"
    within = [s for s in settings if s.drift <= tolerance]
    if within:
        best = max(within, key=lambda s: (s.gain, -s.drift))
        kept = f", {best.kept:.0f} % of plain fine-tuning's" if best.kept is not None else ""
        return best, (f"the largest target force gain ({best.gain:+.1f} %{kept}) of the settings that keep the "
                      f"foundation within {tolerance:g} % (worst change {best.drift:+.1f} %)")
    keeping = [s for s in settings if s.kept is not None and s.kept >= min_kept]
    pool, what = (keeping, f"of those keeping at least {min_kept:g} % of plain fine-tuning's gain") if keeping \
        else (list(settings), "of all (none keeps {:g} % of plain fine-tuning's gain)".format(min_kept))
    best = min(pool, key=lambda s: (s.drift, -s.gain))
    return best, (f"a compromise: no setting keeps the foundation within {tolerance:g} %; the least drift "
                  f"({best.drift:+.1f} %) {what}, target force gain {best.gain:+.1f} %")


def config_block(overrides: Dict[str, object]) -> str:
    """Dotted config overrides (``{"replay.fraction": 0.25}``) as the YAML block to paste into a config."""
    import yaml

    nested: Dict[str, object] = {}
    for key, value in overrides.items():
        node = nested
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    if not nested:
        return "# plain fine-tuning: no protection keys (your config as it is)\n"
    return yaml.safe_dump(nested, sort_keys=False, default_flow_style=False)


def as_json(settings: Sequence[Setting], chosen: Optional[Setting], reason: str, tolerance: float,
            min_kept: float, block: str) -> Dict:
    """frontier.json's content."""
    return {"tolerance_percent": tolerance, "min_kept_percent": min_kept, "gain_key": GAIN_KEY,
            "settings": [asdict(s) for s in settings], "frontier": [s.name for s in frontier(settings)],
            "recommended": chosen.name if chosen else None, "reason": reason, "config": block}


def table(settings: Sequence[Setting], chosen: Optional[Setting], tolerance: float, min_kept: float) -> List[str]:
    """The frontier table's markdown lines: one row per setting (worst over best and final weights), whether it meets
    both goals (foundation within ``tolerance``, ``min_kept`` of plain's gain) and whether it is on the frontier."""
    on = {s.name for s in frontier(settings)}
    lines = ["| setting | foundation E/atom | foundation F | target F gain | kept of plain's F gain | target E/atom gain "
             "| both goals | frontier |", "|---|---|---|---|---|---|---|---|"]
    for s in sorted(settings, key=lambda s: s.drift):
        name = f"**{s.name}** (recommended)" if chosen is s else s.name
        worst = [max(s.changes[kind]["foundation"][k] for kind in KINDS) for k in KEYS]
        kept = f"{s.kept:.0f} %" if s.kept is not None else ""
        both = s.drift <= tolerance and s.kept is not None and s.kept >= min_kept
        lines.append(f"| {name} | {worst[0]:+.1f} % | {worst[1]:+.1f} % | {s.gain:+.1f} % | {kept} | "
                     f"{s.energy_gain:+.1f} % | {'yes' if both else ''} | {'yes' if s.name in on else ''} |")
    return lines
