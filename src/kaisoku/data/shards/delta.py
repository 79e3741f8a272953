"""The ``delta`` codec: predictive compression of arrays whose leading axis is a sequence of frames.

After TEZIP: each frame (a channel or a time step along axis 0) is predicted from the frames before it, and
only the difference between frame and prediction is stored, then zstd. The default predictor is a
per-frame linear fit on the previous frame (``x_c ≈ a_c x_{c-1} + b_c``, least squares, coefficients in
the header); :data:`PREDICTORS` is where another one (a small learned model) plugs in.

Three modes (:func:`delta_codec_name` builds the codec name of each, :func:`parse_delta` reads it back):

* ``delta``: lossless. Integer frames store ``x_c - round(pred)`` exactly; float frames store the
  difference of their bit patterns from the previous frame's.
* ``delta@E`` (absolute bound): residuals are quantised with step ``2E`` (``2 floor(E) + 1`` for
  integers) in a closed loop, predicting from the *decoded* previous frame, so errors never add up: every
  decoded value lies within ``E`` of the original.
* ``delta@log1p:E`` (bound in the ``log1p`` domain, for non-negative integer counts):
  ``|log1p(decoded) - log1p(original)| <= E``, i.e. a relative bound on ``1 + x``. The counts are first
  mapped to levels (consecutive runs of integers, each represented by one integer within ``E`` of all of
  them in ``log1p``; small counts keep a level of their own, so they stay exact), and the level indices
  are then coded losslessly as above. This is the bound that matters when the model sees ``log1p(x)``.

Every lossy write decodes the stored payload and checks the bound on every value.

Payload layout: one mode byte; ``0`` then a zstd frame of the bytes as given (non-array fields);
``1`` then a little-endian header (dtype, shape, predictor, step, residual dtype, coefficients, value
range) and a zstd frame of the residuals, narrowed to the smallest integer type that holds them (in
``log1p`` mode preceded by the level table, ``levels`` values of the array's dtype).
"""

from __future__ import annotations

import json
import math
import struct
from typing import Protocol

import numpy as np

from kaisoku.errors import KaisokuError

_PLAIN, _PREDICTED = 0, 1
_HEAD = struct.Struct("<I")  # length of the JSON header that follows
_NARROW = (np.int8, np.int16, np.int32, np.int64)
_TABLE_MAX = 1 << 17
"""Largest value range predicted through a lookup table (one gather per frame instead of float math)."""

ERROR_MODES = ("abs", "log1p")
"""How ``--error-bound`` is measured: ``abs`` |decoded - x| <= E; ``log1p`` |log1p(decoded) - log1p(x)| <= E."""


def delta_codec_name(error_bound: float = 0.0, error_mode: str = "abs") -> str:
    """The codec name of a delta pack: ``delta``, ``delta@E`` or ``delta@log1p:E`` (checked here, once)."""
    if error_mode not in ERROR_MODES:
        raise KaisokuError(
            f"delta codec: unknown error mode {error_mode!r}; choose one of {', '.join(ERROR_MODES)}"
        )
    if not math.isfinite(error_bound) or error_bound < 0:
        raise KaisokuError(f"delta codec: the error bound must be a finite number >= 0, got {error_bound}")
    if error_bound == 0:
        if error_mode != "abs":
            raise KaisokuError(f"delta codec: error mode {error_mode} needs an error bound > 0")
        return "delta"
    return f"delta@{error_bound:g}" if error_mode == "abs" else f"delta@{error_mode}:{error_bound:g}"


def parse_delta(argument: str) -> tuple[float, str]:
    """``(error_bound, error_mode)`` of the part of a codec name after ``delta@`` (``1``, ``log1p:0.05``)."""
    mode, _, text = argument.rpartition(":")
    try:
        bound = float(text)
    except ValueError:
        raise KaisokuError(f"codec delta@{argument}: the error bound must be a number") from None
    delta_codec_name(bound, mode or "abs")  # validates
    return bound, mode or "abs"


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

    pointwise = True
    """Each predicted value depends on the same position of the last frame only (decoders may tabulate it)."""

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

    def __init__(self, error_bound: float = 0.0, predictor: str = "linear", error_mode: str = "abs") -> None:
        import zstandard

        if predictor not in PREDICTORS:
            raise KaisokuError(
                f"delta codec: unknown predictor {predictor!r}; known: {', '.join(PREDICTORS)}"
            )
        self.name = delta_codec_name(error_bound, error_mode)
        self.error_bound = float(error_bound)
        self.error_mode = error_mode
        self.predictor = predictor
        self._compressor = zstandard.ZstdCompressor(level=3, write_content_size=True, threads=0)
        self._decompressor = zstandard.ZstdDecompressor()

    # -- bytes without a shape: plain zstd -----------------------------------------------------------

    def encode(self, data: bytes) -> bytes:
        """A non-array payload: zstd only."""
        return bytes([_PLAIN]) + self._compressor.compress(data)

    def decode(self, data: bytes | memoryview) -> bytes | memoryview:
        """Restore either kind of payload to the raw bytes of the field (a fresh buffer)."""
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
        return memoryview(_decode_body(header, body).reshape(-1)).cast("B")

    # -- arrays: predicted frames ----------------------------------------------------------------------

    def encode_array(self, data: bytes, dtype: str, shape: tuple[int, ...]) -> bytes:
        """Encode the raw bytes of one array of ``dtype`` and ``shape``; frames along axis 0."""
        array = np.frombuffer(data, dtype=np.dtype(dtype)).reshape(shape)
        if array.ndim < 2 or array.shape[0] < 1 or array.dtype.kind not in "iuf":
            return self.encode(data)
        if self.error_mode == "log1p":
            header, body = _log_levels_body(array, self.error_bound, self.predictor)
        else:
            header, residual = _residuals(array, self.error_bound, self.predictor)
            body = np.ascontiguousarray(residual).tobytes()
        meta = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
        payload = bytes([_PREDICTED]) + _HEAD.pack(len(meta)) + meta + self._compressor.compress(body)
        restored = np.frombuffer(self.decode(payload), dtype=array.dtype).reshape(array.shape)
        _check_bound(array, restored, self.error_bound, self.error_mode)  # what readers will decode
        return payload


def _step(dtype: np.dtype, bound: float) -> float:
    """Quantisation step for ``bound`` (0: lossless)."""
    if bound == 0:
        return 0.0
    if dtype.kind in "iu":
        return float(2 * int(np.floor(bound)) + 1)
    return 2.0 * bound


def _narrowed(out: np.ndarray) -> np.ndarray:
    """``out`` in the smallest signed integer type that holds it."""
    low, high = int(out.min(initial=0)), int(out.max(initial=0))
    narrow = next(t for t in _NARROW if low >= np.iinfo(t).min and high <= np.iinfo(t).max)
    return out.astype(narrow)


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
        # Decoded values stay inside the original's range (counts stay >= 0), which also bounds the
        # decoder's prediction tables.
        header["range"] = [int(array.min()), int(array.max())]
        lo, hi = header["range"]
        decoded = np.empty(array.shape, dtype=np.int64)
        for c in range(frames):
            pred = _int_prediction(model, decoded, c, params, header)
            r = array[c] - pred
            if step == 0:
                out[c] = r
                decoded[c] = array[c]
            else:
                # floor((r + (s-1)/2) / s) rounds to the nearest multiple of the odd step s, ties
                # impossible: symmetric around 0, |r - q s| <= (s-1)/2 = floor(E).
                out[c] = np.floor_divide(r + (int(step) - 1) // 2, int(step))
                decoded[c] = np.clip(pred + out[c] * int(step), lo, hi)
    else:
        decoded_f = np.empty(array.shape, dtype=np.float64)
        for c in range(frames):
            pred = np.zeros(array.shape[1:]) if c == 0 else model.predict(decoded_f[:c], params[c - 1])
            q = np.rint((array[c].astype(np.float64) - pred) / step)
            out[c] = q.astype(np.int64)
            decoded_f[c] = (pred + q * step).astype(dtype)
    residual = _narrowed(out)
    header["residual"] = residual.dtype.str
    return header, residual


def log1p_levels(low: int, high: int, bound: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(starts, lowest, highest)``: integers ``low..high`` cut into runs that one value represents.

    Run ``k`` covers ``starts[k]`` up to ``starts[k + 1] - 1``; every integer from ``lowest[k]`` to
    ``highest[k]`` is within ``bound`` in the log1p domain of every member of the run, so any of them may
    represent it. Runs are as long as the bound allows (a count whose neighbours are further than that
    stays a run of its own: exact).
    """
    logs = np.log1p(np.arange(low, high + 1, dtype=np.float64))
    bound *= 1 - 1e-9  # a margin far above rounding, so the check on write never meets a tie
    starts: list[int] = []
    lowest: list[int] = []
    highest: list[int] = []
    s = 0
    while s < len(logs):
        r = max(s, int(np.searchsorted(logs, logs[s] + bound, side="right")) - 1)
        t = max(r, int(np.searchsorted(logs, logs[r] + bound, side="right")) - 1)
        first = min(r, int(np.searchsorted(logs, logs[t] - bound, side="left")))
        starts.append(low + s)
        lowest.append(low + first)
        highest.append(low + r)
        s = t + 1
    return tuple(np.asarray(a, dtype=np.int64) for a in (starts, lowest, highest))  # type: ignore[return-value]


def _log_levels_body(array: np.ndarray, bound: float, predictor: str) -> tuple[dict, bytes]:
    """Header and body of the ``log1p`` mode: the level table, then the losslessly coded level indices.

    Each run's value is the admissible integer nearest to the mean log1p of the values that fall into it
    in this array, so the quantisation error averages out (no systematic shift of what the model sees).
    """
    if array.dtype.kind not in "iu" or int(array.min()) < 0:
        raise KaisokuError(
            f"delta codec: the log1p error mode needs non-negative integer arrays (got {array.dtype} "
            f"from {array.min()}); use the absolute bound (--error-mode abs)"
        )
    starts, lowest, highest = log1p_levels(int(array.min()), int(array.max()), bound)
    levels = np.searchsorted(starts, array, side="right") - 1
    flat = levels.ravel()
    counts = np.bincount(flat, minlength=len(starts))
    sums = np.bincount(flat, weights=np.log1p(array.astype(np.float64)).ravel(), minlength=len(starts))
    with np.errstate(invalid="ignore", divide="ignore"):
        centre = np.rint(np.expm1(sums / counts))
    values = np.where(counts > 0, np.clip(np.nan_to_num(centre), lowest, highest), highest).astype(np.int64)
    narrow = levels.astype(np.int16 if len(values) <= np.iinfo(np.int16).max else np.int32)
    header, residual = _residuals(narrow, 0.0, predictor)
    header.update(mode="log1p", bound=bound, levels=len(values), level_dtype=array.dtype.str)
    table = values.astype(array.dtype).tobytes()
    return header, table + np.ascontiguousarray(residual).tobytes()


def _decode_body(header: dict, body: bytes) -> np.ndarray:
    """The decoded array of one predicted payload's header and decompressed body."""
    if header.get("mode") == "log1p":
        dtype = np.dtype(header["level_dtype"])
        count = int(header["levels"])
        values = np.frombuffer(body, dtype=dtype, count=count)
        residual = np.frombuffer(body, dtype=np.dtype(header["residual"]), offset=count * dtype.itemsize)
        indices = _reconstruct(header, residual)
        return np.take(values, indices.astype(np.intp), mode="clip")
    return _reconstruct(header, np.frombuffer(body, dtype=np.dtype(header["residual"])))


def _int_prediction(
    model: Predictor, decoded: np.ndarray, c: int, params: list[list[float]], header: dict
) -> np.ndarray:
    """The integer prediction of frame ``c`` from the decoded frames before it (0 for the first).

    A pointwise predictor over a known, small value range is evaluated once per value, as a table, and
    gathered: the same float64 arithmetic on the same values, so the same result as evaluating it at
    every position, at a fraction of the cost.
    """
    info = np.iinfo(np.dtype(header["dtype"]))
    if c == 0:
        return np.zeros(decoded.shape[1:], dtype=decoded.dtype)
    bounds = header.get("range")
    if bounds is not None and getattr(model, "pointwise", False) and bounds[1] - bounds[0] < _TABLE_MAX:
        lo, hi = int(bounds[0]), int(bounds[1])
        table = model.predict(np.arange(lo, hi + 1, dtype=np.float64)[None], params[c - 1])
        np.rint(table, out=table)
        np.clip(table, info.min, info.max, out=table)
        previous = np.subtract(decoded[c - 1], lo, dtype=np.intp)  # the index type take() wants
        # In range by construction (record checksums guard the payload): "clip" skips the bounds checks.
        return np.take(table.astype(decoded.dtype), previous, mode="clip")
    pred = model.predict(decoded[:c], params[c - 1])
    np.rint(pred, out=pred)
    np.clip(pred, info.min, info.max, out=pred)
    return pred.astype(decoded.dtype)


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
    if dtype.kind in "iu" and step == 0:
        # Lossless: x = prediction + residual exactly, so the sum can be formed in the array's own type
        # (modulo 2**bits when a residual is wider: the same value).
        decoded = np.empty(shape, dtype=dtype)
        decoded[0] = residual[0]
        for c in range(1, shape[0]):
            pred = _int_prediction(model, decoded, c, params, header)
            np.add(pred, residual[c], out=decoded[c], casting="unsafe")
        return decoded
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        lo, hi = header.get("range", (info.min, info.max))
        work = np.int32 if dtype.itemsize <= 2 else np.int64  # prediction + step * residual, before the clip
        decoded = np.empty(shape, dtype=work)
        for c in range(shape[0]):
            pred = _int_prediction(model, decoded, c, params, header)
            np.clip(pred + residual[c].astype(work) * int(step), lo, hi, out=decoded[c])
        return decoded.astype(dtype)
    decoded_f = np.empty(shape, dtype=np.float64)
    for c in range(shape[0]):
        pred = np.zeros(shape[1:]) if c == 0 else model.predict(decoded_f[:c], params[c - 1])
        decoded_f[c] = (pred + residual[c] * step).astype(dtype)
    return decoded_f.astype(dtype)


def _check_bound(original: np.ndarray, restored: np.ndarray, bound: float, mode: str = "abs") -> None:
    """Raise unless every restored value is within ``bound`` of the original (exact when 0)."""
    if bound == 0:
        if not np.array_equal(original.view(np.uint8), restored.view(np.uint8)):
            raise KaisokuError("delta codec: the lossless round trip changed the array; please report this")
        return
    if mode == "log1p":
        error = np.abs(np.log1p(original.astype(np.float64)) - np.log1p(restored.astype(np.float64)))
    else:
        error = np.abs(original.astype(np.float64) - restored.astype(np.float64))
    worst = float(error.max(initial=0.0))
    if not worst <= bound:
        raise KaisokuError(
            f"delta codec: a decoded value is {worst:g} from the original ({mode}), beyond the error bound "
            f"{bound:g}; raise the bound or pack losslessly (--codec delta)"
        )
