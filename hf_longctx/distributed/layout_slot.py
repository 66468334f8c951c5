"""The token layout an SP group's backend expects: the names of the layouts and `LayoutSlot`.

It lives with the groups (every `SequenceParallelGroups` carries one slot) and below the data
package, which builds shards in the slot's layout: `data/layout.py` owns which positions each
layout gives a rank; this module only holds which layout is in force.
"""

from __future__ import annotations

from dataclasses import dataclass

LAYOUTS = ("contiguous", "zigzag")


def check_layout(kind: str) -> None:
    """Raise a `ValueError` naming the valid layouts."""
    if kind not in LAYOUTS:
        raise ValueError(f"Unknown token layout {kind!r}; choose one of {list(LAYOUTS)}.")


@dataclass
class LayoutSlot:
    """The token layout the SP backends enabled on one `SequenceParallelGroups` expect.

    `enable_sequence_parallel` claims it (every model enabled on the same groups must agree) and
    releases it on `handle.remove()`; `shard_batch` and `SequenceShardingCollator` read `kind` at
    each call, so a collator built before the model was prepared still shards the right way.
    Picklable: DataLoader worker processes get a copy when they start.
    """

    kind: str = "contiguous"
    users: int = 0

    def claim(self, kind: str) -> None:
        """Set the layout for one more model; a different layout while others hold it is an error.

        Raises:
            ValueError: another model on the same groups uses a different layout.
        """
        check_layout(kind)
        if self.users and kind != self.kind:
            raise ValueError(
                f"Another model on these SequenceParallelGroups expects the {self.kind!r} token layout but this "
                f"backend needs {kind!r}; shard_batch(batch, groups) can serve only one. Use the same sp_backend "
                "for both models or build separate groups with SequenceParallelGroups.build()."
            )
        self.kind = kind
        self.users += 1

    def release(self) -> None:
        """Undo one `claim`; back to contiguous when no model holds the slot."""
        self.users = max(0, self.users - 1)
        if self.users == 0:
            self.kind = "contiguous"
