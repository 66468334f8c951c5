"""Per-rank peak memory of one training step under hf_longctx, and the longest sequence that fits.

`estimate(model, run, device)` is the main function: a pure model of (model shape, run config,
device) -> the memory of each term at the step's peak. `max_seq_len` bisects it over the
sequence length. Nothing here touches torch or a GPU, so a plan costs microseconds and runs
anywhere; `hf-longctx plan` is its command line (`plan_cli.py`). Each term, and why it has the
size it has, is documented in docs/planner.md; the per-token activation formulas live in
`terms.py` (`tiled.py` for `tiled_layer`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from hf_longctx.planner.devices import DeviceProfile
from hf_longctx.planner.kernels import attention_kernel, keeps_transformers_mask
from hf_longctx.planner.layers import layer_stack
from hf_longctx.planner.model_shape import ModelShape, ceil_div
from hf_longctx.planner.run import RunConfig
from hf_longctx.planner.terms import loss_bytes, norm_bytes, valid_head_chunks
from hf_longctx.planner.vision import vision_tower_bytes

GIB = 2**30
TERMS = (
    "parameters",
    "gradients",
    "optimizer_states",
    "zero3_gathers",
    "saved_activations",
    "recompute",
    "backward_transients",
    "logits_loss",
    "all_to_all_buffers",
    "allocator_runtime_overhead",
)
# DeepSpeed's default `stage3_max_live_parameters`: ZeRO-3 keeps up to this many gathered
# parameters on the device (prefetched and reused ones), in the compute dtype.
DS_MAX_LIVE_PARAMETERS = 1_000_000_000
# The planner's largest measured under-prediction (predicted / measured - 1), rounded up to a whole percent: its
# plan for Llama-3.1-8B at 32K on one H100 is 14.2% under ALST's published 71.91 GiB (benchmarks/plan_published.py;
# the 1 x H200 baseline 12.0%; the CPU checks in benchmarks/results/*plan* at most 7.4%). A plan "fits" only with
# this share of the device left over (a peak that much under the real one still fits); with less it is "tight"
# (tests/unit/test_planner_published.py re-derives it from those results).
PLAN_ERROR = 0.15


@dataclass(frozen=True)
class Plan:
    """The answer: the peak phase's terms in GiB, whether they fit, and what dominates."""

    peak_gib: float
    capacity_gib: float
    fits: bool
    breakdown: dict[str, float]
    dominant: str
    peak_phase: str
    phases: dict[str, float]
    tokens_per_rank: int
    num_params: int
    max_seq: int | None = None
    notes: list[str] = field(default_factory=list)
    host_gib: float = 0.0
    host_capacity_gib: float | None = None
    attention_kernel: str = ""
    warnings: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        """JSON-ready dict (`hf-longctx plan --json`), with the verdict and headroom."""
        out = asdict(self)
        if self.max_seq is None:
            out.pop("max_seq")
        return {**out, "verdict": self.verdict(), "headroom": round(self.headroom, 4), "required_headroom": PLAN_ERROR}

    @property
    def headroom(self) -> float:
        """The share of the device the peak leaves free (negative when it does not fit)."""
        return 1 - self.peak_gib / self.capacity_gib if self.capacity_gib > 0 else float("-inf")

    def fits_within(self, margin: float = PLAN_ERROR) -> bool:
        """Fits with at least `margin` of the device left over, host RAM included."""
        return self.fits and (margin <= 0 or self.headroom >= margin)

    def verdict(self, margin: float = PLAN_ERROR) -> str:
        """The verdict: "fits" (headroom at least `margin`, the planner's error), "tight" (fits the device by less),
        or why it does not fit."""
        if self.fits_within(margin):
            return "fits"
        if self.fits:
            return "tight"
        return "does NOT fit" if self.peak_gib > self.capacity_gib else "fits the device, NOT the host RAM"


def check_heads(model: ModelShape, sp: int) -> None:
    """Ulysses splits query heads: raise a `ValueError` listing the SP sizes that work."""
    if model.heads % sp:
        valid = [p for p in range(1, model.heads + 1) if model.heads % p == 0]
        raise ValueError(
            f"Ulysses needs num_attention_heads ({model.heads}) divisible by --sp ({sp}); valid --sp: {valid}."
        )


def model_state_bytes(model: ModelShape, run: RunConfig) -> dict[str, float]:
    """Parameters, gradients and optimizer states held on one rank's device (AdamW).

    bf16 on DeepSpeed: bf16 weights and gradients, fp32 master weights + Adam m and v in the
    optimizer (2 + 2 + 12 bytes per parameter). bf16 on FSDP2: accelerate keeps fp32 sharded weights
    for mixed precision (4 + 4 + 8). bf16 on DDP: mixed precision as the recipes run it (fp32 weights
    loaded, bf16 autocast), so fp32 weights, gradients and AdamW m, v (4 + 4 + 8), plus DDP's fp32
    bucket copy of the gradients when there is more than one rank; pure bf16 weights would round
    most lr-1e-5 updates away. fp32: 4 + 4 + 8. Returns `gradients` (all of them: the optimizer step),
    `gradients_persistent` (forward and loss: DeepSpeed's flat gradient buffers and DDP's bucket copy
    live through the whole step, torch's `param.grad` only from backward on, `zero_grad(set_to_none=True)`;
    during backward see `backward_gradient_bytes`).
    """
    n, w = model.num_params(), run.world
    deepspeed = run.engine.startswith("zero")
    mixed = run.dtype == "bf16"
    p_bytes, g_bytes, o_bytes = (4, 4, 8)
    if mixed and deepspeed:
        p_bytes, g_bytes, o_bytes = (2, 2, 12)
    params, grads, optim = n * p_bytes, n * g_bytes, n * o_bytes
    # DDP's flat gradient buckets (gradient_as_bucket_view=False, torch's default) from two ranks on.
    buckets = grads if run.engine == "ddp" and run.world > 1 else 0.0
    shard = {"ddp": (1, 1, 1), "zero1": (1, 1, w), "zero2": (1, w, w), "zero3": (w, w, w), "fsdp2": (w, w, w)}
    ps, gs, os_ = shard[run.engine]
    params, grads, optim = params / ps, grads / gs, optim / os_
    if run.offload_optimizer:
        optim = 0.0
        if run.engine != "zero1":
            grads = 0.0  # DeepSpeed keeps the gradient partitions next to the CPU optimizer
    if run.offload_params:
        params = 0.0
        if run.engine == "fsdp2":
            grads, optim = 0.0, 0.0  # CPUOffloadPolicy: sharded params, grads and the step on the host
    persistent = grads + buckets if deepspeed else buckets
    return {
        "parameters": params,
        "gradients": grads + buckets,
        "gradients_persistent": persistent,
        "optimizer_states": optim,
    }


def offloaded_state_bytes(model: ModelShape, run: RunConfig) -> float:
    """Bytes of model state one rank's offload flags move to the host: the device's states without them
    minus with them (DeepSpeed keeps the moved partitions in the same dtypes on the host)."""
    kept = RunConfig(**{**asdict(run), "offload_optimizer": False, "offload_params": False})
    moved = model_state_bytes(model, kept)
    left = model_state_bytes(model, run)
    return sum(moved[k] - left[k] for k in ("parameters", "gradients", "optimizer_states"))


def backward_gradient_bytes(model: ModelShape, states: dict[str, float]) -> tuple[float, float]:
    """Gradient bytes at the first and at the last layer of the backward.

    Buffers allocated before the step (DeepSpeed's flat gradients, DDP's buckets) are there throughout;
    torch's `param.grad` (DDP, FSDP2; the Trainer zeroes with `set_to_none=True`) appear as backward
    reaches each parameter: the LM head's and the final norm's first, then one layer at a time, and the
    input embedding's last (one matrix when tied, whose gradient the LM head already started). FSDP2's
    sharded gradients are counted here; its unsharded LM-head gradient is in `gather_bytes`.
    """
    persistent = states["gradients_persistent"]
    created = states["gradients"] - persistent
    n = model.num_params()
    head = model.vocab * model.hidden + model.hidden
    first = min(n, head + model.layer_params()) / n
    last = (n - (0 if model.tied_embeddings else model.vocab * model.hidden)) / n
    return persistent + created * first, persistent + created * last


def gather_bytes(model: ModelShape, run: RunConfig, phase: str) -> float:
    """Unsharded parameters (and their full-size gradients before reduce-scatter) in a phase.

    ZeRO-3 keeps up to `stage3_max_live_parameters` gathered; FSDP2 holds its root module (embedding,
    LM head) unsharded through forward and backward plus the current and the prefetched layer. In the
    loss phase the LM head's full gradient, in the backward phase one layer's, exists before it is
    reduce-scattered; under FSDP2 the LM head's full gradient stays through the whole backward (the root
    module reduce-scatters when the backward ends).
    """
    if run.engine not in ("zero3", "fsdp2") or (run.world == 1 and not run.offload_params):
        return 0.0
    p = run.act_bytes
    unsharded = 1.0 if run.offload_params else 1 - 1 / run.world
    head = model.vocab * model.hidden
    if run.engine == "zero3":
        live = min(model.num_params(), DS_MAX_LIVE_PARAMETERS) * p * unsharded
    else:
        live = (model.embedding_params() + 2 * model.layer_params()) * p * unsharded
    if phase == "loss":
        return live + head * p
    if phase == "backward":
        root_grad = head * p if run.engine == "fsdp2" else 0.0
        return live + model.layer_params() * p + root_grad
    return live if phase == "forward" else 0.0


def _vision_tower(model: ModelShape, run: RunConfig, notes: list[str]) -> float:
    """Bytes of a VLM's vision tower one rank keeps to the backward (`run.vision_patches`; 0 without)."""
    if not run.vision_patches:
        return 0.0
    if model.vision is None:
        raise ValueError(f"--vision-patches needs a model whose config has a vision_config; {model.name!r} has none.")
    share = vision_tower_bytes(model.vision, run.vision_patches, run)
    notes.append(
        f"vision tower: {share['patches_per_rank']:,} of {run.vision_patches:,} patches encoded on this rank "
        f"(sharded over SP), {_gib(share['saved_activations'] + share['gathered_features'])} GiB in saved activations"
    )
    return float(share["saved_activations"] + share["gathered_features"])


def estimate(model: ModelShape, run: RunConfig, device: DeviceProfile) -> Plan:
    """Per-rank peak memory of one training step (forward, loss, backward, optimizer step).

    Args:
        model: the architecture (`load_model_shape`).
        run: sequence length, ranks, engine and memory flags.
        device: capacity and overheads (`DEVICES[...]`, or `.with_capacity(...)`).

    Returns:
        A `Plan`: the terms of the phase with the highest total, in GiB (they sum to `peak_gib`).

    Raises:
        ValueError: `run.sp` does not divide the query heads, or `run.ulysses_head_chunks` does not split them.
    """
    check_heads(model, run.sp)
    valid = valid_head_chunks(model, run.sp)
    if run.ulysses_head_chunks not in valid:
        raise ValueError(
            f"--ulysses-head-chunks {run.ulysses_head_chunks} does not split the heads of a rank into whole query "
            f"groups ({model.heads} query / {model.kv_heads} key-value heads at --sp {run.sp}); valid: {valid}."
        )
    notes: list[str] = []
    a, h, n_layers = run.act_bytes, model.hidden, model.layers
    tokens = run.micro_batch * ceil_div(run.seq_len, run.sp)  # local tokens, padded to a multiple of sp
    states = model_state_bytes(model, run)
    stack = layer_stack(model, run, tokens, device.host_is_device)  # per attention kind (full, sliding, chunked)
    shared = stack.largest("shared")

    checkpoint = tokens * h * a
    stored = stack.stored(checkpoint) + shared  # what every layer keeps until its backward
    if run.router_loss and model.experts and not run.checkpointing:
        # hf_longctx.sequence.router_loss keeps each layer's router logits [T, E] to the backward (with
        # checkpointing they are recomputed with the layer); its per-expert statistics are O(E).
        stored += n_layers * a * tokens * model.experts
    if run.checkpointing and run.offload_activations and not device.host_is_device:
        stored = min(2, n_layers) * checkpoint + shared  # the layer being recomputed and the prefetched one
    elif run.offload_activations:
        notes.append("on the CPU, offloaded activations stay in the same memory: no saving")
    tower = _vision_tower(model, run, notes)
    stored += tower  # the tower's backward runs after the decoder's: its activations are kept to the end
    # offload_activations copies every layer's input to pinned host memory, per rank on the node; the
    # offload flags keep what they move off the device (`offloaded_state_bytes`) on the host too.
    on_host = run.offload_activations and not device.host_is_device
    host_acts = n_layers * checkpoint * run.node_ranks if on_host else 0.0
    host_states = 0.0 if device.host_is_device else offloaded_state_bytes(model, run) * run.node_ranks
    host = host_acts + host_states
    host_fits = run.host_memory_gib is None or host <= run.host_memory_gib * GIB
    if host_acts:
        notes.append(
            f"{n_layers} offloaded layer inputs per rank ({_gib(host_acts / run.node_ranks)} GiB) x "
            f"{run.node_ranks} ranks = {_gib(host_acts)} GiB pinned on the host per node"
        )
    if host_states:
        notes.append(f"offloaded model states: {_gib(host_states)} GiB on the host per node")
    if not host_fits:
        drop = (("no --offload-activations", host_acts), ("no --offload-optimizer / --offload-params", host_states))
        fix = " or ".join(name for name, on in drop if on)
        notes.append(
            f"offloaded activations and states need {_gib(host)} GiB of host memory per node, more than "
            f"--host-memory {run.host_memory_gib:g}: use fewer tokens (--seq-len, --micro-batch), more SP (--sp) "
            f"or {fix}"
        )
    warnings = []
    if keeps_transformers_mask(model, run) and run.attn == "sdpa":
        square = run.micro_batch * run.seq_len**2  # booleans
        warnings.append(
            f"hf_longctx leaves {model.name}'s attention to transformers at --sp 1 ({model.own_attention}): a row "
            f"of packed documents makes sdpa build a [S, S] mask, {_gib(square)} GiB at S = {run.seq_len:,} (not "
            "counted above); pad rows instead of packing them, or use --attn flash"
        )
    if run.sp_spans_nodes:  # the planner models Ulysses only; hf_longctx's hybrid backend keeps it on the node
        warnings.append(
            f"an SP group of {run.sp} ranks spans nodes of {run.node_ranks} (--ranks-per-node): every Ulysses "
            "all-to-all (four per layer, forward and backward) crosses the inter-node network; use "
            'sp_backend="auto" (or "hybrid": Ulysses inside a node, a ring across nodes; not modelled here) or an '
            f"--sp that divides {run.node_ranks}"
        )
    # The backward at its last layer: only layer 0's saved tensors (or input) are left.
    stored_last = stack.kinds[0].kept(checkpoint) + shared + tower
    # The final norm's saved tensors; tiled_layer checkpoints it per tile, so only its input stays.
    final_norm = tokens * (h * a if run.tiled_layer is not False else norm_bytes(h, a, run.liger_kernels))
    logits = loss_bytes(model, run, tokens, fused=run.tiled_loss and not device.host_is_device)

    # The backward at its first layer (every layer's activations; the gradients of the LM head and one layer)
    # and at its last (layer 0's activations; every gradient but the input embedding's): both grow or shrink
    # linearly with the layers done, so the larger of the two is the backward's peak.
    layer_backward = {
        "recompute": stack.recompute(),
        # The gradient of the residual stream and of the layer output stay alive across the layer.
        "backward_transients": stack.largest("backward") + 2 * checkpoint,
        "all_to_all_buffers": stack.largest("all_to_all"),
        "zero3_gathers": gather_bytes(model, run, "backward"),
    }
    phases: dict[str, dict[str, float]] = {
        "forward": {
            "saved_activations": stored,
            "backward_transients": stack.largest("forward"),
            "all_to_all_buffers": stack.largest("all_to_all"),
            "zero3_gathers": gather_bytes(model, run, "forward"),
        },
        "loss": {
            "saved_activations": stored + final_norm,
            "logits_loss": logits,
            "zero3_gathers": gather_bytes(model, run, "loss"),
        },
        "backward": {"saved_activations": stored, **layer_backward},
        "backward_last": {"saved_activations": stored_last, **layer_backward},
        "optimizer": {},
    }
    grads_first, grads_last = backward_gradient_bytes(model, states)
    gradients = {"forward": states["gradients_persistent"], "loss": states["gradients_persistent"]}
    gradients.update(backward=grads_first, backward_last=grads_last, optimizer=states["gradients"])
    totals: dict[str, float] = {}
    detail: dict[str, dict[str, float]] = {}
    for phase, dynamic in phases.items():
        terms = dict.fromkeys(TERMS, 0.0)
        terms["parameters"] = states["parameters"]
        terms["optimizer_states"] = states["optimizer_states"]
        terms["gradients"] = gradients[phase]
        offloaded = run.offload_optimizer or (run.offload_params and run.engine == "fsdp2")
        if phase == "optimizer" and not offloaded and not device.host_is_device:
            # One temporary the size of the local optimizer partition: DeepSpeed's fp32 gradient
            # partition, or torch's foreach AdamW sqrt(v) of the fp32 states (on CPU AdamW steps one
            # tensor at a time).
            terms["optimizer_states"] += 4 * model.num_params() / (1 if run.engine == "ddp" else run.world)
        for key, value in dynamic.items():
            terms[key] += value
        activations = sum(v for k, v in dynamic.items() if k != "zero3_gathers")
        terms["allocator_runtime_overhead"] = device.runtime_gib * GIB + device.fragmentation * activations
        detail[phase] = terms
        totals[phase] = sum(terms.values())
    last_total, last_terms = totals.pop("backward_last"), detail.pop("backward_last")
    if last_total > totals["backward"]:
        totals["backward"], detail["backward"] = last_total, last_terms
    peak_phase = max(totals, key=totals.get)
    breakdown = {k: _gib(v) for k, v in detail[peak_phase].items()}
    peak = totals[peak_phase] / GIB
    capacity = device.capacity_gib
    return Plan(
        peak_gib=round(peak, 3),
        capacity_gib=round(capacity, 3),
        fits=peak <= capacity and host_fits,
        breakdown=breakdown,
        dominant=max(breakdown, key=breakdown.get),
        peak_phase=peak_phase,
        phases={k: _gib(v) for k, v in totals.items()},
        tokens_per_rank=tokens,
        num_params=model.num_params(),
        notes=notes,
        host_gib=_gib(host),
        host_capacity_gib=run.host_memory_gib,
        attention_kernel=attention_kernel(model, run, device.host_is_device),
        warnings=warnings,
    )


def max_seq_len(
    model: ModelShape, run: RunConfig, device: DeviceProfile, limit: int = 2**34, margin: float = 0.0
) -> int:
    """The longest sequence length (a multiple of `run.sp`) whose plan fits with `margin` of the device left over
    (0: up to the capacity, as the published comparisons count; `PLAN_ERROR`: what the CLI calls "fits"); 0 if none.

    The peak grows monotonically with the sequence length, so a bisection over multiples of sp finds
    the boundary in about 35 evaluations. One exception: with `tiled_mlp=True` the MLP runs whole up to
    max(hidden, 4096) tokens per rank and tiled above, so the peak steps down once there; when
    lengths just below that step do not fit but longer ones do, the answer depends on where the search lands.
    """

    def fits(units: int) -> bool:
        return estimate(model, run.with_seq_len(units * run.sp), device).fits_within(margin)

    lo, hi = 0, 1
    while fits(hi):
        lo, hi = hi, hi * 2
        if hi * run.sp > limit:
            return lo * run.sp
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo * run.sp


def _gib(value: float) -> float:
    return round(value / GIB, 3)
