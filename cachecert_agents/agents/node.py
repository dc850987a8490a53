"""The LangGraph node wrapper: a node describes its local-model call, the runtime decides how to run it.

A wrapped node returns a :class:`ModelCall` (the shared context, the node-specific instruction and optionally
the model), a dict whose values may be ``ModelCall`` objects, or LangGraph's ``Command`` whose ``update`` is one of
those (a node that routes); the wrapper runs each call through
:meth:`CacheCertRuntime.generate` (reuse / certified transfer / prefill) and puts the generated text in its place::

    runtime = CacheCertRuntime(RuntimeConfig(routes=[...], audit_log="audit.jsonl"))

    @cachecert_node(runtime, model="gemma3-270m", output_key="outline")
    def planner(state: State) -> ModelCall:
        return ModelCall(context=state["documents"], instruction="Outline a report on " + state["topic"])

The node's signature is kept (``functools.wraps``), so LangGraph still injects ``config``, ``writer``, ``store``
or ``runtime`` when the node asks for them; sync and async nodes are both supported (async ones run the model in a
worker thread). Each decision is emitted as a LangGraph custom stream event and a LangChain custom callback event
named ``cachecert_decision`` when a graph run is active, logged, counted in ``runtime.metrics``, and appended to
the state under ``decisions_key`` when one is given (declare that key with an ``operator.add`` reducer).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import inspect
import logging
from dataclasses import dataclass
from typing import Any, Callable

from langgraph.types import Command

from cachecert_agents.agents.runtime import CacheCertRuntime, Decision

logger = logging.getLogger(__name__)


@dataclass
class ModelCall:
    """One local-model call: ``context`` (a string, or a list of documents joined by blank lines) is the shared
    part whose cache is reused or transferred; ``instruction`` is this node's own suffix."""

    context: str | list[str]
    instruction: str
    model: str | None = None
    system: str | None = None
    max_new_tokens: int | None = None
    stop_strings: tuple[str, ...] = ()

    def context_text(self) -> str:
        if isinstance(self.context, str):
            return self.context
        if isinstance(self.context, (list, tuple)) and all(isinstance(d, str) for d in self.context):
            return "\n\n".join(self.context)
        raise TypeError(f"ModelCall.context must be a string or a list of strings, got {type(self.context).__name__}")


def _emit(decision: Decision) -> None:
    """Report a decision to the active graph run, if any (stream writer and callback handlers)."""
    payload = decision.as_dict()
    try:
        from langgraph.config import get_stream_writer

        get_stream_writer()({"cachecert_decision": payload})
    except Exception:  # not inside a graph run
        pass
    try:
        from langchain_core.callbacks.manager import dispatch_custom_event

        dispatch_custom_event("cachecert_decision", payload)
    except Exception:  # no parent run to attach the event to
        pass


def _run_calls(runtime: CacheCertRuntime, result: Any, default_model: str | None, output_key: str | None,
               node: str, decisions_key: str | None) -> Any:
    decisions: list[Decision] = []

    def run(call: ModelCall) -> str:
        model = call.model or default_model
        if model is None:
            raise ValueError(f"node {node!r}: ModelCall names no model and the decorator has no default model")
        text, decision = runtime.generate(model, call.context_text(), call.instruction, call.system, node=node,
                                          max_new_tokens=call.max_new_tokens, stop_strings=call.stop_strings)
        decisions.append(decision)
        _emit(decision)
        return text

    if isinstance(result, Command) and isinstance(result.update, (dict, ModelCall)):
        # a node that routes (LangGraph's Command) has its update's calls answered like a plain return's
        return dataclasses.replace(result, update=_run_calls(runtime, result.update, default_model, output_key,
                                                             node, decisions_key))
    if isinstance(result, ModelCall):
        if output_key is None:
            raise ValueError(f"node {node!r} returned a ModelCall but the decorator has no output_key")
        out: Any = {output_key: run(result)}
    elif isinstance(result, dict):
        out = {k: run(v) if isinstance(v, ModelCall) else v for k, v in result.items()}
    else:
        return result
    if decisions_key is not None:
        out[decisions_key] = [d.as_dict() for d in decisions]
    return out


def cachecert_node(runtime: CacheCertRuntime, model: str | None = None, output_key: str | None = None,
                   name: str | None = None, decisions_key: str | None = None) -> Callable[[Callable], Callable]:
    """Decorate a LangGraph node whose local-model calls should go through ``runtime`` (see module docstring).

    ``model``: the default model of the node's calls; ``output_key``: where the text of a returned
    :class:`ModelCall` goes; ``name``: the node name in decisions and audits (default: the function's name).
    """

    def wrap(fn: Callable) -> Callable:
        node = name or getattr(fn, "__name__", "node")
        if inspect.iscoroutinefunction(fn):
            @functools.wraps(fn)
            async def async_node(*args: Any, **kwargs: Any) -> Any:
                result = await fn(*args, **kwargs)
                return await asyncio.to_thread(_run_calls, runtime, result, model, output_key, node, decisions_key)

            return async_node

        @functools.wraps(fn)
        def sync_node(*args: Any, **kwargs: Any) -> Any:
            return _run_calls(runtime, fn(*args, **kwargs), model, output_key, node, decisions_key)

        return sync_node

    return wrap
