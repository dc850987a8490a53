"""LangChain adapters over a :class:`CacheCertRuntime` (same policy as the node wrapper: exact reuse, certified
transfer or prefill, with audits): a chat model, and the LangChain v1 agent middleware form.

Messages map to a model call as follows: system messages become the model's system prompt; every message before
the last non-system one is the shared *context* (``"<type>: <content>"`` blocks joined by blank lines, so two
models reading the same conversation share it); the last message is the *instruction*. The decision is returned
in ``AIMessage.response_metadata["cachecert"]``. Tool calling is not supported by the local models here.

    chat = CacheCertChatModel(runtime=runtime, model_name="smollm2-135m")
    chat.invoke([SystemMessage("Be brief."), HumanMessage(documents), HumanMessage("Summarise the documents.")])

    agent = create_agent(model=any_chat_model, tools=[], middleware=[CacheCertMiddleware(runtime, "smollm2-135m")])

The middleware answers the agent's model calls with the local model through the runtime (``invoke`` and
``ainvoke``; the async form runs the model in a worker thread), and hands calls that need tools or structured
output to the agent's own model (the local models here do not call tools). Message content that is a list of
content blocks counts as its text.
"""

from __future__ import annotations

import asyncio
from typing import Any

from langchain_core.callbacks import CallbackManagerForLLMRun
from langchain_core.language_models.chat_models import BaseChatModel
from langchain_core.messages import AIMessage, BaseMessage, SystemMessage
from langchain.agents.middleware import AgentMiddleware, ModelRequest, ModelResponse
from langchain_core.outputs import ChatGeneration, ChatResult
from pydantic import ConfigDict

from cachecert_agents.agents.runtime import CacheCertRuntime


def split_messages(messages: list[BaseMessage]) -> tuple[str | None, str, str]:
    """``(system, context, instruction)`` of a message list (see the module docstring)."""
    system = "\n\n".join(str(m.text) for m in messages if isinstance(m, SystemMessage)) or None
    rest = [m for m in messages if not isinstance(m, SystemMessage)]
    if not rest:
        raise ValueError("CacheCertChatModel needs at least one non-system message (the instruction)")
    # `text`: the text of string content and of content-block lists alike (never a list's Python repr)
    context = "\n\n".join(f"{m.type}: {m.text}" for m in rest[:-1])
    return system, context, str(rest[-1].text)


class CacheCertChatModel(BaseChatModel):
    """LangChain ``BaseChatModel`` whose generations go through ``runtime`` with model ``model_name``."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    runtime: CacheCertRuntime
    model_name: str
    node: str | None = None
    max_new_tokens: int | None = None

    @property
    def _llm_type(self) -> str:
        return "cachecert-local"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {"model_name": self.model_name, "node": self.node}

    def _generate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                  run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> ChatResult:
        system, context, instruction = split_messages(messages)
        text, decision = self.runtime.generate(self.model_name, context, instruction, system, node=self.node,
                                               max_new_tokens=kwargs.get("max_new_tokens", self.max_new_tokens),
                                               stop_strings=tuple(stop or ()))
        message = AIMessage(content=text, response_metadata={"cachecert": decision.as_dict(),
                                                             "model_name": self.model_name})
        return ChatResult(generations=[ChatGeneration(message=message)])


def _system_message(request: ModelRequest) -> SystemMessage | None:
    """The request's system message: ``system_message`` (later langchain 1.x), else the ``system_prompt`` string
    that langchain 1.0 carries instead."""
    if hasattr(request, "system_message"):
        return request.system_message
    prompt = getattr(request, "system_prompt", None)
    return SystemMessage(content=prompt) if prompt else None


class CacheCertMiddleware(AgentMiddleware):
    """LangChain v1 agent middleware: model calls without tools or structured output are answered by
    ``model_name`` through ``runtime``; others go to the agent's model (``handler``)."""

    def __init__(self, runtime: CacheCertRuntime, model_name: str, node: str | None = "agent",
                 max_new_tokens: int | None = None):
        super().__init__()
        self.runtime, self.model_name, self.node, self.max_new_tokens = runtime, model_name, node, max_new_tokens

    def _handles(self, request: ModelRequest) -> bool:
        """Whether the local model answers this call (no tools, no structured output)."""
        return not request.tools and request.response_format is None

    def _answer(self, request: ModelRequest) -> ModelResponse:
        messages = ([prompt] if (prompt := _system_message(request)) is not None else []) + list(request.messages)
        system, context, instruction = split_messages(messages)
        text, decision = self.runtime.generate(self.model_name, context, instruction, system, node=self.node,
                                               max_new_tokens=self.max_new_tokens)
        return ModelResponse(result=[AIMessage(content=text, response_metadata={
            "cachecert": decision.as_dict(), "model_name": self.model_name})])

    def wrap_model_call(self, request: ModelRequest, handler: Any) -> ModelResponse:
        return self._answer(request) if self._handles(request) else handler(request)

    async def awrap_model_call(self, request: ModelRequest, handler: Any) -> ModelResponse:
        """The async form (``agent.ainvoke``): the local model runs in a worker thread, off the event loop."""
        if not self._handles(request):
            return await handler(request)
        return await asyncio.to_thread(self._answer, request)
