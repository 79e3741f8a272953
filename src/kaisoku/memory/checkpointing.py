"""Activation checkpointing per block: keep a block's input, recompute its inside during backward.

The unit is a block of :func:`kaisoku.models.blocks.ordered_blocks` (the same blocks a pipeline is split
on). :func:`apply_recompute` replaces the model's ``forward`` with the blocks run one after the other,
the chosen ones through the non-reentrant :func:`torch.utils.checkpoint.checkpoint`:

- ``blocks``: nothing inside a checkpointed block is kept; the whole block runs again in backward.
- ``selective``: the outputs of convolutions and matrix products are kept, the cheap element-wise
  operations (normalisation, activations, additions) are recomputed
  (:func:`torch.utils.checkpoint.create_selective_checkpoint_contexts`).

Recomputation runs BatchNorm in training mode a second time, which would update its running statistics
twice; the running statistics (and ``num_batches_tracked``) of the block's BatchNorm layers are put
back after each recomputation, so a checkpointed run trains bit-identically to a plain one.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import types
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from kaisoku.errors import ConfigError
from kaisoku.memory.compress import ActivationCompressor
from kaisoku.memory.planner import block_range
from kaisoku.models.blocks import ordered_blocks

RecomputeMode = Literal["none", "blocks", "selective"]
"""What ``memory.recompute`` does: nothing, whole blocks, or only the cheap operations."""

#: Operations whose outputs selective recomputation keeps: the expensive ones.
KEEP_OPS: frozenset[Any] = frozenset(
    op
    for op in (
        torch.ops.aten.convolution.default,
        torch.ops.aten.mm.default,
        torch.ops.aten.addmm.default,
        torch.ops.aten.bmm.default,
        torch.ops.aten.baddbmm.default,
        torch.ops.aten.linear.default,
        torch.ops.aten._scaled_dot_product_flash_attention.default,
        torch.ops.aten._scaled_dot_product_efficient_attention.default,
        getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None),
    )
    if op is not None
)


def _selective_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Keep the outputs of convolutions and matrix products; recompute everything else."""
    if getattr(op, "default", op) in KEEP_OPS or op in KEEP_OPS:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _batchnorm_buffers(block: nn.Module) -> list[torch.Tensor]:
    """Running statistics of every BatchNorm layer in ``block`` (what a recomputation would change)."""
    buffers: list[torch.Tensor] = []
    for module in block.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.track_running_stats:
            buffers.extend(
                b
                for b in (module.running_mean, module.running_var, module.num_batches_tracked)
                if b is not None
            )
    return buffers


@contextlib.contextmanager
def _restore_after(buffers: Sequence[torch.Tensor]) -> Iterator[None]:
    """Put ``buffers`` back as they were on entry: the forward already updated them once."""
    saved = [b.detach().clone() for b in buffers]
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, value in zip(buffers, saved):
                buffer.copy_(value)


def _contexts(mode: RecomputeMode, buffers: Sequence[torch.Tensor]) -> tuple[Any, Any]:
    """The (forward, recompute) contexts of one checkpointed call."""
    if mode == "selective":
        forward_ctx, recompute_ctx = create_selective_checkpoint_contexts(_selective_policy)
    else:
        forward_ctx, recompute_ctx = contextlib.nullcontext(), contextlib.nullcontext()
    if not buffers:
        return forward_ctx, recompute_ctx
    stack = contextlib.ExitStack()

    class _Recompute:
        def __enter__(self) -> None:
            stack.enter_context(_restore_after(buffers))
            stack.enter_context(recompute_ctx)

        def __exit__(self, *exc: object) -> None:
            stack.__exit__(*exc)

    return forward_ctx, _Recompute()


# Newer torch lets saved-tensors hooks see what selective recomputation keeps; older torch has no such
# argument (and would pass it on to the block), so it is given only where checkpoint takes it.
_HOOKS_ARGUMENT: dict[str, Any] = (
    {"respect_saved_tensors_hooks": True}
    if "respect_saved_tensors_hooks" in inspect.signature(checkpoint).parameters
    else {}
)


class CheckpointedBlock(nn.Module):
    """``block`` run through the non-reentrant checkpoint in ``mode`` (blocks or selective)."""

    def __init__(self, block: nn.Module, mode: RecomputeMode) -> None:
        super().__init__()
        self.block = block
        self.mode = mode
        self._buffers_to_restore = _batchnorm_buffers(block)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The block's output; in eval mode or without gradients the block runs plainly."""
        if not (self.training and torch.is_grad_enabled()):
            return self.block(x)
        context_fn = functools.partial(_contexts, self.mode, self._buffers_to_restore)
        return checkpoint(
            self.block,
            x,
            use_reentrant=False,
            preserve_rng_state=True,
            context_fn=context_fn,
            **_HOOKS_ARGUMENT,
        )


def parse_block_list(text: str, count: int) -> list[int]:
    """Block indices from ``"1,2,5-8"`` (empty: every block); ConfigError naming the valid range."""
    if not text.strip():
        return list(range(count))
    chosen: list[int] = []
    for part in text.split(","):
        part = part.strip()
        try:
            chosen.extend(block_range(part, count))
        except ValueError:
            raise ConfigError(f"memory.blocks: '{part}' is not an index or a range like 2-5") from None
        except IndexError:
            raise ConfigError(
                f"memory.blocks: '{part}' is outside the model's blocks 0-{count - 1}"
            ) from None
    return sorted(set(chosen))


def apply_recompute(model: nn.Module, mode: RecomputeMode, blocks: str = "") -> list[int]:
    """Make ``model`` checkpoint the blocks listed in ``blocks`` (all when empty) in ``mode``.

    The model keeps its parameters, buffers and ``state_dict`` names; only its ``forward`` changes (an
    instance attribute running the ordered blocks). Returns the indices checkpointed (none for ``none``).
    """
    if mode == "none":
        return []
    parts = ordered_blocks(model)
    chosen = parse_block_list(blocks, len(parts))
    _install(model, [CheckpointedBlock(part, mode) if i in chosen else part for i, part in enumerate(parts)])
    return chosen


class HookedBlock(nn.Module):
    """``block`` run inside the saved-tensors hooks that ``saving()`` returns (compression, offload)."""

    def __init__(
        self, block: nn.Module, saving: Callable[[], contextlib.AbstractContextManager[Any]]
    ) -> None:
        super().__init__()
        self.block = block
        self.saving = saving

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The block's output; what it saves for backward goes through the hooks while training."""
        if not (self.training and torch.is_grad_enabled()):
            return self.block(x)
        with self.saving():
            return self.block(x)


def apply_techniques(
    model: nn.Module,
    techniques: Sequence[str],
    *,
    compress: str = "bf16",
    offload: Any = None,
) -> None:
    """Run each ordered block of ``model`` with its technique: keep, compress, int8, recompute or offload.

    ``compress``: the mode of ``compress`` blocks (bf16 or int8; ``int8`` blocks are int8; one
    :class:`~kaisoku.memory.compress.ActivationCompressor` each); ``offload``: a
    :mod:`kaisoku.memory.offload` store (its ``hooks()`` per block, its ``begin()`` once per step).
    """
    parts = ordered_blocks(model)
    if len(techniques) != len(parts):
        raise ConfigError(f"a memory plan for {len(techniques)} blocks given to a model of {len(parts)}")
    if "offload" in techniques and offload is None:
        raise ConfigError("a memory plan offloads a block but no offload is set up (memory.offload_dir)")
    runners: list[Callable[[torch.Tensor], torch.Tensor]] = []
    for part, technique in zip(parts, techniques):
        if technique == "recompute":
            runners.append(CheckpointedBlock(part, "blocks"))
        elif technique in ("compress", "int8"):
            mode = "int8" if technique == "int8" else compress
            runners.append(HookedBlock(part, ActivationCompressor(mode).step))  # type: ignore[arg-type]
        elif technique == "offload":
            runners.append(HookedBlock(part, offload.hooks))
        else:
            runners.append(part)
    _install(model, runners, before=offload.begin if "offload" in techniques else None)


def _install(
    model: nn.Module,
    runners: Sequence[Callable[[torch.Tensor], torch.Tensor]],
    before: Callable[[], None] | None = None,
) -> None:
    """Replace ``model.forward`` with ``runners`` applied in turn (``before()`` first when training)."""

    def forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if before is not None and self.training and torch.is_grad_enabled():
            before()
        for runner in runners:
            if isinstance(runner, (CheckpointedBlock, HookedBlock)):
                runner.train(self.training)  # the wrapper is not a submodule: follow the model's mode
            x = runner(x)
        return x

    # Not a submodule: the wrappers hold the model's own tensors, and state_dict names stay unchanged.
    model.forward = types.MethodType(forward, model)  # type: ignore[method-assign]
