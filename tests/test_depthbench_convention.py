"""``convention="depthbench"`` diagnostics equal an independent DepthBench-style reference on every design.

The reference below is written from DepthBench's analysis code, repository keyu-wang-2002/DepthBench:

* ``analysis/depth_probes.py`` @ f807aa279d04ffd6d08bc3d9f2c3a97985a1e980: depth states (hooks on every block,
  HC/mHC streams concatenated ``_reshape_to_streams(...).flatten(-2)``, AttnRes boundary states replaced by the raw
  depth mix found by *query identity* in an intercepted ``fused_attnres``), ``skip_block`` (the block returns its
  input; AttnRes keeps the bank and turns the next boundary mix into the identity on its newest source; MoDA leaves
  zero depth slots), ``swap_blocks`` (the blocks' state dicts minus the AttnRes input mixer, plus the mixer of the
  block's output; the LNS ``ln_scale`` travels) and ``mean_lm_loss``;
* ``analysis/compute_causal_score.py`` @ f807aa27...: C(s, l) = mean_tokens |u'_l - u_l| / max(|u_l|, 1e-8);
  ``analysis/compute_permutation_score.py`` @ f807aa27...: P = |L_swap - L| / L;
* ``analysis/compute_causal_score.py`` @ d2f1ae7a0655b06f16c31effc7c7690bf7a70619 (``compute_global_causal_score``)
  and ``analysis/layer_score_utils.py`` @ 1b0e78bcf2bbacb1dc67c15c3ab4da8955a6930f
  (``compute_global_permutation_score``, 0.9^idx weights).

It shares nothing with ``hf_depth.diagnostics`` beyond the model: other hooks (it patches the depth-softmax op the
AttnRes module calls, as DepthBench patches ``fused_attnres``), state-dict copies instead of pointer swaps, numpy
aggregates.
"""

import contextlib
import math
import types

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import tiny_model

import hf_depth
from hf_depth.diagnostics import angular, causal, conventions, permutation, pruning
from hf_depth.diagnostics.common import as_batches
from hf_depth.diagnostics.report import run_diagnostics
from hf_depth.models import design_attnres
from hf_depth.models.design_attnres import AttnResStream
from hf_depth.models.design_hc import MultiStream
from hf_depth.models.design_hires import HiResStream
from hf_depth.models.design_moda import MoDAConnection

DESIGNS = sorted(hf_depth.DESIGNS)
L = 4
EXTRA = {"block_attnres": dict(attnres_block_size=3)}  # boundaries at sublayers 0, 3, 6: a mix of both kinds


def perturbed(design, seed=0):
    """A tiny model with every parameter moved off its init (non-trivial routing, queries, gates)."""
    model = tiny_model(design, seed=seed, num_hidden_layers=L, **EXTRA.get(design, {}))
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=g) * (p.std() if p.numel() > 1 and p.std() > 0 else 1.0))
    return model


def calib(seed=3, b=2, t=8):
    return torch.randint(2, 97, (b, t), generator=torch.Generator().manual_seed(seed))


# ----------------------------------------------------------------------------------------------- the reference
def family(model):
    stream = model.model.stream
    if isinstance(stream, AttnResStream):
        return "attnres"
    if isinstance(stream, MultiStream):
        return "hyper-connections"
    return "residual"


def layers(model):
    return model.model.layers


def attn_query(layer):
    agg = layer.attn_connection.aggregate if hasattr(layer.attn_connection, "aggregate") else None
    return None if agg is None else agg.query


def is_attn_boundary(model, idx):
    return (2 * idx) % model.config.attnres_block_sublayers == 0


def boundary_indices(model):
    return [i for i in range(1, L) if is_attn_boundary(model, i)] + [L]


def mix_query(model, idx):
    return model.model.stream.aggregate.query if idx == L else attn_query(layers(model)[idx])


@contextlib.contextmanager
def intercept_mix(interceptor):
    """Route every depth-softmax call of the AttnRes modules through ``interceptor(original, query, ...)``."""
    original = design_attnres.depth_aggregate

    def wrapped(query, gamma, sources, eps, stable=None):
        return interceptor(lambda q, g, s, e: original(q, g, s, e, stable), query, gamma, sources, eps)

    design_attnres.depth_aggregate = wrapped
    try:
        yield
    finally:
        design_attnres.depth_aggregate = original


def plain_output(out):
    return out[0] if isinstance(out, tuple) else out  # DepthBench ``normalize_layer_output``


def ref_states(model, ids):
    fam = family(model)
    states = [None] * (L + 1)
    hs = [layers(model)[0].register_forward_pre_hook(lambda m, a: states.__setitem__(0, a[0]))]
    for i, layer in enumerate(layers(model)):
        hs.append(layer.register_forward_hook(lambda m, a, o, i=i: states.__setitem__(i + 1, o)))
    mixes = {}
    with contextlib.ExitStack() as stack:
        if fam == "attnres":
            queries = {id(mix_query(model, i)): i for i in boundary_indices(model)}

            def capture(original, query, gamma, sources, eps):
                out = original(query, gamma, sources, eps)
                if id(query) in queries:
                    mixes[queries[id(query)]] = out[0]
                return out

            stack.enter_context(intercept_mix(capture))
        try:
            logits = model(input_ids=ids, use_cache=False).logits
        finally:
            for h in hs:
                h.remove()
    if fam == "attnres":
        states = [s[-1] for s in states]  # the block's h: the running partial sum, the last entry of our source tuple
        for i, m in mixes.items():
            states[i] = m
    elif fam == "hyper-connections":
        states = [s.reshape(*s.shape[:2], -1) for s in states]
    elif isinstance(model.model.stream, HiResStream):
        states = [s[1] for s in states]  # not in DepthBench: hf_depth measures HiRes's inner stream h
    else:
        states = [plain_output(s) for s in states]
    return logits, states


@contextlib.contextmanager
def ref_skip(model, idx):
    layer, fam = layers(model)[idx], family(model)
    if fam == "attnres":
        def skipped(self, state, *args, **kwargs):
            if self.attn_connection.aggregate is not None:
                self.attn_connection.aggregate(state)  # form the input mix, so z_idx is observed
            return state
    elif isinstance(layer.attn_connection, MoDAConnection):
        def skipped(self, state, *args, **kwargs):
            h, c = state[0], self.attn_connection
            zero = torch.zeros(h.shape[0], c.num_kv_heads, h.shape[1], c.head_dim, dtype=h.dtype)
            writes = 2 if idx < L - 1 else 1  # attention K/V, and the FFN's unless the last block
            return tuple(state) + (zero, zero) * writes
    else:
        def skipped(self, state, *args, **kwargs):
            return state
    with contextlib.ExitStack() as stack:
        if fam == "attnres":
            consumer = model.model.stream.aggregate.query if idx + 1 == L else (
                attn_query(layers(model)[idx + 1]) if is_attn_boundary(model, idx + 1) else None)
            if consumer is not None:
                def identity(original, query, gamma, sources, eps):
                    out = original(query, gamma, sources, eps)
                    return (sources[-1], out[1]) if query is consumer else out

                stack.enter_context(intercept_mix(identity))
        layer.forward = types.MethodType(skipped, layer)
        try:
            yield
        finally:
            del layer.forward


def ref_swap(model, i, j):
    fam = family(model)
    li, lj = layers(model)[i], layers(model)[j]
    si, sj = li.state_dict(), lj.state_dict()
    pairs = []
    for name, ti in si.items():
        if fam == "attnres" and name.startswith("attn_connection.aggregate."):
            continue
        tj = sj.get(name)
        if tj is not None and tj.shape == ti.shape:
            pairs.append((ti, tj))
    if fam == "attnres":
        def out_boundary(idx):
            agg = model.model.stream.aggregate if idx + 1 == L else layers(model)[idx + 1].attn_connection.aggregate
            return [agg.query, agg.key_norm.weight]

        pairs += list(zip(out_boundary(i), out_boundary(j)))
    with torch.no_grad():
        for a, b in pairs:
            tmp = a.detach().clone()
            a.data.copy_(b.data)
            b.data.copy_(tmp)
    for ca, cb in zip(li.connections(), lj.connections()):
        if hasattr(ca, "scale") and isinstance(ca.scale, float):  # LNS ``ln_scale``
            ca.scale, cb.scale = cb.scale, ca.scale


def ref_loss(model, ids):
    logits = model(input_ids=ids, use_cache=False).logits
    return float(F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1)))


def updates(states):
    flat = torch.stack([s.reshape(-1, s.shape[-1]).float() for s in states])
    return flat[1:] - flat[:-1]


def ref_causal(model, ids, eps=1e-8):
    _, states = ref_states(model, ids)
    base = updates(states)
    norm = torch.linalg.vector_norm(base, dim=-1).clamp_min(eps)
    m = torch.zeros(L, L, dtype=torch.float64)
    for s in range(L - 1):
        with ref_skip(model, s):
            _, sk = ref_states(model, ids)
        down = slice(s + 1, L)
        change = torch.linalg.vector_norm(updates(sk)[down] - base[down], dim=-1)
        m[s, down] = (change / norm[down]).mean(-1).double()
    m = m.numpy().astype(np.float32)
    m[np.tril_indices_from(m)] = np.nan
    return m


def ref_global_causal(m):
    n = m.shape[0]
    scores = [float(np.mean(m[s, s + 1:])) for s in range(n - 1)]
    return (1.0 / np.sqrt(n)) * (1.0 / n) * float(np.sum(scores))


def ref_global_perm(scores: dict, n: int):
    vals = list(scores.values())
    counts, sums = np.zeros(n), np.zeros(n)
    w = np.array([0.9**i for i in range(n)])
    for (a, b), v in scores.items():
        counts[a] += 1
        sums[a] += v * w[a]
        counts[b] += 1
        sums[b] += v * w[b]
    avg = [float(sums[i] / counts[i]) if counts[i] > 0 else 0.0 for i in range(n)]
    return float(np.mean(vals)), float(np.sum(vals) / (n * (n - 1) / 2)), float(np.mean(avg))


# ----------------------------------------------------------------------------------------------- the tests
@pytest.mark.parametrize("design", DESIGNS)
def test_depthbench_convention_equals_reference(design):
    model = perturbed(design)
    ids = calib()
    batches = [ids]
    with torch.no_grad():
        _, zs = ref_states(model, ids)
        ours = conventions.forward_states(model, as_batches([ids])[0], "depthbench")
        assert len(ours.states) == L + 1
        for a, b in zip(ours.states, zs):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        ref_m = ref_causal(model, ids)
        c = causal.causal_scores(model, batches, show_progress=False, convention="depthbench")
        np.testing.assert_allclose(c["scores"].numpy(), ref_m, rtol=1e-5, atol=1e-6)
        assert c["global_causal_score"] == pytest.approx(ref_global_causal(ref_m), rel=1e-5)
        # permutation: every pair, by state-dict copies
        base = ref_loss(model, ids)
        ref_p = {}
        for i in range(L):
            for j in range(i + 1, L):
                ref_swap(model, i, j)
                ref_p[(i, j)] = abs(ref_loss(model, ids) - base) / base
                ref_swap(model, i, j)  # swapping twice restores
        assert ref_loss(model, ids) == base
        p = permutation.permutation_scores(model, batches, show_progress=False, convention="depthbench")
        for (i, j), v in ref_p.items():
            assert float(p["scores"][i, j]) == pytest.approx(v, rel=1e-4, abs=2e-6), (i, j)  # fp32 losses ~4.6
        mean, normalized, weighted = ref_global_perm(ref_p, L)
        assert p["global_score_mean"] == pytest.approx(mean, rel=1e-4, abs=2e-6)
        assert p["global_score_normalized"] == pytest.approx(normalized, rel=1e-4, abs=2e-6)
        assert p["global_score_weighted"] == pytest.approx(weighted, rel=1e-4, abs=2e-6)
        # pruning (single-layer removal) with the same skip
        ref_skip_loss = []
        for s in range(L):
            with ref_skip(model, s):
                ref_skip_loss.append(ref_loss(model, ids))
        pr = pruning.pruning_curve(model, batches, show_progress=False, convention="depthbench")
        assert pr["skip_loss"] == pytest.approx(ref_skip_loss, rel=1e-5)
        # angular distance on the same states: d(z_l, z_{l+n})
        D = angular.angular_distance(model, batches, show_progress=False, convention="depthbench")
        u = [F.normalize(z.reshape(-1, z.shape[-1]).double(), dim=-1) for z in zs]
        for n in (1, 2):
            for i in range(L + 1 - n):
                ref = float(torch.acos((u[i] * u[i + n]).sum(-1).clamp(-1, 1)).mean() / math.pi)
                assert float(D[i, n]) == pytest.approx(ref, abs=1e-5), (i, n)


def test_depthbench_skip_is_identity_and_differs_from_branch_on_hc():
    """The issue's example: on HC with perturbed routing the two conventions give different causal maps, and a
    DepthBench-skipped block leaves the (concatenated) state unchanged."""
    model = perturbed("hc")
    ids = calib()
    b = as_batches([ids])[0]
    with conventions.skip_layer(model, 1, "depthbench"):
        f = conventions.forward_states(model, b, "depthbench")
    torch.testing.assert_close(f.states[2], f.states[1], rtol=0, atol=0)
    assert f.states[1].shape[-1] == model.config.hc_streams * model.config.hidden_size
    with conventions.skip_layer(model, 1, "branch"):
        g = conventions.forward_states(model, b, "branch")
    assert (g.states[2] - g.states[1]).abs().max() > 1e-4  # branch skip: the streams still mix
    db = causal.causal_scores(model, [ids], show_progress=False, convention="depthbench")["scores"]
    br = causal.causal_scores(model, [ids], show_progress=False, convention="branch")["scores"]
    assert np.nanmax(np.abs(db.numpy() - br.numpy())) > 1e-3


def test_lns_factor_travels_with_the_block_in_depthbench_swap_only():
    model = tiny_model("lns", num_hidden_layers=3)
    c0, c2 = model.model.layers[0].attn_connection, model.model.layers[2].attn_connection
    before = (c0.scale, c2.scale)
    with conventions.swap_layers(model, 0, 2, "depthbench"):
        assert (c0.scale, c2.scale) == before[::-1]
    with conventions.swap_layers(model, 0, 2, "branch"):
        assert (c0.scale, c2.scale) == before
    assert (c0.scale, c2.scale) == before


def test_report_records_convention_and_rejects_unknown():
    model = tiny_model("pre_ln", num_hidden_layers=3)
    rep = run_diagnostics(model, [calib()], measurements=("causal", "permutation"), show_progress=False)
    assert rep["convention"] == "depthbench"
    assert "global_causal_score" in rep["causal"] and "global_score_weighted" in rep["permutation"]
    with pytest.raises(ValueError, match="convention"):
        run_diagnostics(model, [calib()], measurements=("causal",), show_progress=False, convention="paper")


def _erank(m):
    s = torch.linalg.svdvals(m.double())
    p = s / s.sum(-1, keepdim=True)
    return torch.exp(-(p * torch.log(p.clamp_min(1e-300))).sum(-1))


@pytest.mark.parametrize("design", ["hc", "mhc"])
def test_effective_rank_is_per_token(design):
    """Figure 10: the composed residual transport mix_s ... mix_0 is formed token by token, then its effective rank
    averaged over real tokens (not the rank of a product of token-averaged matrices)."""
    from hf_depth.diagnostics import paths

    model = perturbed(design)
    with torch.no_grad():
        for layer in model.model.layers:  # strongly input-dependent routing
            for conn in layer.connections():
                for name, p in conn.named_parameters():
                    if "dynamic" in name:
                        p.normal_(0, 0.5, generator=torch.Generator().manual_seed(7))
                    if name in ("alpha_scale", "alpha_res_scale", "beta_scale"):
                        p.fill_(2.0)
    x = calib(b=2, t=6)
    mask = torch.ones_like(x)
    mask[0, :2] = 0
    res = paths.residual_paths(model, [(x, mask)], show_progress=False)
    with torch.no_grad():
        model(input_ids=x, attention_mask=mask, use_cache=False)
    mixes = [conn.path_weights() for layer in model.model.layers for conn in layer.connections()]
    tok = mask.bool()
    P = torch.eye(model.config.num_streams, dtype=torch.float64).expand(int(tok.sum()), -1, -1)
    Pm = torch.eye(model.config.num_streams, dtype=torch.float64)
    for s, w in enumerate(mixes):
        M = w["mix"].double()
        M = M[tok] if M.dim() == 4 else M.expand(P.shape)
        P = M @ P
        Pm = w["mix"].double().reshape(-1, *Pm.shape)[(tok.reshape(-1) if M.dim() == 3 else slice(None))].mean(0) @ Pm
        assert res["erank"][s] == pytest.approx(float(_erank(P).mean()), rel=1e-5), s
    assert abs(res["erank_final"] - float(_erank(Pm))) > 1e-3  # the token-averaged product is a different number


def test_model_card_section_names_the_convention(tmp_path):
    import json

    from hf_depth import hub

    (tmp_path / "diagnostics").mkdir()
    rep = {"convention": "depthbench", "causal": {"R_causal": 0.125, "global_causal_score": 0.03},
           "permutation": {"R_perm": 0.25, "global_score_weighted": 0.02}}
    (tmp_path / "diagnostics" / "report.json").write_text(json.dumps(rep))
    text = hub.diagnostics_section(tmp_path)
    assert "DepthBench's analysis conventions" in text and "| 0.0300 |" in text and "| 0.0200 |" in text
    rep["convention"] = "branch"
    (tmp_path / "diagnostics" / "report.json").write_text(json.dumps(rep))
    assert "not comparable" in hub.diagnostics_section(tmp_path)
