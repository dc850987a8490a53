"""A handle over a transformers causal LM: tokenization with offsets, segmented prompts, prefill, continuation,
greedy generation, and per-layer hooks (pre-RoPE queries and keys, attention weights).

A prompt is three token segments: ``prefix`` (the model's own chat-template head, BOS included), ``context`` (the
shared material, tokenized on its own so its character offsets are exact) and ``suffix`` (instruction or question
and the template tail up to the generation prompt). The segments are tokenized separately and concatenated, so a
cache for ``prefix + context`` is a clean unit to reuse, slice or transfer.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Iterator

import torch

from cachecert_agents.errors import CacheCertError
from cachecert_agents.models.geometry import ModelGeometry, geometry_from_config

logger = logging.getLogger(__name__)

_CTX = "\uE000CACHECERT_CONTEXT\uE000"
_SUF = "\uE001CACHECERT_SUFFIX\uE001"


def synchronize(device: torch.device) -> None:
    """Wait until the queued work on ``device`` has finished (CUDA and MPS run asynchronously; a no-op on CPU).
    Timings (prefill saved, transfer cost) read the wall clock around forward passes, so they need it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


@dataclass
class PromptSegments:
    """Token ids of ``prefix``, ``context`` and ``suffix`` (each ``[n]`` int64) and the context's character spans
    ``context_offsets`` ``[n_context, 2]`` within ``context_text``."""

    prefix_ids: torch.Tensor
    context_ids: torch.Tensor
    suffix_ids: torch.Tensor
    context_offsets: torch.Tensor
    context_text: str

    @property
    def input_ids(self) -> torch.Tensor:
        return torch.cat([self.prefix_ids, self.context_ids, self.suffix_ids])

    @property
    def context_span(self) -> tuple[int, int]:
        """``[start, end)`` of the context tokens in :attr:`input_ids`."""
        start = self.prefix_ids.numel()
        return start, start + self.context_ids.numel()

    def __len__(self) -> int:
        return self.prefix_ids.numel() + self.context_ids.numel() + self.suffix_ids.numel()


@dataclass
class ForwardOutput:
    """``logits`` ``[n, vocab]`` (float32) for the fed tokens, the updated ``cache``, and optional per-layer
    ``hidden_states`` (``num_layers + 1`` tensors ``[n, hidden]``, embeddings first) and ``attentions``
    (``num_layers`` tensors ``[heads, n, n_cache_after]``)."""

    logits: torch.Tensor
    cache: Any
    hidden_states: tuple[torch.Tensor, ...] | None = None
    attentions: tuple[torch.Tensor, ...] | None = None


@dataclass
class Generation:
    text: str
    token_ids: list[int]
    finish_reason: str  # "eos" | "stop" | "length"
    first_logits: torch.Tensor | None = None  # [vocab] logits that chose the first token


@dataclass
class QKCapture:
    """Pre-RoPE queries ``[batch, heads, n, head_dim]``, keys and values ``[batch, kv_heads, n, head_dim]`` per
    layer, appended per forward call (after q/k norms where the model has them, before rotation)."""

    queries: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    keys: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    values: dict[int, list[torch.Tensor]] = field(default_factory=dict)

    def query(self, layer: int) -> torch.Tensor:
        return torch.cat(self.queries[layer], dim=2)

    def key(self, layer: int) -> torch.Tensor:
        return torch.cat(self.keys[layer], dim=2)

    def value(self, layer: int) -> torch.Tensor:
        return torch.cat(self.values[layer], dim=2)


class ModelHandle:
    """A causal LM with its tokenizer and geometry. Load with :meth:`load`."""

    def __init__(self, name: str, model: Any, tokenizer: Any, source: str = "") -> None:
        self.name = name
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.source = source or name
        if not getattr(tokenizer, "is_fast", False):
            raise ValueError(f"{name}: a fast tokenizer is needed for character offsets")

    @classmethod
    def load(cls, name_or_path: str, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
             ) -> "ModelHandle":
        """Load an embedded model name, a local directory or a Hugging Face id (see ``loading.load_pretrained``)."""
        from cachecert_agents.models.loading import load_pretrained

        model, tokenizer, source = load_pretrained(name_or_path, dtype=dtype)
        return cls(name_or_path, model.to(device), tokenizer, source)

    # ------------------------------------------------------------------ facts
    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @cached_property
    def geometry(self) -> ModelGeometry:
        return geometry_from_config(self.model.config, self.tokenizer)

    @cached_property
    def weights_fingerprint(self) -> str:
        """sha256 (16 hex) of every parameter's name, shape, dtype and a strided sample of ~4k of its values.

        Tells apart two models of one name (a fine-tune, another quantisation) wherever they differ in most
        weights; it is a sample, so two models that differ in a few individual weights are not told apart."""
        import hashlib

        h = hashlib.sha256()
        with torch.no_grad():
            for name, param in sorted(self.model.named_parameters()):
                flat = param.detach().reshape(-1)
                sample = flat[:: max(1, flat.numel() // 4096)].float().cpu().contiguous()
                h.update(f"{name}:{tuple(param.shape)}:{param.dtype}".encode())
                h.update(sample.numpy().tobytes())
        return h.hexdigest()[:16]

    @property
    def identity(self) -> str:
        """``name@weights_fingerprint``: what a cached context is keyed by, so a cache is never reused by
        another model that happens to carry the same name."""
        return f"{self.name}@{self.weights_fingerprint}"

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    @cached_property
    def stop_token_ids(self) -> set[int]:
        ids: set[int] = set()
        for source in (self.tokenizer.eos_token_id, getattr(self.model.generation_config, "eos_token_id", None)):
            if isinstance(source, int):
                ids.add(source)
            elif source:
                ids.update(int(x) for x in source)
        for tok in ("<|im_end|>", "<|endoftext|>", "<end_of_turn>", "<eos>"):
            tid = self.tokenizer.convert_tokens_to_ids(tok)
            if isinstance(tid, int) and tid != self.tokenizer.unk_token_id and tid is not None:
                ids.add(tid)
        return ids

    # ------------------------------------------------------------------ tokenization and prompts
    def tokenize(self, text: str, add_special_tokens: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids ``[n]`` and character spans ``[n, 2]`` of ``text``."""
        enc = self.tokenizer(text, add_special_tokens=add_special_tokens, return_offsets_mapping=True)
        offsets = torch.tensor(enc["offset_mapping"], dtype=torch.long).reshape(-1, 2)
        return torch.tensor(enc["input_ids"], dtype=torch.long), offsets

    @cached_property
    def adds_bos(self) -> bool:
        """Whether the tokenizer puts a BOS token in front of a sequence (read from its behaviour, not a flag)."""
        bos_id = self.tokenizer.bos_token_id
        if bos_id is None:
            return False
        with_special = self.tokenizer("a", add_special_tokens=True)["input_ids"]
        return bool(with_special) and with_special[0] == bos_id

    def _prefix_ids(self, prefix_text: str) -> torch.Tensor:
        bos = self.tokenizer.bos_token
        add_bos = self.adds_bos and not (bos and prefix_text.startswith(bos))
        ids, _ = self.tokenize(prefix_text, add_special_tokens=False)
        if add_bos:
            ids = torch.cat([torch.tensor([self.tokenizer.bos_token_id]), ids])
        return ids

    def prompt_texts(self, context: str, instruction: str, system: str | None = None) -> tuple[str, str]:
        """The prefix and suffix texts around ``context``.

        Chat models: one user turn ``context + "\\n\\n" + instruction`` in the model's template (with the
        template's default system prompt unless ``system`` is given), ending at the generation prompt.
        Base models (no template): ``context + "\\n\\n" + instruction + "\\nAnswer:"``.
        """
        if self.has_chat_template:
            messages = ([{"role": "system", "content": system}] if system else []) + [
                {"role": "user", "content": f"{_CTX}\n\n{_SUF}"}]
            rendered = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            head, rest = rendered.split(_CTX)
            middle, tail = rest.split(_SUF)
            return head, middle + instruction + tail
        head = f"{system}\n\n" if system else ""
        return head, f"\n\n{instruction}\nAnswer:"

    def format_prompt(self, context: str, instruction: str, system: str | None = None) -> PromptSegments:
        """Tokenize ``prefix + context + suffix`` as three segments (see module docstring)."""
        prefix_text, suffix_text = self.prompt_texts(context, instruction, system)
        context_ids, offsets = self.tokenize(context)
        suffix_ids, _ = self.tokenize(suffix_text)
        return PromptSegments(self._prefix_ids(prefix_text), context_ids, suffix_ids, offsets, context)

    # ------------------------------------------------------------------ forward passes
    def new_cache(self) -> Any:
        from transformers import DynamicCache

        return DynamicCache(config=self.model.config)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, cache: Any = None, position_ids: torch.Tensor | None = None,
                output_hidden_states: bool = False, output_attentions: bool = False, logits_to_keep: int = 0
                ) -> ForwardOutput:
        """Run ``input_ids`` ``[n]`` on top of ``cache`` (a new cache when None), which is updated in place.

        Positions continue from the cache's length unless ``position_ids`` ``[n]`` is given.
        ``output_attentions`` switches to eager attention for this call. ``logits_to_keep=k`` computes logits for
        the last k tokens only (0: all), which saves a lot with large vocabularies. Returns when the device has
        finished (:func:`synchronize`), so a wall clock read around the call times the work itself.
        """
        if cache is None:
            cache = self.new_cache()
        if input_ids.numel() == 0:  # e.g. the empty prefix of a base model without BOS
            return ForwardOutput(torch.zeros(0, self.geometry.vocab_size, device=self.device), cache)
        ids = input_ids.reshape(1, -1).to(self.device)
        kwargs: dict[str, Any] = {"use_cache": True, "cache": cache, "logits_to_keep": logits_to_keep}
        if position_ids is not None:
            kwargs["position_ids"] = position_ids.reshape(1, -1).to(self.device)
        with self._eager_attention(output_attentions):
            out = self.model(input_ids=ids, output_hidden_states=output_hidden_states,
                             output_attentions=output_attentions, **kwargs)
        synchronize(ids.device)
        hidden = tuple(h[0] for h in out.hidden_states) if output_hidden_states else None
        attn = tuple(a[0] for a in out.attentions) if output_attentions else None
        new_cache = getattr(out, "cache", None) or out.past_key_values
        if new_cache is not cache:  # the model made a cache of its own: the one passed (the context) was ignored
            import transformers

            raise CacheCertError(
                f"{type(self.model).__name__} did not use the cache passed as `cache=` (transformers "
                f"{transformers.__version__}); this library needs a transformers 5.x release whose forward takes "
                "`cache=`: upgrade transformers")
        return ForwardOutput(out.logits[0].float(), new_cache, hidden, attn)

    @contextlib.contextmanager
    def _eager_attention(self, enabled: bool) -> Iterator[None]:
        previous = self.model.config._attn_implementation
        if not enabled or previous == "eager":
            yield
            return
        self.model.set_attn_implementation("eager")
        try:
            yield
        finally:
            self.model.set_attn_implementation(previous)

    def prefill(self, input_ids: torch.Tensor, cache: Any = None, logits_to_keep: int = 1) -> ForwardOutput:
        """Prefill ``input_ids`` ``[n]`` (e.g. ``prompt.prefix_ids`` + ``prompt.context_ids``) into a cache;
        logits of the last token only unless ``logits_to_keep`` says otherwise."""
        return self.forward(input_ids, cache, logits_to_keep=logits_to_keep)

    def continue_from(self, cache: Any, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                      logits_to_keep: int = 0) -> ForwardOutput:
        """Process ``input_ids`` ``[n]`` on top of an existing (e.g. rebuilt or transferred) ``cache``."""
        return self.forward(input_ids, cache, position_ids=position_ids, logits_to_keep=logits_to_keep)

    @torch.inference_mode()
    def generate(self, input_ids: torch.Tensor, cache: Any = None, max_new_tokens: int = 64,
                 stop_strings: tuple[str, ...] = (), position_ids: torch.Tensor | None = None) -> Generation:
        """Greedy decoding of up to ``max_new_tokens`` after ``input_ids`` on top of ``cache``.

        Stops at an end-of-sequence/turn token, when the decoded text contains one of ``stop_strings`` (the
        text is cut there), or at the length limit.
        """
        if input_ids.numel() == 0:  # nothing to condition the first token on
            raise ValueError("generate needs at least one input token (e.g. the prompt's suffix)")
        out = self.forward(input_ids, cache, position_ids=position_ids, logits_to_keep=1)
        next_pos = None if position_ids is None else int(position_ids.reshape(-1)[-1]) + 1
        return self.decode(out.cache, out.logits[-1], max_new_tokens, stop_strings, next_pos)

    @torch.inference_mode()
    def decode(self, cache: Any, logits: torch.Tensor, max_new_tokens: int = 64, stop_strings: tuple[str, ...] = (),
               next_position: int | None = None) -> Generation:
        """Greedy decoding from the last fed token's ``logits`` ``[vocab]`` on top of ``cache`` (the second half
        of :meth:`generate`, for callers that ran the prompt's last forward themselves, e.g. to score it)."""
        first_logits = logits.clone()
        tokens: list[int] = []
        reason = "length"
        for _ in range(max_new_tokens):
            token = int(torch.argmax(logits))
            if token in self.stop_token_ids:
                reason = "eos"
                break
            tokens.append(token)
            if stop_strings:
                text = self.tokenizer.decode(tokens, skip_special_tokens=True)
                if any(s in text for s in stop_strings):
                    reason = "stop"
                    break
            pos = None if next_position is None else torch.tensor([next_position + len(tokens) - 1])
            step = self.forward(torch.tensor([token]), cache, position_ids=pos)
            cache, logits = step.cache, step.logits[-1]
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        if reason == "stop":
            cut = min(text.index(s) for s in stop_strings if s in text)
            text = text[:cut]
        return Generation(text.strip(), tokens, reason, first_logits)

    # ------------------------------------------------------------------ hooks
    @contextlib.contextmanager
    def capture_qk(self, layers: list[int] | None = None, queries: bool = True, keys: bool = True,
                   values: bool = False) -> Iterator[QKCapture]:
        """Record pre-RoPE queries and keys (and values, on request) of the given layers during forward calls.

        Hooks ``q_proj``/``k_proj``/``v_proj`` (reshaped to heads) and applies the attention's own
        ``q_norm``/``k_norm`` where present (Gemma 3 norms queries and keys before RoPE). Unlike a cache, this
        sees every token on sliding-window layers too.
        """
        capture = QKCapture()
        geo = self.geometry
        wanted = set(range(geo.num_layers)) if layers is None else set(layers)
        kinds = [(k, store, h) for k, store, h, on in (
            ("q", capture.queries, geo.num_heads, queries), ("k", capture.keys, geo.num_kv_heads, keys),
            ("v", capture.values, geo.num_kv_heads, values)) if on]
        handles = []
        for idx, attn in enumerate(self._attention_modules()):
            if idx not in wanted:
                continue
            for kind, store, heads in kinds:
                norm = getattr(attn, f"{kind}_norm", None)

                def hook(_m, _inp, out, store=store, heads=heads, norm=norm, idx=idx):
                    x = out.view(out.shape[0], out.shape[1], heads, geo.head_dim)  # [b, n, heads, d]
                    if norm is not None:  # the model's own per-head norm, applied before RoPE
                        x = norm(x)
                    store.setdefault(idx, []).append(x.transpose(1, 2).detach().clone())

                handles.append(getattr(attn, f"{kind}_proj").register_forward_hook(hook))
        try:
            yield capture
        finally:
            for h in handles:
                h.remove()

    @contextlib.contextmanager
    def capture_residual_stream(self, start: int, end: int,
                                transform: Any = None) -> Iterator[torch.Tensor]:
        """Record the residual stream at every layer boundary for the fed tokens ``[start, end)`` of the next
        forward call, into one preallocated ``[num_layers + 1, end - start, hidden]`` float32 tensor (yielded;
        filled when the forward returns). Boundary 0 is the input of layer 0 (embeddings, scaled where the model
        scales them), boundary ``m`` the output of layer ``m - 1``, and the last one the final norm's output:
        the same tensors as ``output_hidden_states=True``, without keeping every layer's full-length output
        alive. ``transform`` (e.g. a per-token normalisation) is applied to each ``[end - start, hidden]`` slice.
        """
        base = getattr(self.model, self.model.base_model_prefix, self.model)
        layers, num = base.layers, len(base.layers)
        buf = torch.empty(num + 1, end - start, self.geometry.hidden_size, dtype=torch.float32, device=self.device)

        def put(index: int, x: Any) -> None:
            x = x if torch.is_tensor(x) else x[0]
            part = x[0, start:end].float()
            buf[index] = transform(part) if transform is not None else part

        def first_input(_m: Any, args: tuple, kwargs: dict) -> None:
            put(0, args[0] if args else kwargs["hidden_states"])

        hooks = [layers[0].register_forward_pre_hook(first_input, with_kwargs=True)]
        hooks += [layers[i].register_forward_hook(lambda _m, _a, out, i=i: put(i + 1, out)) for i in range(num - 1)]
        hooks.append(base.norm.register_forward_hook(lambda _m, _a, out: put(num, out)))
        try:
            yield buf
        finally:
            for h in hooks:
                h.remove()

    def _attention_modules(self) -> list[torch.nn.Module]:
        base = getattr(self.model, self.model.base_model_prefix, self.model)
        return [layer.self_attn for layer in base.layers]

    def __repr__(self) -> str:
        return f"ModelHandle({self.name!r}, source={self.source!r}, device={self.device})"
