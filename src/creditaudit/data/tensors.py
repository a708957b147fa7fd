"""A dataset held as whole tensors on the target device, with batched augmentation.

Following airbench: the data live as one tensor per split on the device; a training batch is an
index into it, and augmentation is a few batched tensor ops — no per-sample Python, no DataLoader.
An epoch's order and augmentation are drawn at once (`train_batches`), so a training step makes no
host round trip. Images are kept as raw uint8 (N, C, H, W) and converted + normalised per batch, so the crop's zero
padding is a black pixel exactly as in torchvision's `RandomCrop(32, padding=4)` applied before
`Normalize` (the paper's pipeline).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field, replace
from typing import Iterator

import torch
import torch.nn.functional as F


def draw_crop_flip(n: int, pad: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """The random part of `crop_flip` for n samples: offsets (n, 2) ∈ {0…2·pad}² and flips (n,)
    bool (p = ½), drawn on the CPU generator `gen` (so a run draws the same numbers on any device)."""
    offsets = torch.randint(0, 2 * pad + 1, (n, 2), generator=gen)
    flip = torch.rand(n, generator=gen) < 0.5
    return offsets, flip


def crop_flip(x: torch.Tensor, pad: int, offsets: torch.Tensor, flip: torch.Tensor) -> torch.Tensor:
    """Per-sample crop with `pad`-pixel zero padding at the given offsets, then the given flips.

    x: (N, C, H, W) of any dtype; offsets (N, 2) = (top, left) ∈ {0…2·pad}², flip (N,) bool, both
    on x's device. Equivalent to padding each image by `pad` zeros, taking the H×W window at
    (top, left) and mirroring it left-right where flip is set. The padded batch is viewed as all
    its (2·pad+1)² windows (`unfold`, no copy) and each sample's window is picked with one
    advanced index: a few tensor ops, no host round trip.
    """
    n, c, h, w = x.shape
    windows = F.pad(x, (pad, pad, pad, pad)).unfold(2, h, 1).unfold(3, w, 1)   # (N, C, 2p+1, 2p+1, H, W)
    crops = windows[torch.arange(n, device=x.device), :, offsets[:, 0], offsets[:, 1]]  # (N, C, H, W)
    return torch.where(flip[:, None, None, None], crops.flip(-1), crops)


def random_crop_flip(x: torch.Tensor, pad: int, gen: torch.Generator) -> torch.Tensor:
    """`crop_flip` with offsets and flips drawn from the CPU generator `gen` (`draw_crop_flip`)."""
    offsets, flip = draw_crop_flip(x.shape[0], pad, gen)
    return crop_flip(x, pad, offsets.to(x.device), flip.to(x.device))


def batches_digest(batches) -> str:
    """sha256 (hex) of the test samples in `batches` (an iterable of (x, y)): each sample's input
    bytes (dtype, shape) and its label hashed alone, the sorted per-sample hashes hashed together —
    so the digest names the set of (input, label) pairs an accuracy was measured on, whatever the
    batching or order (an accuracy depends on neither), and changes with any input or label."""
    per_sample = []
    for x, y in batches:
        x, y = torch.as_tensor(x).detach().cpu().contiguous(), torch.as_tensor(y).detach().cpu().contiguous()
        head = f"{x.dtype}|{tuple(x.shape[1:])}|{y.dtype}|".encode()
        xs = x.reshape(len(x), -1).view(torch.uint8).numpy() if x.numel() else [b""] * len(x)
        ys = y.reshape(len(y), -1).view(torch.uint8).numpy()
        per_sample += [hashlib.sha256(head + bytes(xi) + b"|" + bytes(yi)).digest() for xi, yi in zip(xs, ys)]
    h = hashlib.sha256(f"{len(per_sample)}|".encode())
    for d in sorted(per_sample):
        h.update(d)
    return h.hexdigest()


@dataclass
class ArrayDataset:
    """Train/test tensors plus what is needed to turn a raw batch into network input.

    x_*: uint8 images (N, C, H, W), float images (N, C, H, W) (digits, already standardised) or
    float features (N, D); y_*: int64 labels. `prepare` keeps the per-sample shape (`input_shape`):
    images reach the model as images, and a model that wants features flattens them itself (the
    ResidualMLP does, so its input is the same C·H·W numbers in the same order either way).
    mean/std: per-channel normalisation for images (shape (C, 1, 1)); None for features that are
    already standardised. `augment` turns on crop + flip for training batches (images only).
    """

    name: str
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    n_classes: int
    mean: torch.Tensor | None = None
    std: torch.Tensor | None = None
    augment: bool = False
    pad: int = 4
    source: str = ""        # where the tensors came from (a cache, a folder), for `describe`
    _digest: str | None = field(default=None, repr=False, compare=False)
    _test_digest: str | None = field(default=None, repr=False, compare=False)

    @property
    def digest(self) -> str:
        """sha256 (hex) of everything that shapes training on these data: the name, the class
        count, the augmentation, and every tensor's dtype, shape and bytes. Computed once per load
        and carried by `to` (moving devices changes no content); part of every run's key."""
        if self._digest is None:
            h = hashlib.sha256(f"{self.name}|{self.n_classes}|{self.augment}|{self.pad}".encode())
            for t in (self.x_train, self.y_train, self.x_test, self.y_test, self.mean, self.std):
                if t is None:
                    h.update(b"|none")
                    continue
                t = t.detach().cpu().contiguous()
                h.update(f"|{t.dtype}|{tuple(t.shape)}|".encode())
                h.update(t.view(-1).view(torch.uint8).numpy().data if t.numel() else b"")
            self._digest = h.hexdigest()
        return self._digest

    @property
    def test_digest(self) -> str:
        """`batches_digest` of the test split as the model sees it (`eval_batches("test")`, prepared
        on the CPU, so the same on every device): what a run's test accuracy was measured on.
        Computed once per load and carried by `to`."""
        if self._test_digest is None:
            cpu = replace(self, x_train=self.x_train[:0].cpu(), y_train=self.y_train[:0].cpu(),
                          x_test=self.x_test.cpu(), y_test=self.y_test.cpu(),
                          mean=None if self.mean is None else self.mean.cpu(),
                          std=None if self.std is None else self.std.cpu())
            self._test_digest = batches_digest(cpu.eval_batches("test", 1000))
        return self._test_digest

    def describe(self) -> str:
        """What was loaded, for headers and messages: name (source, train/test sizes, digest)."""
        where = f"{self.source}, " if self.source else ""
        return f"{self.name} ({where}{len(self.y_train)}/{len(self.y_test)}, sha {self.digest[:12]})"

    @property
    def d_in(self) -> int:
        return int(self.x_train[0].numel())

    @property
    def input_shape(self) -> tuple[int, ...]:
        """Per-sample shape of the inputs: (D,) for features, (C, H, W) for images."""
        return tuple(int(s) for s in self.x_train.shape[1:])

    @property
    def device(self) -> torch.device:
        return self.x_train.device

    def to(self, device: torch.device | str) -> "ArrayDataset":
        move = lambda t: None if t is None else t.to(device)
        return replace(self, x_train=move(self.x_train), y_train=move(self.y_train),
                       x_test=move(self.x_test), y_test=move(self.y_test),
                       mean=move(self.mean), std=move(self.std))

    def prepare(self, x: torch.Tensor, train: bool = False, gen: torch.Generator | None = None,
                draws: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Raw batch → float32 network input (N, *input_shape): augment (train only), scale, normalise.

        Augmentation uses `draws` = (offsets, flips) already on the device when given (the
        epoch-wide draws of `train_batches`), else draws them from the CPU generator `gen`."""
        if train and self.augment:
            if draws is not None:
                x = crop_flip(x, self.pad, *draws)
            elif gen is None:
                raise ValueError("augmentation needs a generator")
            else:
                x = random_crop_flip(x, self.pad, gen)
        if x.dtype == torch.uint8:
            x = x.float().div_(255.0)
        else:
            x = x.float()
        if self.mean is not None:
            x = (x - self.mean) / self.std
        return x

    def train_batches(self, batch_size: int, gen: torch.Generator
                      ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """One epoch of shuffled, augmented training batches (the last one may be smaller).

        The whole epoch's randomness is drawn at once, before the first batch: the order
        (randperm of the training set) and, for augmented images, every sample's crop offsets and
        flip (`draw_crop_flip`, in the order's positions), all from the CPU generator `gen` and
        copied to the data's device once per epoch. A batch is then slices of device tensors and
        a gather: the training step touches the host never. Drawing on the CPU keeps a run's
        order and augmentation the same on every device (the trainer's generator is a CPU one).
        """
        n = len(self.y_train)
        order = torch.randperm(n, generator=gen)
        draws = draw_crop_flip(n, self.pad, gen) if self.augment else None
        order = order.to(self.device)
        if draws is not None:
            draws = tuple(t.to(self.device) for t in draws)
        for start in range(0, n, batch_size):
            idx = order[start:start + batch_size]
            batch_draws = None if draws is None else tuple(t[start:start + batch_size] for t in draws)
            yield self.prepare(self.x_train[idx], train=True, draws=batch_draws), self.y_train[idx]

    def eval_batches(self, split: str = "test", batch_size: int = 128
                     ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Un-augmented batches of a split in a fixed order."""
        x, y = (self.x_test, self.y_test) if split == "test" else (self.x_train, self.y_train)
        for start in range(0, len(y), batch_size):
            yield self.prepare(x[start:start + batch_size]), y[start:start + batch_size]

    def eval_batch(self, index: int = 0, batch_size: int = 128, split: str = "test"
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """The `index`-th fixed, un-augmented batch of a split (the monitor's eval batch is index 0)."""
        x, y = (self.x_test, self.y_test) if split == "test" else (self.x_train, self.y_train)
        sl = slice(index * batch_size, (index + 1) * batch_size)
        return self.prepare(x[sl]), y[sl]
