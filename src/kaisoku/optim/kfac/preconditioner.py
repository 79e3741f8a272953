"""``KFAC``: a Kronecker-factored preconditioner in front of any base optimizer, data-parallel aware."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from kaisoku.config_sections import kfac_choices, kfac_setting_error
from kaisoku.errors import ConfigError
from kaisoku.optim.kfac.assignment import rank_loads
from kaisoku.optim.kfac.checkpoint import load_state, save_state
from kaisoku.optim.kfac.decompositions import (
    MAX_DAMPING_RAISES,
    FactorDecompositions,
    KFACWarning,  # noqa: F401  (its public home was this module)
    raise_damping_floor,
)
from kaisoku.optim.kfac.discovery import hook_layers
from kaisoku.optim.kfac.distributed import (
    BucketedAllReduce,
    Communicator,
    agree_max,
    broadcast_from_owners,
    resolve_group,
)
from kaisoku.optim.kfac.intervals import MAX_INTERVAL, IntervalTuner
from kaisoku.optim.kfac.layers import BatchNormLayer, Clock, KFACLayer, KroneckerLayer
from kaisoku.optim.kfac.running_averages import blend_factors, statistics_to_reduce

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

logger = logging.getLogger("kaisoku.optim.kfac")

IntSchedule = int | Callable[[int], int]
FloatSchedule = float | Callable[[int], float]

METHODS = kfac_choices("method")
MEMORY_MODES = kfac_choices("memory_mode")
BN_MODES = kfac_choices("bn")
#: ``factor_dtype`` name -> dtype of the Kronecker factors' statistics and storage.
FACTOR_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _at(schedule: IntSchedule | FloatSchedule, step: int) -> Any:
    return schedule(step) if callable(schedule) else schedule


class KFAC:
    """Kronecker-factored approximate curvature preconditioner for Linear (Hugging Face's ``Conv1D`` too), Conv1d,
    Conv2d and BatchNorm layers.

    Use it with any base optimizer::

        kfac = KFAC(model, lr=lambda step: optimizer.param_groups[0]["lr"])
        for batch in loader:
            loss = criterion(model(batch.x), batch.y)   # the loss must be a mean over the batch
            loss.backward()
            kfac.step()          # p.grad <- preconditioned gradient
            optimizer.step()
            optimizer.zero_grad()

    ``model`` may be wrapped in ``DistributedDataParallel``; the hooks go on the inner modules. The
    gradients must already be averaged over the data-parallel ranks (DDP does that) before ``step()``;
    the factor statistics are summed over the ranks here, so every rank holds the factors of the global
    batch. With AMP the statistics are computed in float32 whatever the activation dtype; with a
    ``GradScaler`` pass it as ``grad_scaler`` and call ``scaler.unscale_(optimizer)`` before ``step()``.

    Damping: ``method="eigen"`` applies ``(G (x) A + damping I)^-1`` exactly (through the
    eigendecompositions of A and G); ``method="inverse"`` applies
    ``(G + sqrt(damping) I)^-1 dW (A + sqrt(damping) I)^-1`` (factored Tikhonov damping, with the
    damping of the last decomposition step). BatchNorm
    layers use ``(F + damping I)^-1`` on their diagonal or per-channel 2x2 Fisher.

    Args:
        model: the model (or DDP-wrapped model) whose layers to precondition.
        factor_update_steps: update the running-average factors every this many steps (int or a
            function of the step).
        inv_update_steps: recompute the decompositions every this many steps (int or function).
        damping: Tikhonov damping (float or function of the step).
        factor_decay: weight of the old running average in each factor update, in [0, 1).
        kl_clip: scale the update down so that ``lr^2 * sum(v . g) <= kl_clip``; None or 0 disables.
        lr: the base optimizer's learning rate for KL clipping: a float, a function of the step, or the
            optimizer itself (its first param group's ``lr`` is read at every step).
        method: ``"eigen"`` or ``"inverse"``.
        process_group: the data-parallel group every K-FAC collective runs on; the work assignment
            uses this process's rank in it and its size. ``None`` means what it means to
            torch.distributed: the default group when torch.distributed is initialized, else a single
            process (no collectives). A process outside the group gets ``ValueError``.
        memory_mode: ``"full"`` (every rank keeps every decomposition; owners broadcast them after
            each decomposition step) or ``"owner"`` (only a layer's owner keeps its decomposition and
            broadcasts the preconditioned gradient at every step).
        bn: ``"diagonal"`` or ``"unit"`` (unit-wise 2x2) Fisher for BatchNorm, or ``"skip"`` to leave
            BatchNorm to the base optimizer.
        skip_layers: module names or class names to leave to the base optimizer.
        grad_scaler: the ``torch.amp.GradScaler`` in use, if any, so that G is built from unscaled
            gradients.
        grad_accum: micro-batches per step when each micro-batch's loss is divided by this number
            (gradient accumulation); G is built from per-sample gradients of the undivided loss.
        bucket_cap_mb: size of the flat buffers the factor statistics are all-reduced in.
        stat_fraction: share of each batch (its first ``ceil(fraction * N)`` samples, in (0, 1]) the
            Linear and convolution factor statistics are computed on; 1 uses the whole batch. The
            sub-sample's factors estimate the whole batch's at a fraction of the cost.
        overhead_target: 0 keeps the intervals given; in (0, 1): the first steps update the factors and
            decompositions at every step and are timed, then ``choose_intervals`` picks the intervals
            (powers of two up to ``max_interval``) that keep K-FAC's amortised overhead under this
            fraction of the plain step, from the maximum of each phase over the ranks (the same choice
            everywhere). The choice is logged and kept in ``state_dict()``; ``intervals`` holds it.
        max_interval: cap on the chosen intervals.
        factor_dtype: ``"float32"`` or ``"bfloat16"``: the dtype the Linear and convolution factor
            statistics are multiplied in (their inputs), summed in and the factors are stored in
            (bfloat16 halves their memory and, where the hardware has bf16 matrix units, the statistics
            time). Statistics are all-reduced and blended in float32, decompositions always taken in
            float32; BatchNorm's Fisher stays float32.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        factor_update_steps: IntSchedule = 1,
        inv_update_steps: IntSchedule = 10,
        damping: FloatSchedule = 1e-3,
        factor_decay: FloatSchedule = 0.95,
        kl_clip: float | None = 1e-3,
        lr: FloatSchedule | torch.optim.Optimizer | None = None,
        method: str = "eigen",
        process_group: ProcessGroup | None = None,
        memory_mode: str = "full",
        bn: str = "diagonal",
        skip_layers: Iterable[str] = (),
        grad_scaler: Any = None,
        grad_accum: int = 1,
        bucket_cap_mb: float = 25.0,
        stat_fraction: float = 1.0,
        overhead_target: float = 0.0,
        max_interval: int = MAX_INTERVAL,
        factor_dtype: str = "float32",
    ) -> None:
        problem = kfac_setting_error(
            {
                "factor_update_steps": factor_update_steps,
                "inv_update_steps": inv_update_steps,
                "damping": damping,
                "factor_decay": factor_decay,
                "kl_clip": kl_clip,
                "method": method,
                "memory_mode": memory_mode,
                "bn": bn,
                "grad_accum": grad_accum,
                "bucket_cap_mb": bucket_cap_mb,
                "stat_fraction": stat_fraction,
                "overhead_target": overhead_target,
                "max_interval": max_interval,
                "factor_dtype": factor_dtype,
            },
            "K-FAC ",
        )
        if problem:
            raise ConfigError(problem)
        kl_clip = kl_clip or None  # 0 switches clipping off, as in the config
        if kl_clip is not None and lr is None:
            raise ConfigError(
                f"K-FAC KL clipping (kl_clip={kl_clip}) needs the learning rate: pass lr= a float, a "
                "function of the step or the base optimizer, or kl_clip=None"
            )
        self.factor_update_steps = factor_update_steps
        self.inv_update_steps = inv_update_steps
        self.damping = damping
        self.factor_decay = factor_decay
        self.kl_clip = kl_clip
        self.lr = lr
        self.method = method
        self.memory_mode = memory_mode
        self.bn = bn
        self.grad_scaler = grad_scaler
        self.grad_accum = int(grad_accum)
        self.factor_dtype = factor_dtype
        self.comm: Communicator = resolve_group(process_group)
        self._bucket_elements = max(1, int(bucket_cap_mb * 2**20 / 4))
        self.steps = 0
        self.clock = Clock()
        self._refresh = False
        self._tuner = IntervalTuner(overhead_target, max_interval) if overhead_target > 0 else None
        #: Called on every rank with a ``metrics.jsonl`` record and a log line when intervals are chosen.
        self.on_intervals: Callable[[dict[str, Any], str], None] | None = None

        inner = model.module if isinstance(model, DistributedDataParallel) else model
        self.layers, skipped = hook_layers(
            inner,
            bn=bn,
            skip_layers=skip_layers,
            stat_fraction=stat_fraction,
            factor_dtype=FACTOR_DTYPES[factor_dtype],
            collecting=self._collecting,
            grad_scale=self._grad_scale,
            clock=self.clock,
        )
        if skipped:
            logger.warning(
                "K-FAC leaves %d layer(s) of unsupported types to the base optimizer: %s",
                len(skipped),
                ", ".join(skipped),
            )
        self.skipped_layers = skipped
        self.clock.sync = self._tuner is not None and any(p.is_cuda for p in inner.parameters())

        # Who decomposes which factor, and the decompositions this rank holds (see FactorDecompositions).
        self._kron = [layer for layer in self.layers.values() if isinstance(layer, KroneckerLayer)]
        self.factor_decompositions = FactorDecompositions(
            self._kron, method=method, memory_mode=memory_mode, comm=self.comm
        )
        self.work_costs = self.factor_decompositions.work_costs
        self.assignment = self.factor_decompositions.assignment
        self._decompositions = self.factor_decompositions.held

    # -- schedule ------------------------------------------------------------------------------------
    def _collecting(self) -> bool:
        if self._tuner is not None and self._tuner.tuning:
            return True
        return self.steps % max(1, int(_at(self.factor_update_steps, self.steps))) == 0

    def _grad_scale(self) -> float:
        """What the output gradients are multiplied by, relative to those of a batch-mean loss."""
        scale = 1.0 / self.grad_accum
        if self.grad_scaler is not None and self.grad_scaler.is_enabled():
            scale *= float(self.grad_scaler.get_scale())
        return scale

    def _current_lr(self) -> float:
        if isinstance(self.lr, torch.optim.Optimizer):
            return float(self.lr.param_groups[0]["lr"])
        return float(_at(self.lr, self.steps))

    def owner(self, layer_name: str, factor_index: int) -> int:
        """The rank that decomposes factor ``factor_index`` (0 = A, 1 = G) of a Kronecker layer."""
        return self.factor_decompositions.owner(layer_name, factor_index)

    def rank_loads(self) -> list[float]:
        """Decomposition cost (sum of factor sizes cubed) each rank carries."""
        return rank_loads(self.work_costs, self.assignment, self.comm.world_size)

    @property
    def timings(self) -> dict[str, float]:
        """Cumulative seconds in ``factor`` (statistics and running averages), ``communication``,
        ``decomposition`` and ``precondition`` since construction."""
        return dict(self.clock.seconds)

    def remove_hooks(self) -> None:
        """Detach K-FAC from the model."""
        for layer in self.layers.values():
            layer.remove_hooks()

    # -- the step ------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self) -> None:
        """Update factors and decompositions when due, then replace each layer's ``.grad`` with the
        preconditioned, KL-clipped gradient. Call after ``backward()``, before ``optimizer.step()``."""
        step = self.steps
        damping = float(_at(self.damping, step))
        tuner = self._tuner if self._tuner is not None and self._tuner.tuning else None
        marks = [self.clock.now()] if tuner is not None else []
        factor_at_enter = self.clock.seconds.get("factor", 0.0)
        factor_step = self._collecting()
        inverse_step = step % max(1, int(_at(self.inv_update_steps, step))) == 0 or self._refresh
        inverse_step = inverse_step or (tuner is not None and tuner.decomposes())
        self._refresh = False
        if factor_step:  # while tuning, statistics and decompositions are timed apart
            self._update_factors(damping if inverse_step and tuner is None else None)
        if tuner is not None:
            marks.append(self.clock.now())
        if inverse_step and (tuner is not None or not factor_step):
            for layer in self._kron:
                self._decompose_owned(layer, damping)
        if inverse_step and self.memory_mode == "full":
            self._share_decompositions()
        if tuner is not None:
            marks.append(self.clock.now())
        self._precondition_all(damping)
        for layer in self.layers.values():
            layer.reset_stats()
        self.steps += 1
        if tuner is not None:
            factor_at_exit = self.clock.seconds.get("factor", 0.0)
            tuner.record([*marks, self.clock.now()], factor_at_enter, factor_at_exit, inverse_step)
            if tuner.ready():
                self._choose_intervals(tuner)

    @property
    def intervals(self) -> tuple[int, int] | None:
        """``(factor_update_steps, inv_update_steps)`` chosen from measured cost, or None (fixed, or not yet)."""
        return None if self._tuner is None else self._tuner.chosen

    def _choose_intervals(self, tuner: IntervalTuner) -> None:
        device = next((layer.device for layer in self.layers.values()), torch.device("cpu"))
        tuner.decide(agree_max(tuner.medians(), self.comm, device))
        self._adopt(tuner)
        if self.comm.rank == 0:
            logger.info("%s", tuner.message())
        if self.on_intervals is not None:
            record = {"event": "kfac_intervals", "step": self.steps, "target": tuner.target}
            self.on_intervals({**record, **(tuner.state_dict() or {})}, tuner.message())

    def _adopt(self, tuner: IntervalTuner) -> None:
        assert tuner.chosen is not None
        self.factor_update_steps, self.inv_update_steps = tuner.chosen
        self.clock.sync = False

    def _update_factors(self, decompose_damping: float | None) -> None:
        """All-reduce the statistic sums and counts in buckets; blend each layer's factors as its bucket
        arrives, decomposing the owned ones on a decomposition step while later buckets are in flight."""
        start = time.perf_counter()
        layers = list(self.layers.values())
        items = [statistics_to_reduce(layer) for layer in layers]
        reducer = BucketedAllReduce(items, self.comm, self._bucket_elements)
        self.clock.add("communication", time.perf_counter() - start)
        decompose_seconds = 0.0
        for index, reduced in reducer:
            layer = layers[index]
            decay = float(_at(self.factor_decay, self.steps))
            damping = float(_at(self.damping, self.steps))
            blend_factors(layer, reduced[:-1], reduced[-1], decay=decay, damping=damping, step=self.steps)
            if decompose_damping is not None and isinstance(layer, KroneckerLayer):
                t0 = time.perf_counter()
                self._decompose_owned(layer, decompose_damping, timed=False)
                decompose_seconds += time.perf_counter() - t0
        self.clock.add("communication", reducer.wait_seconds)
        self.clock.add("decomposition", decompose_seconds)
        total = time.perf_counter() - start
        self.clock.add("factor", max(0.0, total - reducer.wait_seconds - decompose_seconds))

    def _decompose_owned(self, layer: KroneckerLayer, damping: float, timed: bool = True) -> None:
        start = time.perf_counter()
        held = self._decompositions[layer.name]
        for index in range(2):
            if self.owner(layer.name, index) != self.comm.rank:
                continue
            factor = layer.factors[index]
            if factor is None:
                continue
            held[index] = self.factor_decompositions.decompose(layer, factor.float(), damping, self.steps)
        if timed:
            self.clock.add("decomposition", time.perf_counter() - start)

    def _share_decompositions(self) -> None:
        """Owners broadcast what they computed; afterwards every rank holds every decomposition."""
        if not self.comm.distributed:
            return
        start = time.perf_counter()
        self.factor_decompositions.share()
        # Packing the buffers counts as communication too.
        self.clock.add("communication", time.perf_counter() - start)

    def _precondition_layer(self, layer: KFACLayer, grad: torch.Tensor, damping: float) -> torch.Tensor:
        """The checked path: a gradient that is already not finite (an overflowing AMP step) passes untouched;
        a result that is not raises the layer's damping and retries (inverses: recomputed next step)."""
        if not bool(torch.isfinite(grad).all()):
            return grad
        why = (
            "the Fisher was singular"
            if isinstance(layer, BatchNormLayer)
            else "the preconditioned gradient was not finite"
        )
        for _ in range(MAX_DAMPING_RAISES):
            result = self._precondition_unchecked(layer, grad, damping)
            if bool(torch.isfinite(result).all()):
                return result
            raise_damping_floor(layer, damping, why, self.steps)
            if isinstance(layer, KroneckerLayer) and self.method == "inverse":
                self._refresh = True
                return grad
        return grad

    def _precondition_unchecked(self, layer: KFACLayer, grad: torch.Tensor, damping: float) -> torch.Tensor:
        """The preconditioned gradient without a finiteness check (no host synchronisation)."""
        effective = max(damping, layer.damping_floor)
        if isinstance(layer, BatchNormLayer):
            return layer.precondition(grad, effective)
        assert isinstance(layer, KroneckerLayer)
        return self.factor_decompositions.precondition(layer, grad, effective)

    def _precondition_all(self, damping: float) -> None:
        start = time.perf_counter()
        grads: dict[str, torch.Tensor] = {}
        for name, layer in self.layers.items():
            grad = layer.grad_matrix()
            if grad is not None:
                grads[name] = grad
        results: dict[str, torch.Tensor] = {}
        owner_mode = self.memory_mode == "owner" and self.comm.distributed
        per_rank: list[list[torch.Tensor]] = [[] for _ in range(self.comm.world_size)]
        for name, grad in grads.items():
            layer = self.layers[name]
            if owner_mode and isinstance(layer, KroneckerLayer):
                owner = self.owner(name, 0)
                if owner == self.comm.rank:
                    results[name] = self._precondition_layer(layer, grad, damping)
                else:
                    results[name] = torch.empty_like(grad)
                per_rank[owner].append(results[name])
            elif owner_mode:
                results[name] = self._precondition_layer(layer, grad, damping)
            else:  # checked below for all layers at once
                results[name] = self._precondition_unchecked(layer, grad, damping)
        waited = broadcast_from_owners(per_rank, self.comm) if owner_mode else 0.0
        self.clock.add("communication", waited)

        # One host synchronisation per step (on a GPU each one drains the queue): the layers' finiteness
        # flags and the KL products travel together. A layer that fails goes through the checked path.
        def kl_sum() -> list[torch.Tensor]:
            if self.kl_clip is None:
                return []
            return [torch.stack([(results[n] * grads[n]).sum() for n in results]).sum().float()]

        names = list(results)
        checks = (
            []
            if owner_mode
            else [torch.isfinite(grads[n]).all() & torch.isfinite(results[n]).all() for n in names]
        )
        host = torch.stack([*(flag.float() for flag in checks), *kl_sum()]).tolist() if names else []
        failed = [name for name, ok in zip(names, host[: len(checks)]) if not ok]
        for name in failed:
            results[name] = self._precondition_layer(self.layers[name], grads[name], damping)
        kl_terms = host[len(checks) :] if not failed else [float(t) for t in kl_sum()]

        scale = 1.0
        if self.kl_clip is not None and results:
            lr = self._current_lr()
            vg = kl_terms[0] * lr * lr
            if vg > 0 and math.isfinite(vg):
                scale = min(1.0, math.sqrt(self.kl_clip / vg))
        for name, result in results.items():
            self.layers[name].write_grad(result * scale if scale != 1.0 else result)
        self.clock.add("precondition", time.perf_counter() - start - waited)

    # -- checkpoints ---------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Step, factors, damping floors, the chosen intervals and the decompositions this rank holds
        (all of them in "full" mode; in "owner" mode only its own, the rest are recomputed from the
        factors on resume). A local operation (no collective); tensors are copies."""
        return save_state(
            steps=self.steps,
            method=self.method,
            bn=self.bn,
            layers=self.layers,
            decompositions=self._decompositions,
            intervals=None if self._tuner is None else self._tuner.state_dict(),
        )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict()`` saved; the next ``step()`` continues where that run stopped.

        Raises ``ConfigError`` when the saved layers do not match this model's.
        """
        self._refresh = load_state(
            state,
            method=self.method,
            bn=self.bn,
            layers=self.layers,
            decompositions=self._decompositions,
            needs_decomposition=self._needs_decomposition,
        )
        self.steps = int(state["steps"])
        if self._tuner is not None:
            self._tuner.load_state_dict(state.get("intervals"))
            if self._tuner.chosen is not None:  # a resumed run keeps the intervals its first steps chose
                self._adopt(self._tuner)

    def _needs_decomposition(self, layer_name: str, factor_index: int) -> bool:
        """Whether this rank uses the decomposition of that factor (all of them in "full" mode)."""
        return self.factor_decompositions.needed_here(layer_name, factor_index)
