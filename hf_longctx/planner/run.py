"""What a training run does per rank (`RunConfig`), apart from the estimate so `terms.py` can name it
without importing `estimate.py` (which imports `terms.py`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

ENGINES = ("ddp", "zero1", "zero2", "zero3", "fsdp2")
DTYPES = ("bf16", "fp32")
ATTNS = ("flash", "sdpa", "eager")
# SP backends: Ulysses is modelled; ring / hybrid / auto (ring K/V exchange buffers, hybrid's split) are not.
SP_BACKENDS = ("ulysses",)
UNMODELLED_BACKENDS = ("ring", "hybrid", "auto")


@dataclass(frozen=True)
class RunConfig:
    """What a training run does per rank; field names follow `hf-longctx plan`'s flags.

    `world` ranks in all, `sp` of them split each sequence; every rank is a data-parallel rank to
    the engine (hf_longctx hides its SP axis from DeepSpeed / FSDP), so ZeRO and FSDP shard over
    `world`. `tiled_mlp` is False, True (tiles of `hidden` tokens, DeepSpeed's TiledMLP rule) or a
    tile count; `tiled_layer` (same values: True = tiles of max(hidden, 4096) tokens) runs every
    token-local part of each decoder layer per sequence tile and attention per query tile (it subsumes
    `tiled_mlp` and recomputes the layer, see `planner/tiled.py`); `offload_activations` checkpoints
    every layer, with or without `gradient_checkpointing`.
    `ulysses_head_chunks` runs the Ulysses exchange and kernel over that many chunks of each rank's heads.
    `loss_chunk_tokens` overrides the tiled loss's tile (default: see `loss_bytes`). `host_memory_gib`
    is one node's RAM for pinned offloaded activations and offloaded model states (None: unlimited),
    shared by `ranks_per_node` ranks (default: min(world, 8)). `router_loss`: an MoE model trains with its
    router load-balancing loss on (`output_router_logits`), whose gradient keeps every layer's router logits to
    the backward (recomputed with the layer under gradient checkpointing). `vision_patches`: a VLM's patches
    (every image and frame of a rank's micro-batch, before the merge), its vision tower sharded over the SP group.
    """

    seq_len: int
    world: int = 1
    sp: int = 1
    micro_batch: int = 1
    engine: str = "ddp"
    dtype: str = "bf16"
    attn: str = "flash"
    gradient_checkpointing: bool = False
    tiled_loss: bool = False
    tiled_mlp: bool | int = False
    tiled_layer: bool | int = False
    offload_activations: bool = False
    offload_optimizer: bool = False
    offload_params: bool = False
    liger_kernels: bool = False
    loss_chunk_tokens: int | None = None
    sp_backend: str = "ulysses"
    ranks_per_node: int | None = None
    host_memory_gib: float | None = None
    ulysses_head_chunks: int = 1
    router_loss: bool = False
    vision_patches: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.vision_patches, int) or self.vision_patches < 0:
            raise ValueError(f"vision_patches must be an integer >= 0, got {self.vision_patches!r}.")
        for key in ("seq_len", "world", "sp", "micro_batch"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{key} must be an integer >= 1, got {value!r}.")
        if self.world % self.sp:
            raise ValueError(f"--world ({self.world}) must be a multiple of --sp ({self.sp}).")
        for key, allowed in (("engine", ENGINES), ("dtype", DTYPES), ("attn", ATTNS)):
            if getattr(self, key) not in allowed:
                raise ValueError(f"--{key} {getattr(self, key)!r} is not one of {list(allowed)}.")
        if self.offload_optimizer and self.engine not in ("zero1", "zero2", "zero3"):
            raise ValueError(
                "--offload-optimizer needs a DeepSpeed engine (--engine zero1/zero2/zero3); FSDP2 offloads "
                "parameters, gradients and optimizer states together: use --engine fsdp2 --offload-params."
            )
        if self.offload_params and self.engine not in ("zero3", "fsdp2"):
            raise ValueError("--offload-params needs --engine zero3 or --engine fsdp2 (sharded parameters).")
        if self.offload_params and self.engine == "zero3" and not self.offload_optimizer:
            raise ValueError("DeepSpeed offloads parameters only with the optimizer: add --offload-optimizer.")
        for key in ("tiled_mlp", "tiled_layer"):
            value = getattr(self, key)
            if not isinstance(value, bool) and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{key} must be True/False or a tile count >= 1, got {value!r}.")
        if self.tiled_layer is not False and self.attn == "eager":
            raise ValueError(
                "--tiled-layer runs attention per query tile with kernels that return the log-sum-exp: "
                "use --attn flash or --attn sdpa."
            )
        chunks = self.ulysses_head_chunks
        if not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 1:
            raise ValueError(f"--ulysses-head-chunks must be an integer >= 1, got {chunks!r}.")
        if chunks > 1 and self.sp == 1:
            raise ValueError("--ulysses-head-chunks applies under sequence parallelism: use --sp > 1 or drop it.")
        if self.loss_chunk_tokens is not None and self.loss_chunk_tokens < 1:
            raise ValueError(f"loss_chunk_tokens must be >= 1, got {self.loss_chunk_tokens}.")
        if self.sp_backend in UNMODELLED_BACKENDS:
            raise ValueError(
                f"--sp-backend {self.sp_backend} is not modelled: the planner models {list(SP_BACKENDS)} only "
                "(ring attention's K/V exchange buffers are not counted); plan with --sp-backend ulysses."
            )
        if self.sp_backend not in SP_BACKENDS:
            raise ValueError(f"--sp-backend {self.sp_backend!r} is not one of {[*SP_BACKENDS, *UNMODELLED_BACKENDS]}.")
        if self.ranks_per_node is not None and self.ranks_per_node < 1:
            raise ValueError(f"--ranks-per-node must be >= 1, got {self.ranks_per_node}.")
        if self.host_memory_gib is not None and not self.host_memory_gib > 0:
            raise ValueError(f"--host-memory must be > 0 GiB, got {self.host_memory_gib}.")

    @property
    def checkpointing(self) -> bool:
        """Every decoder layer is checkpointed: `offload_activations` and `tiled_layer` (which recomputes
        each tile in backward) checkpoint them themselves."""
        return self.gradient_checkpointing or self.offload_activations or self.tiled_layer is not False

    @property
    def act_bytes(self) -> int:
        """Bytes of one activation element (the compute dtype)."""
        return 2 if self.dtype == "bf16" else 4

    @property
    def node_ranks(self) -> int:
        """Ranks sharing one node's host memory."""
        return self.ranks_per_node or min(self.world, 8)

    @property
    def sp_spans_nodes(self) -> bool:
        """An SP group of consecutive ranks reaches past a node: wider than one, or not dividing the node's ranks."""
        return self.world > self.node_ranks and (self.sp > self.node_ranks or self.node_ranks % self.sp != 0)

    def with_seq_len(self, seq_len: int) -> RunConfig:
        """The same run at another sequence length."""
        return RunConfig(**{**asdict(self), "seq_len": seq_len})
