"""Figures of the diagnostics report (matplotlib, Agg backend: no display needed). Each returns the PNG path."""

from __future__ import annotations

import torch

from ..plotting import pyplot as _plt
from ..plotting import save_figure as _save


def _tensor(x) -> torch.Tensor:
    return torch.tensor([[float("nan") if v is None else v for v in row] for row in x]) if isinstance(x, list) else x


def angular_heatmap(D, path, title="") -> str:
    """Figure 5: x = start layer l, y = offset n, colour = d(h_l, h_{l+n})."""
    plt = _plt()
    D = _tensor(D)
    fig, ax = plt.subplots(figsize=(5, 4))
    im = ax.imshow(D[:, 1:].T.numpy(), origin="lower", aspect="auto", cmap="viridis", vmin=0, vmax=max(0.5, float(
        torch.nan_to_num(D, nan=0).max())), extent=(-0.5, D.shape[0] - 0.5, 0.5, D.shape[0] - 0.5))
    ax.set_xlabel("start layer l")
    ax.set_ylabel("offset n")
    ax.set_title(title or "angular distance d(h_l, h_{l+n})")
    fig.colorbar(im, ax=ax)
    return _save(fig, path)


def pair_map(S, path, title, xlabel, ylabel, threshold=None) -> str:
    """Figure 6b/d: a pairwise score map."""
    plt = _plt()
    S = _tensor(S)
    fig, ax = plt.subplots(figsize=(5, 4))
    im = ax.imshow(S.numpy(), origin="upper", cmap="magma", aspect="auto")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title + (f" (threshold {threshold})" if threshold is not None else ""))
    fig.colorbar(im, ax=ax)
    return _save(fig, path)


def pruning_and_lens(pruning: dict | None, lens: list | None, path, title="") -> str:
    """Figure 8: loss increase per removed layer (left) and LogitLens KL per layer (right)."""
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    if pruning:
        axes[0].bar(range(len(pruning["delta"])), pruning["delta"], color="tab:blue")
        axes[0].set_xlabel("removed layer")
        axes[0].set_ylabel("loss increase")
        axes[0].set_title("single-layer pruning")
    if lens:
        axes[1].plot(range(len(lens)), lens, marker="o", color="tab:red")
        axes[1].set_xlabel("layer boundary l")
        axes[1].set_ylabel("KL(p_final || p_l)")
        axes[1].set_title("LogitLens")
    if title:
        fig.suptitle(title)
    return _save(fig, path)


def path_weights(paths: dict, path, title="") -> str:
    """Figure 7 (and 10): w_{i->l} as a heatmap, plus the transport effective rank when present."""
    plt = _plt()
    M = _tensor(paths["matrix"])
    has_rank = "erank" in paths
    fig, axes = plt.subplots(1, 2 if has_rank else 1, figsize=(9 if has_rank else 5, 4))
    ax = axes[0] if has_rank else axes
    im = ax.imshow(M.numpy(), origin="upper", cmap="Blues", aspect="auto")
    ax.set_xlabel("source j (0 = embedding, i + 1 = sublayer i)")
    ax.set_ylabel("input of sublayer l")
    ax.set_title(title or f"residual-path weights ({paths.get('kind')})")
    fig.colorbar(im, ax=ax)
    if has_rank:
        axes[1].plot([float("nan") if v is None else v for v in paths["erank"]], marker=".")
        axes[1].set_xlabel("sublayer")
        axes[1].set_ylabel("effective rank of composed transport")
    return _save(fig, path)


def cost_bars(cost: dict, path, title="") -> str:
    """Figure 11 (one model): prefill FLOP components at the configured T."""
    plt = _plt()
    f = cost["prefill_flops"]
    keys = ["linear", "attention_causal", "lm_head", "extra_matmul", "extra_other"]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar(keys, [f[k] / 1e9 for k in keys], color="tab:green")
    ax.set_ylabel(f"GFLOPs per sequence (T={f['seq_len']})")
    ax.set_title(title or f"prefill FLOPs, {cost['design']}")
    ax.tick_params(axis="x", rotation=30)
    return _save(fig, path)


def overview(report: dict, path) -> str:
    """One figure with the four headline panels: angular heatmap, causal map, permutation map, pruning + lens."""
    plt = _plt()
    m = report["model"]
    fig, axes = plt.subplots(1, 4, figsize=(17, 3.6))
    if "angular" in report:
        D = _tensor(report["angular"]["matrix"])
        im = axes[0].imshow(D[:, 1:].T.numpy(), origin="lower", aspect="auto", cmap="viridis", vmin=0,
                            extent=(-0.5, D.shape[0] - 0.5, 0.5, D.shape[0] - 0.5))
        axes[0].set(xlabel="start layer l", ylabel="offset n", title="angular distance")
        fig.colorbar(im, ax=axes[0])
    for ax, key, label, ylab in ((axes[1], "causal", "R_causal", "skipped layer s"),
                                 (axes[2], "permutation", "R_perm", "layer")):
        if key in report:
            im = ax.imshow(_tensor(report[key]["scores"]).numpy(), cmap="magma", aspect="auto")
            r = report[key][label]
            ax.set(title=f"{key} ({label} = {'n/a' if r is None else f'{r:.2f}'})", xlabel="layer", ylabel=ylab)
            fig.colorbar(im, ax=ax)
    ax = axes[3]
    if "pruning" in report:
        ax.bar(range(len(report["pruning"]["delta"])), report["pruning"]["delta"], color="tab:blue", label="pruning dloss")
    if "logit_lens" in report:
        ax2 = ax.twinx()
        ax2.plot(report["logit_lens"]["kl"], color="tab:red", marker=".", label="LogitLens KL")
        ax2.set_ylabel("KL(p_final || p_l)", color="tab:red")
    ax.set(xlabel="layer", ylabel="loss increase when removed", title="pruning / LogitLens")
    fig.suptitle(f"{m['design']}  L={m['num_hidden_layers']}  d={m['hidden_size']}")
    fig.subplots_adjust(wspace=0.5)
    return _save(fig, path)
