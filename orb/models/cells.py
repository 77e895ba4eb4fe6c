"""The model's compiled passes for use (not training): predictions in physical units, and descriptors.

Both are compiled whatever the caller's execution mode: :class:`orb.inference.predictor.Predictor` runs them in
graph mode (:func:`orb.device.graph_mode`, through the compile cache), and ``jit`` compiles them for any other caller
left in PyNative mode (op by op, a calculator ran 4x slower at 64 atoms). They live with the models because training
(replay labels, the reference fit) runs them as much as inference does.
"""

import mindspore as ms
from mindspore import nn

from orb.graph_cache import CompiledThroughCache


class PredictCell(CompiledThroughCache, nn.Cell):
    """Forward pass returning (energy eV, forces eV/Å, stress eV/Å^3[, confidence]) of the model's family."""

    def __init__(self, model):
        super().__init__(auto_prefix=False)
        self.model = model

    @ms.jit
    def construct(self, *inputs):
        return self.model.predictions(*inputs)


class DescriptorCell(CompiledThroughCache, nn.Cell):
    """Forward pass returning each structure's descriptor (mean node latent, (B, latent_dim))."""

    def __init__(self, model):
        super().__init__(auto_prefix=False)
        self.model = model

    @ms.jit
    def construct(self, *inputs):
        return self.model.descriptors(*inputs)
