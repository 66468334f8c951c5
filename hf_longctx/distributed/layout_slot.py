"""The shard format an SP group's models expect: the names of the token layouts and label kinds, and `LayoutSlot`.

It lives with the groups (every `SequenceParallelGroups` carries one slot) and below the data
package, which builds shards in the slot's layout and label kind: `data/layout.py` owns which positions each
layout gives a rank; this module only holds which layout and which labels are in force.
"""

from __future__ import annotations

from dataclasses import dataclass

LAYOUTS = ("contiguous", "zigzag")
# "next_token": labels are shifted on the full row before sharding (causal LMs: token t is trained on t + 1);
# "per_token": each token keeps its own label, sliced with it (token classification heads).
LABELS = ("next_token", "per_token")


def check_layout(kind: str) -> None:
    """Raise a `ValueError` naming the valid layouts."""
    if kind not in LAYOUTS:
        raise ValueError(f"Unknown token layout {kind!r}; choose one of {list(LAYOUTS)}.")


@dataclass
class LayoutSlot:
    """The token layout and label kind the models enabled on one `SequenceParallelGroups` expect.

    `enable_sequence_parallel` claims it (every model enabled on the same groups must agree) and
    releases it on `handle.remove()`; `shard_batch` and `SequenceShardingCollator` read `kind` and
    `labels` at each call, so a collator built before the model was prepared still shards the right way.
    Picklable: DataLoader worker processes get a copy when they start.
    """

    kind: str = "contiguous"
    users: int = 0
    labels: str = "next_token"

    def claim(self, kind: str, labels: str = "next_token") -> None:
        """Set the layout and label kind for one more model; a different one while others hold the slot is an error.

        Raises:
            ValueError: another model on the same groups uses a different layout or label kind.
        """
        check_layout(kind)
        if labels not in LABELS:
            raise ValueError(f"Unknown label kind {labels!r}; choose one of {list(LABELS)}.")
        if self.users and kind != self.kind:
            raise ValueError(
                f"Another model on these SequenceParallelGroups expects the {self.kind!r} token layout but this "
                f"backend needs {kind!r}; shard_batch(batch, groups) can serve only one. Use the same sp_backend "
                "for both models or build separate groups with SequenceParallelGroups.build()."
            )
        if self.users and labels != self.labels:
            raise ValueError(
                f"Another model on these SequenceParallelGroups takes {self.labels} labels but this one takes "
                f"{labels} labels (a token-classification head keeps each token's own label, a language model is "
                "trained on the next token); shard_batch(batch, groups) can serve only one. Build separate groups "
                "with SequenceParallelGroups.build()."
            )
        self.kind, self.labels = kind, labels
        self.users += 1

    def release(self) -> None:
        """Undo one `claim`; back to contiguous next-token shards when no model holds the slot."""
        self.users = max(0, self.users - 1)
        if self.users == 0:
            self.kind, self.labels = "contiguous", "next_token"
