"""`ParallelismConfig`: accelerate's parallelism config with hf_longctx's SP backends.

Users set it as `parallelism_config=` in `TrainingArguments` / `SFTConfig`. It accepts the
backends implemented here ("ulysses", "ring", "hybrid", "auto") and keeps accelerate's own
("deepspeed") untouched. Every check raises a `ValueError` that names the field to change.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from accelerate.parallelism_config import ParallelismConfig as _AccelerateParallelismConfig

from hf_longctx.attention.backends import BACKENDS as OUR_BACKENDS
from hf_longctx.attention.head_chunks import check_chunks_backend
from hf_longctx.attention.ring.attention import VARIANTS as RING_VARIANTS
from hf_longctx.data.layout import LAYOUTS as RING_LAYOUTS
from hf_longctx.distributed.groups import validate_sp_size

UPSTREAM_BACKENDS = ("deepspeed",)


@dataclass(kw_only=True)
class ParallelismConfig(_AccelerateParallelismConfig):
    """accelerate's `ParallelismConfig` plus hf_longctx's backends (`sp_backend="ulysses"` by default).

    "ring" (ring attention), "hybrid" (Ulysses x ring, `ulysses_degree`) and "auto" (chosen per model)
    take `ring_variant` and `ring_layout`; `sp_backend="deepspeed"` keeps accelerate's upstream
    DeepSpeed ALST path unchanged.
    """

    sp_size: int = field(default=1, metadata={"help": "Ranks that split one sequence (sequence-parallel degree)."})
    sp_backend: str = field(
        default="ulysses",
        metadata={"help": f"Sequence-parallel backend: one of {list(OUR_BACKENDS + UPSTREAM_BACKENDS)}."},
    )
    ulysses_degree: int | None = field(
        default=None,
        metadata={"help": "hybrid/auto: Ulysses degree (divides sp_size and the heads); the ring takes the rest."},
    )
    ring_variant: str | None = field(
        default=None,
        metadata={"help": f"ring/hybrid: one of {list(RING_VARIANTS)} (default p2p; auto chooses)."},
    )
    ring_layout: str = field(
        default="zigzag", metadata={"help": f"ring/hybrid token layout: one of {list(RING_LAYOUTS)}."}
    )
    ulysses_head_chunks: int = field(
        default=1,
        metadata={
            "help": "ulysses: run the all-to-all and the attention kernel over this many chunks of each rank's "
            "heads (recomputed per chunk in backward), so the full-sequence q/k/v/o hold heads / (sp_size * "
            "chunks) heads at a time. Must divide the key/value heads each rank receives; 1 = no chunking."
        },
    )

    tiled_loss: bool | str = field(
        default=False,
        metadata={
            "help": "LM head + cross-entropy in token tiles: the [tokens, vocab] logits of a training forward are "
            "never materialised (each tile holds about as many logits as the shard has hidden-state values). "
            "True = hf_longctx's tiles; 'liger' = Liger's fused linear cross-entropy (CUDA, liger-kernel)."
        },
    )
    tiled_mlp: bool | int = field(
        default=False,
        metadata={
            "help": "Run each dense MLP over the sequence in tiles, recomputed per tile in backward: True = tiles of "
            "max(hidden_size, 4096) tokens, an integer = that many tiles. MoE routed experts stay untiled (logged)."
        },
    )
    tiled_layer: bool | int = field(
        default=False,
        metadata={
            "help": "Run each Llama-family decoder layer (Llama, Qwen2/3, Mistral structure) over the sequence in "
            "tiles, forward and recompute: only the layer's input/output and K/V are sequence-long; it tiles that "
            "layer's MLP too. True = tiles of max(hidden_size, 4096) tokens, an integer = that many tiles. Other "
            "layers, ring and hybrid SP run untiled (logged)."
        },
    )
    offload_activations: bool = field(
        default=False,
        metadata={
            "help": "Checkpoint every decoder layer and keep its saved input in host memory (pinned, copied "
            "back ahead of the recompute); composes with gradient_checkpointing. On CPU it is checkpointing."
        },
    )

    def __post_init__(self) -> None:
        _check_memory_flags(self)
        validate_sp_size(self.sp_size)
        if self.sp_backend not in OUR_BACKENDS + UPSTREAM_BACKENDS:
            raise ValueError(
                f"Unknown sp_backend {self.sp_backend!r}; set sp_backend to one of "
                f"{list(OUR_BACKENDS + UPSTREAM_BACKENDS)}."
            )
        self._check_ring_options()
        check_chunks_backend(self.ulysses_head_chunks, self.sp_backend)
        if self.ulysses_head_chunks > 1 and self.sp_size == 1:
            raise ValueError(
                "ulysses_head_chunks applies under sequence parallelism (sp_size > 1): without SP the model's own "
                "attention runs; set sp_size > 1 or ulysses_head_chunks=1."
            )
        if self.sp_backend in UPSTREAM_BACKENDS:
            if self.memory_enabled:
                raise ValueError(
                    "tiled_loss, tiled_mlp, tiled_layer and offload_activations are hf_longctx features; with "
                    f"sp_backend={self.sp_backend!r} set them to False (or use sp_backend='ulysses')."
                )
            super().__post_init__()
            return
        # accelerate validates sp_backend against a hard-coded ["deepspeed"] and would attach a
        # DeepSpeed handler: run its checks under that name, then restore ours.
        backend = self.sp_backend
        self.sp_backend = "deepspeed"
        try:
            super().__post_init__()
        finally:
            self.sp_backend = backend
        self.sp_handler = None
        if (self.tp_size or 1) > 1 and self.sp_size > 1:
            raise ValueError(f"tp_size > 1 cannot be combined with sp_backend={self.sp_backend!r} yet; set tp_size=1.")
        if self.sp_size > 1:
            # accelerate may never hand this config to `_validate_accelerator` (its shared state was configured
            # earlier): the Trainer's own (gated) checks must exist already to refuse a run without SP.
            from hf_longctx.integrations.trainer.patches import install_trainer_patches

            install_trainer_patches()

    def _check_ring_options(self) -> None:
        if self.ring_variant is not None and self.ring_variant not in RING_VARIANTS:
            raise ValueError(f"ring_variant={self.ring_variant!r}: choose one of {list(RING_VARIANTS)}.")
        if self.ring_layout not in RING_LAYOUTS:
            raise ValueError(f"ring_layout={self.ring_layout!r}: choose one of {list(RING_LAYOUTS)}.")
        if self.ulysses_degree is None:
            return
        if self.sp_backend not in ("hybrid", "auto"):
            raise ValueError(
                f"ulysses_degree applies to sp_backend='hybrid' or 'auto', not {self.sp_backend!r}; "
                "set sp_backend='hybrid' or drop ulysses_degree."
            )
        valid = [d for d in range(1, self.sp_size + 1) if self.sp_size % d == 0]
        if self.ulysses_degree not in valid:
            raise ValueError(
                f"ulysses_degree={self.ulysses_degree!r} must divide sp_size={self.sp_size}: one of {valid}."
            )

    def attention_options(self) -> dict:
        """Keyword arguments of `enable_sequence_parallel` for this config (our backends only)."""
        return {
            "backend": self.sp_backend,
            "ulysses_degree": self.ulysses_degree,
            "ring_variant": self.ring_variant,
            "ring_layout": self.ring_layout,
            "ulysses_head_chunks": self.ulysses_head_chunks,
        }

    def build_device_mesh(self, device_type: str):
        """accelerate's mesh without an SP axis: our SP groups are built by `SequenceParallelGroups`."""
        if self.sp_upstream:
            return super().build_device_mesh(device_type)
        from hf_longctx.integrations.trainer.state import sp_hidden

        with sp_hidden(self):
            return super().build_device_mesh(device_type)

    def _validate_accelerator(self, accelerator) -> None:
        """Called by `Accelerator.__init__`: validate, then hook hf_longctx SP into that accelerator."""
        if self.sp_upstream:
            return super()._validate_accelerator(accelerator)
        from hf_longctx.integrations.trainer.accelerator import attach
        from hf_longctx.integrations.trainer.state import sp_hidden

        with sp_hidden(self):
            if accelerator.is_fsdp2 and self.dp_shard_size == 1 and self.dp_replicate_size == 1:
                # FSDP2 shards parameters over every rank (SP ranks included): give accelerate its
                # usual dp_shard mesh axis over the whole world, built now that the size is known.
                self._set_size("dp_shard", accelerator.num_processes)
                self.device_mesh = None
                accelerator.state.device_mesh = self.get_device_mesh(accelerator.device.type)
            super()._validate_accelerator(accelerator)
        attach(self, accelerator)

    @property
    def memory_enabled(self) -> bool:
        """True when any of the memory flags is on."""
        return bool(self.tiled_loss or self.tiled_mlp or self.tiled_layer or self.offload_activations)

    @property
    def sp_upstream(self) -> bool:
        """True when SP is delegated to accelerate's DeepSpeed path rather than hf_longctx."""
        return self.sp_backend in UPSTREAM_BACKENDS

    @classmethod
    def from_env(cls) -> ParallelismConfig:
        """Build from accelerate's `PARALLELISM_CONFIG_*` variables (what `accelerate launch` exports)."""
        return cls(
            sp_size=int(os.environ.get("PARALLELISM_CONFIG_SP_SIZE", "1")),
            sp_backend=os.environ.get("PARALLELISM_CONFIG_SP_BACKEND", "ulysses"),
        )


def _check_memory_flags(config: ParallelismConfig) -> None:
    if not (isinstance(config.tiled_loss, bool) or config.tiled_loss == "liger"):
        raise ValueError(f"tiled_loss must be True, False or 'liger', got {config.tiled_loss!r}.")
    if not isinstance(config.offload_activations, bool):
        raise ValueError(f"offload_activations must be True or False, got {config.offload_activations!r}.")
    for name in ("tiled_mlp", "tiled_layer"):
        tiles = getattr(config, name)
        if not isinstance(tiles, bool) and not (isinstance(tiles, int) and tiles >= 1):
            raise ValueError(f"{name} must be True, False or a tile count >= 1, got {tiles!r}.")
