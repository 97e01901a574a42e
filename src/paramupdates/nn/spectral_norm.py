"""Spectral normalization whose power-iteration vectors are updated through ``pu.assign``.

``pu.nn.spectral_norm(module, name="weight", n_power_iterations=1, eps=1e-12, dim=None)``
registers the same parametrization as
``torch.nn.utils.parametrizations.spectral_norm`` (same buffers ``_u``,
``_v`` under ``module.parametrizations.<name>[0]``, same initialization, same
``state_dict``), with one difference: in train mode each evaluation of the
weight runs ``n_power_iterations`` steps of the power method

    u <- normalize(W v),   v <- normalize(W^H u)

*out of place* from the current ``(u, v)`` and issues ``assign(_u, u)``,
``assign(_v, v)`` under ``pu.when(self.training)`` (phase ``auxiliary``,
phase order (rule 4)). The weight is ``W / sigma`` with ``sigma = u^H W v``.

Inside a step nothing is written before commit (deferred commit, rule 2): the weight can be
evaluated twice in one forward (each evaluation reads the vectors the
previous one left pending, read-your-writes (rule 1)), and ``pu.checkpoint`` recomputes it with
exactly the vectors the first evaluation saw (replay, rule 3), so backward never
finds a saved ``u`` or ``v`` modified in place (pytorch/pytorch#66363) and
checkpointing changes neither the gradients nor the vectors. Outside a step
the vectors are written at once, as PyTorch does (eager outside a step, rule 8). Values are
bitwise those of PyTorch's parametrization for the same sequence of
evaluations on CPU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils import parametrize
from torch.nn.utils.parametrizations import _SpectralNorm

from ..conditions import when
from ..updates import assign

__all__ = ["SpectralNorm", "spectral_norm"]


class SpectralNorm(_SpectralNorm):
    """The ``_SpectralNorm`` parametrization of PyTorch with update-safe power iteration."""

    def forward(self, weight: Tensor) -> Tensor:
        """``weight / sigma``; in train mode first issues the power-iteration updates of ``_u``, ``_v``."""
        if weight.ndim == 1:
            return F.normalize(weight, dim=0, eps=self.eps)
        weight_mat = self._reshape_weight_to_matrix(weight)
        u, v = self._u, self._v
        if self.training:
            with torch.no_grad():
                w = weight_mat.detach()
                for _ in range(self.n_power_iterations):
                    u = F.normalize(torch.mv(w, v), dim=0, eps=self.eps)
                    v = F.normalize(torch.mv(w.H, u), dim=0, eps=self.eps)
            with when(self.training):
                assign(self._u, u)
                assign(self._v, v)
        else:
            # as PyTorch: copies, so that a later eager update cannot touch what autograd saved
            u = u.clone(memory_format=torch.contiguous_format)
            v = v.clone(memory_format=torch.contiguous_format)
        sigma = torch.vdot(u, torch.mv(weight_mat, v))
        return weight / sigma


def spectral_norm(
    module: nn.Module, name: str = "weight", n_power_iterations: int = 1, eps: float = 1e-12, dim: int | None = None
) -> nn.Module:
    """Apply update-safe spectral normalization to ``module.<name>`` (see the module docstring).

    Arguments as ``torch.nn.utils.parametrizations.spectral_norm``; returns ``module``.
    """
    weight = getattr(module, name, None)
    if not isinstance(weight, Tensor):
        raise ValueError(f"Module '{module}' has no parameter or buffer with name '{name}'")
    if dim is None:
        convs = (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)
        dim = 1 if isinstance(module, convs) else 0
    parametrize.register_parametrization(module, name, SpectralNorm(weight, n_power_iterations, dim, eps))
    return module
