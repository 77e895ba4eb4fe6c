"""Run by tests/test_orb_v3_parity.py, one model per process (full-size models; memory stays bounded):

    python tests/v3_parity.py MODEL CHECK[,CHECK...] TOLERANCES_JSON

compares the MindSpore orb-v3 model MODEL (recipe weights) with the PyTorch orb-models 0.5.5 reference
and prints one JSON line: {quantity: max over elements of |ours - reference| / (atol + rtol |reference|)}
(a quantity passes at <= 1). Non-finite reference entries (orb-models' stress of molecules in direct
models) are reported separately as ``<quantity>/ours_where_reference_nonfinite`` (our value there).

CHECKs: predict (the 8 structures batched, the 2 ZBL probes), inter (latents and edge features),
loss (eval and train metrics, normaliser updates, gradients; conservative: also the equigrad loss),
or one of loss's modes: loss.eval, loss.train, loss.train_equigrad (each compiles its own graph:
one per process keeps the peak memory at one training graph's).
"""

import json
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
Z = np.load(os.path.join(HERE, "data", "orb_v3_parity.npz"))
ORB_NAMES = {"loss": "loss", "loss_energy": "energy_loss", "loss_forces": "{g}forces_loss",
             "loss_stress": "{g}stress_loss", "loss_confidence": "confidence_loss", "energy_mae": "energy_mae_raw",
             "forces_mae": "{g}forces_mae_raw", "forces_cosine": "{g}forces_cosine_sim",
             "forces_within_0.03": "{g}forces_wt_0.03", "stress_mae": "{g}stress_mae_raw",
             "energy_per_atom_reference_mae": "energy_reference_mae", "confidence_accuracy": "confidence_accuracy",
             "rotational_grad_rms": "rotational_grad_rms", "loss_equigrad": "equigrad_loss"}


def graph(name, k, labels=False):
    from orb.data.graphs import AtomGraphs

    g = f"graph/nn{k}/{name.split('/')[-1]}/"
    return AtomGraphs(
        positions=Z[name + "/positions"], numbers=Z[name + "/numbers"], cell=Z[name + "/cell"][None],
        senders=Z[g + "senders"], receivers=Z[g + "receivers"], vectors=Z[g + "vectors"],
        n_node=np.array([len(Z[name + "/numbers"])]), n_edge=np.array([len(Z[g + "senders"])]),
        unit_shifts=Z[g + "unit_shifts"], charge=Z[name + "/charge"].astype(np.float32),
        spin=Z[name + "/spin"].astype(np.float32),
        energy=Z[name + "/label_energy"] if labels else None, forces=Z[name + "/label_forces"] if labels else None,
        stress=Z[name + "/label_stress"] if labels else None)


class Report:
    def __init__(self, tolerances):
        self.tol, self.out = tolerances, {}

    def compare(self, quantity, ours, ref, kind=None):
        atol, rtol = self.tol[kind or quantity]
        ours, ref = np.asarray(ours, np.float64).reshape(np.shape(ref)), np.asarray(ref, np.float64)
        finite = np.isfinite(ref)
        ratio = np.abs(ours - ref)[finite] / (atol + rtol * np.abs(ref[finite]))
        self.out[quantity] = max(self.out.get(quantity, 0.0), float(ratio.max()) if ratio.size else 0.0)
        if not finite.all():
            self.out[quantity + "/ours_where_reference_nonfinite"] = ours[~finite].tolist()


def build(model_name):
    import mindspore as ms

    from orb.io.checkpoint import load_torch_state_dict
    from orb.models import create
    from orb.models.recipe import model_recipe_weights

    ms.set_context(mode=ms.GRAPH_MODE)
    model = create(model_name)
    load_torch_state_dict(model, model_recipe_weights(model, int(Z["meta/seed"])))
    return model



def stress_in_055(cfg) -> bool:
    """Whether orb-models 0.5.5 predicts (and trains) stress for this model: not for OMol models (0.7.0 and this
    project give the conservative one stress, derived from its energy, which 0.5.5's reference does not hold)."""
    return not cfg.omol

def check_predict(model, short, k, report):
    from orb.data.batching import batch_graphs
    from orb.data.tensors import model_inputs

    model.set_train(False)
    # the reference's batch of 8 and its two ZBL probes in one batch (each structure's outputs are its own): two
    # full-size compilations (predictions, raw outputs) instead of four
    structures = [f"s{i}" for i in range(8)] + ["probe/p0", "probe/p1"]
    inputs = model_inputs(batch_graphs([graph(n, k) for n in structures]))
    energy, forces, stress, confidence = model.predictions(*inputs)
    raw = model(*inputs)
    def ref(q):
        return np.concatenate([Z[f"{short}/batch/{q}"]] + [Z[f"{short}/{n}/{q}"] for n in structures[8:]])

    report.compare("energy", energy.asnumpy(), ref("energy"))
    report.compare("forces", forces.asnumpy(), ref("forces"))
    if stress_in_055(model.cfg):
        report.compare("stress", stress.asnumpy(), ref("stress"))
    report.compare("confidence", confidence.asnumpy(), ref("confidence"))
    report.compare("head_energy", raw[0].asnumpy(), ref("head_energy"))
    report.compare("reference_energy",
                   model.reference_energy(inputs[0], inputs[5], len(structures), inputs[12]).asnumpy(),
                   ref("reference_energy"))
    if model.cfg.conservative:
        report.compare("rotational_grad", raw[6].asnumpy(), ref("rotational_grad"))
        report.compare("pair_energy", raw[5].asnumpy(), ref("pair_energy"))
    else:
        report.compare("head_forces", raw[2].asnumpy(), ref("head_forces"))
        if stress_in_055(model.cfg):
            report.compare("head_stress", raw[3].asnumpy(), ref("head_stress"))
        report.compare("pair_energy", raw[5].asnumpy(), ref("pair_energy"))
        report.compare("pair_forces", raw[6].asnumpy(), ref("pair_forces"))
        if stress_in_055(model.cfg):
            report.compare("pair_stress", raw[7].asnumpy(), ref("pair_stress"))


def check_inter(model, short, k, report):
    from conftest import op_by_op

    with op_by_op():  # one layer at a time (check_predict runs the compiled whole)
        compare_latents(model, short, k, report)


def compare_latents(model, short, k, report):
    from mindspore import Tensor, ops

    from orb.models.gns import polynomial_envelope

    gns = model.model
    for i in range(3):
        name, g = f"s{i}", f"graph/nn{k}/s{i}/"
        vectors = Z[g + ("vectors_recomputed" if model.cfg.conservative else "vectors")]
        numbers = Tensor(Z[name + "/numbers"].astype(np.int32))
        senders, receivers = Tensor(Z[g + "senders"].astype(np.int32)), Tensor(Z[g + "receivers"].astype(np.int32))
        node_graph = Tensor(np.zeros(len(Z[name + "/numbers"]), np.int32))
        features, cutoff = gns.edge_features(Tensor(vectors))
        nodes, edges = gns.encoder(gns.atom_emb(numbers), features)
        report.compare("nodes_encoder", nodes.asnumpy(), Z[f"{short}/{name}/nodes_encoder"])
        cond = None
        if model.cfg.omol:
            cond_graph = gns.conditioner(Tensor(Z[name + "/charge"].astype(np.float32)),
                                         Tensor(Z[name + "/spin"].astype(np.float32)))
            report.compare("conditioner", cond_graph.asnumpy(), Z[f"{short}/{name}/conditioner"])
            cond = ops.gather(cond_graph, node_graph, 0)
        inter = f"{short}/inter/{name}/"
        if inter + "edge_features" in Z.files:
            report.compare("edge_features", features.asnumpy(), Z[inter + "edge_features"])
            report.compare("cutoff", cutoff.asnumpy().reshape(-1), Z[inter + "cutoff"])
            report.compare("edges_encoder", edges.asnumpy(), Z[inter + "edges_encoder"])
            envelope = polynomial_envelope(ops.norm(Tensor(vectors), dim=1), 6.0, 4).asnumpy()
            report.compare("cutoff", envelope, Z[inter + "cutoff"])
        for layer_index, layer in enumerate(gns.gnn_stacks):
            nodes, edges = layer(nodes, edges, senders, receivers, cutoff, cond)
            if layer_index in (0, 4):
                report.compare("nodes_gnn", nodes.asnumpy(), Z[f"{short}/{name}/nodes_gnn{layer_index}"],
                               kind=f"nodes_gnn{layer_index}")
                if inter + f"edges_gnn{layer_index}" in Z.files:
                    report.compare("edges_gnn", edges.asnumpy(), Z[inter + f"edges_gnn{layer_index}"],
                                   kind=f"nodes_gnn{layer_index}")


def check_loss(model, short, k, report, modes=None):
    import mindspore as ms
    from mindspore import nn

    from orb.data.batching import batch_graphs
    from orb.data.tensors import loss_inputs
    from orb.training.loss_v3 import OrbV3Loss

    structures = [f"s{i}" for i in Z[f"{short}/loss/structures"]]
    inputs = loss_inputs(batch_graphs([graph(n, k, labels=True) for n in structures]))
    names = {n: p for n, p in model.parameters_and_names()}
    modes = modes or ["eval", "train"] + (["train_equigrad"] if model.cfg.conservative else [])
    prefix = "grad-" if model.cfg.conservative else ""
    for mode in modes:
        from orb.io.checkpoint import load_torch_state_dict
        from orb.models.recipe import model_recipe_weights

        load_torch_state_dict(model, model_recipe_weights(model, int(Z["meta/seed"])))  # every call starts afresh
        cell = OrbV3Loss(model, has_stress=stress_in_055(model.cfg), equigrad_weight=1.0 if "equigrad" in mode else 0.0)
        params = [p for p in model.trainable_params() if p is not model.reference_energy_weight()]

        class Run(nn.Cell):
            def __init__(self):
                super().__init__()
                self.cell = cell
                self.grad = ms.value_and_grad(cell, None, params, has_aux=True)

            def construct(self, *inputs):
                old = self.cell.current_stats()
                if mode == "eval":
                    loss, sums = self.cell(*inputs, *old, *old)
                    return loss, sums, ()
                new, counts = self.cell.new_stats(*inputs)
                (loss, sums), grads = self.grad(*inputs, *old, *new)
                return loss, sums, grads, self.cell.commit(new, counts)

        out = Run()(*inputs)
        metrics = cell.metrics(out[1].asnumpy())
        for key, value in metrics.items():
            ref_key = f"{short}/loss/{mode}/metric/{ORB_NAMES.get(key, key).format(g=prefix)}"
            if ref_key in Z.files:
                report.compare(f"loss_{key}", value, Z[ref_key], kind="energy_mae" if key == "energy_mae" else "loss")
        if mode == "eval":
            continue
        for path in {f.split("/normalizer/")[1].rsplit("/", 1)[0] for f in Z.files
                     if f.startswith(f"{short}/loss/{mode}/normalizer/")}:
            for stat in ("running_mean", "running_var"):
                report.compare("normalizer", names[f"{path}.bn.{stat}"].asnumpy(),
                               Z[f"{short}/loss/{mode}/normalizer/{path}/{stat}_after"])
        group = "grad" if mode == "train" else "grad_equigrad"
        grads = {name: g for p, g in zip(params, out[2]) for name, q in names.items() if q is p
                 for g in [g.asnumpy().astype(np.float64)]}
        total = 0.0
        for name, g in grads.items():
            total += float((g ** 2).sum())
            key = f"{short}/{group}/norm/{name}"
            if key in Z.files and not name.startswith("heads.forces.mlp.NN-1.bias"):  # ~0 in exact arithmetic
                report.compare("grad_norm", np.linalg.norm(g), Z[key])
            key = f"{short}/{group}/value/{name}"
            if key in Z.files and not name.startswith("heads.forces.mlp.NN-1.bias"):
                scale = float(np.abs(Z[key]).max())
                report.compare("grad_value", g / max(scale, 1e-30), Z[key] / max(scale, 1e-30))
        report.compare("grad_norm", np.sqrt(total), Z[f"{short}/{group}/norm_total"])


def main():
    model_name, checks, tolerances = sys.argv[1], sys.argv[2].split(","), json.loads(sys.argv[3])
    short = model_name[len("orb_v3_"):]
    model = build(model_name)
    k = model.cfg.max_neighbors
    report = Report({key: tuple(value) for key, value in tolerances.items()})
    for check in checks:
        name, _, mode = check.partition(".")
        if mode:
            check_loss(model, short, k, report, [mode])
        else:
            {"predict": check_predict, "inter": check_inter, "loss": check_loss}[name](model, short, k, report)
    print("RESULT " + json.dumps(report.out))
    with open("/proc/self/status") as status:  # the process's peak memory, for the suite's budget
        print(next((line.strip() for line in status if line.startswith("VmHWM")), "VmHWM unknown"))


if __name__ == "__main__":
    main()
