"""hf_longctx's attention without SP (`SequenceParallelGroups.single()`, what `sp_size=1` attaches): the model's
kernel per document of `position_ids`, with no mask built by transformers; generation (a filled KV cache, left
padding) runs the model's own attention and mask."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from hf_longctx import SequenceParallelGroups, enable_sequence_parallel
from hf_longctx.integrations.trainer.single import document_attention_refusal
from tests._models import tiny_model

SINGLE = SequenceParallelGroups.single()


def _masks_built(monkeypatch) -> list:
    """Record every mask transformers' `create_causal_mask` returns to a Llama forward."""
    from transformers.models.llama import modeling_llama

    seen, own = [], modeling_llama.create_causal_mask

    def recording(*args, **kwargs):
        mask = own(*args, **kwargs)
        seen.append(mask)
        return mask

    monkeypatch.setattr(modeling_llama, "create_causal_mask", recording)
    return seen


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_rows_train_like_each_document_alone_with_no_mask(monkeypatch, attn):
    ids = torch.randint(1, 128, (1, 24), generator=torch.Generator().manual_seed(0))
    pos = torch.cat([torch.arange(n) for n in (7, 9, 8)]).unsqueeze(0)
    ref_model, model = tiny_model("llama", attn=attn), tiny_model("llama", attn=attn)
    bounds = [0, 7, 16, 24]
    want = torch.cat([ref_model(input_ids=ids[:, a:b]).logits for a, b in zip(bounds[:-1], bounds[1:], strict=True)], 1)
    with enable_sequence_parallel(model, SINGLE):
        masks = _masks_built(monkeypatch)
        got = model(input_ids=ids, position_ids=pos).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert masks and all(m is None for m in masks)  # transformers built no [S, S] mask


def test_right_padded_rows_without_position_ids_match_the_model_on_real_tokens():
    ids = torch.randint(1, 128, (2, 10), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    ref_model, model = tiny_model("llama"), tiny_model("llama")
    want = ref_model(input_ids=ids, attention_mask=mask).logits
    with enable_sequence_parallel(model, SINGLE) as handle:
        got = model(input_ids=ids, attention_mask=mask).logits
        assert handle.context is not None and handle.context.single_document  # served: positions 0..9 per row
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], rtol=1e-5, atol=1e-5)


def test_generation_runs_the_models_own_attention_and_mask(monkeypatch):
    """Left padding (a generation prefill) and a filled KV cache (decoding) are left to the model: same tokens."""
    ids = torch.randint(1, 128, (2, 6), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # left padding
    ref_model, model = tiny_model("llama"), tiny_model("llama")
    ref_model.config.use_cache = model.config.use_cache = True
    kwargs = {"max_new_tokens": 4, "do_sample": False, "pad_token_id": 0}
    want = ref_model.generate(input_ids=ids, attention_mask=mask, **kwargs)
    with enable_sequence_parallel(model, SINGLE) as handle:
        masks = _masks_built(monkeypatch)
        got = model.generate(input_ids=ids, attention_mask=mask, **kwargs)
        assert handle.context is None  # the last forward was left to the model
        cache = DynamicCache(config=model.config)
        model(input_ids=ids[1:, :3], use_cache=True, cache=cache)  # served (no padding)
        assert handle.context is not None and model.config._attn_implementation == handle.key
        model(input_ids=ids[1:, 3:4], use_cache=True, cache=cache)  # decoding: left to the model
        assert handle.context is None and model.config._attn_implementation == handle.key  # restored after
    assert torch.equal(got, want)
    assert any(m is not None for m in masks)  # the model's own mask where it ran its own attention


def test_document_attention_is_refused_where_it_cannot_serve():
    config = type("C", (), {"ulysses_head_chunks": 1})()
    assert document_attention_refusal(tiny_model("llama"), config) is None
    from tests.dist._linear_jobs import tiny_qwen3_next

    assert "linear-attention" in document_attention_refusal(tiny_qwen3_next(), config)


def test_vision_language_models_are_served_at_sp1_except_gemma3():
    """Qwen-VL / LLaVA get hf_longctx at sp_size=1 (per-document mRoPE positions for packed rows, as at SP > 1);
    Gemma 3's decoder attends both ways within an image, so it keeps its own attention."""
    import transformers

    from tests.dist import _vlm as V

    config = type("C", (), {"ulysses_head_chunks": 1})()
    for arch in (*V.ARCHS, "llava"):
        assert document_attention_refusal(V.build(arch), config) is None, arch
    text = {"vocab_size": 160, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
            "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16}  # fmt: skip
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
              "image_size": 8, "patch_size": 2}  # fmt: skip
    gemma3 = transformers.Gemma3ForConditionalGeneration._from_config(
        transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4)
    )
    assert "bidirectionally" in document_attention_refusal(gemma3, config)


def test_vlm_generation_at_sp1_is_the_models_own():
    """`generate()` on a Qwen-VL model with hf_longctx at sp_size=1 gives the plain model's tokens (the image merge
    hook steps aside when the forward runs the model's own attention)."""
    from tests.dist import _vlm as V

    inputs = V.batch([V.row(40, [(10, (4, 4))], seed=3)], 40)
    inputs = {k: v for k, v in inputs.items() if k not in ("labels", "mm_token_type_ids")}
    for arch in V.ARCHS:
        ref_model, model = V.build(arch).eval(), V.build(arch).eval()
        want = ref_model.generate(**inputs, max_new_tokens=4, do_sample=False)
        with enable_sequence_parallel(model, SINGLE):
            got = model.generate(**inputs, max_new_tokens=4, do_sample=False)
        assert torch.equal(got, want), arch


def test_generate_with_a_static_cache_runs_the_models_own_masks():
    """A static cache's masks are built in `prepare_inputs_for_generation`, outside the forward: `generate()` as a
    whole runs the model's own attention, so left padding stays masked (it was attended before)."""
    ids = torch.randint(1, 128, (2, 6), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    ref_model, model = tiny_model("llama"), tiny_model("llama")
    kwargs = {"max_new_tokens": 4, "do_sample": False, "pad_token_id": 0, "cache_implementation": "static"}
    want = ref_model.generate(input_ids=ids, attention_mask=mask, **kwargs)
    with enable_sequence_parallel(model, SINGLE) as handle:
        got = model.generate(input_ids=ids, attention_mask=mask, **kwargs)
        assert model.config._attn_implementation == handle.key and handle.generating == 0
    assert "generate" not in model.__dict__  # the instance patch is gone with the handle
    assert torch.equal(got, want)


@pytest.mark.parametrize("given", ["seq_idx", "cu_seq_lens_q"])
def test_packed_rows_described_without_position_ids_keep_their_documents(given):
    ids = torch.randint(1, 128, (1, 24), generator=torch.Generator().manual_seed(4))
    lengths = (7, 9, 8)
    ref_model, model = tiny_model("llama"), tiny_model("llama")
    pos = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    want = ref_model(input_ids=ids, position_ids=pos, attention_mask=None)
    documents = {
        "seq_idx": torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)]).unsqueeze(0),
        "cu_seq_lens_q": torch.tensor([0, 7, 16, 24], dtype=torch.int32),
    }
    with enable_sequence_parallel(model, SINGLE) as handle:
        got = model(input_ids=ids, **{given: documents[given]})
        assert torch.equal(handle.context.position_ids, pos)
        with pytest.raises(ValueError, match="pass position_ids"):
            model(input_ids=ids.expand(2, -1), cu_seq_lens_q=documents["cu_seq_lens_q"])
    # RoPE is relative: the model's own arange positions give each document the same scores as restarting ones.
    torch.testing.assert_close(got.logits, want.logits, rtol=1e-5, atol=1e-5)


def test_models_that_compute_attention_themselves_keep_it():
    from transformers import BloomConfig, BloomForCausalLM

    config = type("C", (), {"ulysses_head_chunks": 1})()
    bloom = BloomForCausalLM(BloomConfig(vocab_size=128, hidden_size=32, n_layer=1, n_head=4))
    assert "without transformers' attention interface" in document_attention_refusal(bloom, config)


def test_one_rank_exchanges_nothing():
    from hf_longctx.attention.ulysses import exchange_qkv, head_layout

    q, k, v = torch.randn(1, 4, 8, 16), torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16)
    got = exchange_qkv(q, k, v, head_layout(4, 2, 1), SINGLE)
    assert all(a is b for a, b in zip(got, (q, k, v), strict=True))  # no packed q/k/v copy at sp_size=1


def test_left_padded_training_forward_runs_the_models_attention_untiled(caplog):
    """Left padding in a training forward is left to the model's own attention and mask (warned once); the tiled
    layer then runs the layer untiled instead of failing on the missing context."""
    from hf_longctx.attention.single import warn_training_left_to_model
    from hf_longctx.memory.tiled_layer import enable_tiled_layer

    warn_training_left_to_model.cache_clear()
    ids = torch.randint(1, 128, (2, 8), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    ref_model, model = tiny_model("llama"), tiny_model("llama")
    want = ref_model(input_ids=ids, attention_mask=mask, labels=ids).loss
    with enable_sequence_parallel(model, SINGLE), enable_tiled_layer(model, 2):
        got = model(input_ids=ids, attention_mask=mask, labels=ids).loss
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert "Pad on the right" in caplog.text


def test_grouped_kv_reach_sdpa_expanded_where_only_its_math_kernel_takes_them(monkeypatch):
    """fp32 on CUDA: SDPA takes `enable_gqa` with fewer K/V heads only in its math kernel ([S, S] scores). The stand-in
    SDPA refuses exactly that; `sdpa_takes_grouped_kv` says False as it does for CUDA fp32."""
    from hf_longctx.attention import ulysses

    sdpa = torch.nn.functional.scaled_dot_product_attention

    def efficient_or_flash_only(query, key, value, *args, enable_gqa=False, **kwargs):
        assert query.shape[1] == key.shape[1], "grouped K/V: SDPA would run its math kernel"
        return sdpa(query, key, value, *args, enable_gqa=enable_gqa, **kwargs)

    ids = torch.randint(1, 128, (1, 16), generator=torch.Generator().manual_seed(6))
    ref_model, model = tiny_model("llama"), tiny_model("llama")  # 4 query heads, 2 K/V heads
    want = ref_model(input_ids=ids).logits
    monkeypatch.setattr(ulysses, "sdpa_takes_grouped_kv", lambda q: False)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", efficient_or_flash_only)
    with enable_sequence_parallel(model, SINGLE):
        got = model(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_vlm_at_sp1_takes_given_mrope_positions_and_inputs_embeds_as_is():
    """sp_size=1: a VLM called with precomputed 3-D mRoPE positions (LLaMA-Factory-style collators) or with
    inputs_embeds runs its own forward, as without hf_longctx; Molmo 2 (both-way image attention) is refused."""
    from hf_longctx.multimodal.vision import vision_refusal
    from tests.dist import _vlm as V

    ids = torch.randint(3, 140, (1, 12), generator=torch.Generator().manual_seed(5))
    positions = torch.arange(12).expand(3, 1, 12)
    for arch in V.ARCHS:
        ref_model, model = V.build(arch).eval(), V.build(arch).eval()
        embeds = ref_model.get_input_embeddings()(ids)
        with torch.no_grad():
            want = ref_model(input_ids=ids, position_ids=positions).logits
            want_embeds = ref_model(inputs_embeds=embeds).logits
            with enable_sequence_parallel(model, SINGLE):
                got = model(input_ids=ids, position_ids=positions).logits
                got_embeds = model(inputs_embeds=embeds).logits
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(got_embeds, want_embeds)
    molmo = torch.nn.Module()
    molmo.config = type("Config", (), {"model_type": "molmo2"})()
    assert "bidirectionally" in vision_refusal(molmo)
