"""CTI: closed-form checks on synthetic statistics, the query-geometry property, and receiver query statistics
against the model's own attention weights."""

import json
import math

import pytest
import torch

from cachecert_agents.cti.index import layer_terms, schur_residual
from cachecert_agents.cti.queries import attention_concentration, collect_query_statistics
from cachecert_agents.kv.rope import apply_rope, rope_tables
from cachecert_agents.models.handle import ModelHandle
from cachecert_agents.transfer.statistics import PairStatistics
from tests.conftest import tiny_model, tiny_workload


def test_schur_residual_recovers_the_noise_covariance():
    gen = torch.Generator().manual_seed(0)
    f, dim, n = 8, 4, 40000
    w = torch.randn(f, dim, generator=gen, dtype=torch.float64)
    noise_scale = torch.tensor([0.1, 0.5, 1.0, 2.0], dtype=torch.float64)
    stats = PairStatistics.empty({"sender": "s", "receiver": "r"})
    for _ in range(8):
        x = torch.randn(n // 8, f, generator=gen, dtype=torch.float64)
        y = x @ w + torch.randn(n // 8, dim, generator=gen, dtype=torch.float64) * noise_scale
        stats.add("kv:0", [0], x, y, count_tokens=True)
        stats.end_context()
    res, cyy, dof = schur_residual(stats, "kv:0", rho=1e-8)
    assert dof == pytest.approx(f, rel=1e-6)  # no effective shrinkage at this rho
    assert torch.allclose(torch.diagonal(res), noise_scale ** 2, rtol=0.05)
    assert torch.allclose(res - torch.diag(torch.diagonal(res)), torch.zeros(dim, dim, dtype=torch.float64), atol=0.03)
    # closed form: Syy = W^T W + diag(noise^2) for standard normal x
    assert torch.allclose(cyy, w.T @ w + torch.diag(noise_scale ** 2), rtol=0.05, atol=0.1)


def test_gcv_inflated_residual_predicts_the_fitted_maps_error_on_new_tokens():
    """With as many features as a tenth of the tokens the calibration residual is optimistic by about dof/n; the
    GCV-inflated one matches the error the fitted map makes on fresh tokens (and its inflation, on a few contexts
    of few tokens, refuses with a clear message)."""
    from cachecert_agents.cti.index import gcv_inflation

    gen = torch.Generator().manual_seed(1)
    f, dim, n = 200, 6, 2000
    w = torch.randn(f, dim, generator=gen, dtype=torch.float64) / f ** 0.5
    stats = PairStatistics.empty({"sender": "s", "receiver": "r"})
    for _ in range(4):
        x = torch.randn(n // 4, f, generator=gen, dtype=torch.float64)
        stats.add("kv:0", [0], x, x @ w + torch.randn(n // 4, dim, generator=gen, dtype=torch.float64),
                  count_tokens=True)
        stats.end_context()
    res, _, dof = schur_residual(stats, "kv:0", rho=1e-2)
    mx, my, cxx, cxy, _ = stats.centred("kv:0")
    lam = 1e-2 * torch.trace(cxx) / f
    fitted = torch.linalg.solve(cxx + lam * torch.eye(f, dtype=torch.float64), cxy)
    x_new = torch.randn(200_000, f, generator=gen, dtype=torch.float64)
    y_new = x_new @ w + torch.randn(200_000, dim, generator=gen, dtype=torch.float64)
    new_error = float(((y_new - my - (x_new - mx) @ fitted) ** 2).sum(1).mean())
    calibration = float(torch.trace(res))
    assert 150 < dof < f
    assert calibration < 0.85 * new_error
    assert calibration * gcv_inflation(dof, n) == pytest.approx(new_error, rel=0.05)
    with pytest.raises(ValueError, match="too few calibration tokens"):
        gcv_inflation(dof, 200)


def _layer(key_res_diag, value_res, q2, conc=1.0):
    """One KV head, one query head, head dim 4 (rotary: all 4 channels; pairs (0,2), (1,3)), W_O = I."""
    d = 4
    res = torch.zeros(2 * d, 2 * d, dtype=torch.float64)
    res[:d, :d] = torch.diag(torch.tensor(key_res_diag, dtype=torch.float64))
    res[d:, d:] = torch.eye(d, dtype=torch.float64) * value_res
    cyy = torch.eye(2 * d, dtype=torch.float64)
    return layer_terms(0, res, cyy, torch.zeros(2 * d, dtype=torch.float64),
                       torch.tensor([q2], dtype=torch.float64), torch.tensor([conc], dtype=torch.float64),
                       torch.eye(d, dtype=torch.float64), kv_heads=1, head_dim=d, rotary_dim=d)


def test_layer_terms_match_closed_form_values():
    t = _layer([1.0, 0.0, 3.0, 0.0], 0.5, [2.0, 0.0, 0.0, 0.0], conc=0.25)
    # rotation average: channel pair (0,2) -> key var 2, query 1 each; key term = (1*2 + 1*2) / 4 = 1
    assert t.key_term == pytest.approx(1.0)
    # S_v = tr(Cov v) = 4, E = 4, value error tr(G Sres_V) = 2; D = 0.25 * (1 * 4 + 2) / 4
    assert t.deviation == pytest.approx(0.25 * 6 / 4)
    assert t.value_term == pytest.approx(0.25 * 2)
    assert t.residual_fraction == pytest.approx((4 + 2) / 8)


def test_layer_terms_group_query_heads_onto_their_kv_heads_with_their_own_output_columns():
    """Grouped-query attention (4 query heads on 2 KV heads), a random ``W_O`` and a nonzero value mean, against a
    head-by-head evaluation of the definition in docs/cti.md: query head h reads KV head ``h // 2``
    (``repeat_kv``), its own ``W_O`` columns, and the energy counts the value mean."""
    gen = torch.Generator().manual_seed(7)
    heads, kv_heads, d, hidden = 4, 2, 4, 6

    def psd(n):
        a = torch.randn(n, n, generator=gen, dtype=torch.float64)
        return a @ a.T / n + 0.1 * torch.eye(n, dtype=torch.float64)

    res, cyy = psd(2 * kv_heads * d), psd(2 * kv_heads * d) * 3
    mean_y = torch.randn(2 * kv_heads * d, generator=gen, dtype=torch.float64)
    q2 = torch.rand(heads, d, generator=gen, dtype=torch.float64) * 2
    conc = torch.rand(heads, generator=gen, dtype=torch.float64)
    w_o = torch.randn(hidden, heads * d, generator=gen, dtype=torch.float64)
    t = layer_terms(0, res, cyy, mean_y, q2, conc, w_o, kv_heads=kv_heads, head_dim=d, rotary_dim=d)

    def rot_avg(v):  # channels i and i + d/2 share their mean (rotate_half pairing)
        return torch.cat([(v[:2] + v[2:]) / 2, (v[:2] + v[2:]) / 2])

    keys, values = res[:kv_heads * d, :kv_heads * d], res[kv_heads * d:, kv_heads * d:]
    cov_v, mean_v = cyy[kv_heads * d:, kv_heads * d:], mean_y[kv_heads * d:]
    key_terms, devs, energies = [], [], []
    for h in range(heads):
        g = h // (heads // kv_heads)
        block = slice(g * d, (g + 1) * d)
        gram = w_o[:, h * d:(h + 1) * d].T @ w_o[:, h * d:(h + 1) * d]
        key = float((rot_avg(q2[h]) * rot_avg(torch.diagonal(keys[block, block]))).sum() / d)
        spread = float(torch.trace(gram @ cov_v[block, block]))
        value = float(torch.trace(gram @ values[block, block]))
        energies.append(float(torch.trace(gram @ (cov_v[block, block] + torch.outer(mean_v[block], mean_v[block])))))
        key_terms.append(key)
        devs.append(float(conc[h]) * (key * spread + value))
    energy = sum(energies) / heads
    assert t.key_term == pytest.approx(sum(key_terms) / heads, rel=1e-10)
    assert t.energy == pytest.approx(energy, rel=1e-10)
    assert t.deviation == pytest.approx(sum(devs) / heads / energy, rel=1e-10)


def test_key_error_orthogonal_to_the_queries_costs_nothing_while_r2_drops():
    # the queries live on rotary pair (0,2); the key error on pair (1,3): invisible to every query at every position
    t = _layer([0.0, 5.0, 0.0, 5.0], 0.0, [1.0, 0.0, 1.0, 0.0])
    assert t.key_term == 0 and t.deviation == 0
    assert t.residual_fraction > 0.5  # the R^2 / residual baselines see a large error
    aligned = _layer([5.0, 0.0, 5.0, 0.0], 0.0, [1.0, 0.0, 1.0, 0.0])
    assert aligned.deviation > 0 and aligned.residual_fraction == t.residual_fraction


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_concentration_matches_the_models_attention_weights(arch, tiny_tokenizer):
    handle = ModelHandle("tiny", tiny_model(arch, seed=3), tiny_tokenizer)
    geo = handle.geometry
    text = "the cat sat on the mat and the dog ran in the park " * 3
    prompt = handle.format_prompt(text, "q")
    start, end = prompt.context_span
    with handle.capture_qk(queries=True, keys=True) as cap:
        out = handle.forward(prompt.input_ids[:end], output_attentions=True)
    positions = torch.arange(end)
    rows = torch.tensor([start + 3, end - 5, end - 1])
    for layer in range(geo.num_layers):
        cos, sin = rope_tables(geo.rope_for_layer(layer), positions)
        q, k = apply_rope(cap.query(layer)[0], cos, sin), apply_rope(cap.key(layer)[0], cos, sin)
        window = geo.sliding_window if layer in geo.sliding_layers else None
        got = attention_concentration(q, k, positions, rows, (start, end),
                                      float(handle._attention_modules()[layer].scaling), window)
        a = out.attentions[layer][:, rows, start:end].double()
        assert torch.allclose(got, (a * a).sum(-1).mean(-1), atol=1e-4), layer


def test_query_statistics_round_trip(tiny_tokenizer, tmp_path):
    handle = ModelHandle("tiny", tiny_model("qwen2", seed=4), tiny_tokenizer)
    stats = collect_query_statistics(handle, [("the cat sat on the mat " * 4, "q"), ("a dog ran " * 6, "q")],
                                     workload="w", progress=False)
    assert len(stats.q2) == handle.geometry.num_layers and stats.n_tokens > 0
    assert all(torch.all(c > 0) and torch.all(c <= 1) for c in stats.conc)
    stats.save(tmp_path / "q")
    from cachecert_agents.cti.queries import QueryStatistics

    back = QueryStatistics.load(tmp_path / "q", expect={"receiver_kv": handle.geometry.kv_fingerprint()})
    assert torch.equal(back.q2[1], stats.q2[1]) and math.isclose(back.n_tokens, stats.n_tokens)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_attention_outputs_match_the_models_attention_block(arch, tiny_tokenizer):
    from cachecert_agents.cti.attention_cosine import attention_outputs

    handle = ModelHandle("tiny", tiny_model(arch, seed=5), tiny_tokenizer)
    geo = handle.geometry
    ids = torch.arange(3, 30)
    attn = handle._attention_modules()
    seen = {}
    hooks = [a.register_forward_hook(lambda _m, _i, out, i=i: seen.__setitem__(i, out[0][0].detach()))
             for i, a in enumerate(attn)]
    with handle.capture_qk(queries=True, keys=True, values=True) as cap:
        handle.forward(ids)
    for h in hooks:
        h.remove()
    rows = torch.tensor([0, 9, 20, 26])
    positions = torch.arange(27)
    for layer in range(geo.num_layers):
        cos, sin = rope_tables(geo.rope_for_layer(layer), positions)
        q, k = apply_rope(cap.query(layer)[0], cos, sin), apply_rope(cap.key(layer)[0], cos, sin)
        window = geo.sliding_window if layer in geo.sliding_layers else None
        got = attention_outputs(q, k, cap.value(layer)[0], rows, float(attn[layer].scaling), window,
                                attn[layer].o_proj.weight.detach())
        assert torch.allclose(got, seen[layer][rows], atol=1e-5), layer


def test_attention_cosine_baseline_is_one_for_an_exact_map_and_lower_for_a_random_one(tiny_tokenizer):
    from cachecert_agents.cti.attention_cosine import attention_cosine_baseline
    from cachecert_agents.eval.workloads import Example
    from cachecert_agents.transfer.calibrate import collect_statistics
    from cachecert_agents.transfer.mappers import RidgeMapper

    sender = ModelHandle("tiny-a", tiny_model("llama", seed=0), tiny_tokenizer)
    receiver = ModelHandle("tiny-b", tiny_model("llama", seed=0), tiny_tokenizer)  # identical weights
    gen = torch.Generator().manual_seed(0)
    texts = [sender.tokenizer.decode(torch.randint(4, 320, (120,), generator=gen)) for _ in range(6)]
    stats = collect_statistics(sender, receiver, [(t, "q") for t in texts], [], progress=False)
    exact = RidgeMapper.fit(stats, rho=1e-7)
    ex = [Example(id="e", workload="w", context="the dog sat on the mat in the park", instruction="where did the dog sit",
                  references=["mat"], split="evaluation")]
    L = receiver.geometry.num_layers
    res = attention_cosine_baseline(sender, receiver, exact, ex, [1, L])
    assert min(res["per_layer"]) > 0.999 and res["predictions"][str(L)] > 0.999
    rand = attention_cosine_baseline(sender, receiver, exact.randomised(seed=1), ex, [0, 1, L])
    p = rand["predictions"]
    assert p["0"] == 1.0 and p[str(L)] < p["1"] < 1.0  # more mapped layers, lower prediction


def test_correlate_and_report_with_the_cosine_baseline_and_a_second_workload(tmp_path):
    from cachecert_agents.eval.cti_eval import correlate, spearman
    from cachecert_agents.eval.cti_report import write_cti_report

    def pred(sender, cti, cos):
        return {"sender": sender, "receiver": "r", "workload": "squad-long", "n_tokens": 10, "cti": cti,
                "worst_layer": 0, "profile": [{"layer": 0, "deviation": 0.1}],
                "splits": {"4": {"cti": cti, "residual_fraction": 0.5}},
                "baselines": {"r2": 0.5, "residual_fraction": 0.5,
                              "attention_cosine": {"n_examples": 2, "seconds": 1.0, "predictions": {"4": cos}}},
                "cost": {"index_s": 1.0}}

    preds = [pred("a", 1.0, 0.9), pred("b", 2.0, 0.8), pred("c", 3.0, 0.95)]
    rows = [{"sender": s, "receiver": "r", "workload": "hotpotqa", "method": "ridge-kv", "n": 50, "retention": ret}
            for s, ret in (("a", 0.1), ("b", 0.2), ("c", 0.3))]
    assert correlate(preds, rows)["points"] == []  # the index was computed on another workload: no match
    with pytest.raises(ValueError, match="NaN"):
        spearman([1.0, float("nan"), 2.0], [0.1, 0.9, 0.2])  # a NaN would otherwise rank as the best point
    out = correlate([dict(p, workload="hotpotqa") for p in preds], rows)
    c = out["correlations"]["pooled"]
    assert c["spearman_cti"] == pytest.approx(1.0) and c["spearman_attention_cosine"] == pytest.approx(0.5)
    assert c["n_points_pure_kv"] == 3 and c["spearman_cti_pure_kv"] == pytest.approx(1.0)
    # the agreement target ranks the same predictions against agreement, skipping rows that lack it
    matched = [dict(p, workload="hotpotqa") for p in preds]
    agreeing = [dict(r, agreement=a) for r, a in zip(rows, (0.6, 0.5, 0.4))]
    by_agreement = correlate(matched, agreeing, target="agreement")
    assert by_agreement["target"] == "agreement" and len(by_agreement["points"]) == 3
    assert by_agreement["correlations"]["pooled"]["spearman_cti"] == pytest.approx(-1.0)
    assert len(correlate(matched, agreeing[:2] + [rows[2]], target="agreement")["points"]) == 2
    with pytest.raises(ValueError, match="target"):
        correlate(preds, rows, target="f1")
    payload = {"command": "cachecert cti", "date": "d", "machine": "m",
               "results": {"pairs": preds, "retention": out, "statistics_workload": "squad-long",
                           "retention_workload": "hotpotqa"}}
    write_cti_report(payload, tmp_path / "cti_cross.md", tmp_path / "plots", lambda *a: "")
    text = (tmp_path / "cti_cross.md").read_text()
    assert "Cross-workload check" in text and "cti_cross_vs_retention.png" in text
    assert (tmp_path / "plots" / "cti_cross_vs_retention.png").exists()


def test_split_selection_ranks_a_pairs_methods_and_reports_the_pick(tmp_path):
    from cachecert_agents.eval.cti_eval import split_selection
    from cachecert_agents.eval.cti_report import write_cti_report

    def pt(method, retention, cti, res):
        return {"sender": "a", "receiver": "r", "workload": "hotpotqa", "method": method, "n": 30,
                "retention": retention, "agreement": 0.5, "cti": cti, "residual_fraction": res, "r2": 0.7,
                "attention_cosine": None}

    points = [pt("split@4", 0.9, 1.0, 0.5), pt("split@8", 0.6, 0.8, 0.7), pt("ridge-kv", 0.3, 0.9, 0.6),
              dict(pt("ridge-kv", 0.5, 0.5, 0.5), sender="b")]  # pair b has one method: no ranking
    sel = split_selection(points)
    (g,) = sel["groups"]
    assert g["measured_best"] == "split@4" and g["best_cti"] == "split@4" and g["best_residual_fraction"] == "split@8"
    assert g["spearman_cti"] == pytest.approx(0.5) and g["spearman_residual_fraction"] == pytest.approx(-0.5)
    assert "spearman_attention_cosine" not in g  # missing for some methods: not ranked
    assert sel["summary"] == {"n_groups": 1, "mean_spearman_cti": pytest.approx(0.5), "best_matches_cti": 1,
                              "mean_spearman_residual_fraction": pytest.approx(-0.5),
                              "best_matches_residual_fraction": 0}
    payload = {"command": "cachecert cti", "date": "d", "machine": "m",
               "results": {"pairs": [], "retention": {"points": points, "correlations": {},
                                                      "split_selection": sel}}}
    write_cti_report(payload, tmp_path / "cti.md", tmp_path / "plots", lambda *a: "")
    text = (tmp_path / "cti.md").read_text()
    assert "Picking a split from statistics alone" in text and "0.500 (split@4)" in text


def _twins_and_stats(tiny_tokenizer, splits):
    from cachecert_agents.transfer.calibrate import collect_statistics

    sender = ModelHandle("tiny-a", tiny_model("llama", seed=0), tiny_tokenizer)
    receiver = ModelHandle("tiny-b", tiny_model("llama", seed=1), tiny_tokenizer)  # different weights
    gen = torch.Generator().manual_seed(0)
    texts = [sender.tokenizer.decode(torch.randint(4, 320, (90,), generator=gen)) for _ in range(6)]
    stats = collect_statistics(sender, receiver, [(t, "q") for t in texts], splits, progress=False)
    return receiver, stats, texts


def test_propagation_without_noise_reproduces_the_receivers_own_keys_and_values(tiny_tokenizer):
    from cachecert_agents.cti.propagation import propagated_error_moments

    receiver, _, texts = _twins_and_stats(tiny_tokenizer, [])
    hidden = receiver.geometry.hidden_size
    zero = torch.zeros(hidden, hidden, dtype=torch.float64)
    moments, n_tokens, _ = propagated_error_moments(receiver, [(texts[0], "q")], {1: zero}, progress=False)
    L = receiver.geometry.num_layers
    assert sorted(moments[1]) == list(range(1, L)) and n_tokens > 0
    assert all(float(m.abs().max()) < 1e-9 for m in moments[1].values())  # the stubs and masks are exact


def test_propagated_error_scales_with_the_stream_noise_and_orders_splits(tiny_tokenizer):
    from cachecert_agents.cti.index import compute_cti
    from cachecert_agents.cti.propagation import propagated_error_moments

    receiver, stats, texts = _twins_and_stats(tiny_tokenizer, [1])
    hidden = receiver.geometry.hidden_size
    eye = torch.eye(hidden, dtype=torch.float64)
    small, _, _ = propagated_error_moments(receiver, [(texts[0], "q")], {1: 1e-6 * eye}, progress=False)
    double, _, _ = propagated_error_moments(receiver, [(texts[0], "q")], {1: 4e-6 * eye}, progress=False)
    ratio = torch.trace(double[1][1]) / torch.trace(small[1][1])
    assert 3.6 < float(ratio) < 4.4  # same noise draw at twice the scale: first order, error energy x4

    queries = collect_query_statistics(receiver, [(t, "q") for t in texts[:2]], progress=False)
    first_order = compute_cti(stats, queries, receiver)
    L = receiver.geometry.num_layers
    assert first_order["splits"]["1"]["propagated"] is False
    exact_stream = {1: {layer: torch.zeros_like(small[1][layer]) for layer in range(1, L)}}
    res = compute_cti(stats, queries, receiver, propagated=exact_stream)
    split = res["splits"]["1"]
    mapped_layer0 = res["profile"][0]["deviation"]
    assert split["propagated"] and math.isclose(split["predicted_deviation"], mapped_layer0 / L, rel_tol=1e-9)
    assert split["cti_first_order"] == first_order["splits"]["1"]["cti"]
    assert split["cti"] > res["cti"]  # an exact stream: only layer 0 is mapped, so the split beats pure KV


def _tiny_workload():
    return tiny_workload(["the cat sat on the mat and the dog ran in the park " * 3,
                          "a dog ran in the park where the cat sat on the mat " * 3,
                          "where did the cat sit the cat sat on the mat " * 3,
                          "the park had a dog and a cat and the mat " * 3,
                          "the mat was in the park and the cat sat there " * 3], n_calibration=4)


def test_cti_from_its_own_small_statistics_is_cached_and_costed(tiny_tokenizer, cache_home):
    from cachecert_agents.eval.cti_eval import pair_cti, small_cti_inputs

    sender = ModelHandle("tiny-a", tiny_model("llama", seed=0), tiny_tokenizer)
    receiver = ModelHandle("tiny-b", tiny_model("llama", seed=1), tiny_tokenizer)
    wl = _tiny_workload()
    inputs = small_cti_inputs(sender, receiver, wl, 2, n_propagation_contexts=1)
    stats = inputs.statistics
    assert stats.header["n_calibration_contexts"] == 2 and stats.header["collect_s"] > 0
    assert inputs.queries.header["n_contexts"] == 2 and inputs.seconds["propagation_s"] > 0
    assert "hidden:1" in stats.targets  # round(0.25 L) with L = 3: the split model has a stream to propagate
    again = small_cti_inputs(sender, receiver, wl, 2, n_propagation_contexts=1)
    assert again.seconds == {}  # everything loaded from the cache
    other_text = tiny_workload(["a bird sang in the tree by the river " * 3, *[e.context for e in wl.examples()][1:]],
                               n_calibration=4)
    assert small_cti_inputs(sender, receiver, other_text, 2, n_propagation_contexts=1).seconds  # recollected
    assert len(list((cache_home / "cti").glob("*__k2.stats.*.replaced-*"))) == 2  # the earlier ones kept aside
    small_cti_inputs(sender, receiver, wl, 2, n_propagation_contexts=1)  # back to the first text: recollected too
    assert torch.equal(again.statistics.targets["kv:0"].sum_y, stats.targets["kv:0"].sum_y)
    res = pair_cti("tiny-a", receiver, wl, n_propagation_contexts=1, inputs=inputs)
    assert res["statistics_contexts"] == 2 and res["splits"]["1"]["propagated"]
    assert res["cost"]["single_pass_s"] > 0 and res["cost"]["propagation_pass_s"] > 0
    cached = pair_cti("tiny-a", receiver, wl, n_propagation_contexts=1, inputs=again)
    assert cached["cost"]["propagation_pass_s"] is None and cached["splits"]["1"]["cti"] == res["splits"]["1"]["cti"]
    # the calibration (in-sample) residual: smaller, so a higher index; the R^2 baseline is the same either way
    in_sample = pair_cti("tiny-a", receiver, wl, n_propagation_contexts=1, gcv=False,
                         inputs=small_cti_inputs(sender, receiver, wl, 2, n_propagation_contexts=1, gcv=False))
    assert res["gcv"] and not in_sample["gcv"] and in_sample["cti"] > res["cti"]
    assert in_sample["baselines"]["r2"] == pytest.approx(res["baselines"]["r2"])
    assert in_sample["baselines"]["residual_fraction"] > res["baselines"]["residual_fraction"]
    with pytest.raises(FileNotFoundError, match="--statistics-contexts"):
        pair_cti("tiny-a", receiver, wl, n_query_contexts=2)  # no mapper statistics from `calibrate`
    with pytest.raises(ValueError, match="exceed the 2 contexts"):
        small_cti_inputs(sender, receiver, wl, 2, n_propagation_contexts=3)
    # statistics holding a NaN, or query moments all zero, give an error naming the layer, never a number
    from cachecert_agents.cti.index import compute_cti

    poisoned = stats.targets["kv:1"].yy.clone()
    poisoned[0, 0] = float("nan")
    stats.targets["kv:1"].yy = poisoned
    with pytest.raises(ValueError, match=r"layer\(s\) \[1\]"):
        compute_cti(stats, inputs.queries, receiver)
    again.queries.q2 = [torch.zeros_like(q) for q in again.queries.q2]
    again.queries.conc = [torch.zeros_like(c) for c in again.queries.conc]
    with pytest.raises(ValueError, match="unbounded"):
        compute_cti(again.statistics, again.queries, receiver)


def test_single_pass_equals_the_separate_passes(tiny_tokenizer):
    """The CTI's single pass (statistics with the queries recorded, clean targets reused by the propagation) gives
    the same moments, query statistics and propagated errors as the three separate passes on the same contexts."""
    from cachecert_agents.cti.index import stream_residuals
    from cachecert_agents.cti.propagation import propagated_error_moments
    from cachecert_agents.cti.single_pass import cti_inputs
    from cachecert_agents.transfer.calibrate import collect_statistics

    sender = ModelHandle("tiny-a", tiny_model("llama", seed=0), tiny_tokenizer)
    receiver = ModelHandle("tiny-b", tiny_model("llama", seed=1), tiny_tokenizer)
    pairs = [(e.context, e.instruction) for e in _tiny_workload().examples("calibration")][:3]
    one = cti_inputs(sender, receiver, pairs, [1], propagation_contexts=2, progress=False)
    stats = collect_statistics(sender, receiver, pairs, [1], progress=False)
    queries = collect_query_statistics(receiver, pairs, progress=False)
    moments, _, _ = propagated_error_moments(receiver, pairs[:2], stream_residuals(stats), progress=False)
    for name, t in stats.targets.items():
        assert torch.allclose(one.statistics.targets[name].xy, t.xy, rtol=1e-5, atol=1e-6), name
    assert one.statistics.n_tokens == stats.n_tokens
    for a, b in zip(one.queries.q2 + one.queries.conc, queries.q2 + queries.conc):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-8)
    for layer, m in moments[1].items():
        assert torch.allclose(one.propagated[1][layer], m, rtol=1e-3, atol=1e-9), layer
    assert set(one.seconds) == {"pass_s", "propagation_s"}


def test_single_pass_reads_the_floor_answers_without_changing_the_index_inputs(tiny_tokenizer, cache_home):
    """With the reference answers as continuations, the single pass's statistics and query statistics are those
    of the pass without them (the answers come after the context in a causal prefill), and their NLLs are
    :func:`answer_nll`'s; the likelihood floor built on them equals the one that measures everything itself.
    ``small_cti_inputs`` records them with the cached statistics and gives them back only for the same answers."""
    from cachecert_agents.cti.single_pass import cti_inputs
    from cachecert_agents.eval.cti_eval import small_cti_inputs
    from cachecert_agents.eval.receiver_floor import answer_nll, likelihood_floor, reference_continuations

    sender = ModelHandle("tiny-a", tiny_model("llama", seed=0), tiny_tokenizer)
    receiver = ModelHandle("tiny-b", tiny_model("llama", seed=1), tiny_tokenizer)
    wl = _tiny_workload()
    cal = wl.examples("calibration")[:3]
    pairs = [(e.context, e.instruction) for e in cal]
    plain = cti_inputs(sender, receiver, pairs, [1], propagation_contexts=1, progress=False)
    read = cti_inputs(sender, receiver, pairs, [1], propagation_contexts=1, progress=False,
                      continuations=reference_continuations(receiver, cal[:2]))
    assert plain.continuation_nll == [] and len(read.continuation_nll) == 2
    for name, t in plain.statistics.targets.items():
        assert torch.allclose(read.statistics.targets[name].xy, t.xy, rtol=1e-5, atol=1e-6), name
        assert torch.allclose(read.statistics.targets[name].yy, t.yy, rtol=1e-5, atol=1e-6), name
    for a, b in zip(read.queries.q2 + read.queries.conc, plain.queries.q2 + plain.queries.conc):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-9)
    for layer, m in plain.propagated[1].items():
        # the noise is drawn through the stream residual's eigenvectors, which rounding in the longer prefill
        # rotates a little: Monte-Carlo differences of ~1e-3, not a change of the inputs
        assert float((read.propagated[1][layer] - m).norm() / m.norm()) < 1e-3, layer
    for ex, nll in zip(cal, read.continuation_nll):
        assert nll == pytest.approx(answer_nll(receiver, ex.context, ex.instruction, ex.references[0]), rel=1e-5)
    fused = likelihood_floor(receiver, wl, 3, progress=False, with_context=read.continuation_nll)
    whole = likelihood_floor(receiver, wl, 3, progress=False)
    assert fused["n_from_pass"] == 2 and whole["n_from_pass"] == 0
    assert fused["floor"] == pytest.approx(whole["floor"], rel=1e-5)
    assert fused["nll_full"] == pytest.approx(whole["nll_full"], rel=1e-5)
    with pytest.raises(ValueError, match="3 continuations for 2 contexts"):
        cti_inputs(sender, receiver, pairs[:2], [1], progress=False,
                   continuations=reference_continuations(receiver, cal))

    first = small_cti_inputs(sender, receiver, wl, 2, n_propagation_contexts=1, floor_examples=3)
    assert len(first.continuation_nll) == 2  # min(floor examples, statistics contexts)
    assert first.statistics.header["reference_nll"]["ids"] == ["0", "1"]
    cached = small_cti_inputs(sender, receiver, wl, 2, n_propagation_contexts=1, floor_examples=1)
    assert cached.seconds == {} and cached.continuation_nll == first.continuation_nll[:1]

    class OtherAnswers(type(wl)):
        def examples(self, split=None, limit=None):
            return [e.model_copy(update={"references": ["park"]}) if e.id == "1" else e
                    for e in super().examples(split, limit)]

    cached = small_cti_inputs(sender, receiver, OtherAnswers(), 2, n_propagation_contexts=1, floor_examples=2)
    assert cached.seconds == {} and cached.continuation_nll == first.continuation_nll[:1]  # example 1's answer changed


def test_cti_cost_benchmark_times_both_routes(tiny_tokenizer, tmp_path):
    from cachecert_agents.eval.cti_cost import cti_cost

    sender = ModelHandle("tiny-a", tiny_model("llama", seed=0), tiny_tokenizer)
    receiver = ModelHandle("tiny-b", tiny_model("llama", seed=1), tiny_tokenizer)
    row = cti_cost(sender, receiver, _tiny_workload(), [1], statistics_contexts=1, propagation_contexts=1,
                   mapper_contexts=3, heldout_contexts=1, eval_examples=1,
                   extrapolate_to=(10,))
    c, m = row["cti"], row["mapper_route"]
    assert c["total_s"] > 0 and m["eval_s"] > 0 and m["methods_evaluated"] == 2
    assert 0 < row["ratio_cti_to_mapper_route"]["10"] < row["ratio_cti_to_mapper_route"]["1"]
    assert set(c["split_cti"]) == {"1", str(receiver.geometry.num_layers)}
    assert "floor" not in row and "ratio_cti_with_floor_to_mapper_route" not in row
    floored = cti_cost(sender, receiver, _tiny_workload(), [1], statistics_contexts=1, propagation_contexts=1,
                       mapper_contexts=3, heldout_contexts=1, eval_examples=1, extrapolate_to=(10,), floor_examples=2,
                       also_contexts=(2,))
    f = floored["floor"]
    assert f["examples"] == 2 and f["from_pass"] == 1 and f["floor_s"] > 0
    assert f["total_with_floor_s"] == pytest.approx(floored["cti"]["total_s"] + f["floor_s"])
    for n, r in floored["ratio_cti_to_mapper_route"].items():
        assert floored["ratio_cti_with_floor_to_mapper_route"][n] > r
    two = floored["cti_by_contexts"]["2"]
    assert two["statistics_contexts"] == 2 and two["statistics_tokens"] > floored["cti"]["statistics_tokens"]
    assert floored["ratio_by_contexts"]["2"]["10"] == pytest.approx(
        two["total_s"] / floored["cti"]["total_s"] * floored["ratio_cti_to_mapper_route"]["10"])
    from cachecert_agents.eval.cti_report import write_cti_cost_report

    write_cti_cost_report({"date": "d", "machine": "m",
                           "results": [dict(row, command="cachecert bench cti-cost"),
                                        dict(floored, command="cachecert bench cti-cost --floor-examples 2")]},
                          tmp_path / "cti_cost.md")
    text = (tmp_path / "cti_cost.md").read_text()
    assert "at n=1, " in text and "n=10 (extrapolated)" in text and "tiny-a -> tiny-b" in text
    assert "| tiny-a -> tiny-b | tiny | 2 (1) |" in text  # the floor's table: one row, the floored run
    assert text.count("| tiny-a -> tiny-b | tiny | 2 (") == 2  # and the table of other context counts
    with pytest.raises(ValueError, match="exceed"):
        cti_cost(sender, receiver, _tiny_workload(), [1], statistics_contexts=2, propagation_contexts=2,
                 mapper_contexts=3, heldout_contexts=1, also_contexts=(1,))
    with pytest.raises(ValueError, match="needs 9"):
        cti_cost(sender, receiver, _tiny_workload(), [1], mapper_contexts=5)


def test_pairs_with_mappers_lists_default_mappers_of_the_workload(cache_home):
    """What `cachecert cti --all` ranks: one entry per pair with a default mapper for the workload."""
    from cachecert_agents.eval.cti_eval import pairs_with_mappers

    mappers = cache_home / "mappers"
    mappers.mkdir(parents=True)
    for stem in ("a__b__hotpotqa", "a__b__hotpotqa__w13", "c__b__hotpotqa", "a__b__squad-long", "c__d__musique"):
        (mappers / f"{stem}.stats.json").write_text("{}")
    assert pairs_with_mappers("hotpotqa") == [("a", "b"), ("c", "b")]
    assert pairs_with_mappers("squad-long") == [("a", "b")]
    assert pairs_with_mappers("report") == []


def test_cti_results_merge_by_pair_and_refuse_other_settings():
    """``cachecert cti --out`` onto an earlier file keeps the pairs it did not compute, replaces the ones it did,
    and refuses a file computed with another residual (neither mixed nor lost)."""
    from cachecert_agents.cli import _merge_cti_pairs
    from cachecert_agents.errors import CacheCertError

    def pair(s, r, cti, gcv=True):
        return {"sender": s, "receiver": r, "statistics_workload": "hotpotqa", "cti": cti, "gcv": gcv, "rho": 0.01}

    old = [pair("a", "b", 0.5), pair("a", "c", 0.7)]
    merged = _merge_cti_pairs(old, [pair("a", "c", 0.9), pair("b", "c", 0.3)], "cti.json")
    assert {(p["sender"], p["receiver"]): p["cti"] for p in merged} == {("a", "b"): 0.5, ("a", "c"): 0.9,
                                                                        ("b", "c"): 0.3}
    assert all("command" in p for p in merged if p["cti"] != 0.5)
    with pytest.raises(CacheCertError, match="gcv"):
        _merge_cti_pairs(old, [pair("b", "c", 0.3, gcv=False)], "cti.json")


def test_cti_cli_refuses_what_it_cannot_do_before_any_work(tmp_path, cache_home, capsys):
    """``--propagation-contexts 0`` (the first-order split model) parses; ``--all`` with no mapper on the workload
    and the cross-workload check onto an existing results file are refused with one clear line."""
    from cachecert_agents.cli import build_parser, main

    assert build_parser().parse_args(["cti", "--all", "--propagation-contexts", "0"]).propagation_contexts == 0
    data = tmp_path / "none.json"
    assert main(["cti", "--all", "--workload", "hotpotqa", "--transfer", str(data)]) == 2
    assert "no pair has a mapper for hotpotqa" in capsys.readouterr().err
    out = tmp_path / "cti.json"
    out.write_text(json.dumps({"results": {"pairs": []}}))
    assert main(["cti", "--all", "--workload", "squad-long", "--retention-workload", "hotpotqa", "--out", str(out),
                 "--transfer", str(data)]) == 2
    assert "does not merge" in capsys.readouterr().err


def test_context_gain_measures_what_the_transfer_carries_above_the_no_context_floor():
    from cachecert_agents.eval.cti_eval import context_gain, correlate

    row = {"score_full": 0.5, "score_transfer": 0.3, "score_no_context": 0.1}
    assert context_gain(row) == pytest.approx(0.5)  # half the context's lift; retention would say 0.6
    assert context_gain(dict(row, score_transfer=0.1)) == pytest.approx(0.0)  # no better than no context
    assert context_gain(dict(row, score_transfer=0.05)) < 0
    assert context_gain(dict(row, score_no_context=0.49)) is None  # the context barely helps: ratio is noise
    assert context_gain(dict(row, score_no_context=0.6)) is None  # full prefill below no context
    assert context_gain({"score_full": 0.5}) is None
    # ranked against the gain, a receiver that answers well without the context no longer looks like a good pair
    preds = [{"sender": s, "receiver": "r", "workload": "musique", "cti": c, "splits": {"4": {"cti": c,
              "residual_fraction": 0.5}}, "baselines": {"r2": 0.5}} for s, c in (("a", 1.0), ("b", 2.0), ("c", 3.0))]
    rows = [{"sender": s, "receiver": "r", "workload": "musique", "method": "ridge-kv", "n": 50,
             "score_full": 0.2, "score_no_context": nc, "score_transfer": t, "retention": t / 0.2}
            for s, nc, t in (("a", 0.15, 0.15), ("b", 0.05, 0.06), ("c", 0.05, 0.18))]
    rows.append(dict(rows[0], sender="d", score_no_context=0.195))  # lift 0.005: skipped for the gain only
    preds.append(dict(preds[0], sender="d"))
    by_retention, by_gain = correlate(preds, rows), correlate(preds, rows, target="context_gain")
    assert len(by_retention["points"]) == 4 and len(by_gain["points"]) == 3
    assert by_gain["correlations"]["pooled"]["spearman_cti"] == pytest.approx(1.0)
    assert by_retention["correlations"]["pooled"]["spearman_cti"] < 1.0


def test_cti_floor_benchmark_takes_the_floor_from_one_half_and_retention_from_the_other(monkeypatch):
    """benchmarks/cti_floor.py: the floor (no-context / full) and retention never share questions when
    cross-fitted, so the noise of the shared ``score_full`` cannot correlate them."""
    import importlib
    from pathlib import Path

    import numpy as np

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    floor_module = importlib.import_module("cti_floor")
    full = np.array([1.0, 1.0, 0.5, 0.5])
    no_context = np.array([1.0, np.nan, 0.0, 0.0])
    assert floor_module._floor(no_context, full, np.arange(4)) == pytest.approx(1.0 / 2.0)  # id 1 has no answer
    assert np.isnan(floor_module._floor(no_context, np.zeros(4), np.arange(4)))

    def group(receiver, floor_a, cti, workload="musique"):
        # ids a0, a1 in half A carry the floor; b0, b1 in half B carry retention 0.2 + cti / 2
        ids = ["a0", "a1", "b0", "b1"]
        ret = 0.2 + cti / 2
        return {"receiver": receiver, "workload": workload, "ids": ids, "full": np.ones(4),
                "no_context": np.array([floor_a, floor_a, 0.0, 0.0]),
                "transfer": np.array([[0.0, 0.0, ret, ret]]),
                "points": [{"workload": workload, "pure_kv": True, "cti": cti}]}

    groups = [group("r1", 0.9, 0.1), group("r2", 0.5, 0.5), group("r3", 0.1, 0.9)]
    halves = {(r, "musique"): {"a0", "a1"} for r in ("r1", "r2", "r3")}
    ranked = floor_module._rank_all(groups, halves)["pooled"]
    assert ranked["n_points"] == 3 and ranked["cti"] == pytest.approx(1.0)
    assert ranked["floor"] == pytest.approx(-1.0)  # half A's floor, ranked against half B's retention
    assert ranked["floor_in_sample"] != ranked["floor_in_sample"]  # half B has floor 0 everywhere: constant, NaN
    # calibration-split floors rank against every question; a receiver without one is left out, and counted
    points = [{"receiver": r, "workload": "musique", "pure_kv": True, "cti": c, "retention": 0.2 + c / 2}
              for r, c in (("r1", 0.1), ("r2", 0.5), ("r3", 0.9), ("r4", 0.3))]
    ranked = floor_module._rank_with_calibration_floors(points, {("r1", "musique"): 0.9, ("r2", "musique"): 0.5,
                                                                 ("r3", "musique"): 0.1})
    assert ranked["points_without_floor"] == 1 and ranked["pooled"]["n_points"] == 3
    assert ranked["pooled"]["floor"] == pytest.approx(-1.0) and ranked["musique"]["cti"] == pytest.approx(1.0)


def test_suffix_statistics_benchmark_matches_the_index_proxy_and_the_models_attention(monkeypatch, tiny_tokenizer):
    """benchmarks/cti_suffix_queries.py: its context-row concentration is the library's own proxy (the same
    weights the query statistics sum), and its suffix-row mass and concentration are the model's own attention
    weights on the context at the suffix rows."""
    import importlib
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    bench = importlib.import_module("cti_suffix_queries")

    class Ex:
        context, instruction = "the cat sat on the mat " * 5, "where did the cat sit?"

    handle = ModelHandle("tiny", tiny_model("qwen2", seed=6), tiny_tokenizer)
    layers = bench.suffix_statistics(handle, [Ex()])
    proxy = collect_query_statistics(handle, [(Ex.context, Ex.instruction)], progress=False)
    assert len(layers) == handle.geometry.num_layers
    # the model's own (eager) attention weights at the suffix rows, summed over the context columns
    prompt = handle.format_prompt(Ex.context, Ex.instruction)
    start, end = prompt.context_span
    attentions = handle.forward(prompt.input_ids, output_attentions=True).attentions
    for layer, stats in enumerate(layers):
        assert torch.allclose(torch.tensor(stats["conc_context"], dtype=torch.float64), proxy.conc[layer], rtol=1e-6)
        a = attentions[layer][:, end:, start:end].double()  # [H, suffix rows, context]
        assert torch.allclose(torch.tensor(stats["mass_suffix"], dtype=torch.float64), a.sum(-1).mean(-1), atol=1e-4)
        assert torch.allclose(torch.tensor(stats["conc_suffix"], dtype=torch.float64), (a * a).sum(-1).mean(-1),
                              atol=1e-4)


def test_cti_refuses_the_floor_in_the_cross_workload_check(cache_home, tmp_path, capsys):
    """``cti --floor-examples`` with ``--retention-workload`` would adjust one workload's retention by the floor on
    another: refused before any model loads."""
    from cachecert_agents.cli import main

    assert main(["cti", "--all", "--workload", "squad-long", "--retention-workload", "hotpotqa", "--floor-examples",
                 "4", "--statistics-contexts", "4", "--out", str(tmp_path / "x.json")]) == 2
    assert "--floor-examples with --retention-workload" in capsys.readouterr().err


def test_cross_workload_benchmark_reads_the_index_of_the_named_text(monkeypatch):
    """benchmarks/cti_cross_workload.py: retention points of one workload carry the pair's index computed on
    the other workload's calibration text."""
    import importlib
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    bench = importlib.import_module("cti_cross_workload")

    def pair(workload, cti):
        return {"sender": "s", "receiver": "r", "workload": workload, "splits": {"4": {"cti": cti,
                "residual_fraction": 0.5}}, "baselines": {"r2": 0.5}}

    pairs = [pair("hotpotqa", 1.0), pair("musique", 2.0)]
    rows = [{"sender": "s", "receiver": "r", "workload": "musique", "method": "ridge-kv", "n": 10,
             "retention": 0.5, "score_full": 0.5, "score_no_context": 0.1, "score_transfer": 0.25}]
    (own,) = bench.points_from_text(pairs, rows, "musique", "musique")
    (other,) = bench.points_from_text(pairs, rows, "hotpotqa", "musique")
    assert own["cti"] == 2.0 and other["cti"] == 1.0 and other["workload"] == "musique"



def test_retention_predicted_with_the_floor_is_ranked_beside_the_cti():
    """``cti_eval.with_receiver_floor``: ``1 - (1 - f) x deviation`` for pure KV and every split, the floor's cost
    charged; ``correlate`` ranks it on the points that have it; a floor of another receiver or workload is
    refused."""
    from cachecert_agents.eval.cti_eval import correlate, predicted_retention, with_receiver_floor

    assert predicted_retention(0.5, 0.2) == pytest.approx(0.9)
    assert predicted_retention(1.0, 0.7) == 1.0  # a receiver that gains nothing from the context loses nothing
    assert predicted_retention(0.3, 0.0) == 1.0  # an exact transfer

    def pair(receiver, cti):
        return {"sender": "s", "receiver": receiver, "workload": "w", "cti": cti, "mean_deviation": 10 ** -cti,
                "cost": {"index_s": 1.0}, "splits": {"4": {"cti": cti, "predicted_deviation": 10 ** -cti,
                                                           "residual_fraction": 0.5}}, "baselines": {"r2": 0.5}}

    def floor(receiver, f):
        return {"receiver": receiver, "workload": "w", "measure": "likelihood", "n": 4, "floor": f, "p_full": 0.5,
                "p_no_context": 0.5 * f, "receiver_weights": "x"}

    # the CTI orders the receivers a < b < c; retention follows the floor (c's is lowest)
    pairs = [with_receiver_floor(pair("a", 0.6), floor("a", 0.9), 2.0),
             with_receiver_floor(pair("b", 0.7), floor("b", 0.5), 2.0),
             with_receiver_floor(pair("c", 0.8), floor("c", 0.1), 2.0)]
    assert pairs[1]["predicted_retention"] == pytest.approx(1 - 0.5 * 10 ** -0.7)
    assert pairs[1]["splits"]["4"]["predicted_retention"] == pairs[1]["predicted_retention"]
    assert pairs[1]["cost"] == {"index_s": 1.0, "floor_s": 2.0} and pairs[1]["receiver_floor"]["floor"] == 0.5
    assert pairs[0]["receiver_floor"]["workload"] == "w"
    rows = [{"sender": "s", "receiver": r, "workload": "w", "method": "ridge-kv", "n": 10, "retention": ret,
             "score_full": 1.0, "score_no_context": 0.1, "score_transfer": ret} for r, ret in
            (("a", 0.95), ("b", 0.8), ("c", 0.5))]
    corr = correlate(pairs, rows)["correlations"]["pooled"]
    assert corr["spearman_cti"] == pytest.approx(-1.0) and corr["spearman_predicted_retention"] == pytest.approx(1.0)
    assert corr["n_points_predicted_retention"] == 3
    assert "spearman_predicted_retention" not in correlate([pair("a", 0.6), pair("b", 0.7), pair("c", 0.8)],
                                                           rows)["correlations"]["pooled"]
    # a pair without the floor (e.g. merged from an earlier run) is left out of that figure only
    mixed = correlate(pairs[:2] + [pair("c", 0.8)], rows)["correlations"]["pooled"]
    assert mixed["n_points"] == 3 and mixed["n_points_predicted_retention"] == 2
    with pytest.raises(ValueError, match="does not belong"):
        with_receiver_floor(pair("a", 0.6), floor("b", 0.5), 1.0)
    with pytest.raises(ValueError, match="does not belong"):
        with_receiver_floor(pair("a", 0.6), dict(floor("a", 0.5), workload="other"), 1.0)


def test_likelihood_floor_benchmark_extends_a_floor_to_the_same_figures(monkeypatch, tiny_tokenizer):
    """benchmarks/cti_likelihood_floor.py --extend: a floor grown from 1 to 2 examples equals the floor measured on
    2 at once; a floor of other examples is refused."""
    import importlib
    from pathlib import Path

    from cachecert_agents.eval.receiver_floor import likelihood_floor
    from tests.conftest import tiny_workload

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    bench = importlib.import_module("cti_likelihood_floor")
    handle = ModelHandle("tiny", tiny_model("qwen2", seed=9), tiny_tokenizer)
    wl = tiny_workload(["the cat sat on the mat", "a cat on a mat", "evaluation only"], n_calibration=2)
    grown = bench.extend_floor(handle, wl, likelihood_floor(handle, wl, 1, progress=False), 2)
    whole = likelihood_floor(handle, wl, 2, progress=False)
    assert grown["ids"] == whole["ids"] and grown["nll_full"] == whole["nll_full"]
    assert grown["floor"] == pytest.approx(whole["floor"]) and grown["n"] == 2
    with pytest.raises(ValueError, match="not the workload's first"):
        bench.extend_floor(handle, wl, dict(whole, ids=["x", "y"]), 2)
