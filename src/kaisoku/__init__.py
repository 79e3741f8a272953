"""kaisoku: fast deep-learning training at every scale, on PyTorch."""

__version__ = "0.1.0"
