"""KFAC in use: convergence against SGD, resume, bad factors, skipped layers, AMP, schedules."""

from __future__ import annotations

import io
import logging
import math

import pytest
import torch
from torch import nn

from kaisoku.config import Config, validate
from kaisoku.errors import ConfigError
from kaisoku.optim.kfac import KFAC, KFACWarning


def _regression_data() -> tuple[torch.Tensor, torch.Tensor]:
    """Badly scaled inputs (feature scales 0.1 .. 10): hard for SGD, easy for a curvature method."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(256, 16, generator=gen) * torch.logspace(-1, 1, 16)
    teacher = torch.randn(16, 4, generator=gen)
    return x, torch.tanh(x @ teacher / 4)


def _train_loss(lr: float, use_kfac: bool, steps: int = 40) -> float:
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    kfac = KFAC(model, damping=1e-2, kl_clip=None, inv_update_steps=1) if use_kfac else None
    x, y = _regression_data()
    for _ in range(steps):
        loss = ((model(x) - y) ** 2).mean()
        optimizer.zero_grad()
        loss.backward()
        if kfac is not None:
            kfac.step()
        optimizer.step()
    with torch.no_grad():
        final = float(((model(x) - y) ** 2).mean())
    return final if math.isfinite(final) else math.inf


def test_beats_sgd_in_steps_on_the_same_lr_grid() -> None:
    grid = [0.01, 0.03, 0.1, 0.3]
    best_sgd = min(_train_loss(lr, use_kfac=False) for lr in grid)
    best_kfac = min(_train_loss(lr, use_kfac=True) for lr in grid)
    assert best_kfac < 0.5 * best_sgd, (best_kfac, best_sgd)


def _cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1, bias=False),
        nn.BatchNorm2d(4),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(4 * 4 * 4, 5),
    )


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randn(8, 1, 8, 8, generator=gen), torch.randint(0, 5, (8,), generator=gen)


def _make(method: str = "eigen") -> tuple[nn.Module, torch.optim.Optimizer, KFAC]:
    torch.manual_seed(7)
    model = _cnn()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    kfac = KFAC(model, lr=optimizer, inv_update_steps=2, factor_decay=0.9, bn="unit", method=method)
    return model, optimizer, kfac


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, kfac: KFAC, steps: range) -> None:
    for step in steps:
        x, y = _batch(step)
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        kfac.step()
        optimizer.step()


@pytest.mark.parametrize("method", ["eigen", "inverse"])
def test_state_dict_round_trip_resumes_identically(method: str) -> None:
    model, optimizer, kfac = _make(method)
    _train(model, optimizer, kfac, range(5))
    straight = [p.detach().clone() for p in model.parameters()]

    model, optimizer, kfac = _make(method)
    _train(model, optimizer, kfac, range(3))
    buffer = io.BytesIO()
    torch.save(
        {"model": model.state_dict(), "opt": optimizer.state_dict(), "kfac": kfac.state_dict()}, buffer
    )
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)

    model, optimizer, kfac = _make(method)
    model.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["opt"])
    kfac.load_state_dict(saved["kfac"])
    assert kfac.steps == 3
    _train(model, optimizer, kfac, range(3, 5))
    for resumed, expected in zip(model.parameters(), straight):
        assert torch.equal(resumed, expected)


def test_load_state_dict_rejects_another_model() -> None:
    _, _, kfac = _make()
    other = KFAC(nn.Sequential(nn.Linear(2, 2)), kl_clip=None)
    with pytest.raises(ConfigError, match="does not match"):
        other.load_state_dict(kfac.state_dict())


@pytest.mark.parametrize("method", ["eigen", "inverse"])
def test_nan_factor_raises_damping_with_warning_and_weights_stay_finite(method: str) -> None:
    model, optimizer, kfac = _make(method)
    _train(model, optimizer, kfac, range(2))
    layer = kfac.layers["5"]
    layer.factors[0][0, 0] = float("nan")
    with pytest.warns(KFACWarning, match="damping is raised"):
        _train(model, optimizer, kfac, range(2, 4))
    assert layer.damping_floor > 1e-3
    assert all(bool(torch.isfinite(f).all()) for f in layer.factors)
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())


@pytest.mark.parametrize("method", ["eigen", "inverse"])
def test_nan_factor_between_factor_updates_is_decomposed_as_identity(method: str) -> None:
    torch.manual_seed(0)
    layer = nn.Linear(3, 2)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    kfac = KFAC(layer, kl_clip=None, method=method, factor_update_steps=10, inv_update_steps=1)
    for step in range(2):
        if step == 1:
            kfac.layers[""].factors[1][0, 1] = float("nan")
        optimizer.zero_grad()
        layer(torch.randn(4, 3)).pow(2).mean().backward()
        if step == 1:
            with pytest.warns(KFACWarning, match="not finite"):
                kfac.step()
        else:
            kfac.step()
        optimizer.step()
    assert kfac.layers[""].damping_floor > 1e-3
    assert all(bool(torch.isfinite(p).all()) for p in layer.parameters())


def test_non_finite_statistics_are_skipped_with_warning() -> None:
    torch.manual_seed(0)
    layer = nn.Linear(3, 2)
    kfac = KFAC(layer, kl_clip=None)
    layer(torch.randn(4, 3)).sum().backward()
    kfac.step()
    before = [f.clone() for f in kfac.layers[""].factors]
    layer.zero_grad()
    # Inputs whose squares overflow float32: A's statistics become inf, the gradient stays usable.
    out = layer(torch.full((4, 3), 1e20))
    (out * 0).sum().backward()
    with pytest.warns(KFACWarning, match="not finite"):
        kfac.step()
    assert torch.equal(kfac.layers[""].factors[0], before[0])
    assert all(bool(torch.isfinite(p).all()) for p in layer.parameters())


@pytest.mark.parametrize("method", ["eigen", "inverse"])
def test_singular_factor_with_zero_damping_raises_damping(method: str) -> None:
    torch.manual_seed(0)
    layer = nn.Linear(3, 2, bias=False)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    kfac = KFAC(layer, damping=0.0, kl_clip=None, method=method)
    x = torch.randn(4, 3)
    x[:, 1] = 0.0  # A is singular
    layer(x).pow(2).mean().backward()
    with pytest.warns(KFACWarning, match="damping is raised"):
        kfac.step()
    optimizer.step()
    assert kfac.layers[""].damping_floor > 0
    assert all(bool(torch.isfinite(p).all()) for p in layer.parameters())


def test_unsupported_layers_are_listed_in_one_log_line(caplog: pytest.LogCaptureFixture) -> None:
    model = nn.Sequential(
        nn.Conv2d(2, 4, 3, groups=2), nn.Embedding(3, 2), nn.LayerNorm(4), nn.ReLU(), nn.Linear(4, 4)
    )
    with caplog.at_level(logging.WARNING, logger="kaisoku.optim.kfac"):
        kfac = KFAC(model, kl_clip=None)
    records = [r for r in caplog.records if r.name == "kaisoku.optim.kfac"]
    assert len(records) == 1
    message = records[0].getMessage()
    assert "0 (Conv2d with groups=2)" in message
    assert "1 (Embedding)" in message
    assert "2 (LayerNorm)" in message
    assert "ReLU" not in message
    assert list(kfac.layers) == ["4"]


def test_bn_skip_leaves_batchnorm_alone_silently(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="kaisoku.optim.kfac"):
        kfac = KFAC(_cnn(), kl_clip=None, bn="skip")
    assert list(kfac.layers) == ["0", "5"]
    assert not caplog.records


def test_autocast_bf16_keeps_factors_in_float32() -> None:
    model, optimizer, kfac = _make()
    for step in range(3):
        x, y = _batch(step)
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        kfac.step()
        optimizer.step()
    for layer in kfac.layers.values():
        for factor in layer.factors:
            assert factor is not None and factor.dtype == torch.float32
            assert bool(torch.isfinite(factor).all())
    assert all(p.dtype == torch.float32 and bool(torch.isfinite(p).all()) for p in model.parameters())


def test_callable_intervals_decide_update_steps() -> None:
    torch.manual_seed(0)
    layer = nn.Linear(3, 2)
    kfac = KFAC(layer, kl_clip=None, factor_update_steps=lambda step: 2, inv_update_steps=lambda step: 3)
    history = []
    for _ in range(4):
        layer.zero_grad()
        layer(torch.randn(4, 3)).pow(2).mean().backward()
        kfac.step()
        history.append((kfac.layers[""].factors[0].clone(), kfac._decompositions[""][0][0].clone()))
    factors = [f for f, _ in history]
    vectors = [q for _, q in history]
    assert torch.equal(factors[0], factors[1]) and not torch.equal(factors[1], factors[2])
    assert torch.equal(factors[2], factors[3])
    assert torch.equal(vectors[0], vectors[2]) and not torch.equal(vectors[2], vectors[3])


def test_eval_forward_without_grad_collects_nothing() -> None:
    model, optimizer, kfac = _make()
    model.eval()
    with torch.no_grad():
        model(_batch(0)[0])
    assert all(s is None for layer in kfac.layers.values() for s in layer.stat_sums)


def test_bad_arguments_are_config_errors() -> None:
    model = nn.Linear(2, 2)
    with pytest.raises(ConfigError, match="method"):
        KFAC(model, method="cholesky", kl_clip=None)
    with pytest.raises(ConfigError, match="learning rate"):
        KFAC(model)
    with pytest.raises(ConfigError, match="memory_mode"):
        KFAC(model, memory_mode="half", kl_clip=None)


def test_gradient_accumulation_matches_one_big_batch() -> None:
    x = torch.randn(8, 3, generator=torch.Generator().manual_seed(3))
    target = torch.randn(8, 2, generator=torch.Generator().manual_seed(4))
    results = []
    for accum in (1, 2):
        torch.manual_seed(0)
        layer = nn.Linear(3, 2)
        kfac = KFAC(layer, kl_clip=None, grad_accum=accum)
        for chunk_x, chunk_t in zip(x.chunk(accum), target.chunk(accum)):
            (((layer(chunk_x) - chunk_t) ** 2).sum(1).mean() / accum).backward()
        kfac.step()
        results.append([f.clone() for f in kfac.layers[""].factors] + [layer.weight.grad.clone()])
    for single, accumulated in zip(*results):
        torch.testing.assert_close(accumulated, single, rtol=1e-5, atol=1e-6)


def test_without_torch_distributed_it_is_one_process_owning_all_work() -> None:
    import torch.distributed as dist

    assert not dist.is_initialized()
    kfac = KFAC(nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2)), kl_clip=None)
    assert (kfac.comm.group, kfac.comm.rank, kfac.comm.world_size) == (None, 0, 1)
    assert not kfac.comm.distributed
    assert set(kfac.assignment.values()) == {0}


def _host_syncs_of_a_precondition_step(depth: int) -> int:
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(16, 16), nn.ReLU()]
    model = nn.Sequential(*layers, nn.Linear(16, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    kfac = KFAC(model, lr=optimizer, factor_update_steps=4, inv_update_steps=4)
    x, y = torch.randn(32, 16), torch.randint(0, 4, (32,))
    for step in range(6):  # step 5 updates neither factors nor decompositions
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        if step < 5:
            kfac.step()
            optimizer.step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        kfac.step()
    return sum(1 for event in prof.events() if event.name == "aten::_local_scalar_dense")


def test_preconditioning_reads_no_scalar_per_layer() -> None:
    # On a GPU every read of a device scalar drains the queue; per-layer checks made it two per layer. The
    # one read left (a tolist of the stacked flags and KL term) is not an aten op on the CPU.
    assert _host_syncs_of_a_precondition_step(2) == _host_syncs_of_a_precondition_step(12) == 0


@pytest.mark.parametrize(
    ("name", "bad"),
    [
        ("factor_update_steps", 0),
        ("inv_update_steps", 0),
        ("damping", -1.0),
        ("factor_decay", 1.0),
        ("kl_clip", -0.5),
        ("bucket_cap_mb", 0.0),
        ("stat_fraction", 0.0),
        ("overhead_target", 1.0),
        ("method", "newton"),
        ("bn", "full"),
    ],
)
def test_config_and_constructor_refuse_a_setting_alike(name: str, bad: object) -> None:
    """One home for K-FAC's ranges and choices: ``optim.kfac.<name>`` in the config and ``KFAC(<name>=)``
    from Python are refused with the same words."""
    cfg = Config()
    setattr(cfg.optim.kfac, name, bad)
    with pytest.raises(ConfigError) as from_config:
        validate(cfg)
    with pytest.raises(ConfigError) as from_python:
        KFAC(nn.Linear(4, 2), lr=0.1, **{name: bad})
    assert str(from_config.value) == f"optim.kfac.{str(from_python.value).removeprefix('K-FAC ')}"
    assert name in str(from_python.value)


def test_kl_clip_zero_switches_clipping_off_as_in_the_config() -> None:
    """``kl_clip=0`` means no KL clipping (the config's meaning), so no learning rate is needed."""
    assert KFAC(nn.Linear(4, 2), kl_clip=0.0).kl_clip is None


class Conv1D(nn.Module):
    """Hugging Face's ``Conv1D`` as GPT-2 has it: a linear map with its weight stored transposed (nx, nf)."""

    def __init__(self, nf: int, nx: int) -> None:
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.2)
        self.bias = nn.Parameter(torch.randn(nf) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight).reshape(*x.shape[:-1], self.nf)


def test_a_transposed_conv1d_is_preconditioned_as_the_linear_it_is() -> None:
    """GPT-2's layers: K-FAC preconditions a Conv1D exactly as the nn.Linear holding its weight transposed."""
    torch.manual_seed(0)
    transposed = nn.Sequential(Conv1D(6, 5), nn.Tanh(), Conv1D(3, 6))
    plain = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3))
    with torch.no_grad():
        for conv, linear in ((transposed[0], plain[0]), (transposed[2], plain[2])):
            linear.weight.copy_(conv.weight.T)
            linear.bias.copy_(conv.bias)
    x = torch.randn(4, 7, 5)  # sequences: every position is a row of the factors
    kfacs = [KFAC(model, damping=1e-2, kl_clip=None, inv_update_steps=1) for model in (transposed, plain)]
    assert sorted(kfacs[0].layers) == ["0", "2"]  # both hooked, none left to the base optimizer
    raw = {}
    for model, kfac in zip((transposed, plain), kfacs):
        model.zero_grad()
        model(x).square().mean().backward()
        raw[id(model)] = [p.grad.clone() for p in model.parameters()]
        kfac.step()
    for conv, linear in ((transposed[0], plain[0]), (transposed[2], plain[2])):
        assert torch.allclose(conv.weight.grad.T, linear.weight.grad, atol=1e-6)
        assert torch.allclose(conv.bias.grad, linear.bias.grad, atol=1e-6)
    preconditioned = [p.grad for p in transposed.parameters()]
    assert not any(torch.allclose(a, b) for a, b in zip(raw[id(transposed)], preconditioned))  # it did act
