"""The custom-training-loop demo: Ulysses SP over all ranks vs a single-device run of the same steps.

Run with `torchrun --standalone --nproc_per_node 2 -m hf_longctx.cli.demo` (CPU/gloo or GPU/NCCL).
`train_sp` is the loop the README shows; rank 0 then replays the same batches without SP and
prints the largest loss difference. Offline: tiny random-init Llama, GPT-2 tokenizer, vendored texts.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist

import hf_longctx
from hf_longctx.data.defaults import gpt2_tokenizer, tiny_llama, window_dataset
from hf_longctx.data.sharding import shard_batch_for_rank
from hf_longctx.distributed.comm import barrier


def train_sp(model, batches, groups, lr: float, log=print) -> list[float]:
    """Train `model` on `batches` (full `[bs, sl]` token tensors) with sequence parallelism.

    The model and the batches go to the model's device (the rank's GPU under NCCL, the CPU under gloo).
    """
    device = next(model.parameters()).device
    ddp = torch.nn.parallel.DistributedDataParallel(model)  # averages gradients over all ranks
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    with hf_longctx.enable_sequence_parallel(model, groups):
        for step, ids in enumerate(batches):
            start = time.perf_counter()
            ids = ids.to(device)
            shard = hf_longctx.shard_batch({"input_ids": ids, "labels": ids}, groups)
            shift_labels = shard.pop("shift_labels")
            logits = ddp(**shard).logits
            loss = hf_longctx.sequence_parallel_loss(logits, shift_labels, groups)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
            rate = ids.numel() / (time.perf_counter() - start)
            log(f"step {step + 1}/{len(batches)}  loss {loss.item():.6f}  {rate:,.0f} tokens/s")
    return losses


def train_reference(model, batches, lr: float) -> list[float]:
    """The same steps on one device without SP: the ground truth."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    single = hf_longctx.SequenceParallelGroups.single()
    losses = []
    device = next(model.parameters()).device
    for ids in batches:
        ids = ids.to(device)
        batch = shard_batch_for_rank({"input_ids": ids, "labels": ids}, 0, 1)
        shift_labels = batch.pop("shift_labels")
        loss = hf_longctx.sequence_parallel_loss(model(**batch).logits, shift_labels, single)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--no-reference", action="store_true", help="skip the single-device comparison")
    args = parser.parse_args(argv)

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    log = print if rank == 0 else (lambda *a, **k: None)
    groups = hf_longctx.SequenceParallelGroups.build(sp_size=world)
    tok = gpt2_tokenizer()
    ds = window_dataset(tok, args.seq_len, max_windows=args.steps * args.batch_size)
    ids = torch.tensor(ds["input_ids"])
    batches = list(ids.split(args.batch_size))
    log(f"hf_longctx demo: Ulysses SP={world}, {len(batches)} steps of {args.batch_size}x{args.seq_len} tokens")

    sp_losses = train_sp(tiny_llama(tok, num_hidden_layers=args.layers).to(device), batches, groups, args.lr, log)
    if rank == 0 and not args.no_reference:
        torch.set_num_threads(max(torch.get_num_threads(), world))
        log("single-device reference on the same batches ...")
        ref = train_reference(tiny_llama(tok, num_hidden_layers=args.layers).to(device), batches, args.lr)
        worst = max(abs(a - b) / abs(b) for a, b in zip(sp_losses, ref, strict=True))
        log(f"step  loss(SP={world})   loss(SP=1)")
        for i, (a, b) in enumerate(zip(sp_losses, ref, strict=True)):
            log(f"{i + 1:4d}  {a:.6f}  {b:.6f}")
        log(f"SP={world} vs SP=1: max relative loss difference {worst:.2e} over {len(ref)} steps")
    barrier(dist.group.WORLD)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
