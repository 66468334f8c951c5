"""`trainer_config_errors`: the Trainer configurations hf_longctx must refuse, each with the message it raised
(run on every rank by `_trainer_utils.trainer_worker(errors=True)`)."""

from __future__ import annotations

import os

import hf_longctx
from tests._models import tiny_model
from tests.dist._trainer_utils import RecordingCollator, Wrapper, dataset, parallelism_config, unshifted_loss


def trainer_config_errors(out_dir: str) -> dict[str, str | None]:
    """The ValueError message (None: nothing raised) of each misconfiguration: Trainer construction, then
    `train()` for the cases only `train()` can see (the Trainer's loss settings)."""
    from transformers import Trainer, TrainingArguments

    cases = {
        "no_use_cpu": {"use_cpu": False, "sp": 2},
        "sp3": {"use_cpu": True, "sp": 3},
        # 3 query heads cannot be split over 2 ranks: refused when the Trainer first sees the model.
        "heads3": {"use_cpu": True, "sp": 2, "model": {"num_heads": 3, "num_kv_heads": 1, "hidden": 48}},
        # A compute_loss_func that may shift labels itself: refused at train().
        "unmarked_loss": {"use_cpu": True, "sp": 2, "loss": unshifted_loss},
        # Several ranks but no DDP wrapper (ddp_backend given, use_cpu not): gradients never averaged.
        "no_engine": {"use_cpu": False, "sp": 2, "ddp_backend": "gloo"},
        # SP asked, not applied: a wrapper module is trained (accelerate.prepare can switch only the transformers
        # model), refused at the first step.
        "wrapper": {"use_cpu": True, "sp": 2, "wrap": True},
        # Heads and adapters hf_longctx has no exact SP path for, refused by class name when the Trainer is built;
        # a token-classification head whose loss a compute_loss_func would take per shard, refused at train().
        "unknown_head": {"use_cpu": True, "sp": 2, "build": "bare"},
        "shadow": {"use_cpu": True, "sp": 2, "build": "shadow"},
        "token_loss_func": {
            "use_cpu": True,
            "sp": 2,
            "build": "token",
            "loss": hf_longctx.takes_shifted_labels(
                lambda outputs, labels, num_items_in_batch=None: outputs.logits.sum()
            ),
        },  # fmt: skip
        # SP asked, not applied: an Accelerator made earlier keeps accelerate's shared state (use_configured_state),
        # the Trainer's accelerator never sees parallelism_config; refused when the Trainer is built. Last: it
        # changes this process's accelerate state.
        "configured_state": {"use_cpu": True, "sp": 2, "configured_state": True},
    }
    messages: dict[str, str | None] = {}
    for name, case in cases.items():
        stage = "init"
        try:
            if case.get("configured_state"):
                from accelerate import Accelerator
                from accelerate.state import AcceleratorState

                # As in a new process: this Accelerator is the first, no Trainer patch is installed yet.
                AcceleratorState._reset_state(reset_partial_state=True)
                hf_longctx.integrations.trainer.remove_trainer_patches()
                Accelerator(cpu=True)
            args = TrainingArguments(
                output_dir=os.path.join(out_dir, name),
                use_cpu=case["use_cpu"],
                ddp_backend=case.get("ddp_backend"),
                accelerator_config={"use_configured_state": bool(case.get("configured_state"))},
                report_to=[],
                disable_tqdm=True,
                max_steps=1,
                remove_unused_columns=False,
                parallelism_config=parallelism_config(case["sp"]),
            )
            model, train = (
                _build(case.get("build")) or tiny_model("llama", **case.get("model", {})),
                dataset("mixed", 4),
            )
            model = Wrapper(model) if case.get("wrap") else model
            trainer = Trainer(
                model=model,
                args=args,
                train_dataset=train,
                data_collator=RecordingCollator(),
                compute_loss_func=case.get("loss"),
            )
            stage = "train"
            trainer.train()
        except (ValueError, NotImplementedError) as exc:
            messages[name] = f"{stage}: {exc}"
        else:
            messages[name] = None
    return messages


def _build(kind: str | None):
    """A bare decoder without a head, a Llama with a ShadowPEFT adapter, or a token classifier (None: the default)."""
    if kind is None:
        return None
    from transformers import AutoModel

    from tests._models import tiny_config

    if kind == "bare":
        return AutoModel.from_config(tiny_config("llama"))
    if kind == "token":
        from tests.dist._task_heads import task_model

        return task_model("llama", "token")
    from peft import ShadowConfig, get_peft_model

    return get_peft_model(tiny_model("llama"), ShadowConfig(task_type="CAUSAL_LM"))
