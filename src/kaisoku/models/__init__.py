"""Model builders over torchvision and small reference models."""
