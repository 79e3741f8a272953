"""LARS and LAMB: agreement with torch SGD and the per-parameter reference, convergence, state, no host sync."""

from __future__ import annotations

import copy
import io
import itertools

import pytest
import torch
from torch import nn

from kaisoku.optim import LAMB, LARS
from kaisoku.optim.schedules import WarmupSchedule, schedule_factor
from kaisoku_bench.optim import ReferenceLARS


def small_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(2, 4, 3),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(4 * 4 * 4, 3),
        nn.Linear(3, 2),
    )


def train_steps(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    steps: int,
    *,
    lr_factors: list[float] | None = None,
    data_seed: int = 1,
) -> None:
    """A few steps on fixed random data; ``lr_factors`` rescales every group's lr before each step."""
    generator = torch.Generator().manual_seed(data_seed)
    base = [group["lr"] for group in optimizer.param_groups]
    for step in range(steps):
        if lr_factors is not None:
            for group, lr in zip(optimizer.param_groups, base):
                group["lr"] = lr * lr_factors[step]
        x = torch.randn(8, 2, 6, 6, generator=generator)
        target = torch.randn(8, 2, generator=generator)
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), target).backward()
        optimizer.step()


def assert_same_params(a: nn.Module, b: nn.Module, **tolerances: float) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(p, q, msg=lambda m, name=name: f"{name}: {m}", **tolerances)


LR_FACTORS = [1.0, 1.0, 0.5, 0.5, 0.25, 1.0, 0.1, 0.1]


@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("weight_decay", [0.0, 1e-2])
def test_without_adaptation_matches_torch_sgd(nesterov: bool, weight_decay: float) -> None:
    model = small_model()
    ours, theirs = copy.deepcopy(model), copy.deepcopy(model)
    kwargs = dict(lr=0.05, momentum=0.9, nesterov=nesterov, weight_decay=weight_decay)
    lars = LARS(ours.parameters(), adaptation=False, exclude=lambda name, p: False, **kwargs)
    sgd = torch.optim.SGD(theirs.parameters(), foreach=False, **kwargs)
    # Changing learning rates: momentum correction keeps LARS equal to torch's SGD form throughout.
    train_steps(ours, lars, 8, lr_factors=LR_FACTORS)
    train_steps(theirs, sgd, 8, lr_factors=LR_FACTORS)
    assert_same_params(ours, theirs, rtol=1e-5, atol=1e-6)


def test_default_exclusion_matches_sgd_with_no_decay_on_bn_and_bias() -> None:
    model = small_model()
    ours, theirs = copy.deepcopy(model), copy.deepcopy(model)
    lars = LARS(ours.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-2, adaptation=False)
    decay = [p for p in theirs.parameters() if p.ndim > 1]
    no_decay = [p for p in theirs.parameters() if p.ndim <= 1]
    sgd = torch.optim.SGD(
        [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=0.05,
        momentum=0.9,
        weight_decay=1e-2,
    )
    train_steps(ours, lars, 5)
    train_steps(theirs, sgd, 5)
    assert_same_params(ours, theirs, rtol=1e-5, atol=1e-6)


OPTIONS = [
    dict(zip(("nesterov", "trust_clip", "momentum_correction"), values))
    for values in itertools.product([False, True], repeat=3)
]


@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: "-".join(k for k, v in o.items() if v) or "plain")
def test_batched_matches_per_parameter_reference(options: dict[str, bool]) -> None:
    model = small_model()
    ours, ref = copy.deepcopy(model), copy.deepcopy(model)
    with torch.no_grad():  # a zero weight: trust ratio 1 by the norm-zero rule
        ours[5].weight.zero_()
        ref[5].weight.zero_()
    kwargs = dict(lr=0.2, momentum=0.9, weight_decay=1e-3, eta=0.02, **options)
    lars = LARS(ours.parameters(), **kwargs)
    reference = ReferenceLARS(ref.parameters(), **kwargs)
    train_steps(ours, lars, 6, lr_factors=LR_FACTORS)
    train_steps(ref, reference, 6, lr_factors=LR_FACTORS)
    assert_same_params(ours, ref, rtol=1e-5, atol=1e-6)
    # The adaptation really acted: plain SGD lands elsewhere.
    plain = copy.deepcopy(model)
    with torch.no_grad():
        plain[5].weight.zero_()
    train_steps(plain, LARS(plain.parameters(), adaptation=False, **kwargs), 6, lr_factors=LR_FACTORS)
    assert not torch.allclose(plain[0].weight, ours[0].weight, atol=1e-4)


def test_groups_and_name_predicate_match_reference() -> None:
    model = small_model()
    ours, ref = copy.deepcopy(model), copy.deepcopy(model)

    def head(name: str, param: torch.Tensor) -> bool:
        return name.startswith("5.")

    def groups(m: nn.Module) -> list[dict]:
        named = list(m.named_parameters())
        return [
            {"params": [(n, p) for n, p in named if n.startswith("0.")], "lars_exclude": True},
            {
                "params": [(n, p) for n, p in named if not n.startswith("0.")],
                "eta": 0.05,
                "weight_decay": 0.0,
            },
        ]

    kwargs = dict(lr=0.1, momentum=0.9, weight_decay=1e-3, eta=0.01, exclude=head)
    train_steps(ours, LARS(groups(ours), **kwargs), 5)
    train_steps(ref, ReferenceLARS(groups(ref), **kwargs), 5)
    assert_same_params(ours, ref, rtol=1e-5, atol=1e-6)


def test_excluded_parameter_takes_a_plain_sgd_step() -> None:
    weight = torch.ones(2, 3, requires_grad=True)
    bias = torch.ones(3, requires_grad=True)
    optimizer = LARS([weight, bias], lr=0.5, momentum=0.9, weight_decay=0.1, eta=0.01)
    weight.grad = torch.full((2, 3), 2.0)
    bias.grad = torch.full((3,), 2.0)
    optimizer.step()
    # bias (ndim 1): excluded, no weight decay: 1 - 0.5 * 2
    torch.testing.assert_close(bias, torch.zeros(3, requires_grad=True))
    # weight: trust = 0.01 * ||w|| / (||g|| + 0.1 ||w||) with ||w|| = sqrt(6), ||g|| = 2 sqrt(6)
    trust = 0.01 / (2 + 0.1)
    expected = 1 - 0.5 * trust * (2 + 0.1 * 1)
    torch.testing.assert_close(weight, torch.full((2, 3), expected, requires_grad=True))


def rosenbrock(w: torch.Tensor) -> torch.Tensor:
    x, y = w[0, 0], w[0, 1]
    return (1 - x) ** 2 + 100 * (y - x**2) ** 2


@pytest.mark.parametrize(
    "make",
    [lambda p: LARS([p], lr=1.0, eta=0.02, momentum=0.9), lambda p: LAMB([p], lr=0.05)],
    ids=["lars", "lamb"],
)
def test_converges_on_rosenbrock(make) -> None:
    w = torch.tensor([[-1.5, 2.0]], requires_grad=True)  # 2-D, so it is adapted
    optimizer = make(w)
    steps = 2000
    scheduler = WarmupSchedule(optimizer, schedule_factor("cosine", total_steps=steps))
    start = rosenbrock(w).item()
    for _ in range(steps):
        optimizer.zero_grad()
        rosenbrock(w).backward()
        optimizer.step()
        scheduler.step()
    assert rosenbrock(w).item() < 1e-6 < start
    torch.testing.assert_close(w.detach(), torch.ones(1, 2), atol=1e-3, rtol=0)


@pytest.mark.parametrize("cls", [LARS, LAMB])
def test_state_dict_round_trip(cls: type) -> None:
    model = small_model()
    first = copy.deepcopy(model)
    optimizer = cls(first.named_parameters(), lr=0.05, weight_decay=1e-3)
    train_steps(first, optimizer, 3)
    buffer = io.BytesIO()
    torch.save(optimizer.state_dict(), buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)

    second = copy.deepcopy(first)
    resumed = cls(second.named_parameters(), lr=0.05, weight_decay=1e-3)
    resumed.load_state_dict(saved)
    assert resumed.state_dict()["param_groups"] == optimizer.state_dict()["param_groups"]
    train_steps(first, optimizer, 3, data_seed=7)
    train_steps(second, resumed, 3, data_seed=7)
    assert_same_params(first, second, rtol=0, atol=0)


@pytest.mark.parametrize(
    "make",
    [
        lambda params: LARS(params, lr=0.1, weight_decay=1e-4),
        lambda params: LARS(params, lr=0.1, weight_decay=1e-4, nesterov=True, trust_clip=True),
        lambda params: LARS(params, lr=0.1, momentum_correction=False, nesterov=True, weight_decay=1e-4),
        lambda params: LAMB(params, lr=0.01, weight_decay=1e-2),
    ],
    ids=["lars", "lars-nesterov-clip", "lars-no-correction", "lamb"],
)
def test_step_runs_on_meta_tensors(make) -> None:
    # On meta tensors .item() and bool() raise: a step that finishes never read a value on the host.
    model = small_model().to("meta")
    for p in model.parameters():
        p.grad = torch.empty_like(p)
    optimizer = make(model.parameters())
    optimizer.step()
    optimizer.step()
    with pytest.raises(RuntimeError, match="meta"):
        bool(next(model.parameters()).sum() > 0)


def test_grads_are_not_modified_and_missing_grads_are_skipped() -> None:
    model = small_model()
    optimizer = LARS(model.parameters(), lr=0.1, weight_decay=1e-2, nesterov=True)
    train_steps(model, optimizer, 1)
    frozen = model[5].weight
    frozen.grad = None
    before = frozen.detach().clone()
    grads = {p: p.grad.clone() for p in model.parameters() if p.grad is not None}
    optimizer.step()
    for p, g in grads.items():
        assert torch.equal(p.grad, g)
    assert torch.equal(frozen, before)

    fresh = nn.Linear(3, 2)
    untouched = LARS(fresh.parameters(), lr=0.1)
    fresh.weight.grad = torch.ones_like(fresh.weight)
    untouched.step()
    assert fresh.bias not in untouched.state
    assert "momentum_buffer" in untouched.state[fresh.weight]


def test_sparse_gradient_is_rejected() -> None:
    embedding = nn.Embedding(10, 4, sparse=True)
    optimizer = LARS(embedding.parameters(), lr=0.1)
    embedding(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(RuntimeError, match="sparse"):
        optimizer.step()


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(lr=0.0), "lr"),
        (dict(lr=-1.0), "lr"),
        (dict(eta=0.0), "eta"),
        (dict(eta=-0.1), "eta"),
        (dict(weight_decay=-1.0), "weight_decay"),
        (dict(momentum=1.0), "momentum"),
    ],
)
def test_bad_hyper_parameters_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=rf"\b{field}\b"):
        LARS(nn.Linear(2, 2).parameters(), **kwargs)


def test_bad_group_hyper_parameter_names_the_field() -> None:
    layer = nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"\beta\b"):
        LARS([{"params": [layer.weight], "eta": 0.0}, {"params": [layer.bias]}], lr=0.1)


def lamb_reference(
    params: list[torch.Tensor], state: dict, *, lr: float, betas, eps: float, wd: float
) -> None:
    """One LAMB step, one tensor at a time (ndim <= 1 excluded from ratio and decay)."""
    beta1, beta2 = betas
    with torch.no_grad():
        for p in params:
            if p.grad is None:
                continue
            s = state.setdefault(p, {"t": 0, "m": torch.zeros_like(p), "v": torch.zeros_like(p)})
            s["t"] += 1
            s["m"].mul_(beta1).add_(p.grad, alpha=1 - beta1)
            s["v"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
            update = (s["m"] / (1 - beta1 ** s["t"])) / ((s["v"] / (1 - beta2 ** s["t"])).sqrt() + eps)
            if p.ndim > 1:
                update = update + wd * p
                w_norm, u_norm = p.norm(), update.norm()
                ratio = (w_norm / u_norm).clamp(max=10.0) if w_norm > 0 and u_norm > 0 else 1.0
                update = update * ratio
            p.add_(update, alpha=-lr)


def test_lamb_matches_per_parameter_reference() -> None:
    # No bias in front of BatchNorm: its gradient is rounding noise, which Adam's normalisation amplifies.
    model = small_model()
    model[0].bias = None
    ours, ref = copy.deepcopy(model), copy.deepcopy(model)
    lamb = LAMB(ours.parameters(), lr=0.01, weight_decay=1e-2)
    state: dict = {}
    generator = torch.Generator().manual_seed(3)
    for _ in range(4):
        x = torch.randn(8, 2, 6, 6, generator=generator)
        for module in (ours, ref):
            module.zero_grad()
            module(x).square().mean().backward()
        lamb.step()
        lamb_reference(list(ref.parameters()), state, lr=0.01, betas=(0.9, 0.999), eps=1e-6, wd=1e-2)
    assert_same_params(ours, ref, rtol=1e-5, atol=1e-6)


def test_cpu_step_is_a_few_batched_calls_without_host_syncs() -> None:
    from kaisoku_bench.optim import profile_step

    torch.manual_seed(0)
    layers = [nn.Linear(8, 8) for _ in range(40)]
    model = nn.Sequential(*layers, nn.BatchNorm1d(8))
    optimizer = LARS(model.parameters(), lr=0.1, weight_decay=1e-4, nesterov=True, trust_clip=True)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()
    counts = profile_step(optimizer)
    assert counts["host_syncs"] == 0
    # 82 tensors, yet a constant number of operator calls: the work is batched, not per parameter.
    assert counts["top_level_calls"] <= 30
    reference = ReferenceLARS(model.parameters(), lr=0.1, weight_decay=1e-4)
    reference.step()
    assert profile_step(reference)["host_syncs"] == 2 * 40
