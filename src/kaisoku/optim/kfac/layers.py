"""Per-layer K-FAC state: the statistics hooks, the factors and the preconditioning arithmetic.

Scaling convention (``N`` = the leading batch dimension of the layer's input on this rank, ``R`` = the
rows after flattening every other position, i.e. ``N`` for a plain Linear, ``N * H_out * W_out`` for a
convolution, ``N * T`` for a Linear applied to sequences)::

    A = (1/R) sum_rows a a^T                       a: input row (a patch for Conv2d), with a trailing 1
                                                   when the layer has a bias
    G = (1/N) sum_rows (N g)(N g)^T                g: d loss / d output row

The loss is taken to be a mean over the batch, so ``N g`` is the gradient of one sample's loss and ``G``
is the per-sample covariance, summed over the spatial positions of a convolution (the KFC
approximation ``F = A (x) G``). With data parallelism the sums and counts are added over the ranks, so
the factors are those of the global batch whatever the world size.

BatchNorm's Fisher is over the per-sample gradients ``(d gamma_c, d beta_c)`` of each channel: the
diagonal (``E[dgamma^2], E[dbeta^2]``) or the 2x2 block of each unit (channel).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils.hooks import RemovableHandle

from kaisoku.optim.kfac.patches import patch_sums


class SingularFactorError(RuntimeError):
    """A factor could not be decomposed or inverted (not finite, or not positive definite)."""


# ---------------------------------------------------------------------------------------------------------
# Arithmetic on factors (pure tensor functions).


def symmetric_eigen(factor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Eigenvectors ``Q`` and eigenvalues ``d >= 0`` of a symmetric PSD factor (``factor = Q diag(d) Q^T``).

    Falls back to float64 when the float32 solver does not converge; raises ``SingularFactorError`` when
    the factor or its decomposition is not finite.
    """
    if not bool(torch.isfinite(factor).all()):
        raise SingularFactorError("factor is not finite")
    try:
        values, vectors = torch.linalg.eigh(factor)
    except RuntimeError:
        values, vectors = torch.linalg.eigh(factor.double())
        values, vectors = values.float(), vectors.float()
    if not (bool(torch.isfinite(values).all()) and bool(torch.isfinite(vectors).all())):
        raise SingularFactorError("eigendecomposition is not finite")
    # Round-off can leave tiny negative eigenvalues on a PSD matrix. The solver returns column-major
    # vectors; a row-major copy makes products identical on ranks that receive them by broadcast.
    return vectors.contiguous(), values.clamp(min=0.0)


def damped_inverse(factor: torch.Tensor, damping: float) -> torch.Tensor:
    """``(factor + damping I)^-1`` through a Cholesky factorization; raises ``SingularFactorError``."""
    if not bool(torch.isfinite(factor).all()):
        raise SingularFactorError("factor is not finite")
    damped = factor + damping * torch.eye(factor.shape[0], dtype=factor.dtype, device=factor.device)
    lower, info = torch.linalg.cholesky_ex(damped)
    if int(info) != 0:
        raise SingularFactorError(f"factor + {damping:.3g} I is not positive definite")
    inverse = torch.cholesky_inverse(lower)
    if not bool(torch.isfinite(inverse).all()):
        raise SingularFactorError("inverse is not finite")
    return inverse


def precondition_eigen(
    grad: torch.Tensor,
    q_a: torch.Tensor,
    d_a: torch.Tensor,
    q_g: torch.Tensor,
    d_g: torch.Tensor,
    damping: float,
) -> torch.Tensor:
    """``(G (x) A + damping I)^-1 vec(grad)`` for ``grad`` of shape (out, in), row-major vec.

    With ``A = Q_a diag(d_a) Q_a^T`` and ``G = Q_g diag(d_g) Q_g^T`` this is
    ``Q_g [(Q_g^T grad Q_a) / (d_g d_a^T + damping)] Q_a^T``: exact Tikhonov damping of the Kronecker
    product, not of each factor.
    """
    rotated = q_g.T @ grad @ q_a
    rotated = rotated / (d_g[:, None] * d_a[None, :] + damping)
    return q_g @ rotated @ q_a.T


def precondition_inverse(grad: torch.Tensor, a_inv: torch.Tensor, g_inv: torch.Tensor) -> torch.Tensor:
    """``G_inv grad A_inv``, i.e. ``((G + sqrt(l) I) (x) (A + sqrt(l) I))^-1 vec(grad)`` when the inverses
    were taken with factored damping ``sqrt(l)`` on each factor."""
    return g_inv @ grad @ a_inv


def precondition_bn_diagonal(grad: torch.Tensor, fisher: torch.Tensor, damping: float) -> torch.Tensor:
    """``grad / (fisher + damping)`` elementwise; both (C, 2) with columns (gamma, beta)."""
    return grad / (fisher + damping)


def precondition_bn_unit(grad: torch.Tensor, fisher: torch.Tensor, damping: float) -> torch.Tensor:
    """Solve each channel's damped 2x2 Fisher: ``(F_c + damping I)^-1 [dgamma_c, dbeta_c]``.

    ``fisher`` is (C, 3) with columns ``E[dgamma^2], E[dgamma dbeta], E[dbeta^2]``.
    """
    f_gg = fisher[:, 0] + damping
    f_gb = fisher[:, 1]
    f_bb = fisher[:, 2] + damping
    det = f_gg * f_bb - f_gb * f_gb
    v_gamma = (f_bb * grad[:, 0] - f_gb * grad[:, 1]) / det
    v_beta = (f_gg * grad[:, 1] - f_gb * grad[:, 0]) / det
    return torch.stack([v_gamma, v_beta], dim=1)


# ---------------------------------------------------------------------------------------------------------
# Layers.


class Clock:
    """Cumulative seconds per phase (``factor``, ``decomposition``, ``communication``, ``precondition``)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.sync = False

    def now(self) -> float:
        """``time.perf_counter()``, after waiting for the GPU when ``sync`` is set (while K-FAC times phases)."""
        if self.sync and torch.cuda.is_available():
            torch.cuda.synchronize()
        return time.perf_counter()

    def add(self, phase: str, seconds: float) -> None:
        """Add ``seconds`` to ``phase``."""
        self.seconds[phase] = self.seconds.get(phase, 0.0) + seconds


class KFACLayer:
    """One preconditioned module: hooks that sum factor statistics, running-average factors, and the
    gradient as a matrix.

    ``factors[i]`` is the running average of factor ``i`` (None until first seen); ``stat_sums[i]`` and
    ``stat_counts[i]`` accumulate between two factor updates. ``damping_floor`` is raised when a
    factor of this layer turns out singular or not finite.
    """

    #: Names of the factors, in order.
    factor_names: tuple[str, ...] = ()

    def __init__(self, name: str, module: nn.Module) -> None:
        self.name = name
        self.module = module
        n = len(self.factor_names)
        self.factors: list[torch.Tensor | None] = [None] * n
        self.stat_sums: list[torch.Tensor | None] = [None] * n
        self.stat_counts: list[float] = [0.0] * n
        self.damping_floor = 0.0
        self.stat_fraction = 1.0
        """Share of each batch's samples (the first ones) the Kronecker factor statistics are computed on."""
        self.factor_dtype = torch.float32
        """Dtype of the statistics' matrix products (their inputs), of the statistic sums and of the stored
        factors; decompositions are always taken in float32."""
        self._handles: list[RemovableHandle] = []

    @property
    def device(self) -> torch.device:
        """Where the layer's weight (and so its factors) lives."""
        return self.module.weight.device

    # -- shapes --------------------------------------------------------------------------------------
    def factor_shapes(self) -> list[tuple[int, ...]]:
        """Shapes of the factors (and of their statistic sums)."""
        raise NotImplementedError

    def params(self) -> list[nn.Parameter]:
        """The parameters this layer preconditions."""
        params = [self.module.weight]
        bias = getattr(self.module, "bias", None)
        if bias is not None:
            params.append(bias)
        return params

    # -- gradients -----------------------------------------------------------------------------------
    def grad_matrix(self) -> torch.Tensor | None:
        """The gradient of the parameters as the matrix the factors act on (float32); None without grad."""
        raise NotImplementedError

    def write_grad(self, matrix: torch.Tensor) -> None:
        """Copy ``matrix`` (shaped like ``grad_matrix()``) into the parameters' ``.grad``."""
        raise NotImplementedError

    # -- statistics ----------------------------------------------------------------------------------
    def _accumulate(self, index: int, stat: torch.Tensor, count: float) -> None:
        current = self.stat_sums[index]
        self.stat_sums[index] = stat if current is None else current + stat
        self.stat_counts[index] += count

    def reset_stats(self) -> None:
        """Forget the statistics summed since the last factor update."""
        n = len(self.factor_names)
        self.stat_sums = [None] * n
        self.stat_counts = [0.0] * n

    def register(self, collecting: Callable[[], bool], grad_scale: Callable[[], float], clock: Clock) -> None:
        """Install the forward hook (which installs a hook on the output's gradient)."""

        def forward_hook(module: nn.Module, inputs: tuple[Any, ...], output: Any) -> None:
            if not (torch.is_grad_enabled() and module.training and collecting()):
                return
            if not (isinstance(output, torch.Tensor) and output.requires_grad):
                return
            start = clock.now()
            context = self._on_forward(inputs[0].detach())
            clock.add("factor", clock.now() - start)

            def grad_hook(grad: torch.Tensor) -> None:
                start = clock.now()
                self._on_backward(grad.detach(), context, grad_scale())
                clock.add("factor", clock.now() - start)

            # A hook on the output tensor sees d loss / d output even when a later in-place op
            # (ReLU(inplace=True)) modifies that tensor.
            output.register_hook(grad_hook)

        self._handles.append(self.module.register_forward_hook(forward_hook))

    def remove_hooks(self) -> None:
        """Remove the hooks this layer installed."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _on_forward(self, inputs: torch.Tensor) -> Any:
        raise NotImplementedError

    def _on_backward(self, grad: torch.Tensor, context: Any, scale: float) -> None:
        raise NotImplementedError


def _sum_outer(x: torch.Tensor) -> torch.Tensor:
    """``sum over n, l of x[n, :, l] x[n, :, l]^T`` for ``x`` of shape (N, C, L)."""
    channels = x.shape[1]
    if channels <= x.shape[2]:
        # The (N, C, C) batch of per-sample products is no larger than x, and needs no transposed copy.
        return torch.bmm(x, x.transpose(1, 2)).sum(dim=0)
    rows = x.transpose(1, 2).reshape(-1, channels)
    return rows.T @ rows


class KroneckerLayer(KFACLayer):
    """A layer whose Fisher block is approximated by ``A (x) G`` (Linear, Conv1d, Conv2d)."""

    factor_names = ("A", "G")

    @property
    def has_bias(self) -> bool:
        """Whether the layer has a bias (a trailing 1 in every input row)."""
        return getattr(self.module, "bias", None) is not None

    def in_dim(self) -> int:
        """Size of ``A``: the input features per row, plus one for the bias."""
        raise NotImplementedError

    def out_dim(self) -> int:
        """Size of ``G``: the output features."""
        return int(self.module.weight.shape[0])

    def factor_shapes(self) -> list[tuple[int, ...]]:
        """``[(in, in), (out, out)]``."""
        return [(self.in_dim(), self.in_dim()), (self.out_dim(), self.out_dim())]

    def weight_grad_rows(self) -> torch.Tensor:
        """The weight's gradient as (out, in) rows."""
        weight = self.module.weight
        return weight.grad.detach().reshape(weight.shape[0], -1)

    def set_weight_grad(self, rows: torch.Tensor) -> None:
        """Write (out, in) rows back as the weight's gradient."""
        weight = self.module.weight
        weight.grad.copy_(rows.reshape(weight.shape))

    def grad_matrix(self) -> torch.Tensor | None:
        """``[dW | db]`` of shape (out, in [+1])."""
        if self.module.weight.grad is None:
            return None
        matrix = self.weight_grad_rows().float()
        if self.has_bias:
            bias_grad = self.module.bias.grad
            column = torch.zeros_like(matrix[:, :1]) if bias_grad is None else bias_grad.float()[:, None]
            matrix = torch.cat([matrix, column], dim=1)
        return matrix

    def write_grad(self, matrix: torch.Tensor) -> None:
        """Split ``[dW | db]`` back into the parameters' gradients."""
        n_weight = matrix.shape[1] - (1 if self.has_bias else 0)
        self.set_weight_grad(matrix[:, :n_weight])
        if self.has_bias and self.module.bias.grad is not None:
            self.module.bias.grad.copy_(matrix[:, n_weight])

    def _input_sums(self, inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        """``(sum of a a^T, sum of a, number of rows)`` over the input rows ``a`` (no bias column), the
        products taken in the dtype of ``inputs``."""
        raise NotImplementedError

    def _grad_sum(self, grad: torch.Tensor) -> torch.Tensor:
        """``sum of g g^T`` over the output-gradient rows ``g``."""
        raise NotImplementedError

    def _subsample(self, x: torch.Tensor) -> torch.Tensor:
        """The first ``ceil(stat_fraction * N)`` samples of a batched tensor (the batch is shuffled)."""
        if self.stat_fraction >= 1.0 or x.dim() < 2 or not self._batched(x):
            return x
        return x[: max(1, math.ceil(self.stat_fraction * x.shape[0]))]

    def _batched(self, x: torch.Tensor) -> bool:
        """Whether ``x`` (an input or an output gradient) has a leading batch dimension."""
        return True

    def _on_forward(self, inputs: torch.Tensor) -> None:
        stat, column, rows = self._input_sums(self._subsample(inputs).to(self.factor_dtype))
        stat, column = stat.to(self.factor_dtype), column.to(self.factor_dtype)
        if self.has_bias:
            # The bias column of ones, appended to the product rather than to every row.
            corner = torch.tensor([[float(rows)]], dtype=stat.dtype, device=stat.device)
            stat = torch.cat(
                [torch.cat([stat, column[:, None]], dim=1), torch.cat([column[None, :], corner], dim=1)]
            )
        self._accumulate(0, stat, float(rows))

    def _on_backward(self, grad: torch.Tensor, context: Any, scale: float) -> None:
        # N g is one sample's gradient with N the whole batch, also when only a share of it is summed.
        batch = grad.shape[0] if grad.dim() > 1 else 1
        factor = batch / scale
        sample = self._subsample(grad)
        used = sample.shape[0] if sample.dim() > 1 else 1
        stat = self._grad_sum(sample.to(self.factor_dtype)).to(self.factor_dtype)
        self._accumulate(1, stat * (factor * factor), float(used))


class LinearLayer(KroneckerLayer):
    """``nn.Linear``: rows are the input vectors (every position of a sequence input is a row)."""

    def in_dim(self) -> int:
        """``in_features`` (+1 with bias)."""
        return int(self.module.in_features) + (1 if self.has_bias else 0)

    def _input_sums(self, inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        rows = inputs.reshape(-1, inputs.shape[-1])
        return rows.T @ rows, rows.sum(dim=0, dtype=torch.float32), rows.shape[0]

    def _grad_sum(self, grad: torch.Tensor) -> torch.Tensor:
        rows = grad.reshape(-1, grad.shape[-1])
        return rows.T @ rows


class TransposedLinearLayer(LinearLayer):
    """A linear map whose weight is stored transposed, ``y = x @ W + b`` with ``W`` of shape (in, out): Hugging
    Face's ``Conv1D`` (GPT-2 and the models built like it). The factors are a Linear's; the gradient is read
    and written through the transpose."""

    def in_dim(self) -> int:
        """The weight's rows (+1 with bias)."""
        return int(self.module.weight.shape[0]) + (1 if self.has_bias else 0)

    def out_dim(self) -> int:
        """The weight's columns."""
        return int(self.module.weight.shape[1])

    def weight_grad_rows(self) -> torch.Tensor:
        """The weight's gradient transposed: (out, in) rows."""
        return self.module.weight.grad.detach().T

    def set_weight_grad(self, rows: torch.Tensor) -> None:
        """Write (out, in) rows back, transposed, as the weight's gradient."""
        self.module.weight.grad.copy_(rows.T)


def is_transposed_linear(module: nn.Module) -> bool:
    """Whether ``module`` is Hugging Face's ``Conv1D`` (recognised by its shape, with no import of
    ``transformers``): a 2-D ``weight`` of shape (nx, nf), ``nf`` outputs, a bias of nf or none."""
    weight = getattr(module, "weight", None)
    if type(module).__name__ != "Conv1D" or not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        return False
    bias = getattr(module, "bias", None)
    return getattr(module, "nf", None) == weight.shape[1] and (
        bias is None or bias.shape == (weight.shape[1],)
    )


class Conv2dLayer(KroneckerLayer):
    """``nn.Conv2d`` with ``groups == 1``: rows are the unfolded input patches (one per output pixel)."""

    def in_dim(self) -> int:
        """``in_channels * kh * kw`` (+1 with bias)."""
        module = self.module
        kh, kw = module.kernel_size
        return int(module.in_channels * kh * kw) + (1 if self.has_bias else 0)

    def _batched(self, x: torch.Tensor) -> bool:
        return x.dim() == 4

    def _input_sums(self, inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        module = self.module
        if inputs.dim() == 3:
            inputs = inputs.unsqueeze(0)
        padding = module.padding
        if isinstance(padding, str):
            if padding == "same":
                inputs = F.pad(inputs, module._reversed_padding_repeated_twice)
            padding = (0, 0)
        # By kernel offset, never materialising the unfolded (N*L, C*kh*kw) patch matrix.
        return patch_sums(inputs, module.kernel_size, module.stride, padding, module.dilation, inputs.dtype)

    def _grad_sum(self, grad: torch.Tensor) -> torch.Tensor:
        if grad.dim() == 3:
            grad = grad.unsqueeze(0)
        return _sum_outer(grad.reshape(grad.shape[0], grad.shape[1], -1))


class Conv1dLayer(Conv2dLayer):
    """``nn.Conv1d`` with ``groups == 1``: the input as a height-1 image, one patch per output position."""

    def in_dim(self) -> int:
        """``in_channels * k`` (+1 with bias)."""
        return int(self.module.in_channels * self.module.kernel_size[0]) + (1 if self.has_bias else 0)

    def _batched(self, x: torch.Tensor) -> bool:
        return x.dim() == 3

    def _input_sums(self, inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        module = self.module
        if inputs.dim() == 2:
            inputs = inputs.unsqueeze(0)
        padding = module.padding
        if isinstance(padding, str):
            if padding == "same":
                inputs = F.pad(inputs, module._reversed_padding_repeated_twice)
            padding = (0,)
        # A height-1 image with a (1, k) kernel.
        return patch_sums(
            inputs.unsqueeze(2),
            (1, module.kernel_size[0]),
            (1, module.stride[0]),
            (0, padding[0]),
            (1, module.dilation[0]),
            inputs.dtype,
        )

    def _grad_sum(self, grad: torch.Tensor) -> torch.Tensor:
        return _sum_outer(grad if grad.dim() == 3 else grad.unsqueeze(0))


class BatchNormLayer(KFACLayer):
    """BatchNorm with affine parameters; ``unit_wise`` keeps each channel's 2x2 Fisher, else its diagonal."""

    factor_names = ("F",)

    def __init__(self, name: str, module: nn.Module, unit_wise: bool) -> None:
        super().__init__(name, module)
        self.unit_wise = unit_wise

    def factor_shapes(self) -> list[tuple[int, ...]]:
        """``[(C, 3)]`` unit-wise, ``[(C, 2)]`` diagonal."""
        return [(int(self.module.num_features), 3 if self.unit_wise else 2)]

    def grad_matrix(self) -> torch.Tensor | None:
        """``[dgamma, dbeta]`` of shape (C, 2)."""
        weight, bias = self.module.weight, self.module.bias
        if weight.grad is None or bias.grad is None:
            return None
        return torch.stack([weight.grad.detach().float(), bias.grad.detach().float()], dim=1)

    def write_grad(self, matrix: torch.Tensor) -> None:
        """Copy the two columns back into gamma's and beta's gradients."""
        self.module.weight.grad.copy_(matrix[:, 0])
        self.module.bias.grad.copy_(matrix[:, 1])

    def _on_forward(self, inputs: torch.Tensor) -> torch.Tensor:
        module = self.module
        x = inputs.float()
        if x.dim() == 1:
            x = x.unsqueeze(0)
        dims = [0, *range(2, x.dim())]
        use_batch_stats = module.training or module.running_mean is None
        if use_batch_stats:
            mean = x.mean(dim=dims)
            var = x.var(dim=dims, unbiased=False)
        else:
            mean, var = module.running_mean.float(), module.running_var.float()
        shape = [1, -1] + [1] * (x.dim() - 2)
        return (x - mean.view(shape)) / torch.sqrt(var.view(shape) + module.eps)

    def _on_backward(self, grad: torch.Tensor, context: Any, scale: float) -> None:
        x_hat: torch.Tensor = context
        g = grad.float()
        if g.dim() == 1:
            g = g.unsqueeze(0)
        batch, channels = g.shape[0], g.shape[1]
        g = g.reshape(batch, channels, -1) * (batch / scale)
        d_gamma = (g * x_hat.reshape(batch, channels, -1)).sum(dim=2)
        d_beta = g.sum(dim=2)
        if self.unit_wise:
            stat = torch.stack(
                [(d_gamma * d_gamma).sum(0), (d_gamma * d_beta).sum(0), (d_beta * d_beta).sum(0)], dim=1
            )
        else:
            stat = torch.stack([(d_gamma * d_gamma).sum(0), (d_beta * d_beta).sum(0)], dim=1)
        self._accumulate(0, stat, float(batch))

    def precondition(self, grad: torch.Tensor, damping: float) -> torch.Tensor:
        """The preconditioned (C, 2) gradient; the plain gradient before the first factor update."""
        fisher = self.factors[0]
        if fisher is None:
            return grad
        if self.unit_wise:
            return precondition_bn_unit(grad, fisher, damping)
        return precondition_bn_diagonal(grad, fisher, damping)


def classify(module: nn.Module, bn_mode: str) -> tuple[type[KFACLayer] | None, str | None]:
    """The layer class for ``module``, or (None, reason) when K-FAC does not handle it.

    A reason of ``None`` with no class means "nothing to precondition, say nothing" (no trainable
    parameters of its own, or BatchNorm with ``bn="skip"``).
    """
    if isinstance(module, nn.MultiheadAttention):
        # Its in-projection (in_proj_weight) and out_proj run inside F.multi_head_attention_forward: no
        # module call to hook, so the whole attention (out_proj included) is left to the base optimizer.
        return None, "MultiheadAttention: in- and out-projection run inside F.multi_head_attention_forward"
    own = [p for p in module.parameters(recurse=False) if p.requires_grad]
    if not own:
        return None, None
    if isinstance(module, nn.Linear):
        return LinearLayer, None
    if is_transposed_linear(module):
        return TransposedLinearLayer, None
    if isinstance(module, (nn.Conv1d, nn.Conv2d)):
        kind = "Conv1d" if isinstance(module, nn.Conv1d) else "Conv2d"
        if module.groups != 1:
            return None, f"{kind} with groups={module.groups}"
        if module.padding_mode != "zeros":
            return None, f"{kind} with padding_mode='{module.padding_mode}'"
        return (Conv1dLayer if isinstance(module, nn.Conv1d) else Conv2dLayer), None
    if isinstance(module, _BatchNorm):
        if bn_mode == "skip":
            return None, None
        if not module.affine:
            return None, None
        return BatchNormLayer, None
    return None, type(module).__name__
