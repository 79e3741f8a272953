"""Payload codecs (raw, zstd, lz4) and encoded-image sniffing.

A codec compresses the non-image fields of a record (bytes, strings, arrays). Images stay in
their own encoding (JPEG, PNG, ...) and are decoded late, in the loader; compressing them again
would cost CPU and save nothing. Codec objects are cheap and created per thread, because zstd
(de)compressor contexts are neither thread-safe nor picklable.
"""

from __future__ import annotations

import importlib.util
import io
import threading
from typing import Protocol

from kaisoku.data.shards.delta import DeltaCodec, parse_delta
from kaisoku.errors import KaisokuError

ZSTD_LEVEL = 3
"""zstd level used when packing: fast to write, and decompression speed does not depend on it."""

_JPEG_MAGIC = b"\xff\xd8\xff"
_PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


class Codec(Protocol):
    """Compresses and restores one field payload."""

    name: str

    def encode(self, data: bytes) -> bytes:
        """Compress ``data``; the output must be a pure function of the input bytes."""
        ...

    def decode(self, data: bytes | memoryview) -> bytes:
        """Restore the bytes given to :meth:`encode`."""
        ...


class RawCodec:
    """Stores payloads as they are."""

    name = "raw"

    def encode(self, data: bytes) -> bytes:
        """Return ``data`` unchanged."""
        return data

    def decode(self, data: bytes | memoryview) -> bytes:
        """Return ``data`` as bytes."""
        return bytes(data)


class ZstdCodec:
    """zstd frames with the content size in the header (single-threaded, deterministic)."""

    name = "zstd"

    def __init__(self) -> None:
        import zstandard

        self._compressor = zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_content_size=True, threads=0)
        self._decompressor = zstandard.ZstdDecompressor()

    def encode(self, data: bytes) -> bytes:
        """Compress ``data`` into one zstd frame."""
        return self._compressor.compress(data)

    def decode(self, data: bytes | memoryview) -> bytes:
        """Decompress one zstd frame."""
        return self._decompressor.decompress(data)


class Lz4Codec:
    """lz4 frames (needs the optional ``lz4`` package)."""

    name = "lz4"

    def __init__(self) -> None:
        import lz4.frame

        self._frame = lz4.frame

    def encode(self, data: bytes) -> bytes:
        """Compress ``data`` into one lz4 frame with the content size stored."""
        return self._frame.compress(data, store_size=True)

    def decode(self, data: bytes | memoryview) -> bytes:
        """Decompress one lz4 frame."""
        return self._frame.decompress(bytes(data))


def _delta(error_bound: str = "0") -> Codec:
    """The frame-predictive codec of :mod:`kaisoku.data.shards.delta` (``delta``, ``delta@E``, ``delta@log1p:E``)."""
    bound, mode = parse_delta(error_bound)
    return DeltaCodec(bound, error_mode=mode)


_FACTORIES: dict[str, type | object] = {"raw": RawCodec, "zstd": ZstdCodec, "lz4": Lz4Codec, "delta": _delta}
_REQUIRES = {"zstd": "zstandard", "lz4": "lz4", "delta": "zstandard"}
_local = threading.local()


def codec_names() -> list[str]:
    """Every codec name the format knows, installed or not."""
    return list(_FACTORIES)


def available_codecs() -> list[str]:
    """The codec names usable in this environment."""
    return [
        name
        for name in _FACTORIES
        if name not in _REQUIRES or importlib.util.find_spec(_REQUIRES[name]) is not None
    ]


def get_codec(name: str) -> Codec:
    """The codec called ``name``, one instance per thread; a clear error for unknown or missing ones."""
    cache: dict[str, Codec] | None = getattr(_local, "codecs", None)
    if cache is None:
        cache = _local.codecs = {}
    codec = cache.get(name)
    if codec is not None:
        return codec
    base, _, argument = name.partition("@")  # a parameterised codec: delta@0.5
    if base not in _FACTORIES or (argument and base != "delta"):
        raise KaisokuError(f"unknown codec {name!r}; choose one of {', '.join(codec_names())}")
    module = _REQUIRES.get(base)
    if module is not None and importlib.util.find_spec(module) is None:
        raise KaisokuError(f"codec {name!r} needs the {module!r} package: pip install {module}")
    codec = _FACTORIES[base](argument) if argument else _FACTORIES[base]()  # type: ignore[operator]
    cache[name] = codec
    return codec


def image_format(data: bytes | memoryview) -> str | None:
    """``"jpeg"`` or ``"png"`` from the leading magic bytes, ``None`` for anything else."""
    head = bytes(data[:8])
    if head.startswith(_JPEG_MAGIC):
        return "jpeg"
    if head.startswith(_PNG_MAGIC):
        return "png"
    return None


def check_image(data: bytes, *, name: str) -> None:
    """Raise :class:`KaisokuError` naming ``name`` unless ``data`` is a complete, decodable image.

    JPEG is decoded by simplejpeg at 1/8 scale (every entropy-coded byte is still read, so a
    truncated or damaged stream fails, at a fraction of a full decode's cost); PNG chunks are
    checked against their CRCs by Pillow; other formats are fully decoded by Pillow.
    """
    if image_format(data) == "jpeg":
        import simplejpeg

        try:
            simplejpeg.decode_jpeg(data, colorspace="RGB", min_factor=8, strict=True)
        except ValueError:
            pass  # CMYK and other colour spaces simplejpeg refuses: let Pillow judge
        else:
            return
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as image:
            if image_format(data) == "png":
                image.verify()
            else:
                image.load()
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as error:
        raise KaisokuError(
            f"cannot decode image {name} ({len(data)} bytes): {error}; "
            "re-encode or remove it, or pack with skip_corrupt (--skip-corrupt) to leave it out"
        ) from None
