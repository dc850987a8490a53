"""cachecert-agents: certified cross-model KV cache transfer for multi-model agent pipelines.

Public objects:

- :func:`cachecert_node`, :class:`ModelCall` — wrap a LangGraph node's local-model call;
- :class:`CacheCertRuntime`, :class:`RuntimeConfig`, :class:`RouteConfig` — the policy (reuse / certified
  transfer / prefill), the shared cache store, audits and metrics;
- :class:`Certificate` — a saved CacheCert decision rule;
- :class:`ModelHandle` — a causal LM with tokenizer, geometry, segmented prompts, prefill and generation;
- :class:`ModelGeometry` — what a KV cache depends on (layers, KV heads, head dim, rope, sliding window);
- :class:`KVSegment` — model-agnostic pre-RoPE KV cache of a run of tokens, to and from ``DynamicCache``;
- :func:`align_tokens` — character-span alignment of two tokenizations.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["cachecert_node", "ModelCall", "CacheCertRuntime", "RuntimeConfig", "RouteConfig", "Certificate",
           "ModelHandle", "ModelGeometry", "KVSegment", "LayerKV", "TokenAlignment", "align_tokens", "__version__"]

_LAZY = {
    "cachecert_node": "cachecert_agents.agents.node", "ModelCall": "cachecert_agents.agents.node",
    "CacheCertRuntime": "cachecert_agents.agents.runtime", "RuntimeConfig": "cachecert_agents.agents.runtime",
    "RouteConfig": "cachecert_agents.agents.runtime", "Certificate": "cachecert_agents.cert.certificate",
}


def __getattr__(name: str):  # lazy: `import cachecert_agents` stays cheap (no torch/transformers import)
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    if name == "ModelHandle":
        from cachecert_agents.models.handle import ModelHandle
        return ModelHandle
    if name == "ModelGeometry":
        from cachecert_agents.models.geometry import ModelGeometry
        return ModelGeometry
    if name in ("KVSegment", "LayerKV"):
        from cachecert_agents.kv import segment
        return getattr(segment, name)
    if name in ("TokenAlignment", "align_tokens"):
        from cachecert_agents.kv import alignment
        return getattr(alignment, name)
    raise AttributeError(f"module 'cachecert_agents' has no attribute {name!r}")
