"""The compiled LARS and LAMB updates agree with the eager ones within float tolerance."""

from __future__ import annotations

import pytest
import torch

from kaisoku.optim import LAMB, LARS
from kaisoku.optim.schedules import WarmupSchedule
from tests.optim.test_lars import small_model, train_steps


@pytest.mark.parametrize(
    "make",
    [
        lambda params, compile: LARS(params, lr=0.2, weight_decay=1e-3, eta=0.02, compile=compile),
        lambda params, compile: LARS(
            params, lr=0.2, weight_decay=1e-3, eta=0.02, nesterov=True, trust_clip=True, compile=compile
        ),
        lambda params, compile: LAMB(params, lr=0.01, weight_decay=1e-2, compile=compile),
    ],
    ids=["lars", "lars-nesterov-clip", "lamb"],
)
def test_compiled_step_matches_eager(make) -> None:
    # Fixed gradients drawn per step (not a model's): a bias in front of BatchNorm has a gradient of pure
    # rounding noise, which would make two exact-in-theory runs drift apart for reasons unrelated to the
    # optimizer.
    generator = torch.Generator().manual_seed(0)
    shapes = [(8, 4, 3, 3), (8,), (8,), (10, 8), (10,)]
    start = [torch.randn(shape, generator=generator) * 0.1 for shape in shapes]
    eager_params = [t.clone().requires_grad_(True) for t in start]
    compiled_params = [t.clone().requires_grad_(True) for t in start]
    eager = make(eager_params, False)
    compiled = make(compiled_params, True)
    # A learning rate that changes every step: the compiled path must follow it without recompiling.
    schedules = [WarmupSchedule(opt, lambda step: 1.0 / (1 + step)) for opt in (eager, compiled)]
    for _ in range(4):
        grads = [torch.randn(shape, generator=generator) * 0.01 for shape in shapes]
        for params, optimizer, schedule in zip((eager_params, compiled_params), (eager, compiled), schedules):
            for param, grad in zip(params, grads):
                param.grad = grad.clone()
            optimizer.step()
            schedule.step()
    for index, (p, q) in enumerate(zip(eager_params, compiled_params)):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=lambda m, i=index: f"tensor {i}: {m}")
    moved = sum(float((p.detach() - s).abs().sum()) for p, s in zip(eager_params, start))
    assert moved > 0  # the steps did something


def test_compiled_lamb_state_keeps_python_step_counts() -> None:
    model = small_model()
    optimizer = LAMB(model.parameters(), lr=0.01, compile=True)
    train_steps(model, optimizer, 2)
    steps = {state["step"] for state in optimizer.state.values()}
    assert steps == {2}
