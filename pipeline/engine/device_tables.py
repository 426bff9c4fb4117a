"""The CUDA graphs' block tables, kept on the device and updated by row.

A decode graph reads its rows' block tables from one device tensor [max_batch_size, width] that lives as
long as the runner. Between two graph steps most rows keep their table (a sequence gains a block every
`block_size` tokens; rows move only when a sequence before them finishes), so a step sends only the rows
that changed, inside its one host→device copy, and `apply` scatters them before the replay. Uploading
every row's whole table instead costs rows x width x 8 bytes per step (256 rows of 512 blocks: 1 MiB).
"""

from __future__ import annotations

import torch


class DeviceBlockTables:
    def __init__(self, rows: int, width: int, device: torch.device):
        self.device_tables = torch.zeros(rows, width, dtype=torch.long, device=device)
        self.sent = torch.zeros(rows, width, dtype=torch.long)  # host copy of what the device holds

    @property
    def width(self) -> int:
        return self.sent.shape[1]

    def changes(self, tables: torch.Tensor) -> torch.Tensor:
        """The update for host tables [d, w] (w <= width) as one int64 tensor: the changed rows' indices, then
        their first w entries; recorded as sent. Entries past a row's own blocks are never read, so only
        the first w columns are compared and sent."""
        d, w = tables.shape
        changed = torch.arange(d)[(tables != self.sent[:d, :w]).any(1)]
        rows = tables[changed]
        self.sent[changed, :w] = rows
        return torch.cat([changed, rows.reshape(-1)])

    def apply(self, update: torch.Tensor, w: int) -> None:
        """Scatter an update from `changes` (on the device, stream-ordered after its upload)."""
        n = update.numel() // (w + 1)
        if n:
            self.device_tables[:, :w].index_copy_(0, update[:n], update[n:].view(n, w))
