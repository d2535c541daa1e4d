"""A resumable sampler whose global sample order does not depend on the number of processes."""

import hashlib
from typing import Any, Iterator

import torch
from torch.utils.data import Sampler

from toolkit.errors import UserError

# The advice when a resumed data position does not fit: the same value, and the same recipe (another recipe's data
# may differ in size by chance only, and its checkpoint is no resume of this run).
_SAME_RUN = "resume with the same value and the recipe that wrote the checkpoint, or start a new run"


class GlobalBatchSampler(Sampler[int]):
    """Yields this rank's share of each global batch, in an order fixed by ``(seed, epoch)`` alone.

    Each epoch is a permutation of ``range(num_samples)`` (identity when ``shuffle=False``) cut into global
    batches of ``global_batch_size`` consecutive indices; the incomplete tail is dropped so that every optimizer
    step sees a full batch. Of each global batch, rank ``r`` of ``W`` yields the contiguous slice
    ``[r * B / W, (r + 1) * B / W)``. The ranks of any world size thus cover the same global batches in the same
    order, which is what makes 1 x 4 accumulation, 2 x 2 and 4 x 1 train identically.

    Contract with the training loop:

    * After each optimizer step, call :meth:`advance` (once per global batch consumed). Progress is counted this
      way, not from how far iteration got, because a ``DataLoader`` prefetches indices ahead of training.
    * ``iter(sampler)`` starts at the first global batch not yet advanced past, so create the ``DataLoader``
      iterator after :meth:`load_state_dict`.
    * When an epoch runs out (``len(sampler) == 0``), call :meth:`set_epoch` with the next epoch; this resets the
      consumed count.
    * :meth:`state_dict` goes into the checkpoint; :meth:`load_state_dict` resumes at the next unconsumed global
      batch without touching the consumed ones, even on a different world size.

    With a ``DataLoader(batch_size=micro_batch_size)``, :attr:`local_batch_size` must be a multiple of the micro
    batch size, or a micro batch would straddle two global batches.

    Args:
        num_samples: size of the dataset.
        global_batch_size: samples per optimizer step across all ranks (``B``).
        rank: this process's data-parallel rank.
        world_size: number of data-parallel ranks (``W``); must divide ``B``.
        seed: fixes the order of every epoch.
        shuffle: permute each epoch; if False, every epoch is ``0, 1, ..., num_samples - 1`` (the dataset's
            order, for curricula), and the same incomplete tail is dropped every epoch.

    Raises:
        UserError: if ``B`` is not a positive multiple of ``W`` or the dataset is smaller than one global batch.
    """

    def __init__(
        self,
        num_samples: int,
        *,
        global_batch_size: int,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        shuffle: bool = True,
    ) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in a world of size {world_size}")
        if global_batch_size < 1 or global_batch_size % world_size != 0:
            raise UserError(
                f"batch_size {global_batch_size} must be a positive multiple of the number of data-parallel "
                f"processes ({world_size}); try {max(1, round(global_batch_size / world_size)) * world_size}"
            )
        if num_samples < global_batch_size:
            raise UserError(
                f"the dataset has {num_samples} samples, fewer than one global batch (batch_size "
                f"{global_batch_size}); lower batch_size or add data"
            )
        self.num_samples = num_samples
        self.global_batch_size = global_batch_size
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.consumed_global_batches = 0

    @property
    def local_batch_size(self) -> int:
        """Samples this rank yields per global batch (``B / W``)."""
        return self.global_batch_size // self.world_size

    @property
    def steps_per_epoch(self) -> int:
        """Global batches (optimizer steps) per epoch."""
        return self.num_samples // self.global_batch_size

    def __len__(self) -> int:
        """Indices this rank still yields in the current epoch."""
        return (self.steps_per_epoch - self.consumed_global_batches) * self.local_batch_size

    def __iter__(self) -> Iterator[int]:
        # Position and order are read now, not at the first next(): later advance() calls by the training loop
        # must not shift an iteration already under way.
        order = self._epoch_order()
        return self._iter_from(order, self.consumed_global_batches)

    def _iter_from(self, order: list[int], first_batch: int) -> Iterator[int]:
        start = self.rank * self.local_batch_size
        for batch in range(first_batch, self.steps_per_epoch):
            offset = batch * self.global_batch_size + start
            yield from order[offset : offset + self.local_batch_size]

    def _epoch_order(self) -> list[int]:
        if not self.shuffle:
            return list(range(self.num_samples))
        # Hashing (seed, epoch) rather than adding them keeps seed 0 epoch 1 from replaying seed 1 epoch 0.
        digest = hashlib.sha256(f"{self.seed}:{self.epoch}".encode()).digest()
        generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
        return torch.randperm(self.num_samples, generator=generator).tolist()

    def set_epoch(self, epoch: int) -> None:
        """Moves to the start of ``epoch``."""
        self.epoch = epoch
        self.consumed_global_batches = 0

    def advance(self, num_global_batches: int = 1) -> None:
        """Records that the training loop finished ``num_global_batches`` more global batches of this epoch."""
        if num_global_batches < 0:
            raise ValueError(f"cannot advance by {num_global_batches} global batches")
        if self.consumed_global_batches + num_global_batches > self.steps_per_epoch:
            raise ValueError(
                f"advancing by {num_global_batches} passes the end of epoch {self.epoch} "
                f"({self.consumed_global_batches} of {self.steps_per_epoch} global batches consumed)"
            )
        self.consumed_global_batches += num_global_batches

    def state_dict(self) -> dict[str, Any]:
        """Position in the data, independent of world size.

        Besides ``epoch``, ``consumed_global_batches`` and ``seed``, it records ``global_batch_size``,
        ``num_samples`` and ``shuffle`` so that resuming with any of them changed fails instead of silently
        replaying or skipping.
        """
        return {
            "epoch": self.epoch,
            "consumed_global_batches": self.consumed_global_batches,
            "seed": self.seed,
            "global_batch_size": self.global_batch_size,
            "num_samples": self.num_samples,
            "shuffle": self.shuffle,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continues from a :meth:`state_dict`, possibly saved with a different world size.

        Raises:
            UserError: if the checkpoint was made with another seed, global batch size, dataset size or
                ``shuffle``.
        """
        # A checkpoint from before `shuffle` existed was shuffled.
        if bool(state_dict.get("shuffle", True)) != self.shuffle:
            raise UserError(
                f"the checkpoint's data position was saved with shuffle={str(not self.shuffle).lower()}, but this "
                f"run has shuffle={str(self.shuffle).lower()}; {_SAME_RUN}"
            )
        for key in ("seed", "global_batch_size", "num_samples"):
            if key in state_dict and int(state_dict[key]) != getattr(self, key):
                name = "batch_size" if key == "global_batch_size" else key
                raise UserError(
                    f"the checkpoint's data position was saved with {name}={int(state_dict[key])}, but this run "
                    f"has {name}={getattr(self, key)}; {_SAME_RUN}"
                )
        consumed = int(state_dict["consumed_global_batches"])
        if not 0 <= consumed <= self.steps_per_epoch:
            raise UserError(
                f"the checkpoint's data position ({consumed} global batches into the epoch) is outside this "
                f"dataset's {self.steps_per_epoch} global batches per epoch"
            )
        self.epoch = int(state_dict["epoch"])
        self.consumed_global_batches = consumed
