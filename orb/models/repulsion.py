"""orb-v3's ZBL pair repulsion (orb-models 0.5.5 ``pair_repulsion.py``) and the cell arithmetic its stress and the
conservative models' stress share: determinants, per-volume virials, Voigt components."""

import numpy as np
from ase.data import covalent_radii
from mindspore import Tensor, nn, ops

# ZBL screened nuclear repulsion (orb-models' ZBLBasis, p = 6).
ZBL_C = (0.1818, 0.5099, 0.2802, 0.02817)
ZBL_D = (3.2, 0.9423, 0.4028, 0.2016)
COULOMB = 14.3996  # eV Å / e^2


class PairRepulsion(nn.Cell):
    """ZBL energy of every edge, 0.5 * 14.3996 Zu Zv / r * phi(r / a) * envelope(r / (R_u + R_v)).

    As orb-models 0.5.5, the element of an atom is taken to be Z + 1 (the argmax of a one-hot
    that starts at hydrogen, plus one), in the screening length and the covalent radii alike.
    """

    def __init__(self):
        super().__init__()
        self.radii = Tensor(covalent_radii.astype(np.float32))

    def construct(self, numbers, vectors, senders, receivers):
        z_u = ops.gather(numbers, senders, 0).astype(vectors.dtype) + 1.0
        z_v = ops.gather(numbers, receivers, 0).astype(vectors.dtype) + 1.0
        a = 0.4543 * 0.529 / (ops.pow(z_u, 0.3) + ops.pow(z_v, 0.3))
        r = ops.norm(vectors, dim=1)
        phi = 0.0 + ZBL_C[0] * ops.exp(-ZBL_D[0] * r / a)  # the four terms written out (a loop costs compile time)
        phi = phi + ZBL_C[1] * ops.exp(-ZBL_D[1] * r / a)
        phi = phi + ZBL_C[2] * ops.exp(-ZBL_D[2] * r / a)
        phi = phi + ZBL_C[3] * ops.exp(-ZBL_D[3] * r / a)
        r_max = (ops.gather(self.radii, z_u.astype(senders.dtype), 0)
                 + ops.gather(self.radii, z_v.astype(senders.dtype), 0))
        x = r / r_max
        x6 = ops.pow(x, 6)
        envelope = (1.0 - 28.0 * x6 + 48.0 * x6 * x - 21.0 * x6 * x * x) * (x < 1.0).astype(r.dtype)
        return 0.5 * COULOMB * z_u * z_v / r * phi * envelope


def determinant(cell: Tensor) -> Tensor:
    """Determinants of (B, 3, 3) matrices."""
    a0, a1, a2, b0, b1, b2, c0, c1, c2 = ops.unstack(cell.reshape(-1, 9), 1)
    return (ops.stack((a0, a1, a2), 1) * ops.stack((b1 * c2 - b2 * c1, b2 * c0 - b0 * c2, b0 * c1 - b1 * c0), 1)).sum(1)


def voigt(m: Tensor) -> Tensor:
    """(B, 3, 3) -> (B, 6) [xx, yy, zz, yz, xz, xy] with symmetrised off-diagonals."""
    xx, xy, xz, yx, yy, yz, zx, zy, zz = ops.unstack(m.reshape(-1, 9), 1)
    return ops.stack((xx, yy, zz, (yz + zy) / 2.0, (xz + zx) / 2.0, (xy + yx) / 2.0), 1)


def per_volume(virial: Tensor, cell: Tensor, signed: bool) -> Tensor:
    """virial / det(cell) (|det| if not ``signed``), 0 where det = 0 or the result is >= 1e10 (finite gradients)."""
    det = determinant(cell)
    det = det if signed else ops.abs(det)
    ok = det != 0
    safe = ops.where(ok, det, ops.ones_like(det)).reshape(-1, 1, 1)
    stress = virial / safe * ok.astype(virial.dtype).reshape(-1, 1, 1)
    return ops.where(ops.abs(stress) < 1e10, stress, ops.zeros_like(stress))
