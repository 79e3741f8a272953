"""Images re-encoded while packing, as a fast loader's own format stores them: JPEG at a chosen quality and
chroma subsampling, with the longer side capped. Fewer bytes and 4:2:0 chroma decode faster than the source's
4:4:4 JPEGs or PNGs; the cost is a second lossy encoding, so it is off unless asked for."""

from __future__ import annotations

import io
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import simplejpeg
from PIL import Image

#: Chroma subsampling of the JPEGs written, as ``kaisoku pack --jpeg-subsampling`` names it.
SUBSAMPLINGS = {"444": "444", "422": "422", "420": "420"}


@dataclass(frozen=True)
class ImageRecode:
    """How packing re-encodes each image: JPEG ``quality`` (1-100), ``subsampling`` (444, 422 or 420), and
    ``max_side`` (0: keep the size) capping the longer side, the aspect kept."""

    quality: int = 90
    subsampling: str = "420"
    max_side: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.quality <= 100:
            raise ValueError(f"JPEG quality {self.quality} is outside 1..100")
        if self.subsampling not in SUBSAMPLINGS:
            raise ValueError(f"JPEG subsampling {self.subsampling} is not one of {', '.join(SUBSAMPLINGS)}")
        if self.max_side < 0:
            raise ValueError(f"max side {self.max_side} is negative")

    def record(self) -> dict[str, Any]:
        """The settings as the index records them (``pack.recode``)."""
        return asdict(self)

    def __call__(self, data: bytes) -> bytes:
        """``data`` (an image file's bytes) re-encoded as a JPEG of these settings."""
        with Image.open(io.BytesIO(data)) as image:
            image = image.convert("L" if image.mode in ("L", "I;16", "1") else "RGB")
            width, height = image.size
            longer = max(width, height)
            if self.max_side and longer > self.max_side:
                scale = self.max_side / longer
                size = (max(1, round(width * scale)), max(1, round(height * scale)))
                image = image.resize(size, Image.Resampling.LANCZOS, reducing_gap=3.0)
            pixels = np.asarray(image)
        gray = pixels.ndim == 2
        return simplejpeg.encode_jpeg(
            np.ascontiguousarray(pixels[..., None] if gray else pixels),
            quality=self.quality,
            colorspace="GRAY" if gray else "RGB",
            colorsubsampling="Gray" if gray else SUBSAMPLINGS[self.subsampling],
        )
