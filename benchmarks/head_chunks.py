"""Memory of one Ulysses attention call with and without head chunks (`ulysses_head_chunks`), CPU, SP=2.

    python -m benchmarks.head_chunks [--seq 8192] [--heads 16] [--kv-heads 8] [--head-dim 64] [--chunks 1,2,4] [--out P]

`measure` is one rank's call, counted by `live_bytes_mode`; what is counted: benchmarks/README.md ("Head chunks").
"""

from __future__ import annotations

import weakref
from typing import Any

from benchmarks import _harness as H
from benchmarks import _results as R

TARGET = "benchmarks.head_chunks:measure"
PHASES = {"forward_peak": "forward peak", "retained": "kept for backward", "backward_peak": "backward peak"}


def live_bytes_mode():
    """A `TorchDispatchMode` whose `live` / `peak` count the bytes of the storages created under it."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    class LiveBytes(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.live = self.peak = 0
            self._seen: dict[int, Any] = {}

        def reset_peak(self) -> None:
            self.peak = self.live

        def _freed(self, key: int, nbytes: int) -> None:
            self.live -= nbytes
            self._seen.pop(key, None)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    storage = t.untyped_storage()
                    key = storage.data_ptr()
                    if key and key not in self._seen:  # new storage (views and in-place outputs are not)
                        self._seen[key] = weakref.finalize(storage, self._freed, key, storage.nbytes())
                        self.live += storage.nbytes()
                        self.peak = max(self.peak, self.live)
            return out

    return LiveBytes()


def measure(rank: int, world: int, seq: int, heads: int, kv_heads: int, head_dim: int, chunks: int) -> dict:
    """One attention forward + backward on this rank; the bytes the call creates (see the module docstring)."""
    import torch
    import transformers

    import hf_longctx
    from hf_longctx.attention.kernels import SequenceContext
    from hf_longctx.attention.registry import CONTEXT_KWARG
    from hf_longctx.attention.ulysses import head_layout

    torch.set_num_threads(1)
    groups = hf_longctx.SequenceParallelGroups.build(world)
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=heads * head_dim, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim, max_position_embeddings=seq,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM._from_config(config, attn_implementation="sdpa")
    handle = hf_longctx.enable_sequence_parallel(model, groups, ulysses_head_chunks=chunks)
    attention = transformers.modeling_utils.ALL_ATTENTION_FUNCTIONS[handle.key]
    module = model.model.layers[0].self_attn
    local, gen = seq // world, torch.Generator().manual_seed(rank)
    leaves = [
        torch.randn(1, n, local, head_dim, generator=gen, requires_grad=True) for n in (heads, kv_heads, kv_heads)
    ]
    grad = torch.randn(1, local, heads, head_dim, generator=gen)
    context = SequenceContext(torch.arange(seq).unsqueeze(0))
    kwargs = {"dropout": 0.0, "scaling": head_dim**-0.5, CONTEXT_KWARG: context}
    mode = live_bytes_mode()
    with mode:
        # What the model hands the attention (RoPE's outputs): referenced by nothing but the call.
        q, k, v = (t * 1.0 for t in leaves)
        inputs = sum(t.nbytes for t in (q, k, v))
        out, _ = attention(module, q, k, v, None, **kwargs)
        del q, k, v
        forward_peak, retained = mode.peak, mode.live
        mode.reset_peak()
        out.backward(grad)
        backward_peak = mode.peak
    handle.remove()
    # One chunk's q, k, v and output over the full sequence (fp32): the buffers head chunks shrink.
    layout = head_layout(heads, kv_heads, world)
    buffers = 4 * seq * head_dim * (2 * layout.q_local + 2 * layout.kv_local) // chunks
    return {"forward_peak": forward_peak, "retained": retained, "backward_peak": backward_peak, "inputs": inputs,
            "output": out.nbytes, "input_grads": sum(t.grad.nbytes for t in leaves),
            "full_sequence_qkvo": buffers}  # fmt: skip


def describe(shape: dict[str, Any], base: dict[str, Any]) -> str:
    """The page's text: the call measured and what the bytes count (`base`: the chunks = 1 row)."""
    mib = lambda key: R.fmt(base[key], ".1f", R.MiB)  # noqa: E731
    return (
        f"One Llama attention call, {shape['heads']} query / {shape['kv_heads']} key-value heads of dim "
        f"{shape['head_dim']}, {R.seq(shape['seq'])} tokens (one document) over 2 ranks, sdpa, fp32. Bytes of the "
        "tensors the call creates (a dispatch mode counts each storage from its creation until autograd frees it): "
        "the forward's peak, what stays alive for backward (saved tensors + the output), and the backward's peak "
        f"(including the q/k/v gradients it returns, {mib('input_grads')} MiB), counted from the sequence-sharded "
        f"q/k/v on ({mib('inputs')} MiB, made for the call and held by it alone); the output is {mib('output')} "
        "MiB. Worst rank; x = ratio to chunks = 1."
    )


def main(argv: list[str] | None = None) -> int:
    parser = H.options(__doc__, "head-chunks", timeout=600, repeats=1)
    for flag, default in (("--seq", 8192), ("--heads", 16), ("--kv-heads", 8), ("--head-dim", 64)):
        parser.add_argument(flag, type=int, default=default)
    parser.add_argument("--chunks", default="1,2,4")
    args = parser.parse_args(argv)
    shape = {"seq": args.seq, "heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim}

    def launch(seq: int, variant: str) -> dict[str, Any]:
        chunks = int(variant.removeprefix("chunks="))
        return {"target": TARGET, "nproc": 2, "env": H.MALLOC_ENV, "init_backend": "gloo", **shape, "chunks": chunks}

    columns = [R.col("full-seq q/k/v/o per chunk MiB", "full_sequence_qkvo", ".1f", R.MiB)]
    for key, title in PHASES.items():
        columns += [R.col(f"{title} MiB", key, ".1f", R.MiB), R.col("x", f"x_{key}")]
    return H.compare(
        args, argv, [args.seq], [f"chunks={c}" for c in args.chunks.split(",")], launch,
        lambda r: {k: H.worst(r, k) for k in r["result"]["ranks"][0]}, columns,
        "Head-chunked Ulysses: memory of one attention call (CPU, SP=2)", lambda rows: describe(shape, rows[0]),
    )  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main())
