"""How a transformers MoE family adds its router load-balancing loss, read from the model itself.

transformers' MoE decoders (Mixtral, Qwen2/3-MoE, Qwen3-Next, Qwen3-VL-MoE, OLMoE, gpt-oss, Jamba, Granite-MoE,
DBRX, JetMoe, ... 31 families in 5.25) share one pattern in their `ForCausalLM` / `ForConditionalGeneration`
forward:

    output_router_logits = output_router_logits if output_router_logits is not None else self.config...
    aux_loss = load_balancing_loss_func(outputs.router_logits, <num experts>, <top-k>, attention_mask)
    loss += <coefficient> * aux_loss.to(loss.device)

with the router logits recorded by `_can_record_outputs["router_logits"]` hooks. `router_loss_source(cls)` reads
that pattern from the class's source (the three attribute paths on `self`) and checks the modeling module's
`load_balancing_loss_func` numerically against `router_loss.load_balancing_from_stats`, so a new family with the
same loss needs no code here, and a family whose loss differs is refused by name instead of computed wrongly.
`router_modules(model)` finds the modules whose output transformers records, with transformers' own rules.
"""

from __future__ import annotations

import ast
import functools
import inspect
import sys
import textwrap
from dataclasses import dataclass
from typing import Any

import torch

from hf_longctx.sequence.router_stats import RouterStats, load_balancing_from_stats

AUX_FUNCTION = "load_balancing_loss_func"
FLAG = "output_router_logits"


@dataclass(frozen=True)
class RouterLossSource:
    """Where one model class reads its router-loss settings (attribute paths from the model, `self`)."""

    top_k: tuple[str, ...]  # e.g. ("num_experts_per_tok",) or ("config", "text_config", "num_experts_per_tok")
    coefficient: tuple[str, ...]  # e.g. ("router_aux_loss_coef",)
    flag: tuple[str, ...] | None  # the config default of `output_router_logits`; None: only the forward kwarg
    refusal: str | None = None  # why SP cannot compute this class's router loss (None: it can)

    def settings(self, model: torch.nn.Module) -> tuple[int, float]:
        """(top-k, coefficient) as the forward reads them now (TRL rewrites the config's coefficient)."""
        return int(_resolve(model, self.top_k)), float(_resolve(model, self.coefficient))

    def enabled(self, model: torch.nn.Module, kwargs: dict[str, Any]) -> bool:
        """Whether this forward adds the router loss: its `output_router_logits`, else the config's default."""
        given = kwargs.get(FLAG)
        if given is not None:
            return bool(given)
        return bool(_resolve(model, self.flag)) if self.flag is not None else False


def _path(node: ast.AST) -> tuple[str, ...] | None:
    """`self.a.b` -> ("a", "b"); anything else -> None."""
    names: list[str] = []
    while isinstance(node, ast.Attribute):
        names.append(node.attr)
        node = node.value
    return tuple(reversed(names)) if isinstance(node, ast.Name) and node.id == "self" and names else None


def _resolve(model: Any, path: tuple[str, ...]) -> Any:
    value = model
    for name in path:
        value = getattr(value, name)
    return value


def _forward_tree(cls: type) -> ast.AST | None:
    try:
        return ast.parse(textwrap.dedent(inspect.getsource(cls.forward)))
    except (OSError, TypeError, SyntaxError):
        return None


@functools.cache
def router_loss_source(cls: type) -> RouterLossSource | None:
    """How `cls.forward` adds its router load-balancing loss; None when it adds none.

    A forward that calls `load_balancing_loss_func` in another shape, or whose module defines a different
    function, gets a `RouterLossSource` with `refusal` set: under SP it is refused when the loss is on.
    """
    tree = _forward_tree(cls)
    if tree is None or AUX_FUNCTION not in ast.unparse(tree):
        return None
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", None) == AUX_FUNCTION]
    scaled = [
        n.value.left
        for n in ast.walk(tree)
        if isinstance(n, ast.AugAssign)
        and isinstance(n.value, ast.BinOp)
        and isinstance(n.value.op, ast.Mult)
        and "aux_loss" in ast.unparse(n.value.right)
    ]
    flags = [
        n.value.orelse
        for n in ast.walk(tree)
        if isinstance(n, ast.Assign)
        and any(getattr(t, "id", None) == FLAG for t in n.targets)
        and isinstance(n.value, ast.IfExp)
    ]
    args = calls[0].args if len(calls) == 1 and not calls[0].keywords else []
    top_k = _path(args[2]) if len(args) == 4 else None
    coefficient = _path(scaled[0]) if len(scaled) == 1 else None
    shape_ok = (
        len(args) == 4
        and ast.unparse(args[0]) == "outputs.router_logits"
        and ast.unparse(args[3]) == ("attention_mask")
    )
    flag = _path(flags[0]) if len(flags) == 1 else None
    if not (shape_ok and top_k and coefficient) or len(flags) > 1 or (flags and flag is None):
        return RouterLossSource((), (), None, f"{cls.__name__}.forward adds its router loss in an unrecognised way")
    function = getattr(sys.modules.get(cls.__module__), AUX_FUNCTION, None)
    if function is None or not _standard_function(function):
        return RouterLossSource(
            top_k,
            coefficient,
            flag,
            f"{cls.__module__}.{AUX_FUNCTION} is not the load-balancing loss hf_longctx reduces",
        )
    return RouterLossSource(top_k, coefficient, flag)


def _standard_function(function: Any) -> bool:
    """Whether `function(gate_logits, num_experts, top_k, attention_mask)` is the Switch-Transformer loss computed
    from the sequence statistics (checked on random logits, with and without a padding mask)."""
    generator = torch.Generator().manual_seed(0)
    logits = tuple(torch.randn(2 * 5, 6, generator=generator) for _ in range(3))
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    for attention_mask in (None, mask):
        weight = torch.ones(10) if attention_mask is None else attention_mask.reshape(-1).float()
        stats = RouterStats.empty(6, torch.device("cpu"))
        for layer in logits:
            stats.add(layer, weight, top_k=2)
        try:
            theirs = function(logits, 6, 2, attention_mask)
        except Exception:  # noqa: BLE001 - any failure means "not the function we reduce"
            return False
        ours = load_balancing_from_stats(stats.counts, stats.probs, stats.rows)
        if not torch.allclose(torch.as_tensor(theirs, dtype=torch.float32), ours, rtol=1e-5, atol=1e-7):
            return False
    return True


def _recorder_specs(model: torch.nn.Module) -> list[Any]:
    """`_can_record_outputs["router_logits"]` of one model class, as transformers normalises it."""
    from transformers.utils.output_capturing import OutputRecorder

    specs = (getattr(type(model), "_can_record_outputs", None) or {}).get("router_logits")
    specs = specs if isinstance(specs, list) else [specs] if specs is not None else []
    return [
        s
        if isinstance(s, OutputRecorder)
        else OutputRecorder(
            target_class=None if isinstance(s, str) else s, index=1, class_name=s if isinstance(s, str) else None
        )
        for s in specs
    ]


def router_modules(model: torch.nn.Module) -> list[tuple[torch.nn.Module, int]]:
    """Every (module, output index) whose output transformers records as router logits, in forward order.

    The rules are transformers' (`utils/output_capturing.py`): each `PreTrainedModel` in the tree applies its own
    class's recorders to the modules below it; a recorder matches by class, or by the end of the module's name,
    and, when it names a layer, by that name inside the module's path.
    """
    from transformers import PreTrainedModel

    found: list[tuple[torch.nn.Module, int]] = []

    def walk(module: torch.nn.Module, name: str, specs: list[Any]) -> None:
        for child_name, child in module.named_children():
            walk(child, f"{name}.{child_name}", _recorder_specs(child) if isinstance(child, PreTrainedModel) else specs)
        for spec in specs:
            by_class = spec.target_class is not None and isinstance(module, spec.target_class)
            by_name = spec.class_name is not None and name.endswith(spec.class_name)
            if not (by_class or by_name):
                continue
            if spec.layer_name is not None and f".{spec.layer_name.strip('.')}." not in name + ".":
                continue
            found.append((module, spec.index))

    walk(model, "", _recorder_specs(model))
    return found
