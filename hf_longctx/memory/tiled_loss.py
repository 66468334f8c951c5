"""`tiled_loss`: a causal LM's training loss without its `[tokens, vocab]` logits.

`enable_tiled_loss(model)` is the main entry. Why a model-level forward wrapper: a causal LM's
own forward projects every position through `lm_head` before its `loss_function` sees the
logits, so neither `loss_function` nor an `lm_head` hook alone can avoid the full tensor. The
wrapper calls the model's own forward without labels and with `logits_to_keep=1` (one position's
logits, which the model still transforms as usual), captures the final hidden states with a
forward hook on the backbone, and computes the loss tile by tile from a forward hook on
`lm_head`: inside that module call its weight is materialised by every engine (DeepSpeed ZeRO-3
gathers it, FSDP2 unshards it), and the one-position call checks at run time that the logits
really are `transform(lm_head(hidden))`, so an unsupported model raises instead of training on a
different loss. What each forward returns:

- labels and gradients on (training): `loss` only (HF `ForCausalLMLoss` semantics: summed token
  cross-entropy / `num_items_in_batch`, or the token mean without it; plus the MoE aux loss);
- labels under `torch.no_grad()` (evaluate / predict): the model's full logits, and the loss
  computed from them tile by tile (no float32 copy or log-softmax of the whole tensor);
- `fused_lm_head=True` (TRL trainers): TRL's `FusedCausalLMOutput` with the same fields as TRL's
  chunked kernel, computed here in tiles of `lm_head.TILE_LOGITS` logits, where TRL's torch
  fallback (devices without Triton) would hold several `[4096, 32768]` float32 tiles; with Triton
  TRL's own kernel runs, so nothing runs twice;
- no labels: the model's forward unchanged.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch
import torch.nn.functional as F

from hf_longctx import _compat
from hf_longctx.data.sharding import IGNORE_INDEX
from hf_longctx.memory.lm_head import (
    LogitTransform,
    attach,
    gathered,
    linear_cross_entropy_sum,
    linear_token_stats,
    tile_tokens,
)

logger = logging.getLogger(__name__)
LOSS_KWARGS = ("labels", "shift_labels", "num_items_in_batch")


def logit_transform(config: Any) -> LogitTransform:
    """The logit scaling / soft-capping a transformers config declares (Cohere `logit_scale`,
    Granite `logits_scaling`, Gemma `final_logit_softcapping`); the run-time check catches others."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    scale = getattr(text, "logit_scale", None)
    if scale is None and getattr(text, "logits_scaling", None):
        scale = 1.0 / text.logits_scaling
    return LogitTransform(scale=float(scale or 1.0), softcap=getattr(text, "final_logit_softcapping", None))


def _flat_targets(hidden: torch.Tensor, labels: torch.Tensor | None, shift_labels: torch.Tensor | None):
    """`[n, hidden]` states and `[n]` targets, aligned as `ForCausalLMLoss` aligns them."""
    if shift_labels is None:
        shift_labels = F.pad(labels[..., 1:], (0, 1), value=IGNORE_INDEX)
    return hidden.reshape(-1, hidden.shape[-1]), shift_labels.reshape(-1).to(hidden.device)


def _normalise(total: torch.Tensor, targets: torch.Tensor, num_items_in_batch: Any) -> torch.Tensor:
    # ForCausalLMLoss: sum / num_items_in_batch when given, else the mean over valid tokens (0 / 0 = NaN, as HF).
    if num_items_in_batch is None:
        return total / (targets != IGNORE_INDEX).sum().to(total.dtype)
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch


def logits_cross_entropy_sum(logits: torch.Tensor, targets: torch.Tensor, tile: int) -> torch.Tensor:
    """Summed cross-entropy of existing `[n, vocab]` logits, upcast to float32 one tile at a time."""
    total = torch.zeros((), dtype=torch.float32, device=logits.device)
    for start in range(0, logits.shape[0], tile):
        part = slice(start, start + tile)
        total += F.cross_entropy(logits[part].float(), targets[part], ignore_index=IGNORE_INDEX, reduction="sum")
    return total


class TiledLossHandle:
    """Undo record of `enable_tiled_loss`; `.remove()` restores the model's forward and hooks."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.transform = logit_transform(model.config)
        self.liger: Callable[..., Any] | None = None  # Liger's fused linear cross-entropy (tiled_loss="liger")
        self._armed: dict[str, Any] | None = None  # the running forward's request, see `_run`
        self._undo: list[Callable[[], None]] = []

    def remove(self) -> None:
        while self._undo:
            self._undo.pop()()

    # -- hooks ------------------------------------------------------------------------------------

    def _capture_hidden(self, module: torch.nn.Module, args: tuple, output: Any) -> None:
        if self._armed is not None and "hidden" not in self._armed:
            self._armed["hidden"] = output[0] if isinstance(output, (tuple, dict)) else output

    def _on_lm_head(self, module: torch.nn.Module, args: tuple, output: torch.Tensor) -> None:
        request = self._armed
        if request is None or "result" in request:
            return
        hidden = request.get("hidden")
        if hidden is None or not torch.equal(args[0], hidden[..., -1:, :]):
            raise ValueError(
                f"tiled_loss: {type(self.model).__name__} does not feed its backbone's last hidden state to "
                "lm_head; this model is not supported, set tiled_loss=False."
            )
        request["raw_last"] = output
        request["result"] = request["compute"](hidden, module.weight, getattr(module, "bias", None))

    # -- forward --------------------------------------------------------------------------------

    def _run(self, inner: Callable[..., Any], compute: Callable[..., Any], args: tuple, kwargs: dict) -> tuple:
        """Call the model's forward for one position's logits while the hooks compute the loss."""
        self._armed = {"compute": compute}
        try:
            out = inner(*args, logits_to_keep=1, **kwargs)
            request = self._armed
        finally:
            self._armed = None
        if "result" not in request:
            raise ValueError(
                f"tiled_loss: {type(self.model).__name__}.forward never called its output embeddings "
                "(get_output_embeddings()); set tiled_loss=False for this model."
            )
        self._check_transform(request["raw_last"], out.logits)
        result = request["result"]
        if isinstance(result, torch.Tensor):
            return out, attach(result, out.logits)
        differentiable = ("log_probs", "entropy")
        return out, {
            k: attach(v, out.logits) if k in differentiable and v is not None else v for k, v in result.items()
        }

    def _check_transform(self, raw_last: torch.Tensor, logits: torch.Tensor) -> None:
        ours = self.transform.apply(raw_last.float())
        theirs = logits.float()
        tol = 1e-4 if logits.dtype == torch.float32 else 2e-2
        if ours.shape != theirs.shape or not torch.allclose(
            ours, theirs, rtol=tol, atol=tol * (1 + float(theirs.detach().abs().max()))
        ):
            raise ValueError(
                f"tiled_loss: {type(self.model).__name__}'s logits are not lm_head(hidden) with the scaling / "
                f"soft-capping of its config ({self.transform}); set tiled_loss=False for this model."
            )

    def forward(self, inner: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        fused = kwargs.pop("fused_lm_head", False)
        loss_kwargs = {k: kwargs.pop(k, None) for k in LOSS_KWARGS}
        labels, shift_labels, num_items = (loss_kwargs[k] for k in LOSS_KWARGS)
        if fused:
            settings = _compat.trl_fused_head_settings(inner)
            device = self.model.get_output_embeddings().weight.device
            if settings is None or _compat.trl_fused_head_uses_triton(device):
                return inner(*args, fused_lm_head=True, **loss_kwargs, **kwargs)
            return self._fused(inner, settings, args, kwargs, labels, shift_labels, num_items)
        keep = kwargs.get("logits_to_keep", 0)
        if labels is None or not (isinstance(keep, int) and keep == 0):  # as the model: no labels, no loss
            return inner(*args, **{k: v for k, v in loss_kwargs.items() if v is not None}, **kwargs)
        kwargs.pop("logits_to_keep", None)
        return_dict = kwargs.pop("return_dict", None)
        kwargs["return_dict"] = True
        if torch.is_grad_enabled():
            out = self._train(inner, args, kwargs, labels, shift_labels, num_items)
        else:
            out = self._eval(inner, args, kwargs, labels, shift_labels, num_items)
        return out.to_tuple() if return_dict is False else out

    def _with_aux(self, loss: torch.Tensor, out: Any) -> torch.Tensor:
        # The model adds its router load-balancing loss only when it computes the loss itself.
        aux = out.get("aux_loss") if hasattr(out, "get") else None
        if aux is None:
            return loss
        return loss + getattr(self.model, "router_aux_loss_coef", 0.0) * aux.to(loss.device)

    def _train(self, inner, args, kwargs, labels, shift_labels, num_items) -> Any:
        def compute(hidden, weight, bias):
            states, targets = _flat_targets(hidden, labels, shift_labels)
            weight, bias = _full(weight), _full(bias)
            with gathered(weight, bias):
                total = _fused_linear_cross_entropy(states, weight, bias, targets, self.transform, self.liger)
            return _normalise(total, targets, num_items)

        out, loss = self._run(inner, compute, args, kwargs)
        fields = {k: v for k, v in out.items() if k not in ("loss", "logits")}
        return type(out)(loss=self._with_aux(loss, out), **fields)

    def _eval(self, inner, args, kwargs, labels, shift_labels, num_items) -> Any:
        out = inner(*args, **kwargs)
        logits, targets = _flat_targets(out.logits, labels, shift_labels)
        total = logits_cross_entropy_sum(logits, targets, tile_tokens(logits.shape[-1]))
        fields = {k: v for k, v in out.items() if k != "loss"}
        return type(out)(loss=self._with_aux(_normalise(total, targets, num_items), out), **fields)

    def _fused(self, inner, settings, args, kwargs, labels, shift_labels, num_items) -> Any:
        """TRL's `FusedCausalLMOutput`, field for field (see `trl.trainer.utils.add_fused_lm_head`)."""
        from trl.trainer.utils import FusedCausalLMOutput

        transform = LogitTransform(
            scale=float(settings["logit_scale"]),
            softcap=settings["final_logit_softcapping"],
            temperature=float(settings["temperature"]),
        )
        text_config = self.model.config.get_text_config()
        kwargs["use_cache"] = False
        if getattr(text_config, "output_router_logits", False):
            kwargs.setdefault("output_router_logits", True)
        targets_2d: dict[str, torch.Tensor] = {}

        def compute(hidden, weight, bias):
            if shift_labels is None:
                hidden, targets = hidden[:, :-1], labels[:, 1:]
            else:
                targets = shift_labels
            targets_2d["labels"] = targets = targets.to(hidden.device)
            weight, bias = _full(weight), _full(bias)
            fp32 = settings["cast_lm_head_to_fp32"]
            ctx = torch.autocast(hidden.device.type, enabled=False) if fp32 else nullcontext()
            with ctx, gathered(weight, bias):
                states = hidden.reshape(-1, hidden.shape[-1])
                if fp32:  # TRL runs its head in float32 outside autocast: the weight is cast too
                    states, weight = states.float(), weight.float()
                    bias = bias.float() if bias is not None else None
                stats = linear_token_stats(
                    states,
                    weight,
                    bias,
                    targets.reshape(-1),
                    transform,
                    wanted=tuple(settings["outputs"]),
                )
            return {k: (v.view(targets.shape) if v is not None else None) for k, v in stats.items()}

        out, stats = self._run(inner, compute, args, kwargs)
        mask = targets_2d["labels"] != IGNORE_INDEX
        denom = mask.sum().clamp(min=1) if num_items is None else num_items
        loss = -stats["log_probs"].sum() / denom
        aux = out.get("aux_loss")
        if aux is not None:
            loss = loss + getattr(text_config, "router_aux_loss_coef", 0.0) * aux
        return FusedCausalLMOutput(loss=loss, label_mask=mask, aux_loss=aux, **stats)


def _full(param: torch.Tensor | None) -> torch.Tensor | None:
    """A sharded DTensor parameter (FSDP2 outside its module's forward) as its full tensor, else unchanged."""
    from torch.distributed.tensor import DTensor

    return param.full_tensor() if isinstance(param, DTensor) else param


def _fused_linear_cross_entropy(states, weight, bias, targets, transform: LogitTransform, liger) -> torch.Tensor:
    """Summed token cross-entropy: `linear_cross_entropy_sum`, or Liger's fused kernel when it was asked for."""
    if liger is not None:
        if not states.is_cuda:
            raise ValueError(
                f"tiled_loss='liger' runs Liger's Triton kernel, which needs CUDA tensors; got {states.device}. "
                "Set tiled_loss=True (hf_longctx's tiles) on this device."
            )
        out = liger(
            states, weight, targets, bias, ignore_index=IGNORE_INDEX, reduction="sum", softcap=transform.softcap
        )
        return (out[0] if isinstance(out, tuple) else out).float()
    return linear_cross_entropy_sum(states, weight, bias, targets, transform)


def enable_tiled_loss(model: torch.nn.Module, kernel: bool | str = True) -> TiledLossHandle:
    """Make `model`'s training forward compute its loss in tiles (see the module docstring).

    Args:
        model: a transformers causal LM (a linear output embedding and a decoder backbone) whose
            forward accepts `logits_to_keep`.
        kernel: True for hf_longctx's tiles (`linear_cross_entropy_sum`, any device), "liger" for Liger's
            fused linear cross-entropy (CUDA, liger-kernel installed) in the Trainer loss; never chosen
            silently. TRL's fused head always uses hf_longctx's tiles or TRL's own kernel.

    Returns:
        A handle; `handle.remove()` restores the forward (an instance-level forward set by TRL
        or Liger before is kept and wrapped, not replaced).

    Raises:
        ValueError: the model has no linear output embedding, no separate backbone, or no
            `logits_to_keep` argument.
    """
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    backbone = _backbone(model)
    if not isinstance(head, torch.nn.Linear) or backbone is None:
        raise ValueError(
            f"tiled_loss needs a causal LM with a linear lm_head and a decoder backbone (get_decoder()); "
            f"{type(model).__name__} has neither; set tiled_loss=False."
        )
    if "logits_to_keep" not in inspect.signature(type(model).forward).parameters:
        raise ValueError(f"tiled_loss: {type(model).__name__}.forward has no logits_to_keep; set tiled_loss=False.")
    handle = TiledLossHandle(model)
    if kernel == "liger":
        handle.liger = _liger(model, handle.transform)
    elif kernel is not True:
        raise ValueError(f"tiled_loss must be True, False or 'liger', got {kernel!r}.")
    inner = model.forward
    own = model.__dict__.get("forward")
    try:
        for hook in (
            backbone.register_forward_hook(handle._capture_hidden),
            head.register_forward_hook(handle._on_lm_head),
        ):
            handle._undo.append(hook.remove)

        @functools.wraps(inner)
        def forward(*args: Any, **kwargs: Any) -> Any:
            return handle.forward(inner, *args, **kwargs)

        model.forward = forward
        handle._undo.append(lambda: _restore_forward(model, own))
    except Exception:
        handle.remove()
        raise
    ours = f"hf_longctx tiles of {tile_tokens(head.out_features)} tokens"
    chosen = "Liger's fused linear cross-entropy" if handle.liger is not None else ours
    logger.info("hf_longctx: tiled_loss on %s: %s", type(model).__name__, chosen)
    return handle


def _liger(model: torch.nn.Module, transform: LogitTransform) -> Callable[..., Any]:
    """Liger's fused linear cross-entropy for `tiled_loss="liger"`, or a ValueError naming the fix."""
    fn = _compat.liger_fused_linear_cross_entropy()
    if fn is None:
        raise ValueError("tiled_loss='liger' needs liger-kernel: `pip install liger-kernel`, or set tiled_loss=True.")
    if transform.scale != 1.0 or transform.temperature != 1.0:
        raise ValueError(
            f"tiled_loss='liger': Liger's kernel has no logit scaling, which {type(model).__name__} applies "
            f"({transform}); set tiled_loss=True."
        )
    return fn


def _backbone(model: torch.nn.Module) -> torch.nn.Module | None:
    """The module whose output is the final hidden state (`get_decoder()`, `base_model` or `.model`)."""
    candidates = [model.get_decoder() if hasattr(model, "get_decoder") else None]
    candidates += [getattr(model, "base_model", None), getattr(model, "model", None)]
    return next((m for m in candidates if isinstance(m, torch.nn.Module) and m is not model), None)


def _restore_forward(model: torch.nn.Module, own: Any) -> None:
    if own is None:
        model.__dict__.pop("forward", None)
    else:
        model.forward = own
