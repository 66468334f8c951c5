"""`hf-longctx check`: is sequence parallelism exact for this model architecture?

`run(args)` builds a small random-init float32 copy of a local config (`model.py`), runs one SP=K
training step in K gloo ranks launched by torchrun (`worker.py`), recomputes the same step at SP=1
in this process with the plain model and compares the loss and every gradient (`report.py`).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from hf_longctx.check import vlm
from hf_longctx.check.args import add_arguments  # noqa: F401 (re-exported: `python -m hf_longctx.check`)
from hf_longctx.check.model import (
    SEED,
    build_model,
    check_batch,
    head_counts,
    load_config,
    reference_step,
    resolve_config_path,
    shrink_config,
    valid_labels_per_rank,
)
from hf_longctx.check.report import TOP_K, ZERO_GRAD_RTOL, compare, verdict
from hf_longctx.check.worker import WorkerSpec, kill, launch, log_tail

EXIT_PASS, EXIT_FAIL, EXIT_INVALID = 0, 1, 2


def _validate(args: argparse.Namespace) -> None:
    if args.sp < 1:
        raise ValueError(f"--sp must be >= 1, got {args.sp}.")
    for flag, value, low in (
        ("--seq-len", args.seq_len, 4),
        ("--batch-size", args.batch_size, 1),
        ("--layers", args.layers, 1),
    ):
        if value < low:
            raise ValueError(f"{flag} must be >= {low}, got {value}.")
    if args.hidden < 0:
        raise ValueError(f"--hidden must be >= 0 (0 keeps the model's), got {args.hidden}.")
    for flag, value in (
        ("--tolerance-loss", args.tolerance_loss),
        ("--tolerance-grad", args.tolerance_grad),
        ("--timeout", args.timeout),
    ):
        if not value > 0:
            raise ValueError(f"{flag} must be > 0, got {value}.")


def run(args: argparse.Namespace, emit: Callable[[str], None] | None = None) -> int:
    """Run `hf-longctx check` and print its report.

    Args:
        args: the parsed options of `add_arguments`.
        emit: where report lines go (default: print to stdout).

    Returns:
        0 on PASS; 1 on FAIL (above tolerance, the SP run crashed or timed out); 2 on invalid
        input (bad options, no config, unsupported model, heads not divisible by `--sp`), in
        which case nothing is launched.
    """
    from hf_longctx.attention.backends import resolve_backend
    from hf_longctx.attention.linear.support import check_token_mixers
    from hf_longctx.attention.registry import enable_sequence_parallel
    from hf_longctx.attention.ring.hybrid import check_ring_model
    from hf_longctx.data.layout import pad_multiple
    from hf_longctx.distributed.groups import SequenceParallelGroups

    out = emit or (lambda line: print(line, flush=True))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sp = args.sp
    with tempfile.TemporaryDirectory(prefix="hf_longctx_check_") as tmp_name:
        tmp = Path(tmp_name)
        try:
            _validate(args)
            original = load_config(args.model)
            if vlm.is_vision_language(original):
                vlm.check_supported(original, args.seq_len, args.packed)
            heads, kv_heads = head_counts(original)
            # What the workers will run (auto resolved as on one host of sp ranks): raises for bad heads/options.
            backend = resolve_backend(
                args.backend,
                heads,
                kv_heads,
                sp,
                ulysses_degree=args.ulysses_degree,
                ring_variant=args.ring_variant,
                ranks_per_node=sp,
                link="host",
            )
            padded = args.seq_len + (-args.seq_len % pad_multiple(backend.layout, sp))
            config, notes = shrink_config(
                original, layers=args.layers, hidden=args.hidden, min_positions=padded, attn=args.attn
            )
            config.save_pretrained(tmp / "model")
            model = build_model(tmp / "model", args.attn, SEED)
            # Validates the kernel and the model type the way the workers will, before launching.
            enable_sequence_parallel(model, SequenceParallelGroups.single()).remove()
            check_token_mixers(model, sp)  # linear-attention heads must split over the SP size
            if backend.name != "ulysses":
                check_ring_model(model.config.get_text_config(), model)
        except ValueError as exc:
            out(f"INVALID: {exc}")
            return EXIT_INVALID

        text = model.config.get_text_config()
        label = type(model).__name__
        batch = check_batch(model, args.seq_len, args.batch_size, args.packed, SEED)
        n_params = sum(p.numel() for p in model.parameters())
        out(f"hf-longctx check: {label} ({config.model_type}) from {resolve_config_path(args.model)}")
        out(
            f"  test copy: {text.num_hidden_layers} layers, hidden {text.hidden_size}, {heads} heads / "
            f"{kv_heads} kv heads, head_dim {getattr(text, 'head_dim', None) or text.hidden_size // heads}, "
            f"vocab {text.vocab_size}, {n_params:,} params, float32, attn {args.attn}, seed {SEED}"
        )
        out(f"  shrunk: {'; '.join(notes)}")
        out(
            f"  batch: {args.batch_size} x {args.seq_len} tokens (padded to {padded}, {padded // sp} per rank), "
            f"packed: {'3 docs/row' if args.packed else 'no'}, valid labels per SP rank: "
            f"{valid_labels_per_rank(batch, sp, backend.layout)}"
        )
        out(
            f"  backend: {backend.name} (Ulysses degree {backend.ulysses_degree} x ring {backend.ring_size}, "
            f"{backend.layout} layout{', ' + backend.ring_variant if backend.ring_size > 1 else ''})"
            + (f"; {args.backend}: {backend.reason}" if args.backend == "auto" else "")
        )
        if sp > 1:
            out("  (row 0's first half has no labels on purpose: a shard without any label must still be exact)")
        if args.inject_fault:
            out(f"  SELF-TEST: fault {args.inject_fault!r} injected into the SP run; the check must FAIL")

        spec = WorkerSpec(
            config_dir=str(tmp / "model"),
            attn=args.attn,
            seed=SEED,
            seq_len=args.seq_len,
            batch_size=args.batch_size,
            packed=args.packed,
            output=str(tmp / "sp_result.pt"),
            pid_dir=str(tmp),
            fault=args.inject_fault,
            backend=args.backend,
            ulysses_degree=args.ulysses_degree,
            ring_variant=args.ring_variant,
        )
        spec.save(tmp / "spec.json")
        log_path = tmp / "torchrun.log"
        start = time.monotonic()
        proc = launch(tmp / "spec.json", sp, log_path)
        try:
            ref = reference_step(model, batch)  # overlaps with torchrun's start-up
            ref_s = time.monotonic() - start
            try:
                code = proc.wait(max(0.0, args.timeout - (time.monotonic() - start)))
            except subprocess.TimeoutExpired:
                kill(proc, tmp)
                out(log_tail(log_path))
                out(f"FAIL: timed out: the SP={sp} run did not finish within {args.timeout:g} s (killed)")
                return EXIT_FAIL
        finally:
            if proc.poll() is None:  # an exception in the reference or Ctrl-C: leave nothing behind
                kill(proc, tmp)
        sp_s = time.monotonic() - start
        result_path = Path(spec.output)
        if code != 0 or not result_path.exists():
            out(log_tail(log_path))
            out(f"FAIL: the SP={sp} run failed (torchrun exit code {code}); its output is above")
            return EXIT_FAIL

        result = torch.load(result_path, weights_only=True)
        out(f"  SP={sp} run (torchrun, gloo): {sp_s:.1f} s; SP=1 reference (in process): {ref_s:.1f} s")
        if any(sha != ref.weights_sha256 for sha in result["weights_sha256"]):
            out("FAIL: the SP workers and the reference built different weights (seeded init is not deterministic)")
            return EXIT_FAIL
        try:
            cmp = compare(result["loss"], result["grads"], ref)
        except ValueError as exc:
            out(f"FAIL: {exc}")
            return EXIT_FAIL
        if any(result.get("tower_rows", [])):
            out(
                f"  vision tower sharded over the SP group: pixel rows per tower call on each rank "
                f"{result['tower_rows']} (the batch has {batch['pixel_values'].shape[0]}; a rank without an image "
                "encodes a stand-in)"
            )
        out(f"  loss   SP={sp} {cmp.loss_sp:.9f}   SP=1 {cmp.loss_ref:.9f}   rel diff {cmp.loss_rel:.2e}")
        out(f"  grads  worst of {len(cmp.grad_errors)} parameters, max|g_sp - g_ref| / max|g_ref|:")
        for name, err in cmp.grad_errors[:TOP_K]:
            out(f"    {err:.2e}  {name}")
        if cmp.zero_grads:
            out(
                f"  {len(cmp.zero_grads)} reference gradients are zero up to round-off (< {ZERO_GRAD_RTOL:.0e} of the "
                f"largest), so measured against the largest: {', '.join(cmp.zero_grads[:TOP_K])}"
            )
        passed, line = verdict(cmp, sp, args.tolerance_loss, args.tolerance_grad, label)
        out(line)
        return EXIT_PASS if passed else EXIT_FAIL
