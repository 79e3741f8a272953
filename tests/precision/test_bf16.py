"""The bf16 NaN of resnet10 at 16 px (1x1 maps in layer3/4) with 4-8-sample micro-batches.

The cause, found on a CPU with native bf16 (AVX512-BF16): oneDNN's bf16 weight gradient of a 3x3 stride-2
convolution over a 1x1 map leaves the taps that only see padding unwritten, so they hold whatever the
allocator's memory held (NaN now and then). :mod:`kaisoku.precision.float32_layers` runs such convolutions in
float32. Freed memory is poisoned with NaN before each case here, so an unwritten output shows at once.

Ruled out on the way, and kept as tests: BatchNorm over 1x1 maps with 2-8 samples behind a bf16 convolution,
and the bf16 compression hook on DDP's bucket views with gradient accumulation.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.dist_harness import run_ranks


def _poison(*sizes: int) -> None:
    for n in sizes or (1 << 12, 1 << 16, 1 << 20):
        del_me = torch.full((n,), float("nan"))
        del del_me
        del_me = torch.full((n,), float("nan"), dtype=torch.bfloat16)
        del del_me


@pytest.mark.timeout(120)
def test_bf16_batchnorm_over_1x1_maps_with_few_samples_is_finite_and_right() -> None:
    for seed in range(90):
        g = torch.Generator().manual_seed(seed)
        n = (2, 4, 8)[seed % 3]
        conv = nn.Conv2d(16, 32, 3, 1, 1, bias=False)
        bn = nn.BatchNorm2d(32)
        if seed % 2:
            bn.weight.data.zero_()  # zero_init_residual's last BatchNorm of a block
        x = torch.randn(n, 16, 1, 1, generator=g).relu()
        if seed % 5 == 0:
            x = torch.zeros_like(x)  # a dead channel: variance exactly 0
        x.requires_grad_(True)
        _poison()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = conv(x)
            y = bn(h).relu()
        y.float().sum().backward()
        for name, value in {"out": y, "input grad": x.grad, "weight grad": conv.weight.grad}.items():
            assert torch.isfinite(value.float()).all(), f"seed {seed}, {n} samples: {name} non-finite"
        assert torch.isfinite(bn.running_var).all() and torch.isfinite(bn.running_mean).all()
        # BatchNorm of the same bf16 values computed in float32: the bf16 path agrees to bf16's precision.
        reference = nn.functional.batch_norm(
            h.detach().float(), None, None, bn.weight.detach(), bn.bias.detach(), training=True
        ).relu()
        assert torch.allclose(y.float(), reference, atol=0.05, rtol=0.02), f"seed {seed}"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("direct", [False, True], ids=["autocast", "bf16-tensors"])
def test_bf16_batchnorm_over_identical_1x1_samples_at_any_magnitude_is_finite(direct: bool) -> None:
    # Identical samples over a 1x1 map: the variance is exactly 0 (or a rounding residue) at every scale.
    for n, scale, seed in [(n, s, k) for n in (2, 4, 8) for s in (1e-3, 1.0, 300.0, 3e4) for k in range(2)]:
        g = torch.Generator().manual_seed(seed)
        x = (torch.randn(1, 64, 1, 1, generator=g) * scale).expand(n, -1, -1, -1)
        if seed:
            x = x + torch.randn(n, 64, 1, 1, generator=g) * scale * 1e-3  # near-identical
        x = x.to(torch.bfloat16).requires_grad_(True)
        bn = nn.BatchNorm2d(64)
        if direct:
            params = [t.bfloat16() for t in (bn.running_mean, bn.running_var, bn.weight, bn.bias)]
            y = nn.functional.batch_norm(x, *params, training=True)
        else:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y = bn(x)
        y.backward(torch.randn(y.shape, generator=g).to(y.dtype))
        assert x.grad is not None
        for name, value in {"out": y, "input grad": x.grad, "running var": bn.running_var}.items():
            assert torch.isfinite(value.float()).all(), f"{n} samples, scale {scale}, seed {seed}: {name}"
        assert y.float().abs().max() < 10.0  # normalised: |y| <= sqrt(n - 1)


def test_cross_entropy_with_label_smoothing_runs_in_float32_under_bf16_autocast() -> None:
    g = torch.Generator().manual_seed(0)
    fc = nn.Linear(512, 10)
    h = torch.randn(6, 512, generator=g).mul(1e4).requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = fc(h)
        loss = nn.functional.cross_entropy(logits, torch.arange(6), label_smoothing=0.1)
    assert logits.dtype == torch.bfloat16 and loss.dtype == torch.float32
    loss.backward()
    assert torch.isfinite(loss) and h.grad is not None and torch.isfinite(h.grad).all()


def _hook_rank(rank: int, world_size: int, tmp: Path, steps: int) -> float:
    from kaisoku.distributed.data_parallel import BucketPlan, wrap_ddp

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        nn.Linear(32, 10),
    )  # fmt: skip
    plain = copy.deepcopy(model)
    ddp = wrap_ddp(
        model, torch.device("cpu"), plan=BucketPlan(mode="layer-groups", first_mb=0.001, cap_mb=1.0, growth=2.0),
        compress_bf16=True,
    )  # fmt: skip
    worst = 0.0
    for step in range(steps):
        batches = []
        for micro in range(2):
            g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
            batches.append((torch.randn(4, 3, 1, 1, generator=g), torch.randint(0, 10, (4,), generator=g)))
        for micro, (x, y) in enumerate(batches):
            _poison()
            context = ddp.no_sync() if micro == 0 else torch.enable_grad()
            with context:
                nn.functional.cross_entropy(ddp(x), y).div(2).backward()
        # The fp32 reference: the same micro-batches on a copy, averaged over ranks in float32.
        plain.load_state_dict(model.state_dict())
        for x, y in batches:
            nn.functional.cross_entropy(plain(x), y).div(2).backward()
        for p, q in zip(model.parameters(), plain.parameters()):
            assert p.grad is not None and torch.isfinite(p.grad).all(), f"step {step}: non-finite gradient"
            ref = q.grad.clone()
            torch.distributed.all_reduce(ref)
            ref /= world_size
            scale = ref.abs().max().clamp(min=1e-6)
            worst = max(worst, float((p.grad - ref).abs().max() / scale))
            q.grad = None
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.1 * p.grad
        for p in model.parameters():
            p.grad = None  # zero_grad(set_to_none=True), as the engine does
    return worst


@pytest.mark.timeout(120)
def test_bf16_compression_hook_on_bucket_views_with_accumulation(tmp_path: Path) -> None:
    worst = run_ranks(_hook_rank, 2, tmp_path, 6)
    # bf16 keeps 8 significant bits: the averaged gradient is within a few bf16 steps of fp32's.
    assert max(worst) < 2**-6


def test_bf16_mode_keeps_every_normalization_in_float32_with_the_same_state() -> None:
    from kaisoku.config_sections import PrecisionConfig
    from kaisoku.models.zoo import build_model
    from kaisoku.precision import apply_precision

    model = build_model("resnet10", num_classes=10, size=16)
    model.add_module("extra_norms", nn.Sequential(nn.LayerNorm(4), nn.GroupNorm(2, 4)))
    keys = list(model.state_dict())
    assert apply_precision(model, PrecisionConfig(mode="bf16"), torch.device("cpu")) is None
    norms = [m for m in model.modules() if isinstance(m, (nn.BatchNorm2d, nn.LayerNorm, nn.GroupNorm))]
    assert len(norms) > 3 and all(type(m).__name__.startswith("Float32") for m in norms)
    assert list(model.state_dict()) == keys  # checkpoints stay interchangeable with fp32 runs
    # A 1x1 map of near-identical samples (the resnet10 layer4 case): statistics in float32, finite.
    bn = nn.BatchNorm2d(8)
    apply_precision(bn, PrecisionConfig(mode="bf16"), torch.device("cpu"))
    x = (1000.0 + 1e-3 * torch.randn(4, 8, 1, 1, generator=torch.Generator().manual_seed(0))).requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = bn(x.bfloat16())
    assert y.dtype == torch.float32
    y.square().sum().backward()
    assert torch.isfinite(y).all() and x.grad is not None and torch.isfinite(x.grad).all()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        z = model(torch.randn(2, 3, 16, 16))
    assert torch.isfinite(z).all()


@pytest.mark.parametrize(
    ("size", "kernel", "stride", "padding", "expected"),
    [
        (1, 3, 2, 1, True),  # resnet layer4.0.conv1 at 16 px: only the centre tap reads the input
        (1, 3, 1, 1, True),
        (2, 3, 2, 1, True),  # one output at position 0 reads -1..1: tap 0 sees padding only
        (3, 3, 2, 1, False),
        (56, 3, 2, 1, False),  # a normal-sized map: every tap reads real input somewhere
        (1, 1, 2, 0, False),
        (16, 7, 2, 3, False),  # the 7x7 stem at 16 px
        (4, 7, 2, 3, True),
        (2, 7, 2, 3, True),
    ],
)
def test_padding_only_taps_by_hand(size: int, kernel: int, stride: int, padding: int, expected: bool) -> None:
    from kaisoku.precision.float32_layers import padding_only_taps

    assert padding_only_taps((size, 8), (kernel, 1), (stride, 1), (padding, 0), (1, 1)) is expected
    assert padding_only_taps((8, size), (1, kernel), (1, stride), (0, padding), (1, 1)) is expected


def _conv_case(conv: nn.Conv2d, x: torch.Tensor, gy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    weight = conv.weight
    weight.grad = None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = conv(x)
    _poison(weight.numel() * 4)
    y.backward(gy.to(y.dtype))
    assert weight.grad is not None
    return y, weight.grad


@pytest.mark.timeout(60)
def test_stride2_conv_over_a_1x1_map_gets_finite_exact_padding_tap_gradients_under_bf16() -> None:
    from kaisoku.precision import keep_padded_convs_float32

    for seed in range(10):
        g = torch.Generator().manual_seed(seed)
        conv = nn.Conv2d(64, 128, 3, stride=2, padding=1, bias=False)
        assert keep_padded_convs_float32(conv) == 1 and keep_padded_convs_float32(conv) == 0  # idempotent
        x = torch.randn(8, 64, 1, 1, generator=g).bfloat16()
        gy = torch.randn(8, 128, 1, 1, generator=g)
        y, grad = _conv_case(conv, x, gy)
        assert y.dtype == torch.float32  # ran in float32: a tap sees only padding
        assert torch.isfinite(grad).all(), f"seed {seed}: non-finite weight gradient"
        # Taps other than the centre only ever multiply padding: their gradient is exactly 0.
        outer = grad.clone()
        outer[:, :, 1, 1] = 0
        assert not outer.any(), f"seed {seed}"
        reference = torch.einsum("no,ni->oi", gy.flatten(1), x.float().flatten(1))
        assert torch.allclose(grad[:, :, 1, 1], reference, atol=1e-4, rtol=1e-4)
    # Over a normal-sized map the convolution stays in bf16.
    y, grad = _conv_case(conv, torch.randn(8, 64, 8, 8).bfloat16(), torch.randn(8, 128, 4, 4))
    assert y.dtype == torch.bfloat16 and torch.isfinite(grad).all()


@pytest.mark.timeout(120)
def test_resnet10_at_16px_under_bf16_mode_has_finite_gradients_over_seeds() -> None:
    # The configuration that went NaN (layer4.0.conv1 over a 1x1 map), single process, memory poisoned.
    from kaisoku.config_sections import PrecisionConfig
    from kaisoku.models.zoo import build_model
    from kaisoku.precision import apply_precision

    for seed in range(6):
        torch.manual_seed(seed)
        model = build_model("resnet10", num_classes=10, size=16, stem="imagenet")
        apply_precision(model, PrecisionConfig(mode="bf16"), torch.device("cpu"))
        g = torch.Generator().manual_seed(seed)
        x, y = torch.randn(8, 3, 16, 16, generator=g), torch.randint(0, 10, (8,), generator=g)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = nn.functional.cross_entropy(model(x).float(), y)
        _poison(512 * 256 * 9 * 4)
        loss.backward()
        bad = [n for n, p in model.named_parameters() if p.grad is None or not torch.isfinite(p.grad).all()]
        assert not bad, f"seed {seed}: non-finite gradients in {bad}"
