"""Real fp8 matrix products on GPUs that have fp8 tensor cores (compute capability 8.9 and later).

Under ``precision.mode fp8-stats`` a Linear layer on such a device runs its three matmuls through
``torch._scaled_mm`` with the same delayed per-tensor scaling as the emulation: the input and weight in
E4M3, the output gradient in E5M2, each scale a power of two from that tensor's amax history
(:class:`~kaisoku.precision.scaler.ExponentScaler.encode`). ``_scaled_mm`` wants the first operand
row-major and the second column-major, and every dimension a multiple of 16: a call whose shapes do not
fit falls back to the emulated product for that call. Convolutions stay emulated. Elsewhere (the CPU,
older GPUs) :func:`fp8_support` says why not and the emulation runs.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from kaisoku.precision.quant import LayerQuant, QuantLinear

#: Smallest CUDA compute capability with fp8 tensor cores (Ada, Hopper and later).
FP8_CAPABILITY = (8, 9)


def fp8_support(device: torch.device) -> str:
    """Empty where real fp8 matmuls run on ``device``; else the one-line reason they do not."""
    if device.type != "cuda":
        return f"{device.type} has no fp8 matmul; fp8 is emulated (rounded through torch.float8 dtypes)"
    if not hasattr(torch, "_scaled_mm"):
        return f"torch {torch.__version__} has no torch._scaled_mm"
    capability = torch.cuda.get_device_capability(device)
    if capability < FP8_CAPABILITY:
        return (
            f"{torch.cuda.get_device_name(device)} (compute capability {capability[0]}.{capability[1]}) has no "
            f"fp8 tensor cores; they need {FP8_CAPABILITY[0]}.{FP8_CAPABILITY[1]} or later"
        )
    return ""


def _fits(*dims: int) -> bool:
    return all(d % 16 == 0 for d in dims)


def _column_major(t: torch.Tensor) -> torch.Tensor:
    return t.t().contiguous().t()


class _Fp8Linear(torch.autograd.Function):
    """``x @ w.T`` with both operands in E4M3 and the output gradient in E5M2, on fp8 tensor cores."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, weight: torch.Tensor, quant: LayerQuant, record: bool
    ) -> torch.Tensor:
        assert quant.activations is not None and quant.weights is not None
        out_dtype = x.dtype if x.dtype in (torch.float32, torch.bfloat16, torch.float16) else torch.float32
        x_fp8, x_scale = quant.activations.encode(x, record=record)
        w_fp8, w_scale = quant.weights.encode(weight, record=record)
        out = torch._scaled_mm(x_fp8, w_fp8.t(), scale_a=x_scale, scale_b=w_scale, out_dtype=out_dtype)
        ctx.save_for_backward(x_fp8, x_scale, w_fp8, w_scale)
        ctx.quant = quant
        ctx.weight_dtype = weight.dtype
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None, None]:
        x_fp8, x_scale, w_fp8, w_scale = ctx.saved_tensors
        quant: LayerQuant = ctx.quant
        assert quant.gradients is not None
        g_fp8, g_scale = quant.gradients.encode(grad.contiguous())
        # (M, N) @ (N, K): the weight as a column-major (N, K).
        grad_x = torch._scaled_mm(
            g_fp8, _column_major(w_fp8), scale_a=g_scale, scale_b=w_scale, out_dtype=grad.dtype
        )
        # (N, M) @ (M, K): the gradient transposed row-major, the input column-major.
        grad_w = torch._scaled_mm(
            g_fp8.t().contiguous(),
            _column_major(x_fp8),
            scale_a=g_scale,
            scale_b=x_scale,
            out_dtype=torch.float32,
        )
        return grad_x, grad_w.to(ctx.weight_dtype), None, None


class Fp8Linear(QuantLinear):
    """A :class:`QuantLinear` whose matmuls run in real fp8 where the shapes allow, else emulated."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The layer on fp8 tensor cores (the bias added in the output dtype)."""
        quant = self.quant
        lead = x.shape[:-1]
        x2d = x.reshape(-1, x.shape[-1])
        usable = (
            quant.activations is not None
            and quant.weights is not None
            and quant.gradients is not None
            and _fits(x2d.shape[0], self.in_features, self.out_features)
        )
        if not usable:
            return super().forward(x)
        out = _Fp8Linear.apply(x2d.contiguous(), self.weight, quant, self.training)
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out.reshape(*lead, self.out_features)


def use_real_fp8(model: nn.Module) -> int:
    """Switch the model's quantized Linear layers to :class:`Fp8Linear`; how many were switched."""
    count = 0
    for module in model.modules():
        if type(module) is QuantLinear and "e4m3" in module.quant.label:
            module.__class__ = Fp8Linear
            count += 1
    return count
