"""Deterministic global batches over packed rows, addressed by the consumed-samples position.

Rows are shuffled by (seed, epoch) with a private generator, so every rank derives the same
order without communication, and a run resumed from `consumed_samples` sees exactly the batches
the uninterrupted run would have seen.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_lora.data.packing import PackedRows, inputs_labels_mask


@dataclass
class Batch:
    tokens: torch.Tensor  # [B, S] int64, replicated on every rank
    labels: torch.Tensor  # [B, S] int64
    loss_mask: torch.Tensor  # [B, S] float32
    attention_mask: torch.Tensor  # [B, 1, S, S] bool, True = masked

    def to(self, device: torch.device) -> "Batch":
        """This batch on `device` (made on the host; the training loop moves it once)."""
        return Batch(*(None if t is None else t.to(device, non_blocking=True)
                       for t in (self.tokens, self.labels, self.loss_mask, self.attention_mask)))


class PackedDataset:
    def __init__(self, rows: PackedRows, seed: int):
        if rows.tokens.shape[0] == 0:
            raise ValueError("no packed rows")
        self.rows = rows
        self.seed = seed
        self._cached_epoch, self._cached_order = -1, None

    def __len__(self) -> int:
        return self.rows.tokens.shape[0]

    def _order(self, epoch: int) -> torch.Tensor:
        if epoch != self._cached_epoch:
            g = torch.Generator().manual_seed(self.seed * 1000003 + epoch)
            self._cached_epoch, self._cached_order = epoch, torch.randperm(len(self), generator=g,
                                                                           device="cpu")
        return self._cached_order

    def batch(self, consumed_samples: int, global_batch_size: int) -> Batch:
        """The global batch starting at position `consumed_samples` of the endless epoch stream."""
        idx = []
        for pos in range(consumed_samples, consumed_samples + global_batch_size):
            epoch, within = divmod(pos, len(self))
            idx.append(int(self._order(epoch)[within]))
        index = torch.tensor(idx, device="cpu")
        tokens, labels, loss_mask, attention_mask = inputs_labels_mask(
            self.rows.tokens[index], self.rows.targets[index], self.rows.sample_ids[index]
        )
        return Batch(tokens, labels, loss_mask, attention_mask)
