"""The CUDA paths, on a GPU where one is present (skipped elsewhere): NCCL at world size 1 through the
engine's DDP wrapper, bf16 / fp16 autocast training with the gradient scaler, real fp8 matmuls against
their emulation, and the compiled LARS step against the eager one."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from kaisoku.data.datagen import generate
from kaisoku.distributed.env import World
from kaisoku.engine.build import build_trainer
from kaisoku.run_facts import check_config
from tests.dist_harness import run_ranks
from tests.train_harness import cosmoflow_tiny_config, metric_lines, tiny_config

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10),
    )  # fmt: skip


def _nccl_ddp_body(rank: int, world_size: int, tmp: Path, compress: bool) -> float:
    import torch.distributed as dist

    from kaisoku.distributed.data_parallel import BucketPlan, wrap_ddp

    assert dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device())
    local = _net().to(device)
    ddp = wrap_ddp(_net().to(device), device, plan=BucketPlan(), compress_bf16=compress)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(8, 3, 8, 8, generator=generator).to(device)
    y = torch.randint(0, 10, (8,), generator=generator).to(device)
    for model in (local, ddp):
        nn.functional.cross_entropy(model(x), y).backward()
    worst = 0.0
    for a, b in zip(local.parameters(), ddp.module.parameters(), strict=True):
        assert a.grad is not None and b.grad is not None
        worst = max(worst, float((a.grad - b.grad).abs().max() / a.grad.abs().max().clamp_min(1e-12)))
    return worst


@pytest.mark.timeout(180)
@pytest.mark.parametrize("compress", [False, True])
def test_nccl_world_size_one_ddp_gives_the_local_gradients(tmp_path: Path, compress: bool) -> None:
    (worst,) = run_ranks(_nccl_ddp_body, 1, tmp_path, compress, backend="nccl", timeout=150)
    # One rank: the all-reduce averages over itself; bf16 compression rounds to 8 mantissa bits.
    assert worst <= (2**-8 if compress else 1e-6)


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return generate(tmp_path_factory.mktemp("data") / "shapes", count=64, size=16, val_count=16, workers=1)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", ["bf16", "fp16"])
def test_autocast_modes_train_on_cuda(mode: str, tmp_path: Path, tiny_data: Path) -> None:
    cfg = tiny_config(
        tiny_data, tmp_path / "run", precision__mode=mode, train__device="cuda", train__epochs=3
    )
    check_config(cfg, 1)
    trainer = build_trainer(cfg, World())
    assert trainer.device.type == "cuda"
    scaler = trainer.engine.precision.scaler
    assert scaler.is_enabled() == (mode == "fp16")
    summary = trainer.fit()
    trainer.metrics.close()
    losses = [line["loss"] for line in metric_lines(tmp_path / "run") if "loss" in line]
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0]
    assert torch.isfinite(torch.tensor(summary["final_loss"]))
    if mode == "fp16":
        assert scaler.get_scale() > 0
        state = torch.load(sorted((tmp_path / "run" / "checkpoints").glob("*.pt"))[-1], weights_only=False)
        assert state["scaler"]["scale"] == scaler.get_scale()


def test_real_fp8_linear_matches_its_emulation() -> None:
    from kaisoku.precision.fp8 import fp8_support, use_real_fp8
    from kaisoku.precision.quant import quantize_model

    device = torch.device("cuda")
    reason = fp8_support(device)
    if reason:
        pytest.skip(reason)
    torch.manual_seed(0)
    emulated = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32)).to(device)
    real = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32)).to(device)
    real.load_state_dict(emulated.state_dict())
    quantize_model(emulated, "fp8-stats", keep=[])
    quantize_model(real, "fp8-stats", keep=[])
    assert use_real_fp8(real) == 2
    x = torch.randn(32, 64, device=device)
    target = torch.randn(32, 32, device=device)
    outputs = []
    for model in (emulated, real):
        for _ in range(3):  # a few steps so the delayed scales come from a filled amax history
            model.zero_grad()
            out = model(x)
            nn.functional.mse_loss(out, target).backward()
        outputs.append((out.detach(), [p.grad.clone() for p in model.parameters()]))
    (out_e, grads_e), (out_r, grads_r) = outputs
    # Same rounded operands; only the accumulation differs (tensor cores vs float32 matmul).
    assert torch.allclose(out_r, out_e, rtol=2e-2, atol=2e-2 * float(out_e.abs().max()))
    for g_e, g_r in zip(grads_e, grads_r, strict=True):
        assert torch.allclose(g_r, g_e, rtol=5e-2, atol=5e-2 * float(g_e.abs().max()))


def test_compiled_lars_matches_eager_on_cuda() -> None:
    from kaisoku.optim import LARS

    device = torch.device("cuda")
    torch.manual_seed(0)
    params = [
        torch.randn(64, 32, device=device),
        torch.randn(32, device=device),
        torch.randn(10, 64, device=device),
    ]
    grads = [torch.randn_like(p) for p in params]
    results = []
    for compiled in (False, True):
        copies = [nn.Parameter(p.clone()) for p in params]
        groups = [
            {"params": [copies[0], copies[2]], "weight_decay": 5e-5},
            {"params": [copies[1]], "weight_decay": 0.0, "lars_exclude": True},
        ]
        optimizer = LARS(groups, lr=0.1, momentum=0.9, compile=compiled)
        for _ in range(3):
            for copy, grad in zip(copies, grads, strict=True):
                copy.grad = grad.clone()
            optimizer.step()
        results.append([c.detach() for c in copies])
    for eager, compiled in zip(*results, strict=True):
        assert torch.allclose(eager, compiled, rtol=1e-5, atol=1e-6)


def test_more_ranks_than_gpus_run_on_the_cpu_under_auto_and_stop_under_cuda() -> None:
    from kaisoku.distributed.env import pick_device
    from kaisoku.errors import KaisokuError

    count = torch.cuda.device_count()
    assert (
        pick_device("auto", World(rank=0, world_size=count, local_rank=0, local_world_size=count)).type
        == "cuda"
    )
    crowded = World(rank=0, world_size=count + 1, local_rank=0, local_world_size=count + 1)
    assert pick_device("auto", crowded) == torch.device("cpu")
    with pytest.raises(KaisokuError, match=f"--nproc {count} or --train.device cpu") as info:
        pick_device("cuda", crowded)
    assert "\n" not in str(info.value)


@pytest.mark.timeout(180)
def test_cosmoflow_trains_on_cuda(tmp_path: Path) -> None:
    import numpy as np

    from kaisoku.data.cosmo import universe_arrays
    from kaisoku.data.shards.writer import pack

    x, y = universe_arrays(16, 8, seed=0)
    xv, yv = universe_arrays(8, 8, seed=0, split="val")
    np.savez(tmp_path / "cosmo.npz", x_train=x, y_train=y, x_val=xv, y_val=yv)
    pack(tmp_path / "cosmo.npz", tmp_path / "packed", codec="delta", workers=1, progress=False)
    cfg = cosmoflow_tiny_config(
        tmp_path / "packed", tmp_path / "run", train__max_steps=4, train__device="cuda"
    )
    check_config(cfg, 1)
    trainer = build_trainer(cfg, World())
    summary = trainer.fit()
    trainer.metrics.close()
    assert torch.isfinite(torch.tensor(summary["final_loss"]))


@pytest.mark.parametrize("name", ["LARS", "LAMB"])
def test_eager_layerwise_step_launches_no_kernel_per_tensor(name: str) -> None:
    import kaisoku.optim as optim
    from kaisoku_bench.optim import cuda_kernels_per_step

    device = torch.device("cuda")
    generator = torch.Generator().manual_seed(0)
    params = [nn.Parameter(torch.randn(16, 8 + i % 5, generator=generator).to(device)) for i in range(300)]
    for param in params:
        param.grad = torch.randn(param.shape, generator=generator).to(device)
    optimizer = getattr(optim, name)(params, lr=0.01, weight_decay=1e-4)
    for _ in range(2):
        optimizer.step()
    # A 0-dim scale tensor per parameter in a _foreach call would launch one kernel per tensor (>= 300).
    assert cuda_kernels_per_step(optimizer) < 100
