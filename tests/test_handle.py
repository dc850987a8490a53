"""ModelHandle on tiny random models with a tiny in-process tokenizer: prompts, generation, hooks."""

import pytest
import torch

from cachecert_agents.kv.rope import apply_rope, rope_tables
from cachecert_agents.kv.segment import KVSegment
from cachecert_agents.models.handle import ModelHandle
from tests.conftest import tiny_model

CHATML = ("{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
          "{% if add_generation_prompt %}<s>assistant\n{% endif %}")


@pytest.fixture(params=["llama", "gemma3"])
def handle(request, tiny_tokenizer):
    return ModelHandle(f"tiny-{request.param}", tiny_model(request.param), tiny_tokenizer)


def test_plain_prompt_segments(handle):
    prompt = handle.format_prompt("the cat sat on the mat", "where did the cat sit")
    assert handle.tokenizer.decode(prompt.context_ids) == "the cat sat on the mat"
    assert handle.tokenizer.decode(prompt.suffix_ids) == "\n\nwhere did the cat sit\nAnswer:"
    start, end = prompt.context_span
    assert torch.equal(prompt.input_ids[start:end], prompt.context_ids)
    spans = prompt.context_offsets.tolist()
    assert [prompt.context_text[a:b] for a, b in spans] == [handle.tokenizer.decode([i]) for i in prompt.context_ids]


def test_chat_template_segments(tiny_tokenizer):
    tiny_tokenizer.chat_template = CHATML
    try:
        h = ModelHandle("tiny", tiny_model("llama"), tiny_tokenizer)
        prompt = h.format_prompt("the cat sat", "where")
        text = h.tokenizer.decode(prompt.input_ids)
        assert text == "<s>user\nthe cat sat\n\nwhere</s>\n<s>assistant\n"
        assert h.tokenizer.decode(prompt.prefix_ids) == "<s>user\n"
    finally:
        tiny_tokenizer.chat_template = None


def test_generation_from_rebuilt_cache_matches_full_prompt(handle):
    prompt = handle.format_prompt("the dog ran in the park and the cat sat on the mat", "where did the cat sit")
    full = handle.generate(prompt.input_ids, max_new_tokens=6)
    start, end = prompt.context_span
    pre = handle.prefill(prompt.input_ids[:end])
    seg = KVSegment.from_cache(pre.cache, handle.geometry)
    resumed = handle.generate(prompt.suffix_ids, cache=(seg.slice(0, start) + seg.slice(start, end)).to_cache(
        handle.geometry), max_new_tokens=6)
    assert resumed.token_ids == full.token_ids
    assert torch.allclose(resumed.first_logits, full.first_logits, atol=1e-5)
    assert full.finish_reason in ("eos", "length") and len(full.token_ids) <= 6


def test_stop_strings_cut_the_text(handle):
    prompt = handle.format_prompt("the cat", "the")
    free = handle.generate(prompt.input_ids, max_new_tokens=8)
    if len(free.text) < 2:
        pytest.skip("random model produced too little text to cut")
    stop = free.text[1]
    cut = handle.generate(prompt.input_ids, max_new_tokens=8, stop_strings=(stop,))
    assert cut.finish_reason == "stop" and stop not in cut.text


def test_capture_qk_gives_pre_rope_keys(handle):
    ids = torch.arange(3, 23)
    with handle.capture_qk(values=True) as cap:
        out = handle.forward(ids)
    geo = handle.geometry
    for layer in range(geo.num_layers):
        q, k = cap.query(layer), cap.key(layer)
        assert q.shape == (1, geo.num_heads, 20, geo.head_dim)
        assert k.shape == (1, geo.num_kv_heads, 20, geo.head_dim)
        cached = out.cache.layers[layer].keys
        n = cached.shape[-2]
        cos, sin = rope_tables(geo.rope_for_layer(layer), torch.arange(20 - n, 20))
        assert torch.allclose(apply_rope(k[:, :, -n:], cos, sin), cached, atol=1e-5)
        assert torch.allclose(cap.value(layer)[:, :, -n:], out.cache.layers[layer].values, atol=1e-6)


def test_attention_weights_on_request(handle):
    out = handle.forward(torch.arange(3, 13), output_attentions=True, output_hidden_states=True)
    geo = handle.geometry
    assert len(out.attentions) == geo.num_layers
    assert out.attentions[0].shape[:2] == (geo.num_heads, 10)
    assert torch.allclose(out.attentions[-1].sum(-1), torch.ones(geo.num_heads, 10), atol=1e-4)
    assert len(out.hidden_states) == geo.num_layers + 1
    assert handle.model.config._attn_implementation == "sdpa"  # restored after the call


def test_load_from_a_local_directory(tmp_path, tiny_tokenizer):
    model = tiny_model("qwen2")
    model.save_pretrained(tmp_path / "ckpt")
    tiny_tokenizer.save_pretrained(tmp_path / "ckpt")
    handle = ModelHandle.load(str(tmp_path / "ckpt"))
    assert handle.source.startswith("path:") and handle.geometry.model_type == "qwen2"
    ids = torch.arange(3, 13)
    assert torch.allclose(handle.forward(ids).logits, ModelHandle("m", model, tiny_tokenizer).forward(ids).logits)


def test_unknown_model_name_is_a_clear_error(monkeypatch):
    from cachecert_agents.errors import UnknownModelError

    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # read at import time
    with pytest.raises(UnknownModelError, match="smollm2-135m"):
        ModelHandle.load("no-such-org/no-such-model-xyz")


def test_residual_stream_capture_equals_output_hidden_states(handle):
    """The hook capture (a sender's features) holds exactly the tensors of ``output_hidden_states`` over the
    chosen token span, on every architecture (Gemma 3's scaled embeddings and sliding layers included)."""
    ids = torch.arange(3, 23)
    ref = handle.forward(ids, output_hidden_states=True).hidden_states
    with handle.capture_residual_stream(4, 17, transform=lambda x: 2 * x) as got:
        handle.forward(ids)
    assert got.shape == (handle.geometry.num_layers + 1, 13, handle.geometry.hidden_size)
    for m, h in enumerate(ref):
        assert torch.equal(got[m], 2 * h[4:17].float()), m
    # hooks are gone afterwards: a later forward does not write into the old buffer
    before = got.clone()
    handle.forward(torch.arange(5, 25))
    assert torch.equal(got, before)


def test_a_model_that_ignores_the_cache_argument_is_refused(tiny_tokenizer):
    """A transformers release whose forward does not take ``cache=`` would answer without the context, silently:
    ``forward`` sees that the returned cache is not the one passed and raises instead."""
    from cachecert_agents.errors import CacheCertError

    model = tiny_model("llama")
    handle = ModelHandle("tiny", model, tiny_tokenizer)
    ids = torch.tensor([5, 6, 7])
    cache = handle.prefill(ids).cache
    real_forward = model.forward
    model.forward = lambda *args, cache=None, **kwargs: real_forward(*args, **kwargs)  # drops the argument
    with pytest.raises(CacheCertError, match="did not use the cache"):
        handle.forward(torch.tensor([8]), cache)
