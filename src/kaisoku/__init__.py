"""kaisoku: fast deep-learning training at every scale, on PyTorch.

``kaisoku.fit(config, model=..., data=...)`` trains your own model with every kaisoku feature;
``kaisoku.launch(main, nproc=N)`` runs a script's ``main`` on N local ranks (or as it is under torchrun or
srun); ``kaisoku.Config`` is the run's settings (the same tree as ``kaisoku train --help``) and
``kaisoku.ModelSpec`` what a model factory is given.
"""

from typing import Any

__version__ = "0.1.0"

#: Public names loaded on first use: ``import kaisoku`` (and so every ``kaisoku`` command) stays quick.
_LAZY = {
    "fit": "kaisoku.api",
    "launch": "kaisoku.api",
    "Config": "kaisoku.config",
    "ModelSpec": "kaisoku.parts",
}

__all__ = ["Config", "ModelSpec", "__version__", "fit", "launch"]


def __getattr__(name: str) -> Any:
    """``kaisoku.fit``, ``kaisoku.launch``, ``kaisoku.Config``, ``kaisoku.ModelSpec``, imported when first used."""
    if name in _LAZY:
        import importlib  # start-up: the training stack loads only when one of these names is used

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'kaisoku' has no attribute {name!r}")
