"""The facts a run plan is resolved from: the world's shape, the training data's and the model's, each
gathered once (:mod:`kaisoku.run_facts`) and handed to :func:`kaisoku.run_plan.resolve`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kaisoku.parts import ModelSpec

ShardLevel = Literal["none", "grad", "full"]
DataSource = Literal["packed", "folder", "generated-shapes", "generated-cosmo", "user"]
LossName = Literal["cross-entropy", "mse", "user"]
TaskKind = Literal["classification", "token-classification", "language-model", "regression", "loss-only"]
BatchForm = Literal["pairs", "nested-pairs", "dicts"]
"""How a user's samples come: (tensor input, target) pairs, pairs whose input nests tensors (a dict input goes
to the model as keyword arguments), or dicts (the whole batch goes to the model as keyword arguments)."""


@dataclass(frozen=True)
class WorldShape:
    """How many ranks a run has and how they sit on nodes: all a plan needs of the world."""

    world_size: int = 1
    ranks_per_node: int = 1

    @property
    def num_nodes(self) -> int:
        """Nodes of the run (ranks are spread evenly over them)."""
        return max(1, self.world_size // max(1, self.ranks_per_node))


@dataclass(frozen=True)
class DataFacts:
    """What a plan needs to know of the training data, read from its index, folder or dataset object."""

    source: DataSource
    """packed (kaisoku pack), folder (class sub-folders), the generated shapes or universe set, or user."""
    task: TaskKind = "classification"
    """classification (integer labels), token-classification or language-model (integer labels per token),
    or regression (float targets): as the data's targets say."""
    sample_shape: tuple[int, ...] = ()
    """One input sample's shape as the model gets it; () for images cropped to data.image_size."""
    in_channels: int = 3
    """Channels of an input sample."""
    num_classes: int = 0
    """Classes (or regression targets); 0 where the data does not say."""
    num_samples: int = 0
    """Training samples; 0 where not known before the data is opened (an image folder)."""
    has_val: bool = False
    """Whether a validation split exists."""
    root: str = ""
    """The dataset folder (packed or image folder); "" for the user's dataset."""
    readable: bool = True
    """False where the index could not be read: the ranks report that, with the run folder, as a data failure."""
    description: str = ""
    """How a message names the data, e.g. ``data.path /d holds images [32, 32, 3] (classification)``."""
    target_key: str | None = None
    """Where a dict sample holds its target (None: the data gives (input, target) pairs, or dicts without a
    target that only the user's loss reads)."""
    batch_form: BatchForm = "pairs"
    """How the samples come (the packed, folder and generated sets give tensor pairs)."""
    tokens_per_sample: int = 0
    """Token ids per input sample where the input is a sequence of them (``input_ids``), else 0: throughput
    is then also reported in tokens/s."""
    val_samples: int = 0
    """Validation samples, where known before the data is opened (0: unknown or none)."""


@dataclass(frozen=True)
class ModelFacts:
    """What a plan needs to know of the model: how it splits into blocks and its layer names."""

    spec: ModelSpec
    """What the model was built to take and give."""
    block_count: int | None
    """Ordered blocks (the most pipeline stages); None when the model cannot be split into blocks."""
    block_error: str = ""
    """Why the model cannot be split (one line), when ``block_count`` is None."""
    layer_names: tuple[str, ...] = ()
    """Names of its Conv/Linear layers (precision.keep may name them)."""
