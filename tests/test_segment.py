"""KVSegment: model-free algebra, and exact cache round trips on tiny random llama, qwen2 and gemma3 models."""

import pytest
import torch
from transformers import DynamicCache

from cachecert_agents.errors import GeometryMismatchError
from cachecert_agents.kv.segment import KVSegment, LayerKV
from cachecert_agents.models.geometry import geometry_from_config
from tests.conftest import tiny_config, tiny_model


def _forward(model, ids, cache=None, position_ids=None):
    with torch.no_grad():
        out = model(input_ids=ids[None], cache=cache if cache is not None else DynamicCache(config=model.config),
                    use_cache=True, position_ids=None if position_ids is None else position_ids[None])
    return out.logits[0], out.past_key_values


def test_roundtrip_equals_full_forward(tiny):
    """Prefill 20 tokens (crosses gemma3's window of 8), round-trip through segments, continue with 5 tokens."""
    arch, model, geometry = tiny
    ids = torch.randint(3, 320, (25,), generator=torch.Generator().manual_seed(1))
    reference, _ = _forward(model, ids)
    _, cache = _forward(model, ids[:20])
    segment = KVSegment.from_cache(cache, geometry, token_ids=ids[:20])
    rebuilt = (segment.slice(0, 4) + segment.slice(4, 20)).to_cache(geometry)
    logits, _ = _forward(model, ids[20:], rebuilt)
    assert torch.allclose(logits, reference[20:], atol=1e-5), (logits - reference[20:]).abs().max()


def test_sliding_layers_store_only_the_window(tiny):
    arch, model, geometry = tiny
    ids = torch.arange(3, 23)
    _, cache = _forward(model, ids)
    segment = KVSegment.from_cache(cache, geometry)
    for i, layer in enumerate(segment.layers):
        if geometry.layer_types[i] == "sliding_attention":
            assert layer.n_stored == geometry.sliding_window - 1
            assert layer.token_index.tolist() == list(range(20 - 7, 20))
        else:
            assert layer.n_stored == 20
    rebuilt = segment.to_cache(geometry)
    assert rebuilt.get_seq_length() == 20
    for layer in rebuilt.layers:
        if getattr(layer, "is_sliding", False):
            assert layer.cumulative_length == 20


def test_rebuild_at_other_positions(tiny):
    """A segment computed at positions 0.. and rebuilt at 7.. equals a forward pass run at positions 7.."""
    arch, model, geometry = tiny
    ids = torch.randint(3, 320, (16,), generator=torch.Generator().manual_seed(2))
    shifted = torch.arange(7, 7 + 16)
    reference, _ = _forward(model, ids, position_ids=shifted)
    _, cache = _forward(model, ids[:12])
    rebuilt = KVSegment.from_cache(cache, geometry).to_cache(geometry, start_position=7)
    logits, _ = _forward(model, ids[12:], rebuilt, position_ids=shifted[12:])
    assert torch.allclose(logits, reference[12:], atol=1e-5)


def test_corrupted_segment_changes_the_output():
    model = tiny_model("llama")
    geometry = geometry_from_config(model.config)
    ids = torch.randint(3, 320, (20,), generator=torch.Generator().manual_seed(3))
    reference, _ = _forward(model, ids)
    _, cache = _forward(model, ids[:16])
    seg = KVSegment.from_cache(cache, geometry)
    perm = torch.randperm(16, generator=torch.Generator().manual_seed(0))
    bad = KVSegment(geometry, [LayerKV(l.keys[:, :, perm], l.values[:, :, perm], l.token_index) for l in seg.layers],
                    seg.length, seg.positions)
    logits, _ = _forward(model, ids[16:], bad.to_cache(geometry))
    exact, _ = _forward(model, ids[16:], seg.to_cache(geometry))
    # random tiny weights react weakly to the cache; the corruption must still dwarf the round trip's rounding
    assert (logits - reference[16:]).abs().max() > 100 * (exact - reference[16:]).abs().max() + 1e-4


def test_geometry_mismatch_is_refused_naming_both():
    llama = geometry_from_config(tiny_config("llama"))
    gemma = geometry_from_config(tiny_config("gemma3"))
    seg = _synthetic(llama, 5)
    with pytest.raises(GeometryMismatchError) as err:
        seg.to_cache(gemma)
    assert "llama" in str(err.value) and "gemma3" in str(err.value)
    with pytest.raises(GeometryMismatchError):
        KVSegment.concatenate([seg, _synthetic(gemma, 3)])


def _synthetic(geometry, length, fill=None):
    layers = []
    for _ in range(geometry.num_layers):
        k = torch.randn(1, geometry.num_kv_heads, length, geometry.head_dim) if fill is None else \
            torch.full((1, geometry.num_kv_heads, length, geometry.head_dim), float(fill))
        layers.append(LayerKV(k, k.clone(), torch.arange(length)))
    return KVSegment(geometry, layers, length, torch.arange(length), torch.arange(length))


def test_concatenate_slice_and_memory():
    geometry = geometry_from_config(tiny_config("qwen2"))
    a, b = _synthetic(geometry, 3, fill=1.0), _synthetic(geometry, 5, fill=2.0)
    ab = a + b
    assert ab.length == 8 and ab.layers[0].token_index.tolist() == list(range(8))
    assert ab.layers[1].keys[0, 0, :, 0].tolist() == [1.0] * 3 + [2.0] * 5
    assert ab.token_ids.tolist() == [0, 1, 2, 0, 1, 2, 3, 4]
    back = ab.slice(3, 8)
    assert torch.equal(back.layers[2].values, b.layers[2].values)
    assert ab.nbytes == a.nbytes + b.nbytes == 8 * geometry.num_layers * 2 * geometry.num_kv_heads * geometry.head_dim * 4
    with pytest.raises(ValueError):
        ab.slice(5, 9)


def test_incomplete_segment_cannot_stand_alone():
    geometry = geometry_from_config(tiny_config("gemma3"))
    seg = _synthetic(geometry, 20)
    tail = seg.slice(0, 20)
    full_layer = geometry.layer_types.index("full_attention")
    tail.layers[full_layer] = tail.layers[full_layer].select(torch.arange(20) >= 2, shift=0)
    with pytest.raises(ValueError, match="cannot stand as a cache"):
        tail.to_cache(geometry)


def test_geometry_reads_per_layer_rope():
    geometry = geometry_from_config(tiny_config("gemma3"))
    assert geometry.rope["sliding_attention"].theta == 10000.0
    assert geometry.rope["full_attention"].theta == 1e6
    assert geometry.qk_norm and geometry.sliding_layers == [0, 1, 3] and geometry.sliding_window == 8
    assert not geometry_from_config(tiny_config("llama")).qk_norm
    assert geometry.kv_fingerprint() != geometry_from_config(tiny_config("llama")).kv_fingerprint()
