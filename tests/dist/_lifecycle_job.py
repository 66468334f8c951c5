"""A torchrun job for `test_lifecycle.py`: SP=2 Trainer through train, evaluate, predict and detach.

Prints one `RESULT <json>` line per rank: the number of live process groups at each stage. A third Trainer
runs predict and is still attached when the interpreter exits (the usual end of a script). An atexit
hook registered first (so it runs last) prints whether torch.distributed was shut down before the
interpreter exits: a gloo group still alive at exit can abort the process with SIGABRT.
"""

from __future__ import annotations

import atexit
import gc
import json
import os
import sys

import torch.distributed as dist


def _at_exit() -> None:
    print(f"EXIT rank={os.environ['RANK']} distributed_shut_down={not dist.is_initialized()}", flush=True)


atexit.register(_at_exit)

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from transformers import Trainer, TrainingArguments  # noqa: E402

import hf_longctx  # noqa: E402
from tests._models import tiny_model  # noqa: E402
from tests.dist import _trainer_utils as U  # noqa: E402


def live_groups() -> int:
    return len(dist.distributed_c10d._world.pg_map)


def make_trainer(out: str) -> Trainer:
    args = TrainingArguments(
        output_dir=out,
        use_cpu=True,
        report_to=[],
        disable_tqdm=True,
        per_device_train_batch_size=2,
        per_device_eval_batch_size=2,
        max_steps=2,
        save_strategy="no",
        remove_unused_columns=False,
        parallelism_config=hf_longctx.ParallelismConfig(sp_size=2),
    )
    return Trainer(
        model=tiny_model("llama"), args=args, train_dataset=U.dataset("mixed", 8), data_collator=U.RecordingCollator()
    )


def main(out: str) -> Trainer:
    counts = {}
    trainer = make_trainer(out)
    counts["attached"] = live_groups()
    trainer.train()
    trainer.evaluate(U.dataset("eval", 5))
    trainer.predict(U.dataset("eval", 5))
    hf_longctx.integrations.trainer.detach(trainer)
    counts["detached"] = live_groups()
    second = make_trainer(out)
    counts["second"] = live_groups()
    second.evaluate(U.dataset("eval", 5))
    del second
    gc.collect()
    counts["collected"] = live_groups()
    print("RESULT " + json.dumps(counts), flush=True)
    # The usual end of a script: the last Trainer is still attached (neither detached nor collected) at exit.
    return make_trainer(out)


if __name__ == "__main__":
    last = main(sys.argv[1])
    last.predict(U.dataset("eval", 5))
