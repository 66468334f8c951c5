"""The MoE router load-balancing loss from statistics reduced over the SP group, accumulated layer by layer.

transformers' loss (Switch Transformer eqs. 4-6) is `E * sum_e f_e * P_e` where, over every token of the batch and
every MoE layer, `f_e` is the fraction of top-k assignments expert e gets and `P_e` the mean router probability of
e (padding excluded by the attention mask). Both are sequence-wide means, so a rank's shard alone gives another
number (measured 1.4% off for Qwen3-MoE, 32% on gpt-oss's grad_norm at SP=2). `RouterLoss` hooks the router
modules instead: each call adds its layer's per-expert counts and probability sums to `RouterStats`, and one
all-reduce of `2E + 1` values per forward makes them global. Each layer's logits stay only as the gradient needs
them, saved for backward like the layer's other tensors: under activation checkpointing they are dropped and
recomputed with the layer (the hook replays its statistics there), where transformers keeps every layer's router
logits until the loss (24 GiB for 1M tokens x 128 experts x 48 layers in fp32). `f` carries no gradient, so the
loss is linear in each rank's probability sums:

- the model's `loss` gets `coef x` this rank's share `E * sum_e f_e * p_local_e / N`; the shares of an SP group
  add up to the loss without SP, as the token loss shares do (Trainer multiplies both by the world size, DDP averages);
- `aux_loss` is the whole value on every SP rank (what TRL logs and adds), with a gradient P times the share's,
  so the engine's average over the SP ranks gives the exact gradient (as `comm.group_sum` does for DPO's sums).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from hf_longctx.distributed.comm import group_sum
from hf_longctx.distributed.groups import SequenceParallelGroups
from hf_longctx.sequence.replicated import mark_replicated
from hf_longctx.sequence.router_source import FLAG, RouterLossSource, router_loss_source, router_modules
from hf_longctx.sequence.router_stats import RouterStats, load_balancing_from_stats, router_sums


class RouterLoss:
    """The router loss of one model under SP: hooks on its routers, one `RouterStats` per forward."""

    def __init__(self, model: torch.nn.Module, source: RouterLossSource) -> None:
        self.source = source
        self._model = weakref.ref(model)
        self.active = False  # from `begin` to `finish` of a forward that adds the loss
        self.stats: RouterStats | None = None  # that forward's sums, from its first router call
        self.weights: torch.Tensor | None = None  # [bs * sl_l] float32, of the last forward with gradients on
        self.replay = False  # that forward added the loss: a checkpointed layer recomputed in backward replays it
        self.top_k, self.coefficient = 0, 0.0
        self.hooks = [module.register_forward_hook(self._record(index)) for module, index in router_modules(model)]

    @classmethod
    def attach(cls, model: torch.nn.Module) -> RouterLoss | None:
        """A `RouterLoss` for a model whose forward adds a router loss, else None."""
        source = router_loss_source(type(model))
        return None if source is None else cls(model, source)

    def remove(self) -> None:
        for hook in self.hooks:
            hook.remove()
        self.hooks.clear()

    def begin(self, kwargs: dict[str, Any], weights: torch.Tensor) -> None:
        """Start a forward: when it adds the router loss, take that over (`weights`: `[bs * sl_l]` counted tokens).

        Raises:
            ValueError: the loss is on and this family's loss cannot be reduced exactly (named), or no router found.
        """
        model = self._model()
        self.abort()
        enabled = model is not None and self.source.enabled(model, kwargs)
        if torch.is_grad_enabled():  # the forward whose layers backward may recompute
            self.replay = enabled
        if not enabled:
            return
        if self.source.refusal is not None or not self.hooks:
            why = self.source.refusal or f"no module of {type(model).__name__} records router logits"
            raise ValueError(
                f"{why}: under sequence parallelism each rank would compute it on its own shard (a wrong loss). "
                f"Set {FLAG}=False (router_aux_loss_coef=0 in TRL) or train with sp_size=1."
            )
        kwargs[FLAG] = False  # transformers neither keeps the router logits nor computes the shard's loss
        self.top_k, self.coefficient = self.source.settings(model)
        self.weights, self.active = weights.to(torch.float32), True

    def abort(self) -> None:
        """Forget the forward in progress (it raised, or a new one starts)."""
        self.active, self.stats = False, None

    def _record(self, index: int):
        def hook(module: torch.nn.Module, args: tuple, output: Any) -> None:
            replay = not self.active and self.replay and torch.is_grad_enabled()
            if not (self.active or replay):  # a forward without the loss
                return
            logits = output[index] if isinstance(output, (tuple, list)) else output
            logits = logits.reshape(-1, logits.shape[-1])
            if replay:
                # Activation checkpointing recomputes this layer in backward: recreate the logits the statistics
                # saved (the result was counted in the forward).
                if logits.requires_grad and logits.shape[0] == self.weights.numel():
                    router_sums(logits, self.weights.to(logits.device), self.top_k)
                return
            if logits.shape[0] != self.weights.numel():
                raise ValueError(
                    f"{type(module).__name__} routed {logits.shape[0]} tokens but the shard holds "
                    f"{self.weights.numel()}: hf_longctx cannot tell which tokens its router loss counts."
                )
            if self.stats is None:
                self.stats = RouterStats.empty(logits.shape[-1], logits.device)
            self.stats.add(logits, self.weights, self.top_k)

        return hook

    def finish(self, output: Any, groups: SequenceParallelGroups) -> None:
        """End the forward: the exact loss share into `output.loss`, the whole value into `output.aux_loss`."""
        active, stats = self.active, self.stats
        self.abort()
        if not active:
            return
        if stats is None:
            raise ValueError("No router ran in this forward, so there is no router loss to compute.")
        if not hasattr(output, "keys"):
            raise ValueError("The model returned a tuple; call it with return_dict=True for its router loss under SP.")
        experts = stats.counts.numel()
        size = groups.sp_world_size
        total = group_sum(torch.cat([stats.probs, stats.counts, stats.rows.reshape(1)]), groups.sp_group, size)
        probs, counts, rows = total[:experts], total[experts:-1].detach(), total[-1].detach()
        rows = rows.clamp(min=1)  # a batch of padding only: loss 0, not NaN
        share = load_balancing_from_stats(counts, stats.probs, rows)
        output["aux_loss"] = mark_replicated(load_balancing_from_stats(counts, probs, rows))
        loss = output.get("loss")
        if loss is not None:
            output["loss"] = loss + self.coefficient * share.to(loss.device)
