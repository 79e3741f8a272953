"""Images re-encoded while packing, as a fast loader's own format stores them: JPEG at a chosen quality and
chroma subsampling, with the longer side capped; tiny images as raw pixels. Fewer bytes and 4:2:0 chroma
decode faster than the source's 4:4:4 JPEGs or PNGs; the cost is a second lossy encoding, so it is off
unless asked for. Raw pixels (binary PNM: ``P6`` RGB, ``P5`` grey, 8 bits) are lossless and read by a copy,
with no decoding, at several times the bytes of a JPEG."""

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
    """How packing re-encodes each image: JPEG ``quality`` (1-100; 0: keep the source's bytes),
    ``subsampling`` (444, 422 or 420), ``max_side`` (0: keep the size) capping the longer side, the aspect
    kept, and ``raw_side`` (0: none): an image whose longer side is at most this, once capped, is stored as
    raw pixels (:func:`raw_pixel_bytes`) instead."""

    quality: int = 90
    subsampling: str = "420"
    max_side: int = 0
    raw_side: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.quality <= 100:
            raise ValueError(f"JPEG quality {self.quality} is outside 0..100 (0: keep the source's bytes)")
        if self.quality == 0 and self.max_side:
            raise ValueError("a max side needs a JPEG quality to re-encode the images it resizes")
        if self.quality == 0 and not self.raw_side:
            raise ValueError(
                "JPEG quality 0 keeps the source's bytes: give a raw side, or nothing is recoded"
            )
        if self.subsampling not in SUBSAMPLINGS:
            raise ValueError(f"JPEG subsampling {self.subsampling} is not one of {', '.join(SUBSAMPLINGS)}")
        if self.max_side < 0:
            raise ValueError(f"max side {self.max_side} is negative")
        if self.raw_side < 0:
            raise ValueError(f"raw side {self.raw_side} is negative")

    def record(self) -> dict[str, Any]:
        """The settings as the index records them (``pack.recode``)."""
        return asdict(self)

    def __call__(self, data: bytes) -> bytes:
        """``data`` (an image file's bytes) re-encoded by these settings: raw pixels, a JPEG, or (quality 0,
        larger than ``raw_side``) ``data`` itself."""
        with Image.open(io.BytesIO(data)) as image:
            if self.quality == 0 and max(image.size) > self.raw_side:
                return data  # neither capped (quality 0 has no max side) nor raw: the source's bytes
            image = image.convert("L" if image.mode in ("L", "I;16", "1") else "RGB")
            width, height = image.size
            longer = max(width, height)
            if self.max_side and longer > self.max_side:
                scale = self.max_side / longer
                size = (max(1, round(width * scale)), max(1, round(height * scale)))
                image = image.resize(size, Image.Resampling.LANCZOS, reducing_gap=3.0)
            if max(image.size) <= self.raw_side:
                return raw_pixel_bytes(image)
            pixels = np.asarray(image)
        gray = pixels.ndim == 2
        return simplejpeg.encode_jpeg(
            np.ascontiguousarray(pixels[..., None] if gray else pixels),
            quality=self.quality,
            colorspace="GRAY" if gray else "RGB",
            colorsubsampling="Gray" if gray else SUBSAMPLINGS[self.subsampling],
        )


def raw_pixel_bytes(image: Image.Image) -> bytes:
    """An RGB or grey (``L``) image as binary PNM bytes: the header ``P6\\n<width> <height>\\n255\\n`` (``P5``
    for grey), then the pixels row by row, as :func:`kaisoku.data.loading.transforms.raw_pixels` reads them."""
    buffer = io.BytesIO()
    image.save(buffer, format="PPM")  # Pillow's writer: P6 for RGB, P5 for L, 8 bits, exactly that header
    return buffer.getvalue()
