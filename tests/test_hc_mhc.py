"""HC and mHC: reduction to Pre-LN at init (ARCHITECTURES.md section 7), Sinkhorn constraints, gradients,
float64 gradchecks of the residual operators, parameter roles and config validation."""

import pytest
import torch
from helpers import batch, tiny_config, tiny_model

import hf_depth
from hf_depth.models import functional as F
from hf_depth.models.design_hc import ROUTING_ROLES, HCConnection, MultiStreamConnection, routing_precision
from hf_depth.models.design_mhc import MHCConnection

MHC_INITS = ("uniform", "identity")


def with_pre_ln_weights(design: str, common: dict | None = None, **kw):
    """(Pre-LN model, ``design`` model carrying the Pre-LN branch weights, routing at its init)."""
    pre = tiny_model("pre_ln", **(common or {}))
    model = tiny_model(design, seed=1, **(common or {}), **kw)
    missing, unexpected = model.load_state_dict(pre.state_dict(), strict=False)
    assert not unexpected
    assert missing and all("_connection." in k for k in missing), missing
    return pre, model


def logits(model, x, mask):
    with torch.no_grad():
        return model(x, attention_mask=mask).logits


def routing_connections(model):
    return [c for layer in model.model.layers for c in layer.connections()]


# ------------------------------------------------------------------------------------- (a), (b) Pre-LN at init
@pytest.mark.parametrize("dynamic", [True, False])
def test_hc_mean_then_norm_equals_pre_ln_at_init(dynamic):
    pre, hc = with_pre_ln_weights("hc", hc_final_reduce="mean_then_norm", hc_dynamic=dynamic)
    x, mask = batch()
    torch.testing.assert_close(logits(hc, x, mask), logits(pre, x, mask), rtol=1e-5, atol=1e-5)
    # every layer boundary too: the collapsed view is the Pre-LN residual stream
    with torch.no_grad():
        hs_pre = pre(x, attention_mask=mask, output_hidden_states=True).hidden_states
        hs_hc = hc(x, attention_mask=mask, output_hidden_states=True).hidden_states
    for a, b in zip(hs_hc, hs_pre):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_hc_sum_of_normed_gives_n_times_pre_ln_logits():
    pre, hc = with_pre_ln_weights("hc", hc_final_reduce="sum_of_normed", hc_streams=3)
    x, mask = batch()
    torch.testing.assert_close(logits(hc, x, mask), 3 * logits(pre, x, mask), rtol=1e-5, atol=1e-5)


def test_hc_default_follows_depthbench():
    cfg = hf_depth.config_for("hc")
    assert (cfg.hc_streams, cfg.hc_final_reduce, cfg.hc_dynamic, cfg.hc_scale_output_init) == (
        4, "sum_of_normed", True, True)  # fmt: skip
    cfg = hf_depth.config_for("mhc")
    assert (cfg.mhc_streams, cfg.mhc_sinkhorn_iters, cfg.mhc_init, cfg.mhc_final_reduce) == (
        4, 20, "uniform", "mean_then_norm")  # fmt: skip


@pytest.mark.parametrize("design", ["hc", "mhc"])
def test_output_projections_init_divided_by_sqrt_n(design):
    pre, model = (
        tiny_model("pre_ln"),
        tiny_model(design, mhc_init="identity") if design == "mhc" else tiny_model(design),
    )
    # same seed and the same random draws in the same order (HC and mHC-identity routing inits are deterministic)
    for name, p in pre.named_parameters():
        q = model.get_parameter(name)
        factor = 0.5 if name.endswith(("o_proj.weight", "down_proj.weight")) else 1.0
        torch.testing.assert_close(q, factor * p, rtol=0, atol=0, msg=name)


def test_mhc_identity_init_close_to_pre_ln():
    """phi = 0 and +-8 biases: H_pre = sigmoid(+-8) only rescales the branch input (removed by the branch norm),
    H_res = Sinkhorn(+-8) has row sums 1 to fp32 precision, H_post = 1. Measured max |diff| 4.4e-7 on logits up
    to 0.40; the tolerance 1e-3 is the scale of sigmoid(-8) = 3.4e-4, the size of any leak the +-8 init allows."""
    pre, mhc = with_pre_ln_weights("mhc", mhc_init="identity")
    x, mask = batch()
    torch.testing.assert_close(logits(mhc, x, mask), logits(pre, x, mask), rtol=1e-3, atol=1e-3)


def test_mhc_uniform_init_with_zero_phi_equals_pre_ln():
    """H_pre = 1/2 reads x = 2h (sum 2, not 1): equal to Pre-LN up to the RMSNorm eps, which matters at the
    embedding's scale (rms ~0.02: eps 1e-6 moves the logits by ~2e-4), so both models use eps 1e-12 here."""
    common = {"rms_norm_eps": 1e-12}
    pre, mhc = with_pre_ln_weights("mhc", common, mhc_init="uniform", mhc_phi_init_std=0.0)
    x, mask = batch()
    torch.testing.assert_close(logits(mhc, x, mask), logits(pre, x, mask), rtol=1e-5, atol=1e-5)


def test_mhc_uniform_init_near_pre_ln():
    """Small random phi (N(0, 0.02^2), gates 0.01) lets the write weights H_post differ by ~1e-3 across
    streams, so the model is only near Pre-LN: relative RMS difference of the logits below 1e-2."""
    pre, mhc = with_pre_ln_weights("mhc", mhc_init="uniform")
    x, mask = batch()
    a, b = logits(mhc, x, mask), logits(pre, x, mask)
    assert not torch.equal(a, b)
    assert (a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt() < 1e-2


# ------------------------------------------------------------------------------------- (c) Sinkhorn constraints
def random_state(config, b=2, t=5, seed=0, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    return scale * torch.randn(b, t, config.mhc_streams, config.hidden_size, generator=g)


@pytest.mark.parametrize("mhc_init", MHC_INITS)
@pytest.mark.parametrize("autocast", [False, True])
def test_mhc_res_doubly_stochastic(mhc_init, autocast):
    cfg = tiny_config("mhc", mhc_init=mhc_init)
    conn = MHCConnection(cfg, 3)
    with torch.no_grad():  # larger routing weights than at init, so Sinkhorn has work to do
        conn.dynamic_phi.normal_(0, 0.02, generator=torch.Generator().manual_seed(1))
        conn.alpha_scale.fill_(3.0)
    H = random_state(cfg)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), torch.no_grad():
        conn.read(H, None)  # the model's path (records the token means for path_weights)
        with routing_precision(H):  # what read does around the coefficients
            pre, post, res = conn.coefficients(H)
    assert res.dtype == torch.float32 and pre.dtype == torch.float32
    assert res.std() > 0.05  # not trivially uniform
    ones = torch.ones(res.shape[:-1])
    torch.testing.assert_close(res.sum(-1), ones, rtol=0, atol=1e-5)
    torch.testing.assert_close(res.sum(-2), ones, rtol=0, atol=1e-5)
    assert ((pre > 0) & (pre < 1)).all() and ((post > 0) & (post < 2)).all()
    seen = conn.path_weights()
    torch.testing.assert_close(seen["res"].sum(-1), torch.ones(4), rtol=0, atol=1e-5)


def test_sinkhorn_20_iterations_is_approximate_for_peaked_logits():
    """Columns are exact (the last step), rows converge with the iterations: 20 suffice for logits of spread
    ~0.5 (rows within 1e-5), not for spread 2 (rows off by 2.7e-2 at 20, 1.6e-3 at 100, 3.2e-5 at 300 and
    3.6e-7 at 1000 iterations: measured on 1000 such matrices)."""
    z = 2.0 * torch.randn(200, 4, 4, generator=torch.Generator().manual_seed(0))
    for iters, row_tol in ((20, None), (300, 1e-4)):
        res = F.sinkhorn(z, iters)
        torch.testing.assert_close(res.sum(-2), torch.ones(200, 4), rtol=0, atol=1e-5)
        row_err = (res.sum(-1) - 1).abs().max()
        assert row_err > 1e-3 if row_tol is None else row_err < row_tol, (iters, row_err)
    res = F.sinkhorn(0.5 * z / 2.0, 20)
    torch.testing.assert_close(res.sum(-1), torch.ones(200, 4), rtol=0, atol=1e-5)


def test_mhc_routing_under_bf16_autocast_matches_fp32():
    cfg = tiny_config("mhc")
    conn = MHCConnection(cfg, 0)
    H = random_state(cfg)
    y = torch.randn(2, 5, cfg.hidden_size)
    with torch.no_grad():
        _, carry = conn.read(H, None)
        ref = conn.write(H, y, carry)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            x, carry = conn.read(H, None)
            out = conn.write(H, y, carry)
    assert x.dtype == torch.float32 and out.dtype == torch.float32  # the residual stays fp32 under AMP
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


def test_mhc_static_path_weights():
    model = tiny_model("mhc", mhc_init="identity")
    w = model.model.residual_path_weights()
    assert sorted(w) == list(range(2 * model.config.num_hidden_layers))
    for s, pw in w.items():
        assert pw["static_pre"].argmax().item() == s % 4 and pw["static_pre"].max() > 0.999
        torch.testing.assert_close(pw["static_res"], torch.eye(4), rtol=0, atol=1e-3)
        torch.testing.assert_close(pw["static_post"], torch.ones(4))
    uniform = tiny_model("mhc").model.residual_path_weights()[0]["static_res"]
    torch.testing.assert_close(uniform, torch.full((4, 4), 0.25))


def test_hc_static_path_weights_and_roles():
    model = tiny_model("hc")
    x, _ = batch()
    model(x)
    for s, pw in model.model.residual_path_weights().items():
        assert torch.equal(pw["static_pre"], torch.nn.functional.one_hot(torch.tensor(s % 4), 4).float())
        assert torch.equal(pw["static_res"], torch.eye(4)) and torch.equal(pw["static_post"], torch.ones(4))
        # at init the dynamic term is zero: the last-seen means equal the static parts
        for k in ("pre", "res", "post"):
            torch.testing.assert_close(pw[k], pw[f"static_{k}"])


@pytest.mark.parametrize("design,kw", [("hc", {}), ("hc", {"hc_dynamic": False}), ("mhc", {})])
def test_every_routing_parameter_has_a_role(design, kw):
    model = tiny_model(design, **kw)
    static = []
    for conn in routing_connections(model):
        assert isinstance(conn, MultiStreamConnection)
        own = dict(conn.named_parameters())
        roles = conn.parameter_roles()
        assert set(roles) == set(own) and set(roles.values()) <= set(ROUTING_ROLES)
        convention = {"routing_static": "static_{}", "routing_dynamic": "dynamic_{}", "routing_scale": "{}_scale"}
        for name, role in roles.items():  # the naming convention agrees with the declared role
            prefix, suffix = convention[role].split("{}")
            assert name.startswith(prefix) and name.endswith(suffix), (name, role)
        static += [own[n] for n, r in roles.items() if r == "routing_static"]
    expected = 4 if design == "hc" else 2  # static_alpha + static_beta (HC) / static_bias (mHC), per block (x2)
    assert len(static) == expected * model.config.num_hidden_layers


# ------------------------------------------------------------------------------------- (d) gradients
@pytest.mark.parametrize("design,kw", [("hc", {}), ("mhc", {"mhc_init": "uniform"}), ("mhc", {"mhc_init": "identity"})])
def test_gradients_reach_every_routing_parameter(design, kw):
    """At init every routing parameter gets a finite gradient; those that are not gated by a zero dynamic term
    (HC's gate scales multiply tanh(0) = 0, mHC-identity's gates multiply phi = 0) get a non-zero one at once,
    and after a single optimizer step none is zero: nothing is frozen."""
    model = tiny_model(design, **kw).train()
    x, _ = batch(left_pad=(0, 0, 0))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    gated = {"alpha_scale", "beta_scale"}
    for step in range(2):
        opt.zero_grad()
        model(x, labels=x).loss.backward()
        for conn in routing_connections(model):
            for name, p in conn.named_parameters():
                assert p.grad is not None and torch.isfinite(p.grad).all(), (conn.sublayer_idx, name)
                if step == 1 or name not in gated:
                    assert p.grad.abs().max() > 0, (step, conn.sublayer_idx, name)
        opt.step()


# ------------------------------------------------------------------------------------- (e) gradcheck, float64
def test_gradcheck_hc_operator():
    g = torch.Generator().manual_seed(0)
    n, d = 3, 5

    def r(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64, requires_grad=True)

    H, y = r(2, 2, n, d), r(2, 2, d)
    params = (r(n, n + 1), r(d, n + 1), r(()), r(n), r(d), r(()))

    def op(H, y, sa, da, asc, sb, db, bsc):
        A, beta = F.hc_coefficients(H, sa, da, asc, sb, db, bsc, eps=1e-8)
        x, mixed = F.hc_width(H, A)
        return x, F.hc_depth(mixed, beta, y)

    assert torch.autograd.gradcheck(op, (H, y, *params))


def test_gradcheck_mhc_operator():
    g = torch.Generator().manual_seed(0)
    n, d = 3, 4

    def r(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=g, dtype=torch.float64)).requires_grad_()

    H, y = r(2, 2, n, d), r(2, 2, d)
    phi, alpha, bias = r(n * d, n * n + 2 * n, scale=0.5), r(3), r(n * n + 2 * n)

    def op(H, y, phi, alpha, bias):
        pre, post, res = F.mhc_coefficients(H, phi, alpha, bias, iters=20, eps=1e-6)
        x, mixed = F.mhc_width(H, pre, res)
        return x, F.mhc_depth(mixed, post, y), res

    assert torch.autograd.gradcheck(op, (H, y, phi, alpha, bias))


@pytest.mark.parametrize("design", ["hc", "mhc"])
def test_gradcheck_connection_module(design):
    """The module path (read without a norm, then write) in float64, against all of its parameters."""
    streams = {f"{design}_streams": 3}
    cfg = tiny_config(design, hidden_size=4, num_attention_heads=1, num_key_value_heads=1, **streams)
    conn = (HCConnection if design == "hc" else MHCConnection)(cfg, 1).double()
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in conn.parameters():  # move off the init so every term is active
            p.add_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    names = [n for n, _ in conn.named_parameters()]
    wrapped = _ReadWrite(conn)
    H = torch.randn(1, 2, 3, 4, generator=g, dtype=torch.float64, requires_grad=True)
    y = torch.randn(1, 2, 4, generator=g, dtype=torch.float64, requires_grad=True)

    def op(H, y, *ps):
        return torch.func.functional_call(wrapped, {f"conn.{n}": p for n, p in zip(names, ps)}, (H, y))

    params = [p.detach().clone().requires_grad_() for p in conn.parameters()]
    assert torch.autograd.gradcheck(op, (H, y, *params))


class _ReadWrite(torch.nn.Module):
    def __init__(self, conn):
        super().__init__()
        self.conn = conn

    def forward(self, H, y):
        x, carry = self.conn.read(H, None)
        return x, self.conn.write(H, y, carry)


# ------------------------------------------------------------------------------------- checkpoints
@pytest.mark.parametrize("design", ["hc", "mhc"])
def test_trained_routing_survives_save_reload(design, tmp_path):
    """Loaded routing parameters are not overwritten by the init sweep (the init values would hide that)."""
    model = tiny_model(design)
    with torch.no_grad():
        for conn in routing_connections(model):
            for p in conn.parameters():
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(tmp_path)
    again = type(model).from_pretrained(tmp_path).eval()
    for (n, p), (m, q) in zip(model.named_parameters(), again.named_parameters()):
        assert n == m and torch.equal(p, q), n


# ------------------------------------------------------------------------------------- (f) config errors
@pytest.mark.parametrize(
    "design,field,value",
    [
        ("hc", "hc_streams", 0),
        ("hc", "hc_streams", 2.5),
        ("hc", "hc_dynamic", "yes"),
        ("hc", "hc_alpha_scale_init", -1.0),
        ("hc", "hc_beta_scale_init", "x"),
        ("hc", "hc_final_reduce", "sum"),
        ("hc", "hc_scale_output_init", 1),
        ("hc", "hc_norm_eps", 0.0),
        ("mhc", "mhc_streams", -4),
        ("mhc", "mhc_sinkhorn_iters", 0),
        ("mhc", "mhc_init", "zeros"),
        ("mhc", "mhc_gate_init", -0.01),
        ("mhc", "mhc_phi_init_std", None),
        ("mhc", "mhc_identity_logit", -8),
        ("mhc", "mhc_final_reduce", "mean"),
        ("mhc", "mhc_scale_output_init", "no"),
        ("mhc", "mhc_norm_eps", 2.0),
    ],
)
def test_config_errors_name_the_field(design, field, value):
    with pytest.raises(ValueError, match=f"`{field}`"):
        tiny_config(design, **{field: value})


def test_config_error_lists_allowed_values():
    with pytest.raises(ValueError, match="sum_of_normed.*mean_then_norm"):
        tiny_config("hc", hc_final_reduce="max")
    with pytest.raises(ValueError, match="uniform.*identity"):
        tiny_config("mhc", mhc_init="eye")


@pytest.mark.parametrize("mhc_init", MHC_INITS)
def test_mhc_model_under_bf16_autocast(mhc_init):
    """Whole model under bf16 autocast: the residual state stays fp32, every sublayer's H_res (token mean of the
    last forward) is doubly stochastic within 1e-5, and the logits stay near the fp32 ones."""
    model = tiny_model("mhc", mhc_init=mhc_init)
    x, mask = batch()
    ref = logits(model, x, mask)
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        out = model(x, attention_mask=mask, output_hidden_states=True)
    assert all(h.dtype == torch.float32 for h in out.hidden_states[:-1])
    for pw in model.model.residual_path_weights().values():
        torch.testing.assert_close(pw["res"].sum(-1), torch.ones(4), rtol=0, atol=1e-5)
        torch.testing.assert_close(pw["res"].sum(-2), torch.ones(4), rtol=0, atol=1e-5)
    low = out.logits.float()
    assert (low - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt() < 0.05
