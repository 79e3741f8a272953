"""``ImageLabelTransform``: a packed image-and-label sample to an augmented CHW image and its label."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kaisoku.data.loading.batch_augment import decode_batch_into
from kaisoku.data.loading.gpu_decode import EncodedBatch, encode_batch
from kaisoku.data.loading.transforms import AugmentSpec, augment, augment_into, decode_image


@dataclass(frozen=True, kw_only=True)
class ImageLabelTransform:
    """``sample -> (CHW uint8 image, int label)``, augmented by ``(seed, epoch, index)``.

    Accepts the image as a decoded array (the dataset's default) or as encoded bytes (a dataset
    built with ``decode_images=False``), which are then decoded here, with ``decode_min_side``
    letting JPEG decoding downscale by 2, 4 or 8 while both sides stay >= it (useful for
    evaluation of large photos: set it to ``spec.size``).
    """

    spec: AugmentSpec
    """Crop, flip and output size."""

    seed: int = 0
    """Run seed; with the epoch and the sample index it keys the augmentation."""

    image_field: str = "image"
    """Field holding the image."""

    label_field: str = "label"
    """Field holding the integer label."""

    decode_min_side: int = 0
    """Only for encoded images: the smallest side JPEG DCT-domain downscaling may leave (0: full size)."""

    def __call__(self, sample: dict[str, Any], *, index: int, epoch: int) -> tuple[np.ndarray, int]:
        """The augmented CHW uint8 image and the label of ``sample``."""
        image = sample[self.image_field]
        if not isinstance(image, np.ndarray):
            image = decode_image(image, name=f"sample {index}", min_side=self.decode_min_side)
        out = augment(image, self.spec, seed=self.seed, epoch=epoch, index=index)
        return out, int(sample[self.label_field])

    def into(self, sample: dict[str, Any], *, index: int, epoch: int, out: np.ndarray) -> int:
        """Write the augmented CHW uint8 image of ``sample`` into ``out``; return its label."""
        image = sample[self.image_field]
        if not isinstance(image, np.ndarray):
            image = decode_image(image, name=f"sample {index}", min_side=self.decode_min_side)
        augment_into(image, self.spec, seed=self.seed, epoch=epoch, index=index, out=out)
        return int(sample[self.label_field])

    def batch_into(
        self, samples: Sequence[dict[str, Any]], *, indices: Sequence[int], epoch: int, out: np.ndarray
    ) -> list[int]:
        """Write the augmented images of ``samples`` (encoded images, sample ``indices``) into ``out``
        (N x 3 x S x S) in one call (:func:`~kaisoku.data.loading.batch_augment.decode_batch_into`); return
        their labels. Training specs only: the boxes and flips are those :meth:`into` draws."""
        decode_batch_into(
            [sample[self.image_field] for sample in samples],
            self.spec,
            seed=self.seed,
            epoch=epoch,
            indices=indices,
            out=out,
            names=[f"sample {index}" for index in indices],
        )
        return [int(sample[self.label_field]) for sample in samples]

    def encoded(
        self, samples: Sequence[dict[str, Any]], *, indices: Sequence[int], epoch: int
    ) -> tuple[EncodedBatch, list[int]]:
        """The encoded images of ``samples`` with their keyed boxes and flips, to be decoded on the training
        device (:func:`~kaisoku.data.loading.gpu_decode.encode_batch`: the boxes and flips :meth:`into`
        draws), and their labels."""
        batch = encode_batch(
            [sample[self.image_field] for sample in samples],
            self.spec,
            seed=self.seed,
            epoch=epoch,
            indices=indices,
            names=[f"sample {index}" for index in indices],
        )
        return batch, [int(sample[self.label_field]) for sample in samples]
