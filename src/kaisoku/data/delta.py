"""The ``delta`` codec: predictive compression of arrays whose leading axis is a sequence of frames.

After TEZIP: each frame (a channel or a time step along axis 0) is predicted from the frames before it, and
only the difference between frame and prediction is stored, then zstd. The default predictor is a
per-frame linear fit on the previous frame (``x_c ≈ a_c x_{c-1} + b_c``, least squares, coefficients in
the header); :data:`PREDICTORS` is where another one (a small learned model) plugs in.

Two modes:

* ``delta``: lossless. Integer frames store ``x_c - round(pred)`` exactly; float frames store the
  difference of their bit patterns from the previous frame's.
* ``delta@E``: error-bounded. Residuals are quantised with step ``2E`` (``2 floor(E) + 1`` for integers)
  in a closed loop, predicting from the *decoded* previous frame, so errors never add up: every decoded
  value lies within ``E`` of the original. The bound is checked on every write.

Payload layout: one mode byte; ``0`` then a zstd frame of the bytes as given (non-array fields);
``1`` then a little-endian header (dtype, shape, predictor, step, residual dtype, coefficients) and a zstd
frame of the residuals, narrowed to the smallest integer type that holds them.
"""

from __future__ import annotations

import json
import struct
from typing import Protocol

import numpy as np

from kaisoku.errors import KaisokuError

_PLAIN, _PREDICTED = 0, 1
_HEAD = struct.Struct("<I")  # length of the JSON header that follows
_NARROW = (np.int8, np.int16, np.int32, np.int64)


class Predictor(Protocol):
    """Predicts frame ``c`` from the frames before it, with parameters fitted at encode time."""

    def fit(self, previous: np.ndarray, frame: np.ndarray) -> list[float]:
        """Parameters (plain floats, stored in the payload) predicting ``frame`` from ``previous``."""
        ...

    def predict(self, previous: np.ndarray, params: list[float]) -> np.ndarray:
        """The float64 prediction of the next frame from ``previous`` (frames ``0..c-1``, decoded)."""
        ...


class LinearPredictor:
    """``a * previous[-1] + b``, ``a`` and ``b`` fitted by least squares per frame."""

    def fit(self, previous: np.ndarray, frame: np.ndarray) -> list[float]:
        """Least-squares ``a``, ``b`` of ``frame`` on the last previous frame."""
        x = previous[-1].astype(np.float64).ravel()
        y = frame.astype(np.float64).ravel()
        mx, my = float(x.mean()), float(y.mean())
        var = float(((x - mx) ** 2).mean())
        a = float(((x - mx) * (y - my)).mean()) / var if var > 0 else 0.0
        return [a, my - a * mx]

    def predict(self, previous: np.ndarray, params: list[float]) -> np.ndarray:
        """``a * previous[-1] + b`` in float64."""
        out = previous[-1].astype(np.float64)
        out *= params[0]
        out += params[1]
        return out


PREDICTORS: dict[str, Predictor] = {"linear": LinearPredictor()}
"""Predictor name -> predictor; the name is stored in each payload, so a decoder needs the same entry."""


class DeltaCodec:
    """Frame-predictive codec; ``error_bound`` 0 is lossless (see the module docs)."""

    def __init__(self, error_bound: float = 0.0, predictor: str = "linear") -> None:
        import zstandard

        if not error_bound >= 0 or not np.isfinite(error_bound):
            raise KaisokuError(
                f"delta codec: the error bound must be a finite number >= 0, got {error_bound}"
            )
        if predictor not in PREDICTORS:
            raise KaisokuError(
                f"delta codec: unknown predictor {predictor!r}; known: {', '.join(PREDICTORS)}"
            )
        self.error_bound = float(error_bound)
        self.predictor = predictor
        self.name = "delta" if error_bound == 0 else f"delta@{error_bound:g}"
        self._compressor = zstandard.ZstdCompressor(level=3, write_content_size=True, threads=0)
        self._decompressor = zstandard.ZstdDecompressor()

    # -- bytes without a shape: plain zstd -----------------------------------------------------------

    def encode(self, data: bytes) -> bytes:
        """A non-array payload: zstd only."""
        return bytes([_PLAIN]) + self._compressor.compress(data)

    def decode(self, data: bytes | memoryview) -> bytes:
        """Restore either kind of payload to the raw bytes of the field."""
        view = memoryview(data)
        if len(view) == 0:
            raise ValueError("empty delta payload")
        if view[0] == _PLAIN:
            return self._decompressor.decompress(view[1:])
        if view[0] != _PREDICTED:
            raise ValueError(f"unknown delta payload mode {view[0]}")
        (size,) = _HEAD.unpack_from(view, 1)
        header = json.loads(bytes(view[1 + _HEAD.size : 1 + _HEAD.size + size]))
        body = self._decompressor.decompress(view[1 + _HEAD.size + size :])
        residual = np.frombuffer(body, dtype=np.dtype(header["residual"]))
        return _reconstruct(header, residual).tobytes()

    # -- arrays: predicted frames ----------------------------------------------------------------------

    def encode_array(self, data: bytes, dtype: str, shape: tuple[int, ...]) -> bytes:
        """Encode the raw bytes of one array of ``dtype`` and ``shape``; frames along axis 0."""
        array = np.frombuffer(data, dtype=np.dtype(dtype)).reshape(shape)
        if array.ndim < 2 or array.shape[0] < 1 or array.dtype.kind not in "iuf":
            return self.encode(data)
        header, residual = _residuals(array, self.error_bound, self.predictor)
        restored = _reconstruct(header, residual)
        _check_bound(array, restored, self.error_bound)
        meta = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
        return (
            bytes([_PREDICTED])
            + _HEAD.pack(len(meta))
            + meta
            + self._compressor.compress(np.ascontiguousarray(residual).tobytes())
        )


def _step(dtype: np.dtype, bound: float) -> float:
    """Quantisation step for ``bound`` (0: lossless)."""
    if bound == 0:
        return 0.0
    if dtype.kind in "iu":
        return float(2 * int(np.floor(bound)) + 1)
    return 2.0 * bound


def _residuals(array: np.ndarray, bound: float, predictor: str) -> tuple[dict, np.ndarray]:
    model = PREDICTORS[predictor]
    dtype = array.dtype
    step = _step(dtype, bound)
    frames = array.shape[0]
    params = [model.fit(array[:c], array[c]) for c in range(1, frames)]
    header: dict = {
        "dtype": dtype.str,
        "shape": list(array.shape),
        "predictor": predictor,
        "step": step,
        "params": params,
    }
    if step == 0 and dtype.kind == "f":
        bits = array.view(np.dtype(f"<u{dtype.itemsize}"))
        residual = bits.copy()
        residual[1:] = bits[1:] - bits[:-1]  # wraps modulo 2**bits: exact inverse by cumulative sum
        header["residual"] = residual.dtype.str
        return header, residual
    out = np.empty(array.shape, dtype=np.int64)
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        if step:
            # Decoded values stay inside the original's range (counts stay >= 0): still within the bound.
            header["range"] = [int(array.min()), int(array.max())]
        lo, hi = header.get("range", (info.min, info.max))
        decoded = np.empty(array.shape, dtype=np.int64)
        for c in range(frames):
            pred = _int_prediction(model, decoded, c, params, info)
            r = array[c] - pred
            if step == 0:
                out[c] = r
                decoded[c] = array[c]
            else:
                out[c] = np.floor_divide(r + (int(step) - 1) // 2, int(step))
                decoded[c] = np.clip(pred + out[c] * int(step), lo, hi)
    else:
        decoded_f = np.empty(array.shape, dtype=np.float64)
        for c in range(frames):
            pred = np.zeros(array.shape[1:]) if c == 0 else model.predict(decoded_f[:c], params[c - 1])
            q = np.rint((array[c].astype(np.float64) - pred) / step)
            out[c] = q.astype(np.int64)
            decoded_f[c] = (pred + q * step).astype(dtype)
    narrow = next(
        t for t in _NARROW if out.min(initial=0) >= np.iinfo(t).min and out.max(initial=0) <= np.iinfo(t).max
    )
    header["residual"] = np.dtype(narrow).str
    return header, out.astype(narrow)


def _int_prediction(
    model: Predictor, decoded: np.ndarray, c: int, params: list[list[float]], info: np.iinfo
) -> np.ndarray:
    """The int64 prediction of frame ``c`` of integer data from the decoded frames before it (0 for the first)."""
    if c == 0:
        return np.zeros(decoded.shape[1:], dtype=np.int64)
    pred = model.predict(decoded[:c], params[c - 1])
    np.rint(pred, out=pred)
    np.clip(pred, info.min, info.max, out=pred)
    return pred.astype(np.int64)


def _reconstruct(header: dict, residual: np.ndarray) -> np.ndarray:
    dtype = np.dtype(header["dtype"])
    shape = tuple(int(d) for d in header["shape"])
    residual = residual.reshape(shape)
    step = float(header["step"])
    if step == 0 and dtype.kind == "f":
        return np.cumsum(residual, axis=0, dtype=residual.dtype).view(dtype)
    model = PREDICTORS.get(header["predictor"])
    if model is None:
        raise ValueError(f"unknown delta predictor {header['predictor']!r}")
    params = header["params"]
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        lo, hi = header.get("range", (info.min, info.max))
        decoded = np.empty(shape, dtype=np.int64)
        for c in range(shape[0]):
            pred = _int_prediction(model, decoded, c, params, info)
            if step == 0:
                np.add(pred, residual[c], out=decoded[c])
            else:
                np.clip(pred + residual[c].astype(np.int64) * int(step), lo, hi, out=decoded[c])
        return decoded.astype(dtype)
    decoded_f = np.empty(shape, dtype=np.float64)
    for c in range(shape[0]):
        pred = np.zeros(shape[1:]) if c == 0 else model.predict(decoded_f[:c], params[c - 1])
        decoded_f[c] = (pred + residual[c] * step).astype(dtype)
    return decoded_f.astype(dtype)


def _check_bound(original: np.ndarray, restored: np.ndarray, bound: float) -> None:
    """Raise unless every restored value is within ``bound`` of the original (exact when 0)."""
    if bound == 0:
        if not np.array_equal(original.view(np.uint8), restored.view(np.uint8)):
            raise KaisokuError("delta codec: the lossless round trip changed the array; please report this")
        return
    error = np.abs(original.astype(np.float64) - restored.astype(np.float64))
    worst = float(error.max(initial=0.0))
    if not worst <= bound:
        raise KaisokuError(
            f"delta codec: a decoded value is {worst:g} from the original, beyond the error bound {bound:g}; "
            "raise the bound or pack losslessly (--codec delta)"
        )
