"""A fine-tuned model as MindIR, for MindSpore's own inference stack (MindSpore Lite, serving on Ascend).

    orb-export --checkpoint best_weights.ckpt --output model.mindir [--data structures.db | --shape N,E,G ...]

A MindIR graph has fixed input shapes, as the compiled steps here do: one file per padded batch shape
(nodes, edges, graphs), named ``model_<nodes>x<edges>x<graphs>.mindir`` when there are several, planned on
``--data`` (the few bucket shapes that hold its structures packed by size, as orb-evaluate plans them) or given
with ``--shape``. Each is the model's whole prediction (graph in, energy, forces, stress and, for orb-v3,
confidence out, in physical units; conservative models differentiate inside it). ``model.json`` beside them says
how to fill the inputs (names, types, shapes, the padding convention of :func:`orb.data.batching.pad_batch`) and
what the outputs are; :func:`load_exported` loads a file back with MindSpore's own loader.
"""

import argparse
import os
from typing import Dict, List, Optional, Sequence

import numpy as np

from orb.errors import OrbInputError
from orb.signals import out_of_space

OUTPUTS = ("energy (graphs,) eV", "forces (nodes, 3) eV/Å", "stress (graphs, 6) eV/Å³ Voigt, ASE sign",
           "confidence (nodes, 50): orb-v3's per-atom force-error bin probabilities over 0-0.3 eV/Å")


NODE_INPUTS = ("numbers", "positions", "node_graph")  # the other inputs: per edge or per graph
EDGE_INPUTS = ("vectors", "senders", "receivers", "unit_shifts")


def example_inputs(model, nodes: int, edges: int, graphs: int):
    """Inputs of a padded batch of this shape (one padding graph holding every node and edge), in the model's float
    type: what the export traces, shapes and types only."""
    from orb.data.batching import empty_batch, pad_batch
    from orb.data.tensors import model_arrays, to_tensors
    from orb.models import is_float64_model

    batch = empty_batch(with_energy=False, with_forces=False, with_stress=False, with_charge=model.cfg.omol)
    arrays = model_arrays(pad_batch(batch, nodes, edges, graphs))
    if is_float64_model(model):
        arrays = tuple(a.astype(np.float64) if a.dtype == np.float32 else a for a in arrays)
    return to_tensors(arrays)


def dimension(name: str, axis: int, size: int) -> object:
    """How ``model.json`` names an input's dimension: the first is per node, edge or graph."""
    if axis:
        return size
    return "nodes" if name in NODE_INPUTS else "edges" if name in EDGE_INPUTS else "graphs"


def shapes_for(data_path, model, batch_size: int) -> List[tuple]:
    """The bucket shapes orb-evaluate would plan for ``data_path`` (structures packed by size), each with the
    limit's graph slots (4 x ``batch_size`` structures + 1 padding graph: the most a served batch of small structures
    may need, more than ``data_path``'s own steps may hold)."""
    from orb.data.dataset import AseDbDataset
    from orb.data.formats import LabelKeys, readable_database
    from orb.inference.evaluate import packed_batches

    data = AseDbDataset(readable_database(data_path, LabelKeys(labels=False)), require_labels=False, labels=False,
                        settings=model.cfg.graph_settings(), charge_spin=model.cfg.omol)
    data.census()  # every row checked as orb-evaluate checks it (an atom of Z=0, a NaN position: one line naming it)
    _, buckets = packed_batches(data, batch_size, fill_graphs=False)
    return [(b.num_nodes, b.num_edges, b.num_graphs) for b in buckets]


def outputs_of(output: str) -> list:
    """What an export to ``output`` may write or remove (:func:`orb.files.refuse_overwriting_inputs`): the file,
    its description ``<stem>.json`` and the files of other shapes ``<stem>_<nodes>x<edges>x<graphs>.mindir``."""
    stem = os.path.basename(output[:-len(".mindir")] if output.endswith(".mindir") else output)
    return [("--output", output, None),
            ("--output", os.path.dirname(os.path.abspath(output)),
             lambda name: name == stem + ".json" or (name.startswith(stem + "_") and name.endswith(".mindir")))]


def export(model, output: str, shapes: Sequence[tuple]) -> List[str]:
    """One MindIR file per shape (``output`` itself when there is one) and ``model.json``; the files written.

    All or nothing: every file is written aside first and renamed into place only when all are written, then the
    files an earlier export of the same name listed and this one did not are removed (``model.json`` describes
    exactly the files beside it). A stop signal is honoured between two files (a graph being exported is never
    interrupted: MindSpore dumped its analyzer's trace then), removing this run's files; an earlier export stays."""
    import mindspore as ms

    from orb.data.tensors import MODEL_INPUTS
    from orb.device import ops_profile
    from orb.files import fsync_directory, remove_stale_temporaries, temporary_prefix, write_atomically, write_json
    from orb.models.cells import PredictCell
    from orb.precision import precision
    from orb.signals import STOP, STOPPED_STATUS, Stopped

    cell = PredictCell(model)
    cell.set_train(False)
    stem = output[:-len(".mindir")] if output.endswith(".mindir") else output
    folder = os.path.dirname(os.path.abspath(output))
    json_path = os.path.join(folder, os.path.basename(stem) + ".json")
    staged, files = [], {}
    remove_stale_temporaries(folder, min_age=600.0)  # those of an export that was killed (SIGKILL: no clean-up)

    def stop_if_asked() -> None:
        if STOP.received is not None:
            raise Stopped(f"stopped by {STOP.received} while exporting: none of this export's files are kept (an "
                          f"earlier export of {output} is): run the same command again (exit status {STOPPED_STATUS})")

    try:
        with STOP.deferred():
            for nodes, edges, graphs in shapes:
                stop_if_asked()
                path = output if len(shapes) == 1 else f"{stem}_{nodes}x{edges}x{graphs}.mindir"
                inputs = example_inputs(model, nodes, edges, graphs)

                def write(tmp: str) -> None:  # ms.export appends .mindir to the name it is given
                    ms.export(cell, *inputs, file_name=tmp[:-len(".mindir")], file_format="MINDIR")
                    os.chmod(tmp, 0o644)  # MindSpore writes it read-only

                aside = temporary_prefix(path) + ".exporting"  # a temporary's name: removed once stale
                staged.append((aside, path))
                write_atomically(aside, write, suffix=".mindir")
                files[os.path.basename(path)] = {"nodes": nodes, "edges": edges, "graphs": graphs}
            inputs = example_inputs(model, *shapes[0])
            aside = temporary_prefix(json_path) + ".exporting"  # the description too, before any file is replaced:
            staged.append((aside, json_path))  # a full disk now leaves the earlier export whole (it left new graphs
            write_json(aside, {                # beside the earlier description)
                "model": model.cfg.to_dict(), "precision": precision(), "ops_profile": ops_profile(),
                "sum_form": model.sum_form, "files": files,
                "inputs": [{"name": n, "dtype": str(t.dtype), "shape": [dimension(n, axis, size)
                                                                        for axis, size in enumerate(t.shape)]}
                           for n, t in zip(MODEL_INPUTS, inputs)],
                "padding": "orb.data.batching.pad_batch: the real graphs first, then one padding graph holding every "
                           "padding node (atomic number 0) and edge (a self-edge of length 10 Å), then empty graphs; "
                           "outputs of padding rows are to be ignored",
                "outputs": described_outputs(model.cfg)})
            stop_if_asked()
            earlier = listed_files(json_path)
            for aside, path in staged:  # renames only, from here
                os.replace(aside, path)
            staged.clear()
            for name in earlier - set(files):  # the earlier export's other shapes: no longer described
                if os.path.exists(os.path.join(folder, name)):
                    os.remove(os.path.join(folder, name))
            fsync_directory(folder)
    except BaseException:
        for aside, _ in staged:
            if os.path.exists(aside):
                os.remove(aside)
        raise
    return [os.path.join(folder, name) for name in files] + [json_path]


def listed_files(json_path: str) -> set:
    """The MindIR files an earlier export's description lists (none when there is none, or it cannot be read)."""
    import json

    try:
        with open(json_path) as f:
            return {name for name in json.load(f).get("files", {}) if "/" not in name and name.endswith(".mindir")}
    except (OSError, ValueError, AttributeError):
        return set()


def load_exported(path: str):
    """An exported file as a callable cell (MindSpore's ``load`` and ``nn.GraphCell``)."""
    import mindspore as ms
    from mindspore import nn

    return nn.GraphCell(ms.load(path))


def main(argv: Optional[List[str]] = None) -> int:
    from orb.signals import run_command

    return run_command(lambda: parse_and_export(argv))  # a stop: 75, the file being written removed


def parse_and_export(argv: Optional[List[str]]) -> int:
    from orb.device import quiet_mindspore

    quiet_mindspore()  # before anything imports MindSpore
    written = run(build_parser().parse_args(argv))
    print(f"wrote {', '.join(written)}")
    return 0


def build_parser(prog: Optional[str] = None) -> argparse.ArgumentParser:
    """orb-export's options."""
    from orb.bundled import command_path
    from orb.commands import HelpFormatter, Parser
    from orb.device import OPS_PROFILES, add_device_argument
    from orb.precision import PRECISIONS

    parser = Parser(prog=prog, allow_abbrev=False, description=__doc__.split("\n\n")[0],
                                     formatter_class=HelpFormatter)
    parser.add_argument("--checkpoint", required=True, type=command_path, help="PyTorch or MindSpore orb checkpoint")
    parser.add_argument("--output", required=True, help="the MindIR file (.mindir; several shapes: one per shape, "
                        "the shape in the name)")
    parser.add_argument("--data", nargs="+", default=None, help="plan the shapes on these structures (any format "
                        "orb-evaluate reads)", type=command_path)
    parser.add_argument("--shape", action="append", default=[], help="NODES,EDGES,GRAPHS of a padded batch "
                        "(repeatable): a batch holds fewer nodes and graphs than these, and at most EDGES edges")
    parser.add_argument("--batch_size", type=int, default=8, help="with --data: structures of an average batch")
    parser.add_argument("--model", default=None, help="model name, when the checkpoint cannot tell "
                        "(default: the checkpoint's)")
    add_device_argument(parser)
    parser.add_argument("--precision", default="float32-high", choices=PRECISIONS,
                        help="what the exported graph computes in (orb.precision)")
    parser.add_argument("--ops_profile", default="portable", choices=OPS_PROFILES,
                        help="operators the graph holds: portable (MindSpore's own, Ascend's split sums: the file "
                        "is served on any device), cpu (this machine's kernel library, by its path, CPU forms and "
                        "float64 sums: only on a CPU that has that file), auto (cpu on the CPU); ORB_OPS_PROFILE "
                        "overrides")
    return parser


def parse_shape(text: str) -> tuple:
    try:
        nodes, edges, graphs = (int(x) for x in text.split(","))
    except ValueError:
        raise OrbInputError(f"--shape {text!r}: expected NODES,EDGES,GRAPHS (three integers)") from None
    if nodes < 2 or edges < 1 or graphs < 2:
        raise OrbInputError(f"--shape {text}: a padded batch needs at least 2 nodes, 1 edge and 2 graphs (one "
                            "real, one for the padding)")
    if nodes > MAX_NODES or edges > MAX_NODES * 128 or graphs > nodes:  # (1e11 nodes: a 1.1 TiB allocation)
        raise OrbInputError(f"--shape {text}: at most {MAX_NODES} nodes, 128 edges a node and a graph a node")
    return nodes, edges, graphs


MAX_NODES = 10 ** 7  # atoms of one exported batch shape (a served batch: 10,000 structures of 1,000 atoms)


def run(args) -> List[str]:
    from orb.files import refuse_overwriting_inputs

    shapes = [parse_shape(s) for s in args.shape]  # (the options checked before MindSpore's 1 s import)
    if not shapes and not args.data:
        raise OrbInputError("give the batch shapes to export: --data STRUCTURES (planned on them) or --shape "
                            "NODES,EDGES,GRAPHS")
    if not 1 <= args.batch_size <= 10 ** 5:
        raise OrbInputError(f"--batch_size must be within 1 and 100000, got {args.batch_size}")
    if not args.output.endswith(".mindir"):
        raise OrbInputError(f"--output {args.output}: a MindIR file name ends with .mindir")
    refuse_overwriting_inputs(outputs_of(args.output), [("--checkpoint", args.checkpoint), ("--data", args.data)])
    from orb.inference.runs import make_output_folder

    # (as orb-md's --output: it was refused, "does not exist"); said before MindSpore's import
    make_output_folder(os.path.dirname(os.path.abspath(args.output)), f"--output {args.output}")
    from orb.device import import_mindspore

    import_mindspore()  # then what the other imports need, with a stop signal honoured after it
    from orb.device import configure_mindspore, configured_profile, ops_profile, set_ops_profile
    from orb.io.checkpoint import model_from_checkpoint
    from orb.precision import set_sum_form, sum_form

    configure_mindspore(args.device_target, precision=args.precision)
    profile_before, sums_before = configured_profile(), sum_form()
    try:  # (the settings put back after: a script calling this builds its later models as before)
        set_ops_profile(args.ops_profile)  # portable by default: a MindIR made on a CPU login node is served on Ascend
        if ops_profile() == "portable" and args.precision != "float64":
            set_sum_form("split")  # the long sums as Ascend computes them (no float64 there), on every device
        model = model_from_checkpoint(args.checkpoint, args.model)
        if args.data:
            shapes += shapes_for(args.data[0] if len(args.data) == 1 else args.data, model, args.batch_size)
        return export(model, args.output, sorted(set(shapes)))
    except OSError as exc:  # (a full disk: the file system's line, status 1)
        if out_of_space(exc):
            raise
        raise OrbInputError(f"--output {args.output}: cannot write it ({exc.strerror or exc})") from None
    finally:
        set_ops_profile(profile_before)
        set_sum_form(sums_before)


def described_outputs(cfg) -> list:
    """What each output of the exported graph is (a model without a stress head outputs zeros in its place: said,
    so that no deployment reads them as a prediction)."""
    outputs = list(OUTPUTS[:4 if cfg.family == "orb_v3" else 3])
    if not cfg.has_stress:
        outputs[2] = f"stress (graphs, 6): zeros, not a prediction ({cfg.name} has no stress head)"
    return outputs


def predictions_of(cell, inputs) -> Dict[str, np.ndarray]:
    """A loaded export's outputs as numpy arrays by name."""
    out = cell(*inputs)
    names = ("energy", "forces", "stress", "confidence")
    return {name: value.asnumpy() for name, value in zip(names, out)}
