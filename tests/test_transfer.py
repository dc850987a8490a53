"""Transfer engine: moments and ridge on synthetic data, artifacts, and transfers between tiny models."""

import json
import shutil
from pathlib import Path

import pytest
import torch

from cachecert_agents.artifacts import artifact_fingerprint, file_fingerprint, keep_aside
from cachecert_agents.errors import GeometryMismatchError
from cachecert_agents.models.handle import ModelHandle
from cachecert_agents.transfer.apply import transfer
from cachecert_agents.transfer.calibrate import collect_statistics, pair_header
from cachecert_agents.transfer.features import flatten_kv, sender_features, unflatten_kv
from cachecert_agents.transfer.mappers import RidgeMapper, heldout_r2, ridge_solve
from cachecert_agents.transfer.statistics import PairStatistics, sender_layers_for
from tests.conftest import tiny_model, tiny_workload


def _synthetic_stats(w, b, n_chunks, seed, noise=0.0):
    gen = torch.Generator().manual_seed(seed)
    stats = PairStatistics.empty({"sender": "s", "receiver": "r", "sender_kv": "a", "receiver_kv": "b"})
    xs, ys = [], []
    for _ in range(n_chunks):
        x = torch.randn(50, w.shape[0], generator=gen) @ torch.randn(w.shape[0], w.shape[0], generator=gen) * 0.5
        y = x @ w + b + noise * torch.randn(50, w.shape[1], generator=gen)
        stats.add("kv:0", [0, 1], x, y, count_tokens=True)
        stats.end_context()
        xs.append(x), ys.append(y)
    return stats, torch.cat(xs), torch.cat(ys)


def test_streaming_ridge_recovers_a_known_linear_map():
    gen = torch.Generator().manual_seed(0)
    w, b = torch.randn(12, 5, generator=gen, dtype=torch.float64), torch.randn(5, generator=gen, dtype=torch.float64)
    stats, _, _ = _synthetic_stats(w.float(), b.float(), n_chunks=8, seed=1)
    heldout, _, _ = _synthetic_stats(w.float(), b.float(), n_chunks=2, seed=2)
    mapper = RidgeMapper.fit(stats, heldout)
    assert torch.allclose(mapper.weights["kv:0"].double(), w, atol=1e-2)
    assert torch.allclose(mapper.biases["kv:0"].double(), b, atol=1e-2)
    assert mapper.header["targets"]["kv:0"]["heldout_r2"] > 0.9999


def test_float32_products_match_float64_moments():
    """What the calibration passes use (one context's products in float32 into float64 sums) against float64."""
    gen = torch.Generator().manual_seed(3)
    header = {"sender": "s", "receiver": "r", "sender_kv": "a", "receiver_kv": "b"}
    both = [PairStatistics.empty(header) for _ in range(2)]
    for _ in range(3):
        x, y = torch.randn(2000, 64, generator=gen) + 3.0, torch.randn(2000, 16, generator=gen)
        for stats, dtype in zip(both, (torch.float32, torch.float64)):
            stats.add("kv:0", [0], x, y, count_tokens=True, product_dtype=dtype)
            stats.end_context()
    low, high = both
    for a, b in ((low.features["x0"].xx, high.features["x0"].xx), (low.targets["kv:0"].xy, high.targets["kv:0"].xy)):
        assert a.dtype == torch.float64
        assert ((a - b).norm() / b.norm()).item() < 1e-6


def test_r2_from_moments_matches_direct_computation():
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(6, 4, generator=gen)
    stats, x, y = _synthetic_stats(w, torch.zeros(4), n_chunks=4, seed=4, noise=0.7)
    mx, my, cxx, cxy, _ = stats.centred("kv:0")
    wf = ridge_solve(cxx, cxy, 0.1)
    bf = my - mx @ wf
    resid = y.double() - (x.double() @ wf + bf)
    direct = 1 - resid.pow(2).sum() / (y.double() - y.double().mean(0)).pow(2).sum()
    assert heldout_r2(wf, bf, stats, "kv:0") == pytest.approx(float(direct), abs=1e-8)


def test_artifacts_round_trip_and_refuse_a_wrong_pair(tmp_path):
    w = torch.randn(6, 3)
    stats, _, _ = _synthetic_stats(w, torch.zeros(3), n_chunks=3, seed=5)
    stats.save(tmp_path / "stats")
    back = PairStatistics.load(tmp_path / "stats", expect={"receiver_kv": "b"})
    assert back.n_tokens == stats.n_tokens and torch.equal(back.targets["kv:0"].xy, stats.targets["kv:0"].xy)
    mapper = RidgeMapper.fit(stats, rho=1e-3)
    mapper.save(tmp_path / "mapper")
    loaded = RidgeMapper.load(tmp_path / "mapper", expect={"sender_kv": "a"})
    assert torch.equal(loaded.weights["kv:0"], mapper.weights["kv:0"])
    with pytest.raises(GeometryMismatchError, match="receiver_kv"):
        RidgeMapper.load(tmp_path / "mapper", expect={"receiver_kv": "other"})
    with pytest.raises(GeometryMismatchError):
        PairStatistics.load(tmp_path / "stats", expect={"sender": "someone-else"})
    assert not list(tmp_path.glob("*.tmp"))
    # the header names its tensors: the mapper's fingerprint is that of its file, and a header paired with
    # other tensors (a crash between the two renames, a file copied over) is refused
    assert loaded.fingerprint == mapper.fingerprint == file_fingerprint(tmp_path / "mapper.safetensors")
    RidgeMapper.fit(stats, rho=1.0).save(tmp_path / "other")
    shutil.copy(tmp_path / "other.safetensors", tmp_path / "mapper.safetensors")
    with pytest.raises(ValueError, match="not written together"):
        RidgeMapper.load(tmp_path / "mapper")


def test_alignment_coverage_counts_an_uncovered_last_token():
    """A receiver token past the sender's text (uncovered) is counted as such, not an index error."""
    import numpy as np

    from cachecert_agents.kv.alignment import align_tokens

    cov = align_tokens(np.array([[0, 3], [3, 6], [6, 8]]), np.array([[0, 2], [2, 6]])).coverage()
    assert cov["covered_fraction"] == pytest.approx(2 / 3)
    assert cov["char_coverage"] == pytest.approx(6 / 8)


def test_atomic_writes_from_many_threads_leave_one_whole_file_and_no_temporaries(tmp_path):
    import threading

    from cachecert_agents.artifacts import write_atomic

    target = tmp_path / "shared.json"
    bodies = [f"{i}:" + "x" * 100_000 for i in range(8)]
    threads = [threading.Thread(target=write_atomic, args=(target, body)) for body in bodies]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert target.read_text() in bodies
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shared.json"]


def test_weights_identity_is_checked_where_recorded_and_warned_about_where_not(tmp_path, caplog):
    """An artifact records both models' weights fingerprints: another model of the same geometry and tokenizer
    (a fine-tune, another quantisation) is refused; an artifact built before they were recorded still loads,
    with a warning that only geometry and tokenizer were checked."""
    stats, _, _ = _synthetic_stats(torch.randn(6, 3), torch.zeros(3), n_chunks=3, seed=5)
    stats.header.update(sender_weights="aaaa", receiver_weights="bbbb")
    RidgeMapper.fit(stats, rho=1e-3).save(tmp_path / "mapper")
    assert RidgeMapper.load(tmp_path / "mapper", expect={"sender_weights": "aaaa"}).weights
    with pytest.raises(GeometryMismatchError, match="receiver_weights"):
        RidgeMapper.load(tmp_path / "mapper", expect={"receiver_weights": "cccc"})
    del stats.header["sender_weights"], stats.header["receiver_weights"]
    RidgeMapper.fit(stats, rho=1e-3).save(tmp_path / "legacy")
    with caplog.at_level("WARNING"):
        RidgeMapper.load(tmp_path / "legacy", expect={"sender_weights": "aaaa", "receiver_kv": "b"})
    assert "weights are not checked" in caplog.text


def test_keep_aside_never_overwrites(tmp_path):
    first = tmp_path / "a.json"
    first.write_text("1")
    aside = keep_aside(first)
    assert aside is not None and aside.read_text() == "1" and not first.exists()
    first.write_text("2")
    aside2 = keep_aside(first)
    assert aside2 != aside and aside.read_text() == "1" and aside2.read_text() == "2"
    assert keep_aside(tmp_path / "missing.json") is None


def test_sender_layer_choice_is_proportional_and_clipped():
    assert sender_layers_for(0, 29, 25) == [0, 1, 2]
    assert sender_layers_for(28, 29, 25) == [22, 23, 24]
    assert sender_layers_for(14, 29, 25) == [11, 12, 13]
    assert sender_layers_for(3, 4, 2, width=3) == [0, 1]


def test_flatten_and_unflatten_kv_are_inverse():
    k, v = torch.randn(1, 2, 7, 4), torch.randn(1, 2, 7, 4)
    flat = flatten_kv(k, v)
    assert flat.shape == (7, 16)
    k2, v2 = unflatten_kv(flat, 2, 4)
    assert torch.equal(k, k2) and torch.equal(v, v2)


CONTEXTS = ["the cat sat on the mat and the dog ran in the park " * 3,
            "a dog ran in the park where the cat sat on the mat " * 3,
            "where did the cat sit the cat sat on the mat " * 3,
            "the park had a dog and a cat and the mat " * 3]


def _twins(arch: str, tokenizer) -> tuple[ModelHandle, ModelHandle]:
    """Sender and receiver with identical weights."""
    return (ModelHandle("tiny-a", tiny_model(arch, seed=7), tokenizer),
            ModelHandle("tiny-b", tiny_model(arch, seed=7), tokenizer))


@pytest.fixture
def twins(tiny_tokenizer):
    """Identical-weight tiny llamas."""
    return _twins("llama", tiny_tokenizer)


def test_pure_kv_transfer_between_identical_models_equals_the_exact_cache(twins):
    sender, receiver = twins
    L = receiver.geometry.num_layers
    # K = W_k (g * h/rms(h)) is exactly linear in the features; random text spans all 3 x 64 feature
    # directions (a handful of repeated sentences would leave most of them unseen)
    gen = torch.Generator().manual_seed(0)
    texts = [sender.tokenizer.decode(torch.randint(4, 320, (120,), generator=gen)) for _ in range(6)]
    stats = collect_statistics(sender, receiver, [(t, "where did the cat sit") for t in texts], [],
                               progress=False)
    mapper = RidgeMapper.fit(stats, rho=1e-7)
    prompt = receiver.format_prompt("the dog sat on the mat in the park", "where did the dog sit")
    feats = sender_features(sender, sender.format_prompt(prompt.context_text, "where did the dog sit"))
    result = transfer(receiver, prompt, feats, mapper, split=L)
    exact = receiver.forward(prompt.input_ids, logits_to_keep=1).logits[-1]
    got = receiver.continue_from(result.cache, prompt.suffix_ids, logits_to_keep=1).logits[-1]
    assert torch.allclose(got, exact, atol=1e-3), (got - exact).abs().max()


@pytest.fixture(params=["llama", "gemma3"])
def arch_twins(request, tiny_tokenizer):
    """Identical-weight pairs of each attention layout (Gemma 3: sliding-window layers, window 8)."""
    return _twins(request.param, tiny_tokenizer)


def test_split_zero_is_a_full_prefill(arch_twins):
    sender, receiver = arch_twins
    stats = collect_statistics(sender, receiver, [(c, "q") for c in CONTEXTS[:2]], [1], progress=False)
    mapper = RidgeMapper.fit(stats, rho=1e-2)
    prompt = receiver.format_prompt(CONTEXTS[3], "where did the cat sit")
    feats = sender_features(sender, sender.format_prompt(CONTEXTS[3], "where did the cat sit"))
    exact = receiver.forward(prompt.input_ids, logits_to_keep=1).logits[-1]
    result = transfer(receiver, prompt, feats, mapper, split=0)
    got = receiver.continue_from(result.cache, prompt.suffix_ids, logits_to_keep=1).logits[-1]
    assert torch.allclose(got, exact, atol=1e-5)
    # an intermediate split runs end to end and changes the answer only through the mapped part
    mid = transfer(receiver, prompt, feats, mapper, split=1)
    assert mid.cache.get_seq_length() == len(prompt) - prompt.suffix_ids.numel()
    with pytest.raises(ValueError, match="split must be"):
        transfer(receiver, prompt, feats, mapper, split=99)


def test_receiver_targets_equal_the_context_run_on_the_prefix_cache(arch_twins):
    """The targets come from one forward over prefix + context; they must be the keys/values and stream the
    receiver computes for the context on top of its own prefix cache (sliding-window layers included)."""
    from cachecert_agents.transfer.features import receiver_targets

    _, receiver = arch_twins
    prompt = receiver.format_prompt(CONTEXTS[0], "where did the cat sit")
    got = receiver_targets(receiver, prompt, [1, 2], queries=True)
    n = len(prompt.context_ids)
    with receiver.capture_qk(keys=True, values=True) as cap:
        prefix = receiver.prefill(prompt.prefix_ids)
        out = receiver.forward(prompt.context_ids, prefix.cache, output_hidden_states=True, logits_to_keep=1)
    for layer in range(receiver.geometry.num_layers):
        want = flatten_kv(cap.key(layer)[:, :, -n:], cap.value(layer)[:, :, -n:])
        assert torch.allclose(got.kv[layer], want, atol=1e-5)
    for s in (1, 2):
        assert torch.allclose(got.hidden[s], out.hidden_states[s].float(), atol=1e-5)
    assert got.qk.key(0).shape[2] == prompt.context_span[1]  # prefix + context recorded for the query statistics


def test_pair_header_names_both_models(twins):
    header = pair_header(*twins, workload="w")
    assert header["sender"] == "tiny-a" and header["receiver"] == "tiny-b" and header["workload"] == "w"
    assert header["sender_kv"] == header["receiver_kv"]
    assert header["sender_weights"] == twins[0].weights_fingerprint
    assert header["receiver_weights"] == twins[1].weights_fingerprint


def test_random_map_control_keeps_scale_and_drops_information():
    stats, _, _ = _synthetic_stats(torch.randn(6, 3), torch.ones(3), n_chunks=3, seed=6)
    mapper = RidgeMapper.fit(stats, rho=1e-3)
    control = mapper.randomised(seed=1)
    w, r = mapper.weights["kv:0"], control.weights["kv:0"]
    assert torch.allclose(w.norm(), r.norm()) and not torch.allclose(w, r)
    assert torch.equal(control.biases["kv:0"], mapper.biases["kv:0"])
    assert control.header["control"] == "random-map"


def test_artifact_names_with_dots_keep_their_stem(tmp_path):
    stats, _, _ = _synthetic_stats(torch.randn(4, 2), torch.zeros(2), n_chunks=2, seed=8)
    mapper = RidgeMapper.fit(stats, rho=1e-3)
    mapper.save(tmp_path / "qwen2.5-coder-0.5b__qwen2.5-coder-1.5b__w")
    stats.save(tmp_path / "qwen2.5-coder-0.5b__qwen2.5-coder-1.5b__w.stats")
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["qwen2.5-coder-0.5b__qwen2.5-coder-1.5b__w.json",
                     "qwen2.5-coder-0.5b__qwen2.5-coder-1.5b__w.safetensors",
                     "qwen2.5-coder-0.5b__qwen2.5-coder-1.5b__w.stats.json",
                     "qwen2.5-coder-0.5b__qwen2.5-coder-1.5b__w.stats.safetensors"]
    assert RidgeMapper.load(tmp_path / "qwen2.5-coder-0.5b__qwen2.5-coder-1.5b__w").weights.keys() == {"kv:0"}


def test_oracle_transfer_with_everything_true_is_exact(twins):
    """Diagnostics: true KV below the split and the true residual stream at it reproduce a full prefill."""
    from cachecert_agents.transfer.features import receiver_targets

    sender, receiver = twins
    stats = collect_statistics(sender, receiver, [(c, "q") for c in CONTEXTS[:2]], [2], progress=False)
    mapper = RidgeMapper.fit(stats, rho=1e-2)
    prompt = receiver.format_prompt(CONTEXTS[3], "where did the cat sit")
    feats = sender_features(sender, sender.format_prompt(CONTEXTS[3], "where did the cat sit"))
    truth = receiver_targets(receiver, prompt, [2])
    exact = receiver.forward(prompt.input_ids, logits_to_keep=1).logits[-1]
    both = transfer(receiver, prompt, feats, mapper, split=2, true_targets=truth, oracle="both")
    got = receiver.continue_from(both.cache, prompt.suffix_ids, logits_to_keep=1).logits[-1]
    assert torch.allclose(got, exact, atol=1e-5)
    for oracle in ("kv", "hidden"):
        result = transfer(receiver, prompt, feats, mapper, split=2, true_targets=truth, oracle=oracle)
        assert result.cache.get_seq_length() == len(prompt) - prompt.suffix_ids.numel()
    with pytest.raises(ValueError, match="oracle"):
        transfer(receiver, prompt, feats, mapper, split=2, oracle="kv")


def test_wider_residual_stream_window_reads_more_sender_layers(twins):
    sender, receiver = twins
    narrow = collect_statistics(sender, receiver, [(c, "q") for c in CONTEXTS[:2]], [1], progress=False)
    wide = collect_statistics(sender, receiver, [(c, "q") for c in CONTEXTS[:2]], [1], progress=False,
                              hidden_width=5)
    boundaries = sender.geometry.num_layers + 1
    assert narrow.targets["hidden:1"].sender_layers == sender_layers_for(1, boundaries, boundaries, 3)
    assert wide.targets["hidden:1"].sender_layers == sender_layers_for(1, boundaries, boundaries, 5)
    assert len(wide.targets["hidden:1"].sender_layers) == min(5, boundaries)
    # the key/value targets keep the default window, so their moments are identical
    assert torch.equal(wide.targets["kv:0"].xy, narrow.targets["kv:0"].xy)
    mapper = RidgeMapper.fit(wide, rho=1e-2)
    prompt = receiver.format_prompt(CONTEXTS[3], "where did the cat sit")
    feats = sender_features(sender, sender.format_prompt(CONTEXTS[3], "where did the cat sit"))
    result = transfer(receiver, prompt, feats, mapper, split=1)  # the runtime reads the window from the mapper
    assert result.cache.get_seq_length() == len(prompt) - prompt.suffix_ids.numel()


def test_method_names_round_trip():
    from cachecert_agents.eval.transfer_eval import method_name, parse_method

    for split, width, anchor, pct in ((3, None, None, None), (14, 9, None, None), (28, None, None, None),
                                      (17, 13, 4, None), (17, None, 2, None), (28, None, 3, None),
                                      (28, None, None, 30), (14, 9, None, 100)):
        assert parse_method(method_name(split, 28, width, anchor, pct), 28) == (
            split, width if split < 28 else None, anchor, pct)
    assert method_name(14, 28, 9) == "split@14+w9" and method_name(28, 28, 9) == "ridge-kv"
    assert method_name(17, 28, 13, 4) == "split@17+w13+a4" and method_name(28, 28, None, 2) == "ridge-kv+a2"
    assert parse_method("split@17+a4").anchor == 4 and parse_method("ridge-kv").split is None
    assert method_name(28, 28, None, None, 35) == "ridge-kv+r35" and parse_method("ridge-kv+r35").recompute == 35
    for bad in ("split@", "split@x", "kv", "split@3+9", "split@3+a", "ridge-kv+w3", "ridge-kv+r0", "ridge-kv+r101",
                "ridge-kv+r30+a2"):
        with pytest.raises(ValueError, match="ridge-kv, split@K or split@K\\+wW"):
            parse_method(bad)


def test_anchored_transfer_computes_the_layers_below_the_anchor_and_reads_the_stream_there(twins):
    """With an anchor a, layers < a are the receiver's own (exact) and the maps read its stream entering a, so
    layer a's keys/values are an exactly linear function of the features, whatever the sender."""
    _, receiver = twins
    sender = ModelHandle("tiny-c", tiny_model("llama", seed=11), receiver.tokenizer)  # different weights
    L = receiver.geometry.num_layers
    gen = torch.Generator().manual_seed(0)
    texts = [sender.tokenizer.decode(torch.randint(4, 320, (120,), generator=gen)) for _ in range(6)]
    stats = collect_statistics(sender, receiver, [(t, "q") for t in texts], [2], progress=False, anchor=1)
    assert "kv:0" not in stats.targets and stats.header["anchor"] == 1  # computed by the receiver, not mapped
    hidden_r = receiver.geometry.hidden_size
    assert stats.targets["kv:1"].anchor == 1 and stats.targets["kv:1"].feature_key.endswith("+r1")
    assert stats.targets["kv:1"].xy.shape[0] == 3 * sender.geometry.hidden_size + hidden_r
    mapper = RidgeMapper.fit(stats, rho=1e-7)
    assert mapper.anchor == 1
    prompt = receiver.format_prompt("the dog sat on the mat in the park", "where did the dog sit")
    feats = sender_features(sender, sender.format_prompt(prompt.context_text, "where did the dog sit"))
    exact = receiver.forward(prompt.input_ids[:prompt.context_span[1]], logits_to_keep=1).cache
    result = transfer(receiver, prompt, feats, mapper, split=2)
    start, end = prompt.context_span
    for layer, atol in ((0, 1e-5), (1, 1e-3)):
        got_k, want_k = result.cache.layers[layer].keys, exact.layers[layer].keys
        assert torch.allclose(got_k[:, :, start:end], want_k[:, :, start:end], atol=atol), layer
    # a sender-only mapper's layer 1 is not exact here: the anchor is what makes it so
    plain = RidgeMapper.fit(collect_statistics(sender, receiver, [(t, "q") for t in texts], [2], progress=False),
                            rho=1e-7)
    other = transfer(receiver, prompt, feats, plain, split=2).cache
    for layer in (0, 1):
        assert not torch.allclose(other.layers[layer].keys[:, :, start:end],
                                  exact.layers[layer].keys[:, :, start:end], atol=1e-2), layer
    pure = transfer(receiver, prompt, feats, mapper, split=L)  # anchored pure KV above the anchor runs too
    assert pure.cache.get_seq_length() == len(prompt) - prompt.suffix_ids.numel()
    with pytest.raises(ValueError, match="anchored mapper"):
        transfer(receiver, prompt, feats, mapper, split=1)
    with pytest.raises(ValueError, match="below every split"):
        collect_statistics(sender, receiver, [(texts[0], "q")], [1], progress=False, anchor=1)
    small = collect_statistics(sender, receiver, [(texts[0], "q")], [2], progress=False, anchor=1, kv_until=2)
    assert set(small.targets) == {"kv:1", "hidden:2"}  # what a split-2 transfer reads, nothing more


def test_build_mapper_for_an_anchored_split_keeps_what_it_reads_and_evaluates(twins, tmp_path):
    """End to end on tiny models: an anchored mapper is calibrated apart (``__a1``), keeps only the maps a split
    transfer at 2 reads, is reused on the next call, and its transfers are evaluated and named ``split@2+a1``."""
    from cachecert_agents.eval.transfer_eval import build_mapper, evaluate_transfer, record_settings, summarise
    from cachecert_agents.eval.workloads import Agreement
    from cachecert_agents.jsonl import read_jsonl

    sender, receiver = twins
    wl = tiny_workload(CONTEXTS, n_calibration=3)
    mapper = build_mapper(sender, receiver, wl, [2], n_contexts=2, n_heldout=1, out_dir=tmp_path, anchor=1)
    assert mapper.anchor == 1 and set(mapper.weights) == {"kv:1", "hidden:2"}
    assert (tmp_path / "tiny-a__tiny-b__tiny__a1.json").exists()
    again = build_mapper(sender, receiver, wl, [2], n_contexts=2, n_heldout=1, out_dir=tmp_path, anchor=1)
    assert torch.equal(again.weights["hidden:2"], mapper.weights["hidden:2"])  # loaded, not refitted
    with pytest.raises(ValueError, match="below every split"):
        build_mapper(sender, receiver, wl, [1], n_contexts=2, n_heldout=1, out_dir=tmp_path, anchor=1)
    stem = tmp_path / "tiny-a__tiny-b__tiny__a1"
    assert mapper.fingerprint == file_fingerprint(f"{stem}.safetensors")
    assert mapper.header["statistics_sha256"] == artifact_fingerprint(f"{stem}.stats")
    records, full = evaluate_transfer(sender, receiver, wl, mapper, [2], n=1, results_dir=tmp_path / "r",
                                      progress=False, controls=False)
    (row,) = summarise(records, full)
    assert row["method"] == "split@2+a1" and row["n"] == 1
    assert all(r["mapper_sha256"] == mapper.fingerprint for r in records)  # each label names its mapper
    assert [r["receiver_weights"] for r in full] == [receiver.weights_fingerprint]
    # a cached full-prefill answer of other weights under the same name is not reused: it is computed again
    full_path = tmp_path / "r" / "full" / "tiny-b__tiny.jsonl"
    full_path.write_text(json.dumps(dict(full[0], receiver_weights="other", answer="stale")) + "\n")
    _, full_again = evaluate_transfer(sender, receiver, wl, mapper, [2], n=1, results_dir=tmp_path / "r",
                                      progress=False, controls=False)
    assert full_again[-1]["receiver_weights"] == receiver.weights_fingerprint
    # a record made on other data or settings (here: another agreement criterion) is redone, not resumed; a
    # record that predates `settings` is taken as it is
    records_file = tmp_path / "r" / "tiny-a__tiny-b__tiny.jsonl"
    (latest,) = [r for r in read_jsonl(records_file) if r["method"] == "split@2+a1"]
    assert latest["settings"] == record_settings(wl, wl.examples("evaluation")[0], sender, receiver)
    records_file.write_text(json.dumps(dict(latest, settings="other", answer="stale")) + "\n")
    redone, _ = evaluate_transfer(sender, receiver, wl, mapper, [2], n=1, results_dir=tmp_path / "r",
                                  progress=False, controls=False)
    assert [r["answer"] for r in redone] == [latest["answer"]] and len(read_jsonl(records_file)) == 2
    records_file.write_text(json.dumps({k: v for k, v in latest.items() if k != "settings"}) + "\n")
    evaluate_transfer(sender, receiver, wl, mapper, [2], n=1, results_dir=tmp_path / "r", progress=False,
                      controls=False)
    assert len(read_jsonl(records_file)) == 1
    records_file.write_text(json.dumps(latest) + "\n")
    shorter = tiny_workload(CONTEXTS, n_calibration=3)
    shorter.max_new_tokens = 2  # another generation setting: other answers
    evaluate_transfer(sender, receiver, shorter, mapper, [2], n=1, results_dir=tmp_path / "r", progress=False,
                      controls=False)
    assert [r["settings"] == latest["settings"] for r in read_jsonl(records_file)] == [True, False]
    # back to the first settings: the newest record (other settings) decides, so it is redone, not the older
    # matching one resumed under it
    again, _ = evaluate_transfer(sender, receiver, wl, mapper, [2], n=1, results_dir=tmp_path / "r",
                                 progress=False, controls=False)
    assert [r["settings"] == latest["settings"] for r in read_jsonl(records_file)] == [True, False, True]
    assert again[0]["settings"] == latest["settings"] and again[0]["agreement"] == str(wl.agreement)
    # the agreement criterion labels answers, it does not make them: not a reason to redo
    strict = tiny_workload(CONTEXTS, n_calibration=3)
    strict.agreement = Agreement.parse("token-f1>=0.9")
    evaluate_transfer(sender, receiver, strict, mapper, [2], n=1, results_dir=tmp_path / "r", progress=False,
                      controls=False)
    assert len(read_jsonl(records_file)) == 3
    # recalibrating (another calibration size) keeps the earlier mapper and statistics aside, never overwrites
    build_mapper(sender, receiver, wl, [2], n_contexts=1, n_heldout=1, out_dir=tmp_path, anchor=1)
    assert len(list(tmp_path.glob("tiny-a__tiny-b__tiny__a1.*.replaced-*"))) == 4


def test_build_mapper_resumes_from_statistics_saved_before_a_stop(twins, tmp_path, monkeypatch):
    """A run stopped after the statistics pass (killed, out of memory) resumes from the saved statistics: only
    the held-out pass runs again, and the refitted mapper equals the first. Statistics of another size are
    collected anew, the earlier ones kept aside."""
    import cachecert_agents.eval.transfer_eval as te

    sender, receiver = twins
    wl = tiny_workload(CONTEXTS, n_calibration=3)
    first = te.build_mapper(sender, receiver, wl, [2], n_contexts=2, n_heldout=1, out_dir=tmp_path)
    stem = tmp_path / "tiny-a__tiny-b__tiny"
    for path in (f"{stem}.json", f"{stem}.safetensors"):  # the stop: statistics saved, no mapper yet
        Path(path).unlink()
    passes = []
    collect = te.collect_statistics
    monkeypatch.setattr(te, "collect_statistics", lambda *a, **k: passes.append(k["total"]) or collect(*a, **k))
    again = te.build_mapper(sender, receiver, wl, [2], n_contexts=2, n_heldout=1, out_dir=tmp_path)
    assert passes == [1]  # the held-out pass only
    assert set(again.weights) == set(first.weights)
    assert all(torch.equal(again.weights[k], first.weights[k]) for k in first.weights)
    assert again.header["statistics_sha256"] == first.header["statistics_sha256"]
    assert not list(tmp_path.glob("tiny-a__tiny-b__tiny.stats.*.replaced-*"))  # nothing set aside
    # other statistics asked for (another split, so other targets): collected again, the saved ones kept aside
    passes.clear()
    te.build_mapper(sender, receiver, wl, [1, 2], n_contexts=2, n_heldout=1, out_dir=tmp_path)
    assert passes == [2, 1]
    assert len(list(tmp_path.glob("tiny-a__tiny-b__tiny.stats.*.replaced-*"))) == 2


def test_diagnose_splits_resumes_and_counts_each_example_once(twins, tmp_path):
    """``diagnose_splits`` on tiny models: every variant answered once per example; a rerun adds nothing, and a
    record made on other settings is redone and replaces the earlier one in the rows (n stays 1)."""
    from cachecert_agents.eval.transfer_eval import build_mapper, diagnose_splits, evaluate_transfer
    from cachecert_agents.jsonl import read_jsonl

    sender, receiver = twins
    wl = tiny_workload(CONTEXTS, n_calibration=3)
    mapper = build_mapper(sender, receiver, wl, [2], n_contexts=2, n_heldout=1, out_dir=tmp_path)
    evaluate_transfer(sender, receiver, wl, mapper, [2], n=1, results_dir=tmp_path / "r", progress=False,
                      controls=False)
    rows = diagnose_splits(sender, receiver, wl, mapper, [2], n=1, results_dir=tmp_path / "r", progress=False)
    assert sorted(r["variant"] for r in rows) == ["mapped", "oracle-hidden", "oracle-kv"]
    assert all(r["n"] == 1 for r in rows)
    path = tmp_path / "r" / "diagnose__tiny-a__tiny-b__tiny.jsonl"
    first = read_jsonl(path)
    path.write_text("".join(json.dumps(dict(r, settings="other")) + "\n" for r in first))
    again = diagnose_splits(sender, receiver, wl, mapper, [2], n=1, results_dir=tmp_path / "r", progress=False)
    assert all(r["n"] == 1 for r in again) and len(read_jsonl(path)) == 2 * len(first)
    diagnose_splits(sender, receiver, wl, mapper, [2], n=1, results_dir=tmp_path / "r", progress=False)
    assert len(read_jsonl(path)) == 2 * len(first)


def test_build_mapper_without_a_size_takes_the_cached_one(twins, tmp_path):
    """``n_contexts=None`` (``eval transfer`` without ``--n-calibration``) reuses the cached mapper whatever its
    calibration size, and refits one that lacks a split on that same size; with nothing cached it asks for the
    default size (32 here, more than the tiny workload holds, hence the clear error)."""
    from cachecert_agents.eval.transfer_eval import DEFAULT_CALIBRATION_CONTEXTS, build_mapper

    sender, receiver = twins
    wl = tiny_workload(CONTEXTS, n_calibration=3)
    L = receiver.geometry.num_layers
    first = build_mapper(sender, receiver, wl, [L], n_contexts=1, n_heldout=1, out_dir=tmp_path)
    again = build_mapper(sender, receiver, wl, [L], n_contexts=None, n_heldout=1, out_dir=tmp_path)
    assert again.header["n_calibration_contexts"] == 1 and again.fingerprint == first.fingerprint
    wider = build_mapper(sender, receiver, wl, [2, L], n_contexts=None, n_heldout=1, out_dir=tmp_path)
    assert "hidden:2" in wider.weights and wider.header["n_calibration_contexts"] == 1
    assert len(list(tmp_path.glob("tiny-a__tiny-b__tiny.*.replaced-*"))) == 4  # the earlier one kept aside
    with pytest.raises(ValueError, match=f"asked for {DEFAULT_CALIBRATION_CONTEXTS} "):
        build_mapper(sender, receiver, wl, [L], n_contexts=None, n_heldout=1, out_dir=tmp_path / "empty")
    # the workload's calibration text changed (other data, another context construction): refitted, not reused
    changed = tiny_workload([CONTEXTS[1], CONTEXTS[0], *CONTEXTS[2:]], n_calibration=3)
    refit = build_mapper(sender, receiver, changed, [2, L], n_contexts=None, n_heldout=1, out_dir=tmp_path)
    assert refit.header["calibration_sha256"] != wider.header["calibration_sha256"]
    assert refit.fingerprint != wider.fingerprint and len(list(tmp_path.glob("tiny-a__tiny-b__tiny.*.replaced-*"))) == 8
