"""Explicit residual-path weights w_{i->l} (DepthBench Figures 7, 9, 10): AttnRes mixing, HC/mHC transport.

A design with explicit paths returns them from ``model.model.residual_path_weights()`` as
``{sublayer_idx: {name: tensor}}`` (sublayer s = 2*layer + {0 attention, 1 FFN}; key ``2L`` = the final
aggregation, if any). Each tensor is either static (no token dims) or per token with leading ``[B, T]`` dims,
holding the values of the **last forward** (the diagnostics run one forward per calibration batch and read them
after it). Recognized formats:

* **AttnRes** (Full / Block): ``{"weights": [..., K]}``, the depth-softmax over K sources. Optional
  ``"members": [K, S + 1]``: which base sources each aggregation source sums (column 0 = embedding, column
  ``i + 1`` = output of sublayer ``i``; Block AttnRes: a block sum has ones on its sublayers). Without
  ``members``, ``K == s + 1`` means Full AttnRes order ``[embedding, out_0, ..., out_{s-1}]``.
* **hf_depth HC / mHC connections**: ``{"pre": [..., n], "res": [..., n, n], "post": [..., n]}`` with
  ``x = pre . H`` and ``H'_t = sum_s res[t, s] H_s + post_t y`` (``static_*`` copies are ignored) = the
  canonical transport below.
* **canonical transport** (what HC and mHC are converted to): ``{"read": [..., n], "mix": [..., n, n],
  "write": [..., n]}`` with ``x = read . H`` and ``H' = mix H + write y``; optional ``"init": [n]`` (embedding
  coefficient of each stream, default all ones: the embedding is replicated into every stream).

Anything else is reported raw (token-mean of each tensor) as ``"unmapped"``.

Outputs: ``matrix[l, j]`` = token-mean weight of source j (0 = embedding, i + 1 = sublayer i) in the input of
sublayer l. For transport designs this is the exact per-token effective transport
``read_l . mix_{l-1} ... mix_{i+1} write_i`` (and ``read_l . mix_{l-1} ... mix_0 init`` for the embedding),
averaged over tokens. ``erank`` is the entropy effective rank exp(H(sigma / sum sigma)) of the composed residual
transport ``mix_l ... mix_0`` after each sublayer (token-mean; Figure 10: HC 2.53-2.81, mHC 1.44-1.65 at 400M).
``dead_layers``: layers whose every sublayer puts at least ``threshold`` of its weight on the embedding
(Block AttnRes's dead zone, Figure 9: 2 / 5 / 8 layers at L = 16 / 24 / 32).
"""

from __future__ import annotations

import torch

from .common import as_batches, base_model, forward_states, num_layers, progress

DEAD_THRESHOLD = 0.9


def _tokens(t: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-token ``[B, T, ...]`` -> ``[N, ...]`` (real tokens only); static tensors get a leading 1."""
    t = t.detach().float()
    if t.dim() >= 2 and tuple(t.shape[:2]) == tuple(mask.shape):
        return t[mask]
    return t.unsqueeze(0)


def to_transport(w: dict) -> dict | None:
    """hf_depth HC / mHC or canonical path weights -> ``{"read", "mix", "write"[, "init"]}``; None if not a transport."""
    if {"read", "mix", "write"} <= w.keys():
        return w
    if {"pre", "res", "post"} <= w.keys():  # hf_depth's HC / mHC connections (token means of the last forward)
        return {"read": w["pre"], "mix": w["res"], "write": w["post"]}
    return None


def effective_rank(m: torch.Tensor) -> torch.Tensor:
    """Entropy effective rank exp(-sum p log p), p = singular values / their sum (Roy & Vetterli), per matrix."""
    s = torch.linalg.svdvals(m.double())
    p = s / s.sum(-1, keepdim=True).clamp_min(1e-300)
    ent = -(p * torch.log(p.clamp_min(1e-300))).sum(-1)
    return ent.exp()


class PathAccumulator:
    """Streams calibration batches; sums the per-token path matrices."""

    def __init__(self, num_sublayers: int):
        self.S = num_sublayers
        rows = self.S + 1  # sublayer inputs 0..S-1 and the final aggregation S
        self.matrix = torch.zeros(rows, self.S + 1, dtype=torch.float64)
        self.rows_count = torch.zeros(rows, dtype=torch.float64)
        self.erank = torch.zeros(self.S, dtype=torch.float64)
        self.erank_count = torch.zeros(self.S, dtype=torch.float64)
        self.raw: dict[int, dict[str, torch.Tensor]] = {}
        self.raw_count: dict[int, float] = {}
        self.kinds: set[str] = set()

    # -- one batch
    def add(self, weights: dict[int, dict[str, torch.Tensor]], mask: torch.Tensor) -> None:
        ntok = float(mask.sum())
        transport = {}
        for s, w in sorted(weights.items()):
            tw = {k: _tokens(v, mask) for k, v in w.items() if isinstance(v, torch.Tensor)}
            for k, v in tw.items():  # raw token means, whatever the format
                self.raw.setdefault(s, {})
                prev = self.raw[s].get(k)
                self.raw[s][k] = (v.sum(0) if v.shape[0] > 1 else v[0] * ntok) + (0 if prev is None else prev)
            self.raw_count[s] = self.raw_count.get(s, 0.0) + ntok
            if "weights" in tw:
                self._attnres(s, tw, ntok)
            elif (t := to_transport(tw)) is not None:
                transport[s] = t
            else:
                self.kinds.add("unmapped")
        if transport:
            self._transport(transport, ntok)

    def _attnres(self, s: int, w: dict, ntok: float) -> None:
        p = w["weights"]  # [N or 1, K]
        K = p.shape[-1]
        members = w.get("members")
        if members is not None:
            members = members.reshape(K, -1)[:, : self.S + 1]
        elif K == s + 1 and s <= self.S:
            members = torch.eye(K, self.S + 1)
        else:
            self.kinds.add("unmapped")
            return
        self.kinds.add("attnres")
        row = (p @ members.to(p))  # [N or 1, S + 1]
        row = row.sum(0) if row.shape[0] > 1 else row[0] * ntok
        self.matrix[min(s, self.S)] += row.double()
        self.rows_count[min(s, self.S)] += ntok

    def _transport(self, tr: dict[int, dict], ntok: float) -> None:
        self.kinds.add("transport")
        first = next(iter(tr.values()))
        n = first["read"].shape[-1]
        N = max(max(v.shape[0] for v in t.values()) for t in tr.values())
        init = first.get("init")
        init = torch.ones(N, n, dtype=torch.float64) if init is None else init.double().reshape(-1, n).expand(N, n)
        V = torch.zeros(N, n, self.S + 1, dtype=torch.float64)  # stream contents in terms of the sources
        V[:, :, 0] = init
        P = torch.eye(n, dtype=torch.float64).expand(N, n, n)  # composed residual transport
        scale = ntok if N == 1 else 1.0  # static weights stand for every token
        for s in range(self.S + 1):
            t = tr.get(s)
            if t is None:
                continue
            a = t["read"].double().expand(N, n)
            self.matrix[s] += torch.einsum("bn,bnj->bj", a, V).sum(0) * scale
            self.rows_count[s] += ntok
            if s == self.S or "mix" not in t:
                continue
            M = t["mix"].double().expand(N, n, n)
            V = torch.einsum("bts,bsj->btj", M, V)
            V[:, :, s + 1] += t["write"].double().expand(N, n)
            P = M @ P
            er = effective_rank(P)
            self.erank[s] += er.sum() * scale
            self.erank_count[s] += ntok

    # -- result
    def result(self, threshold: float = DEAD_THRESHOLD) -> dict | None:
        if not self.raw:
            return None
        seen = self.rows_count > 0
        matrix = torch.full_like(self.matrix, float("nan"))
        matrix[seen] = self.matrix[seen] / self.rows_count[seen, None]
        out = {
            "kind": "+".join(sorted(self.kinds)) or "unmapped",
            "matrix": matrix.float(),
            "raw": {
                str(s): {k: (v / self.raw_count[s]).tolist() for k, v in w.items()} for s, w in sorted(self.raw.items())
            },
        }
        if "attnres" in self.kinds:  # a fraction of a softmax: HC/mHC transport weights are not normalized
            out.update(dead_layers(matrix, threshold))
        if "transport" in self.kinds:
            er = torch.where(self.erank_count > 0, self.erank / self.erank_count.clamp_min(1), torch.nan)
            valid = er[~torch.isnan(er)]
            out["erank"] = er.tolist()
            out["erank_final"] = float(valid[-1]) if valid.numel() else float("nan")
            out["erank_mean"] = float(valid.mean()) if valid.numel() else float("nan")
        return out


def dead_layers(matrix: torch.Tensor, threshold: float = DEAD_THRESHOLD) -> dict:
    """Layers whose every sublayer puts >= ``threshold`` of its input weight on the embedding (column 0)."""
    S = matrix.shape[1] - 1
    emb = matrix[:S, 0]
    dead = [i for i in range(S // 2) if all(bool(emb[s] >= threshold) for s in (2 * i, 2 * i + 1))]
    lead = 0
    while lead in dead:
        lead += 1
    return {"dead_layers": len(dead), "dead_layer_list": dead, "leading_dead_layers": lead, "dead_threshold": threshold}


@torch.no_grad()
def residual_paths(model, batches, threshold: float = DEAD_THRESHOLD, show_progress: bool = True) -> dict | None:
    """Token-mean explicit path weights over the calibration data; ``None`` for designs with implicit paths
    (Pre-LN family, plain Llama)."""
    base = base_model(model)
    if not hasattr(base, "residual_path_weights"):
        return None
    acc = PathAccumulator(2 * num_layers(model))
    for b in progress(as_batches(batches), desc="path weights", enabled=show_progress):
        forward_states(model, b, states=False)
        w = base.residual_path_weights()
        if not w:
            return None
        acc.add(w, b.tokens)
    return acc.result(threshold)
