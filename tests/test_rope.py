"""RoPE removal and re-application: model-free round trips and agreement with transformers' own rotation."""

import pytest
import torch

from cachecert_agents.kv.rope import apply_rope, exact_dtype, remove_rope, rope_tables
from cachecert_agents.models.geometry import RopeSpec


def _spec(head_dim=16, theta=10000.0, scaling=1.0, rotary_dim=None):
    rotary_dim = rotary_dim or head_dim
    inv = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim))
    return RopeSpec(rope_type="default", theta=theta, attention_scaling=scaling, rotary_dim=rotary_dim,
                    inv_freq=inv.tolist())


@pytest.mark.parametrize("scaling,rotary_dim", [(1.0, None), (1.37, None), (1.0, 8), (0.8, 12)])
def test_remove_inverts_apply(scaling, rotary_dim):
    spec = _spec(scaling=scaling, rotary_dim=rotary_dim)
    x = torch.randn(2, 3, 50, 16)
    cos, sin = rope_tables(spec, torch.arange(100, 150))
    y = apply_rope(x, cos, sin)
    assert not torch.allclose(y, x)
    assert torch.allclose(remove_rope(y, cos, sin), x, atol=1e-5)


def test_apply_matches_transformers_llama_rotation():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    spec = _spec(head_dim=32, theta=500000.0)
    q = torch.randn(1, 4, 20, 32)
    cos, sin = rope_tables(spec, torch.arange(20))
    _, k_ref = apply_rotary_pos_emb(q, q, cos[None], sin[None])
    assert torch.equal(apply_rope(q, cos, sin), k_ref)


def test_rotation_preserves_relative_dot_products():
    """<R_m q, R_n k> depends only on m - n: shifting both positions leaves the logit unchanged."""
    spec = _spec()
    q, k = torch.randn(1, 1, 1, 16), torch.randn(1, 1, 1, 16)
    def dot(m, n):
        cq, sq = rope_tables(spec, torch.tensor([m]))
        ck, sk = rope_tables(spec, torch.tensor([n]))
        return float((apply_rope(q, cq, sq) * apply_rope(k, ck, sk)).sum())
    assert dot(30, 10) == pytest.approx(dot(250, 230), abs=1e-4)
    assert dot(30, 10) != pytest.approx(dot(30, 20), abs=1e-3)


def test_exact_dtype_is_float64_except_on_mps():
    """remove_rope computes in float64 where the device has it; Apple's MPS has none, so it gets float32 there
    (no MPS device here: the choice is tested, the MPS run is not)."""
    assert exact_dtype("cpu") == torch.float64
    assert exact_dtype(torch.device("cuda", 0)) == torch.float64
    assert exact_dtype("mps") == torch.float32
    spec = _spec()
    x = torch.randn(2, 40, 16)
    cos, sin = rope_tables(spec, torch.arange(40))
    assert remove_rope(apply_rope(x, cos, sin), cos, sin).dtype == x.dtype
