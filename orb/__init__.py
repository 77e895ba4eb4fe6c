"""orb-mindspore: fine-tune and use Orbital Materials' ORB interatomic potentials with MindSpore.

Importing any part of it keeps MindSpore's own log to errors (:func:`orb.device.quiet_mindspore`) unless ``GLOG_v`` is
set: a script using the calculator printed MindSpore's notes on backends that are not installed and on its compile
cache, as the commands do not."""

__version__ = "0.2.0"  # (pyproject.toml reads it from here: one place)

from orb.device import quiet_mindspore  # noqa: E402

quiet_mindspore()
