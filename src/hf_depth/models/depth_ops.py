"""Cross-layer operations whose saved activations stay linear in depth (AttnRes depth softmax, MoDA attention).

The plain autograd form of these designs keeps a stacked copy of every earlier source (AttnRes) or depth K/V
(MoDA) per sublayer, O(L^2) in all. Here:

* ``SourceBank``: the sources of one forward are copied once, when they are produced, into a preallocated
  ``[capacity, *shape]`` buffer; a consumer reads ``bank[:K]`` as a view (no copy). The bank writes through
  ``.data`` (own version counter), so the views that earlier sublayers saved stay valid: a slot is written once
  and never changed, which ``sync`` checks by identity (weak references) before handing out a view; any
  mismatch (a caller's own tuple, reentrant checkpointing, ``torch.compile``) falls back to a transient
  ``torch.stack`` with the same numerics.
* ``depth_aggregate`` / ``moda_attention``: ``autograd.Function`` s that save only the bank view (one storage
  for the whole forward), the parameters and the small inputs, through ``save_for_backward`` (so
  ``saved_tensors_hooks`` -- the activation counter, CPU offloading -- see everything), and recompute the
  normalized keys, logits and softmax in backward.

On CPU (fp32, outside ``torch.compile``) MoDA's depth part runs the native kernel of ``hf_depth.native`` (one pass
over each bank per direction; each slot's gradient summed once, by its first reader, from the consumers' records),
and AttnRes' softmax and weighted sum over the sources theirs (``native.agg_forward`` / ``agg_backward``, one pass
per token); the eager forms below are their fallback and reference.

Numerics: the same function as ``functional.depth_softmax`` / ``functional.moda_attention`` (fp32 inside);
gradients are the analytic ones, equal to autograd of the references up to fp32 rounding (tests compare both
at every design and several depths). The Triton depth-softmax kernel reads ``bank[:K]`` in place.
"""

from __future__ import annotations

import weakref

import torch

from . import dispatch

try:  # the native CPU kernels; a folder saved for trust_remote_code has no such package: the eager forms run
    from hf_depth import native
except ImportError:
    native = None
from .functional import (
    _ONE_PASS_MIN,
    _acc_dtype,
    _as,
    _masked_scores,
    depth_softmax,
    inv_rms,
    mix_streams,
    read_and_mix,
    write_streams,
)

_BANK_ATTR = "_hf_depth_bank"
#: AttnRes' native consumers per group of bank-gradient records (``SourceBank.records``): each slot's accumulator row
#: is read and written once per group instead of once per consumer, for this many [N, d] output gradients held
AGG_GROUP = 8


class SourceBank:
    """Write-once slots ``[capacity, *shape]`` holding copies of tensors produced during one forward."""

    def __init__(self, like: torch.Tensor, capacity: int, rms_eps: float | None = None):
        self.data = torch.empty((capacity, *like.shape), dtype=like.dtype, device=like.device)
        self._raw = self.data.data  # writes through here do not bump the version seen by saved views
        self.rms_eps = rms_eps
        # 1 / rms of every slot (fp32), computed once when the slot is written (AttnRes keys)
        self.rinv = None if rms_eps is None else torch.empty(
            (capacity, *like.shape[:-1]), dtype=_acc_dtype(like.dtype), device=like.device)
        self._rraw = None if self.rinv is None else self.rinv.data
        self.refs: list = [None] * capacity
        self.count = 0
        self.fresh = 0  # the first slot the last ``sync`` wrote (= its length when it wrote none)
        self._grad = None  # (graph task id, [capacity, *shape] gradient accumulator), see ``grad``
        self._records = None  # (graph task id, [(weights, x)] of the native MoDA consumers), see ``slot_grads``
        self.two: TwoPhase | None = None  # the consumers' static queries (AttnRes two-phase form), see ``TwoPhase``

    @staticmethod
    def enabled() -> bool:
        return not torch.compiler.is_compiling()

    @classmethod
    def attach(cls, holder: torch.Tensor, capacity: int, rms_eps: float | None = None) -> torch.Tensor:
        """``holder`` aliased with a fresh bank attached (the alias, not the caller's tensor, carries it)."""
        alias = holder.view(holder.shape)
        if cls.enabled():
            setattr(alias, _BANK_ATTR, cls(holder, capacity, rms_eps))
        return alias

    @staticmethod
    def of(holder: torch.Tensor) -> SourceBank | None:
        return getattr(holder, _BANK_ATTR, None) if SourceBank.enabled() else None

    def sync(self, tensors) -> torch.Tensor | None:
        """``bank[:K]`` holding ``tensors`` (written now where new), or None if a slot holds something else."""
        k = len(tensors)
        if k > len(self.refs):
            return None
        self.fresh = k
        for i in range(k):
            ref = self.refs[i]
            if ref is None:
                if i != self.count:
                    return None
                self._write(i, tensors[i])
                self.fresh = min(self.fresh, i)
            elif ref() is not tensors[i]:
                return None
        return self.data[:k]

    def grad(self, dtype: torch.dtype) -> torch.Tensor:
        """The gradient accumulator of the slots in the running backward (zeros when that backward first asks).

        Every consumer of ``bank[:K]`` adds its slot gradients here in place, and the *first* reader of a slot
        (the ``sync`` call that wrote it) hands the slot's total on as the source's gradient: its backward runs
        after every later consumer's, since each later sublayer reads (through sources or the running partial
        sum) the output that this reader feeds. Per-source gradient tensors and autograd's per-source
        accumulation -- O(L^2) fresh [B, T, d] buffers -- are never made."""
        task = torch._C._current_graph_task_id()
        if self._grad is None or self._grad[0] != task or self._grad[1].dtype != dtype:
            self._grad = (task, torch.zeros(self.data.shape, dtype=dtype, device=self.data.device))
        return self._grad[1]

    def records(self, grouped: bool = False):
        """The running backward's ``native.SlotGrads``: each native consumer leaves its (weights, x) there instead of
        adding ``weights[j] x`` into every slot j of ``grad`` (a read and a write of the bank per consumer), and
        ``slot_grads`` sums each slot for its first reader. MoDA keeps every record (each slot summed once);
        ``grouped`` (AttnRes, whose consumers' output gradients are not otherwise kept) adds each group of records
        into ``grad`` (fp32) in one pass, so at most a group is held, whatever the depth."""
        task = torch._C._current_graph_task_id()
        if self._records is None or self._records[0] != task:
            if grouped:  # the bank's rows as one [N, d] plane: B = H = 1, the tokens as T
                cap, d = self.data.shape[0], self.data.shape[-1]
                shape = (cap, 1, 1, self.data[0].numel() // d, d)
                recs = native.SlotGrads(shape, into=self.grad(torch.float32).view(shape), group=AGG_GROUP)
            else:
                recs = native.SlotGrads(self.data.shape)
            self._records = (task, recs)
        return self._records[1]

    def slot_grads(self, lo: int, hi: int, dtype: torch.dtype) -> torch.Tensor:
        """Slots [lo, hi)'s total gradient in the running backward: the native consumers' records (summed once)
        plus what eager consumers added into ``grad`` (``grad``'s own rows where the records add into it)."""
        task = torch._C._current_graph_task_id()
        recs = self._records[1] if self._records is not None and self._records[0] == task else None
        acc = self._grad[1][lo:hi] if self._grad is not None and self._grad[0] == task else None
        if recs is None:
            return self.grad(dtype)[lo:hi] if acc is None else acc
        if recs.into is not None:  # the records add into ``grad``: its own rows
            recs.grads(lo, hi)
            return acc
        out = recs.grads(lo, hi)
        return out if acc is None else out.add_(acc)

    def release_grad(self) -> None:
        self._grad = self._records = None
        if self.two is not None:
            self.two.release()

    def _write(self, i: int, t: torch.Tensor) -> None:
        if t.shape != self.data.shape[1:]:
            raise ValueError(f"bank slot shape {tuple(self.data.shape[1:])}, got {tuple(t.shape)}")
        # the native kernel writes the copy and each row's 1 / rms in one pass; else (or where it declines) the ops
        if self._rraw is None or not (_native_ok() and native.slot_write(t, self._raw, self._rraw, i, self.rms_eps)):
            with torch.no_grad():
                self._raw[i].copy_(t)
                if self._rraw is not None:
                    self._rraw[i] = _rinv(self._raw[i], self.rms_eps)
        self.refs[i] = weakref.ref(t)
        self.count = i + 1


def _rinv(v: torch.Tensor, eps: float) -> torch.Tensor:
    """1 / rms of the rows of v [..., d] in fp32, [...] (``functional.inv_rms``: no squared copy of v)."""
    return inv_rms(v.to(_acc_dtype(v.dtype)), eps).squeeze(-1)


def _native_ok() -> bool:
    """Whether the native CPU kernels (``hf_depth.native``) may run here: the package is importable (a folder saved
    for ``trust_remote_code`` has none) and ``torch.compile`` is not tracing (a ctypes call is opaque to it). Each
    op still declines the tensors it does not take."""
    return native is not None and SourceBank.enabled()


_ANY_AUTOCAST = getattr(torch._C, "_is_any_autocast_enabled", None)  # False: no autocast on, for any device


def _outside_autocast(x: torch.Tensor, fn, *args):
    """``fn(*args)`` with autocast off for ``x``'s device; in eager mode called directly where no autocast is on
    (entering an autocast context costs ~30 us on a cold cache, once per sublayer and op on the CPU path); under
    ``torch.compile`` always inside the context, which it traces."""
    if SourceBank.enabled() and _ANY_AUTOCAST is not None and not _ANY_AUTOCAST():
        return fn(*args)
    with torch.autocast(device_type=x.device.type, enabled=False):
        return fn(*args)


# --------------------------------------------------------------------------------------------- AttnRes
def _partial_logit(partial, qg, eps):
    """(P [N, d] in fp32, 1/rms(P) [N], z_P = r_P <qg, P> [N]) of the running partial sum; both [N] vectors are
    saved for backward (two floats per token), so the backward never re-reads P for them."""
    P = partial.reshape(-1, qg.shape[-1])
    Pa = _as(P, qg.dtype)
    rp = _rinv(P, eps)
    return Pa, rp, rp * (Pa @ qg)


def _slot_logits(qg, Va, r):
    """z [K, N] = r_k <qg, v_k> of the sources Va [K, N, d] (in qg's dtype) and their 1 / rms r [K, N]."""
    K, N, d = Va.shape
    return r * (Va.reshape(K * N, d) @ qg).view(K, N)


def _agg_softmax(qg, V, r, zp):
    """(logits, softmax, V in fp32) over V [K, N, d] (+ the partial's logit zp [N] as the last entry); fp32 math."""
    Va = _as(V, qg.dtype)
    z = _slot_logits(qg, Va, r)
    if zp is not None:
        z = torch.cat((z, zp.unsqueeze(0)))
    return z, torch.softmax(z, dim=0), Va


def _slot_dots(do, Va):
    """<do_n, v_kn> for every slot k and token n: [K, N] (a [K, N] view of one batched [1, d] @ [d, K] product
    per token, the product einsum would pick, without its dispatch)."""
    return torch.bmm(do.unsqueeze(1), Va.permute(1, 2, 0)).view(do.shape[0], Va.shape[0]).t()


def _logit_grads(p, do, Va, Pa):
    """dL/dz of the depth softmax p [K(+1), N] given the output gradient do [N, d]: softmax backward of the slot
    dots <do, v_k> (+ <do, P> of the partial Pa as the last row)."""
    dp = _slot_dots(do, Va)
    if Pa is not None:
        dp = torch.cat((dp, (do * Pa).sum(-1).unsqueeze(0)))
    return p * (dp - (p * dp).sum(0, keepdim=True))


def _partial_grad(do, p_last, dz_last, rp, zp, qg, Pa):
    """(gradient of the partial sum [N, d], a = dz r_P [N]) through its weight and its logit z_P = r_P <qg, P>:
    p_P do + a qg - (a z_P r_P / d) P. ``a @ Pa`` is the partial's part of the ``qg`` gradient."""
    a = dz_last * rp
    dpartial = do * p_last.unsqueeze(-1)
    dpartial.addcmul_(a.unsqueeze(-1), qg).addcmul_((a * zp * rp).unsqueeze(-1), Pa, value=-1.0 / Pa.shape[-1])
    return dpartial, a


#: at most this many tokens (decoding), ``_weighted_sum`` is one batched product per token (on CPU, 2x slower than
#: the K slot passes from ~64 tokens on, 7x faster at 2 tokens, where each of the K passes is its dispatch)
_FEW_TOKENS = 16


def _weighted_sum(p, Va, Pa):
    """sum_k p_k v_k (+ p_K P): one slot at a time, accumulated in place (einsum would copy V per token on CPU);
    for at most ``_FEW_TOKENS`` tokens (decoding), where K ops growing with depth would each cost their dispatch,
    one batched ``[1, K] @ [K, d]`` product per token instead."""
    K = Va.shape[0]
    if Va.shape[1] <= _FEW_TOKENS:
        out = torch.bmm(p[:K].t().unsqueeze(1), Va.transpose(0, 1)).squeeze(1)
        return out if Pa is None else out.addcmul_(p[K].unsqueeze(-1), Pa)
    pk, vk = p.unsqueeze(-1).unbind(0), Va.unbind(0)  # the slots as views, by one call each
    out = pk[0] * vk[0]
    for k in range(1, len(vk)):
        out.addcmul_(pk[k], vk[k])
    if Pa is not None:
        out.addcmul_(pk[-1], Pa)
    return out


def _aggregate(z, Va, partial, qg, eps):
    """The depth softmax's forward from the stable sources' logits z [K, N] (Va [K, N, d], in qg's dtype) and the
    running partial sum (its logit formed here): (out [N, d], p [N, S] token-major, r_P, z_P). On CPU in fp32 the
    native kernel (``native.agg_forward``: one pass per token); else, or where it does not take the tensors, the
    eager form (the reference)."""
    if _native_ok():
        fused = native.agg_forward(z, Va, None if partial is None else partial.reshape(-1, Va.shape[-1]), qg, eps)
        if fused is not None:
            return fused
    Pa = rp = zp = None
    if partial is not None:
        Pa, rp, zp = _partial_logit(partial, qg, eps)
        z = torch.cat((z, zp.unsqueeze(0)))
    p = torch.softmax(z, dim=0)
    return _weighted_sum(p, Va, Pa), p.t(), rp, zp


def _aggregate_outputs(ctx, saved, eps, bank, fresh, out, p):
    """What both depth-softmax Functions save and return: (out [..., d] in V's dtype, p [..., S]). ``saved``:
    (query, key weight, V, 1/rms of V, partial, its 1/rms, its logit); p [N, S]."""
    V = saved[2]
    lead, d = V.shape[1:-1], V.shape[-1]
    ctx.save_for_backward(*saved)  # the same tensors on both paths (a checkpointed recomputation may take either)
    ctx.eps, ctx.bank, ctx.fresh = eps, bank, fresh
    ctx.set_materialize_grads(False)  # p is not differentiable: no zero gradient is made for it
    p = p.reshape(*lead, -1)
    ctx.mark_non_differentiable(p)
    return out.to(V.dtype).view(*lead, d), p


class TwoPhase:
    """The static pseudo-queries of every consumer of a bank (Kimi AttnRes' two-phase form).

    ``qg`` [C, d] (fp32, in the graph): row c = query_c * key weight_c of consumer c (one per aggregation of the
    forward). A slot's logits against every consumer that reads it, r_i (qg @ v_i^T) [C', N], are one matmul done when
    the slot is written, so a sublayer's softmax reads its column of precomputed logits instead of a pass over all
    its sources. In backward each consumer writes its logits' gradient into row c of ``dz`` [C, capacity, N], and
    the slot's first reader (whose backward runs after every later consumer's, see ``SourceBank.grad``) turns its
    complete row into the slot's and the queries' gradients with two matmuls. The logits are a transient: held in
    forward until the last consumer (column C - 1) has read them, and rebuilt once per backward from the bank (one
    matmul per slot), never saved between forward and backward."""

    def __init__(self, bank: SourceBank, queries, key_weights, qg: torch.Tensor):
        # the bank's tensors, not the bank: the bank holds this object (no reference cycle, so both are freed by
        # reference counting with the graph, never left for the garbage collector)
        self.data, self.rinv = bank.data, bank.rinv
        self.queries, self.key_weights = tuple(queries), tuple(key_weights)
        self.cols = {id(q): c for c, q in enumerate(self.queries)}
        self.qg, self.qg_d = qg, qg.detach()
        self.qg_rows = self.qg_d.unbind(0)  # consumer c's query, a view each (one op per forward, not per sublayer)
        n = bank.data.shape[1:-1].numel()
        self.z_shape = (qg.shape[0], bank.data.shape[0], n)  # [C, capacity, N]: a consumer's column is contiguous
        self.z = torch.empty(self.z_shape, dtype=qg.dtype, device=qg.device)
        self.z_rows = self.z.unbind(0)
        self.writes: list[tuple[int, int, int]] = []  # (first slot, end, writer column) of every write
        self._task = None  # (graph task id, rebuilt logits, their gradients, the query gradient, and their rows)

    def column(self, query, key_weight) -> int | None:
        """The consumer column of (query, key weight), or None if they are not the ones the logits were made with."""
        c = self.cols.get(id(query))
        if c is None or self.queries[c] is not query:
            return None
        w = self.key_weights[c]
        if w is key_weight or (w is not None and key_weight is not None and torch.equal(w, key_weight)):
            return c
        return None

    def logits(self, lo: int, hi: int, col: int) -> torch.Tensor:
        """z of slots ``lo:hi``, written by consumer ``col``, against it and every later consumer (the ones that
        read them): [C - col, hi - lo, N] (fp32)."""
        V = self.data[lo:hi]
        d = V.shape[-1]
        Va = V.reshape(-1, d).to(self.qg_d.dtype)
        r = self.rinv[lo:hi].reshape(1, hi - lo, -1)
        return r * (self.qg_d[col:] @ Va.t()).view(-1, hi - lo, r.shape[-1])

    def write(self, lo: int, hi: int, col: int) -> None:
        """Consumer ``col`` wrote slots ``lo:hi``: their logits (columns ``col:``), computed now."""
        self.writes.append((lo, hi, col))
        self.z[col:, lo:hi] = self.logits(lo, hi, col)

    def backward_buffers(self) -> tuple:
        """(z rebuilt from the bank as in forward, zero logit gradients, zero ``qg`` gradient, and the consumers' rows
        of each of the three), once per graph task.
        Entries of a slot at columns before its writer's are never read (no earlier consumer reads it). Every
        consumer adds its part of the ``qg`` gradient in place; the first consumer, whose backward runs last (it
        writes slot 0, see ``SourceBank.grad``), returns the total: one gradient for autograd to pass on, not one
        [C, d] tensor per consumer."""
        task = torch._C._current_graph_task_id()
        if self._task is None or self._task[0] != task:
            z = torch.empty(self.z_shape, dtype=self.qg_d.dtype, device=self.qg_d.device)
            for lo, hi, col in self.writes:
                z[col:, lo:hi] = self.logits(lo, hi, col)
            bufs = (z, torch.zeros_like(z), torch.zeros_like(self.qg_d))
            self._task = (task, *bufs, *(b.unbind(0) for b in bufs))
        return self._task[1:]

    def release(self) -> None:
        self._task = None


_PLAIN = (torch.Tensor, torch.nn.Parameter)  # parameter types whose rows the two-phase form stacks (not sharded)


def attach_queries(holder: torch.Tensor, queries, key_weights) -> None:
    """Give the bank on ``holder`` the static queries of its consumers, in the order they read (two-phase form).

    Only when autograd records (training): without a backward, the per-sublayer logits cost the same."""
    bank = SourceBank.of(holder)
    if bank is None or bank.rinv is None or not torch.is_grad_enabled():
        return
    d, dev = holder.shape[-1], holder.device
    for t in (*queries, *(w for w in key_weights if w is not None)):
        if type(t) not in _PLAIN or t.shape != (d,) or t.device != dev:  # e.g. sharded parameters
            return
    acc = bank.rinv.dtype
    if all(w is not None for w in key_weights):  # one product of the stacked rows (one backward node, not one each)
        qg = _as(torch.stack(queries), acc) * _as(torch.stack(key_weights), acc)
    else:
        qg = torch.stack([_as(q, acc) if w is None else _as(q, acc) * _as(w, acc) for q, w in zip(queries, key_weights)])
    bank.two = TwoPhase(bank, queries, key_weights, qg)


class _TwoPhaseAggregate(torch.autograd.Function):
    """``_DepthAggregate`` with the slot logits precomputed by their writer (``TwoPhase``); saves the same tensors
    (a checkpointed recomputation may take either path)."""

    @staticmethod
    def forward(ctx, query, key_weight, qg, eps, V, r, partial, bank, two, col, *sources):
        K, d = V.shape[0], V.shape[-1]
        acc = qg.dtype
        fresh = bank.fresh
        if two.z is not None and fresh < K:  # this call wrote slots fresh..K-1: their logits, once
            two.write(fresh, K, col)
        Va = V.reshape(K, -1, d)
        Va = _as(Va, acc)
        qc = two.qg_rows[col]
        z = two.z_rows[col][:K] if two.z is not None else _slot_logits(qc, Va, r.reshape(K, -1))
        out, p, rp, zp = _aggregate(z, Va, partial, qc, eps)
        if col == len(two.queries) - 1:  # the last consumer has read them: not kept until backward
            two.z = two.z_rows = None
        ctx.two, ctx.col = two, col
        return _aggregate_outputs(ctx, (query, key_weight, V, r, partial, rp, zp), eps, bank, fresh, out, p)

    @staticmethod
    def backward(ctx, dout, _dp):
        _, _, V, r, partial, rp, zp = ctx.saved_tensors
        bank, two, col, fresh = ctx.bank, ctx.two, ctx.col, ctx.fresh
        K, d = V.shape[0], V.shape[-1]
        acc = two.qg_d.dtype
        Va = V.reshape(K, -1, d)
        Va = _as(Va, acc)
        Z, DZ, DQ, Zr, DZr, DQr = two.backward_buffers()
        qc = two.qg_rows[col]
        z = Zr[col][:K]
        Pa = None if partial is None else partial.reshape(-1, d).to(acc)
        fused = None
        if dout is not None and _native_ok():  # softmax, logit grads and the partial's gradient in one pass
            do = dout.reshape(-1, d).to(acc).contiguous()
            pw = Va.new_empty(K, Va.shape[1])  # the weights: their p_k do is summed by groups of consumers
            fused = native.agg_backward(z, Va, Pa, qc, rp, zp, do, DZr[col][:K], None, pw)
            if fused is not None:
                bank.records(grouped=True).add(pw.view(K, 1, 1, -1), do.view(1, 1, *do.shape))
        if fused is None:
            dV = bank.grad(acc)[:K].view(K, -1, d)
            if Pa is not None:
                z = torch.cat((z, zp.unsqueeze(0)))
            p = torch.softmax(z, dim=0)
            do = torch.zeros_like(Va[0]) if dout is None else dout.reshape(-1, d).to(acc)
            dz = _logit_grads(p, do, Va, Pa)
            DZr[col][:K] = dz[:K]
            dV.addcmul_(p[:K].unsqueeze(-1), do)
            # the running partial sum's own logit (read by this consumer only)
            fused = (None, None) if Pa is None else _partial_grad(do, p[K], dz[K], rp, zp, qc, Pa)
        dpartial, a = fused
        if Pa is not None:
            dpartial = dpartial.to(partial.dtype).view_as(partial)
            DQr[col].addmv_(Pa.t(), a)
        grads = ()
        if fresh < K:  # the slots this call wrote: every consumer's logit gradient (and p_k do) is in now
            rf = r.reshape(K, -1)[fresh:]
            dzs = DZ[col:, fresh:K]  # [C - col, n, N]: only this and later consumers read these slots
            A = dzs * rf  # d z / d v = r qg - (z r^2 / d) v
            B = -(dzs * Z[col:, fresh:K]).sum(0) * rf * rf / d
            A = A.reshape(A.shape[0], -1)
            dV = bank.slot_grads(fresh, K, acc).view(K - fresh, -1, d)
            dV.add_((A.t() @ two.qg_d[col:]).view(K - fresh, -1, d))
            dV.addcmul_(B.unsqueeze(-1), Va[fresh:])
            DQ[col:].addmm_(A, Va[fresh:].reshape(-1, d))
            grads = tuple(g.to(V.dtype) for g in dV.view(K - fresh, *V.shape[1:]).unbind(0))
        dqg = None
        if fresh == 0:  # the first consumer, the last backward of this graph task: the queries' whole gradient
            dqg = DQ
            bank.release_grad()
            two.release()
        return (None, None, dqg, None, None, None, dpartial, None, None, None, *grads)


class _DepthAggregate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key_weight, eps, V, r, partial, bank, *sources):
        K, d = V.shape[0], V.shape[-1]
        acc = _acc_dtype(V.dtype)
        qg = query.to(acc) if key_weight is None else query.to(acc) * key_weight.to(acc)
        Va = V.reshape(K, -1, d)
        Va = _as(Va, acc)
        out, p, rp, zp = _aggregate(_slot_logits(qg, Va, r.reshape(K, -1)), Va, partial, qg.contiguous(), eps)
        fresh = 0 if bank is None else bank.fresh
        return _aggregate_outputs(ctx, (query, key_weight, V, r, partial, rp, zp), eps, bank, fresh, out, p)

    @staticmethod
    def backward(ctx, dout, _dp):
        query, key_weight, V, r, partial, rp, zp = ctx.saved_tensors
        K, d = V.shape[0], V.shape[-1]
        acc = _acc_dtype(V.dtype)
        q32 = query.to(acc)
        g32 = None if key_weight is None else key_weight.to(acc)
        qg = q32 if g32 is None else q32 * g32
        Pa = None if partial is None else partial.reshape(-1, d).to(acc)
        rf = r.reshape(K, -1)
        z, p, Va = _agg_softmax(qg, V.reshape(K, -1, d), rf, zp)
        do = torch.zeros_like(Va[0]) if dout is None else dout.reshape(-1, d).to(acc)
        dz = _logit_grads(p, do, Va, Pa)
        a = dz[:K] * rf  # d z / d v = r qg - (z r^2 / d) v
        b = -(dz[:K] * z[:K] * rf * rf) / d
        bank = ctx.bank
        dV = bank.grad(acc)[:K].view(K, -1, d) if bank is not None else torch.zeros_like(Va)
        dV.addcmul_(p[:K].unsqueeze(-1), do)
        dV.addcmul_(a.unsqueeze(-1), qg)
        dV.addcmul_(b.unsqueeze(-1), Va)
        dqg = a.reshape(-1) @ Va.reshape(-1, d)
        dpartial = None
        if Pa is not None:
            dpartial, ap = _partial_grad(do, p[K], dz[K], rp, zp, qg, Pa)
            dqg = dqg + ap @ Pa
            dpartial = dpartial.to(partial.dtype).view_as(partial)
        dq = None if not ctx.needs_input_grad[0] else (dqg if g32 is None else dqg * g32).to(query.dtype)
        dw = None if key_weight is None or not ctx.needs_input_grad[1] else (dqg * q32).to(key_weight.dtype)
        # with a bank, only the slots this call wrote: their gradient is complete now (see ``SourceBank.grad``), with
        # what native consumers' records still hold
        if bank is not None:
            dV = bank.slot_grads(ctx.fresh, K, acc)
        dV = dV.view(K - ctx.fresh, *V.shape[1:])
        grads = tuple(g.to(V.dtype) for g in dV.unbind(0))
        if bank is not None and ctx.fresh == 0:
            bank.release_grad()
        return (dq, dw, None, None, None, dpartial, None, *grads)


def depth_aggregate(query: torch.Tensor, key_weight: torch.Tensor | None, sources, eps: float,
                    stable: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``functional.depth_softmax(query, key_weight, torch.stack(sources), eps)`` without the stacked copy.

    ``sources[:stable]`` never change after this call (they are read from the bank of ``sources[0]`` when it has
    one); ``sources[stable]`` (at most one more) is a running partial sum, read as is. Returns (out, p [..., S]).
    """
    stable = len(sources) if stable is None else stable
    fixed, rest = tuple(sources[:stable]), tuple(sources[stable:])
    if len(rest) > 1:
        raise ValueError(f"at most one partial source after the stable ones, got {len(rest)}")
    if not SourceBank.enabled() and not dispatch.use_triton(fixed[0]):
        # torch.compile without Triton (no bank: ``SourceBank.enabled``): the reference ops, which the compiler fuses
        # and AOTAutograd differentiates, traced whole (``fullgraph``) with and without grad
        return depth_softmax(query, key_weight, torch.stack(sources), eps)
    partial = rest[0] if rest else None
    bank = SourceBank.of(fixed[0])
    V = None if bank is None else bank.sync(fixed)
    if V is not None and bank.rms_eps == eps:
        r = bank.rinv[: len(fixed)]
    elif V is not None:
        r = _rinv(V, eps)
    else:
        bank = None
        V = torch.stack([s.detach() for s in fixed])
        r = _rinv(V, eps)
    two = None if bank is None else bank.two
    if two is not None and bank.rms_eps == eps and not dispatch.use_triton(V):
        col = two.column(query, key_weight)
        if col is not None:
            return _TwoPhaseAggregate.apply(query, key_weight, two.qg, eps, V, r, partial, bank, two, col,
                                            *fixed[bank.fresh:])  # the slots it wrote (SourceBank.grad)
    if two is not None and bank.fresh < len(fixed):  # slots without logits: no later call may take the two-phase path
        bank.two = None
    if dispatch.use_triton(V):
        return _triton_aggregate(query, key_weight, V, partial, eps, fixed)
    first = 0 if bank is None else bank.fresh  # inputs: the sources whose gradient this call hands on (SourceBank.grad)
    return _DepthAggregate.apply(query, key_weight, eps, V, r, partial, bank, *fixed[first:])


class _TritonAggregate(torch.autograd.Function):
    """Triton depth softmax on ``V`` read in place (no partial): saves V, query, weight; recomputes p in backward."""

    @staticmethod
    def forward(ctx, query, key_weight, eps, V, *sources):
        k = _triton_ops()
        S, d = V.shape[0], V.shape[-1]
        out, p = k.depth_softmax_fwd(query.contiguous(), None if key_weight is None else key_weight.contiguous(),
                                     V.reshape(S, -1, d), eps)
        ctx.save_for_backward(query, key_weight, V)
        ctx.eps, ctx.n_sources = eps, len(sources)
        p = p.view(*V.shape[1:-1], S)
        ctx.mark_non_differentiable(p)
        return out.view(V.shape[1:]), p

    @staticmethod
    def backward(ctx, dout, _dp):
        k = _triton_ops()
        query, key_weight, V = ctx.saved_tensors
        S, d = V.shape[0], V.shape[-1]
        q, w, Vf = query.contiguous(), None if key_weight is None else key_weight.contiguous(), V.reshape(S, -1, d)
        out, p = k.depth_softmax_fwd(q, w, Vf, ctx.eps)  # recomputed: p is not kept between forward and backward
        dp = torch.zeros_like(p)
        dv, dq, dw = k.depth_softmax_bwd(dout.reshape(-1, d).contiguous(), dp, q, w, Vf, out, p, ctx.eps)
        dv = dv.view(V.shape)
        return (dq.to(query.dtype), None if key_weight is None else dw.to(key_weight.dtype), None, None,
                *(dv[i] for i in range(ctx.n_sources)))


def _triton_ops():
    """``torch.ops.hf_depth`` with the depth-softmax kernels registered (loads their module once)."""
    dispatch._kernels().depth_softmax  # noqa: B018  (imports kernels/depth_softmax_op.py, which registers them)
    return torch.ops.hf_depth


def _triton_aggregate(query, key_weight, V, partial, eps, fixed):
    if partial is not None:  # the running partial sum changes every sublayer: one transient slot next to the bank
        V = torch.cat((V, partial.detach().unsqueeze(0)))
        fixed = (*fixed, partial)
    return _TritonAggregate.apply(query, key_weight, eps, V, *fixed)


# --------------------------------------------------------------------------------------------- MoDA
def _moda_probs(q, kr, mask, scaling, dk, depth_mask, low):
    """fp32 scores over [sequence | depth] and their softmax, as ``functional._moda_attention``.

    Returns (p, Tk, the bool mask whose False entries get no gradient (masked_fill) or None).
    """
    scores, mask = _masked_scores(q, kr, mask, scaling, low)
    tk = scores.shape[-1]
    if dk is None:
        return torch.softmax(scores, dim=-1), tk, mask
    depth_scores = ((q.unsqueeze(0) * dk).sum(-1) * scaling).movedim(0, -1)
    if depth_mask is not None:
        depth_scores = depth_scores.masked_fill(~depth_mask.to(torch.bool), low)
    return torch.softmax(torch.cat((scores, depth_scores), dim=-1), dim=-1), tk, mask


def _rep(x: torch.Tensor | None, n_rep: int, dim: int, acc: torch.dtype) -> torch.Tensor | None:
    """``x.repeat_interleave(n_rep, dim).to(acc)`` without the copies when they are no-ops (MHA, fp32)."""
    if x is None:
        return None
    return (x if n_rep == 1 else x.repeat_interleave(n_rep, dim=dim)).to(acc)


def _depth_mix(w: torch.Tensor, dv: torch.Tensor) -> torch.Tensor:
    """sum_s w[..., s] dv[s] for w [B, H, T, D] and dv [D, B, H, T, hd]: one batched [1, D] @ [D, hd] per token
    (the broadcast product would write a [D, B, H, T, hd] temporary)."""
    return (w.unsqueeze(-2) @ dv.permute(1, 2, 3, 0, 4)).squeeze(-2)


def _group_sum(x: torch.Tensor, n_rep: int, dim: int) -> torch.Tensor:
    """Inverse of ``repeat_interleave(n_rep, dim)`` for gradients: sum each group of ``n_rep`` heads."""
    if n_rep == 1:
        return x
    shape = x.shape
    return x.reshape(*shape[:dim], shape[dim] // n_rep, n_rep, *shape[dim + 1:]).sum(dim + 1)


class _MoDAAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, mask, scaling, depth_mask, dk, dv, banks, *depth):
        acc = _acc_dtype(query.dtype)
        n_rep = query.shape[1] // key.shape[1]
        low = torch.finfo(acc).min
        q = query.to(acc)
        kr = _rep(key, n_rep, 1, acc)
        dkr = _rep(dk, n_rep, 2, acc)
        p, tk, _ = _moda_probs(q, kr, mask, scaling, dkr, depth_mask, low)
        out = p[..., :tk] @ _rep(value, n_rep, 1, acc)
        if dk is not None:
            out = out + _depth_mix(p[..., tk:], _rep(dv, n_rep, 2, acc))
        ctx.save_for_backward(query, key, value, mask, depth_mask, dk, dv)
        ctx.scaling = scaling
        _keep_banks(ctx, banks)
        return out.transpose(1, 2).to(query.dtype)

    @staticmethod
    def backward(ctx, dout):
        query, key, value, mask, depth_mask, dk, dv = ctx.saved_tensors
        acc = _acc_dtype(query.dtype)
        n_rep = query.shape[1] // key.shape[1]
        q = query.to(acc)
        kr, vr = _rep(key, n_rep, 1, acc), _rep(value, n_rep, 1, acc)
        dkr, dvr = _rep(dk, n_rep, 2, acc), _rep(dv, n_rep, 2, acc)
        p, tk, keep = _moda_probs(q, kr, mask, ctx.scaling, dkr, depth_mask, torch.finfo(acc).min)
        do = dout.transpose(1, 2).to(acc)  # [B, H, T, hd]
        dp = do @ vr.transpose(-1, -2)
        if dk is not None:
            dp = torch.cat((dp, (do.unsqueeze(0) * dvr).sum(-1).movedim(0, -1)), dim=-1)
        ds = p * (dp - (p * dp).sum(-1, keepdim=True)) * ctx.scaling
        dseq = ds[..., :tk]
        if keep is not None:  # masked_fill passes no gradient to masked scores (fully masked padding rows)
            dseq = dseq.masked_fill(~keep, 0.0)
        dq = dseq @ kr
        dkey = _group_sum(dseq.transpose(-1, -2) @ q, n_rep, 1).to(key.dtype)
        dvalue = _group_sum(p[..., :tk].transpose(-1, -2) @ do, n_rep, 1).to(value.dtype)
        grads = ()
        if dk is not None:
            dd = ds[..., tk:]
            if depth_mask is not None:
                dd = dd.masked_fill(~depth_mask.to(torch.bool), 0.0)
            dq = dq + _depth_mix(dd, dkr)
            dd = dd.movedim(-1, 0).unsqueeze(-1)  # [D, B, H, T, 1]
            pd = p[..., tk:].movedim(-1, 0).unsqueeze(-1)  # [D, B, H, T, 1]
            grads = _moda_depth_grads(ctx, dk, dv, acc, _depth_grads_adder(dd, q, pd, do, n_rep))
        return (dq.to(query.dtype), dkey, dvalue, None, None, None, None, None, None, *grads)


def _depth_grads_adder(dd, q, pd, do, n_rep):
    """The eager accumulation of the depth slots' gradients: gK += dd q, gV += p dO (dd, p as [D, B, H, T, 1])."""

    def add(Gk, Gv):
        if n_rep == 1:
            Gk.addcmul_(dd, q.unsqueeze(0))
            Gv.addcmul_(pd, do.unsqueeze(0))
        else:
            Gk.add_(_group_sum(dd * q.unsqueeze(0), n_rep, 2))
            Gv.add_(_group_sum(pd * do.unsqueeze(0), n_rep, 2))

    return add


def _keep_banks(ctx, banks) -> None:
    """Keep on ``ctx`` the banks a MoDA consumer read and the slots it wrote (``moda_attention``'s inputs)."""
    ctx.banks = banks
    ctx.fresh = None if banks is None else (banks[0].fresh, banks[1].fresh)


def _moda_depth_grads(ctx, dk, dv, acc, add=None, records=None) -> tuple:
    """The gradients of the depth tensors the consumer was handed (``moda_attention``): with banks, (dK_i, dV_i)
    of the slots it wrote, i >= min(fresh of the two banks), each slot's total over every consumer (see
    ``SourceBank.grad``): this consumer either adds its part into the banks' gradients in place (``add(Gk, Gv)``,
    the eager form) or leaves ``records`` = ((dd, q), (p, dO)) for ``SourceBank.slot_grads`` (the native kernel).
    Without banks (this call is every slot's only reader), (dK_0, dV_0, dK_1, ...) in fresh [D, ...] buffers."""
    D, kv_heads = dk.shape[0], dk.shape[2]
    if ctx.banks is None:
        if records is not None:
            Gk, Gv = (native.moda_slot_grads([w], [x], 0, D, kv_heads) for w, x in records)
        else:
            Gk, Gv = dk.new_zeros(dk.shape, dtype=acc), dv.new_zeros(dv.shape, dtype=acc)
            add(Gk, Gv)
        return tuple(g for pair in zip(Gk.to(dk.dtype).unbind(0), Gv.to(dv.dtype).unbind(0)) for g in pair)
    (kb, vb), (fk, fv) = ctx.banks, ctx.fresh
    if records is not None:
        kb.records().add(*records[0])
        vb.records().add(*records[1])
    else:
        add(kb.grad(acc)[:D], vb.grad(acc)[:D])
    Gk, Gv = kb.slot_grads(fk, D, acc), vb.slot_grads(fv, D, acc)
    grads = tuple(g for i in range(min(fk, fv), D) for g in (Gk[i - fk].to(dk.dtype) if i >= fk else None,
                                                             Gv[i - fv].to(dv.dtype) if i >= fv else None))
    if fk == 0:
        kb.release_grad()
    if fv == 0:
        vb.release_grad()
    return grads


def _live(depth_mask, n: int):
    """A [n] depth mask as the native kernel's uint8 live flags (None: every slot live); another shape: False."""
    if depth_mask is None:
        return None
    if depth_mask.shape != (n,):
        return False
    return depth_mask.to(torch.bool).to(torch.uint8).contiguous()  # True = attend, as ``masked_fill(~mask)``


def _native(q, dk, dv, o, lse, live) -> bool:
    """Whether the native CPU kernel (``hf_depth.native``) runs MoDA's depth part for these tensors (never under
    ``torch.compile``: a ctypes call is opaque to it, the eager form's ops trace)."""
    return (live is not False and _native_ok()
            and q.dtype == torch.float32 and native.library() is not None
            and native.moda_depth_supported(q, dk, dv, o, lse, live))


_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_FLASH_BWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def _register_flash_flops() -> None:
    """``FlopCounterMode`` counts SDPA's CUDA kernels but not the CPU flash kernel: give it the same formulas
    (GQA included), so the counter sees MoDA's sequence attention as it saw the explicit matmuls."""
    from torch.utils import flop_counter as fc

    if _FLASH in fc.flop_registry:
        return

    @fc.register_flop_formula(_FLASH)
    def _forward_flops(query, key, value, *args, out_shape=None, **kwargs) -> int:
        return fc.sdpa_flop_count(query, key, value)  # shapes

    @fc.register_flop_formula(_FLASH_BWD)
    def _backward_flops(grad_out, query, key, value, *args, out_shape=None, **kwargs) -> int:
        return fc.sdpa_backward_flop_count(grad_out, query, key, value)


_register_flash_flops()


def _depth_dot(x: torch.Tensor, bank: torch.Tensor, n_rep: int) -> torch.Tensor:
    """x [B, H, T, hd] . bank [D, B, Hkv, T, hd] per token -> [B, H, T, D]: one batched [n_rep, hd] @ [hd, D] per
    (token, kv head) reading the bank in place (no repeated copy for GQA, no [D, B, H, T, hd] temporary)."""
    B, H, T, hd = x.shape
    xg = x.view(B, H // n_rep, n_rep, T, hd).transpose(2, 3)
    return (xg @ bank.permute(1, 2, 3, 4, 0)).transpose(2, 3).reshape(B, H, T, -1)


def _depth_mix_gqa(w: torch.Tensor, bank: torch.Tensor, n_rep: int) -> torch.Tensor:
    """sum_s w[..., s] bank[s] for w [B, H, T, D], bank [D, B, Hkv, T, hd] -> [B, H, T, hd] (GQA: in place)."""
    B, H, T, D = w.shape
    wg = w.reshape(B, H // n_rep, n_rep, T, D).transpose(2, 3)
    return (wg @ bank.permute(1, 2, 3, 0, 4)).transpose(2, 3).reshape(B, H, T, -1)


def _flash_mask(mask, t: int, tk: int, acc: torch.dtype, low: float):
    """(is_causal, additive mask or None) reproducing ``_masked_scores`` in the CPU flash kernel (masked -> ``low``,
    so a masked probability is exactly 0 next to any live score)."""
    if mask is None:
        if t == tk or t == 1:
            return t == tk, None
        mask = torch.ones(t, tk, dtype=torch.bool).tril(tk - t).view(1, 1, t, tk)
    if mask.dtype == torch.bool:
        return False, torch.zeros(mask.shape, dtype=acc, device=mask.device).masked_fill_(~mask, low)
    return False, mask.to(acc)


def _flash_exact(query, mask, depth_mask, n_depth: int) -> bool:
    """The flash path equals the reference unless some query row has no live score at all (a fully masked
    sequence row and no live depth slot): the reference's softmax is then uniform and its ``masked_fill`` passes
    no gradient, which the kernel cannot reproduce. Under ``torch.compile`` the answer may not read the data (a
    data-dependent branch breaks ``fullgraph``): where it would, the reference form runs, exact for every mask."""
    if query.device.type != "cpu":
        return False
    if mask is None or (n_depth and depth_mask is None):
        return True
    if not SourceBank.enabled():
        return False
    if n_depth and bool(depth_mask.any()):
        return True
    live = mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2
    return bool(live.any(-1).all())


def _moda_flash(query, key, value, mask, scaling: float, depth_mask, dk, dv):
    """(o [B, T, H, hd], lse [B, H, T]) of the joint softmax over [sequence | depth], fp32 (``_MoDAFlash``'s forward):
    the sequence part by the CPU flash kernel, merged with the depth scores by log-sum-exp."""
    acc = _acc_dtype(query.dtype)
    n_rep = query.shape[1] // key.shape[1]
    low = torch.finfo(acc).min
    q, k, v = query.to(acc), key.to(acc), value.to(acc)
    causal, amask = _flash_mask(mask, q.shape[-2], k.shape[-2], acc, low)
    out, lse = _FLASH(q, k, v, 0.0, causal, attn_mask=amask, scale=scaling)
    o = out.transpose(1, 2)  # [B, T, H, hd], contiguous
    if dk is not None:
        dka, dva, live = dk.to(acc), dv.to(acc), _live(depth_mask, dk.shape[0])
        if _native(q, dka, dva, o, lse, live):  # o and lse become the joint softmax's, in place
            native.moda_depth_forward(q, dka, dva, o, lse, live, scaling)
        else:
            sd = _depth_dot(q, dka, n_rep) * scaling
            if depth_mask is not None:
                sd = sd.masked_fill(~depth_mask.to(torch.bool), low)
            total = torch.logaddexp(lse, torch.logsumexp(sd, dim=-1))
            o = o * torch.exp(lse - total).transpose(1, 2).unsqueeze(-1)
            o = o + _depth_mix_gqa(torch.exp(sd - total.unsqueeze(-1)), dva, n_rep).transpose(1, 2)
            lse = total
    return o, lse


def _moda_flash_output(query, key, value, mask, scaling: float, depth_mask, dk, dv) -> torch.Tensor:
    """``_MoDAFlash``'s output without autograd (a prompt, an evaluation batch, a decoding step)."""
    return _moda_flash(query, key, value, mask, scaling, depth_mask, dk, dv)[0].to(query.dtype)


class _MoDAFlash(torch.autograd.Function):
    """``_MoDAAttention`` with the sequence part in the CPU flash kernel: its output and log-sum-exp are merged
    with the explicit depth scores [B, H, T, D] by log-sum-exp (one softmax over [sequence | depth]); the backward
    hands the kernel the *combined* output and log-sum-exp, so its P = exp(S - lse) and rowsum(dO O) are the joint
    softmax's, and adds the depth part analytically. Saves q, k, v, the output (o_proj's input) and the lse."""

    @staticmethod
    def forward(ctx, query, key, value, mask, scaling, depth_mask, dk, dv, banks, *depth):
        o, lse = _moda_flash(query, key, value, mask, scaling, depth_mask, dk, dv)
        ctx.save_for_backward(query, key, value, mask, depth_mask, dk, dv, o, lse)
        ctx.scaling = scaling
        _keep_banks(ctx, banks)
        return o.to(query.dtype)

    @staticmethod
    def backward(ctx, dout):
        query, key, value, mask, depth_mask, dk, dv, o, lse = ctx.saved_tensors
        acc = _acc_dtype(query.dtype)
        n_rep = query.shape[1] // key.shape[1]
        low = torch.finfo(acc).min
        q, k, v = query.to(acc), key.to(acc), value.to(acc)
        causal, amask = _flash_mask(mask, q.shape[-2], k.shape[-2], acc, low)
        do_t = dout.to(acc)
        do = do_t.transpose(1, 2)
        dq, dkey, dvalue = _FLASH_BWD(do, q, k, v, o.transpose(1, 2), lse, 0.0, causal, attn_mask=amask,
                                      scale=ctx.scaling)
        grads = ()
        if dk is not None:
            dka, dva, live = dk.to(acc), dv.to(acc), _live(depth_mask, dk.shape[0])
            if _native(q, dka, dva, o, lse, live) and dq.dtype == acc:  # one pass over each bank
                pd, dd = native.moda_depth_backward(q, do, dq, dka, dva, o, lse, live, ctx.scaling)
                grads = _moda_depth_grads(ctx, dk, dv, acc, records=((dd, q), (pd, do)))
            else:
                sd = _depth_dot(q, dka, n_rep) * ctx.scaling
                if depth_mask is not None:
                    sd = sd.masked_fill(~depth_mask.to(torch.bool), low)
                pd = torch.exp(sd - lse.unsqueeze(-1))
                rowsum = (do_t * o).sum(-1).transpose(1, 2).unsqueeze(-1)  # [B, H, T, 1]
                dd = pd * (_depth_dot(do, dva, n_rep) - rowsum) * ctx.scaling
                if depth_mask is not None:
                    dd = dd.masked_fill(~depth_mask.to(torch.bool), 0.0)
                dq = dq + _depth_mix_gqa(dd, dka, n_rep)
                add = _depth_grads_adder(dd.movedim(-1, 0).unsqueeze(-1), q, pd.movedim(-1, 0).unsqueeze(-1), do,
                                         n_rep)
                grads = _moda_depth_grads(ctx, dk, dv, acc, add)
        return (dq.to(query.dtype), dkey.to(key.dtype), dvalue.to(value.dtype), None, None, None, None, None, None,
                *grads)


def moda_attention(query, key, value, depth: tuple, mask, scaling: float, depth_mask=None) -> torch.Tensor:
    """``functional.moda_attention`` with depth = (K_0, V_0, K_1, V_1, ...) read from their banks in place.

    The banks hang on ``depth[0]`` (keys) and ``depth[1]`` (values), see ``attach_moda_banks``. Returns
    [B, T, H, hd]."""
    if mask is not None and mask.dim() != 4:
        raise ValueError("MoDA needs a 4-D attention mask: use attn_implementation 'eager' or 'sdpa'")
    dk = dv = banks = None
    handed = depth  # the depth tensors autograd sees: every slot, or with banks the slots this call wrote
    if depth:
        keys, values = depth[0::2], depth[1::2]
        kb, vb = SourceBank.of(depth[0]), SourceBank.of(depth[1])
        dk = None if kb is None else kb.sync(keys)
        dv = None if vb is None else vb.sync(values)
        if dk is None or dv is None:
            dk, dv = torch.stack([k.detach() for k in keys]), torch.stack([v.detach() for v in values])
        else:
            banks = (kb, vb)
            # an earlier slot's gradient is handed on by its first reader (``SourceBank.grad``), through the bank: a
            # later reader is no edge of its producer's graph (O(L) edges in all, not one per slot and reader)
            handed = depth[2 * min(kb.fresh, vb.fresh):]
    flash = _flash_exact(query, mask, depth_mask, len(depth))
    if flash and SourceBank.enabled() and not torch.is_grad_enabled():  # nothing to save: no autograd Function
        return _outside_autocast(query, _moda_flash_output, query, key, value, mask, scaling, depth_mask, dk, dv)
    fn = _MoDAFlash if flash else _MoDAAttention
    return _outside_autocast(query, fn.apply, query, key, value, mask, scaling, depth_mask, dk, dv, banks, *handed)


class _FFNDepthKV(torch.autograd.Function):
    """``native.moda_kv_write`` with its backward ``native.moda_kv_grad``: the ops' values and gradients bit for bit,
    one pass each way (the ops take ~15 per FFN sublayer, forward and backward, on stream-sized tensors)."""

    @staticmethod
    def forward(ctx, kv, cos, sin, kv_heads):
        ctx.save_for_backward(cos, sin)  # the position tables the attention keeps anyway: no new memory
        ctx.kv_heads, ctx.shape = kv_heads, kv.shape
        return native.moda_kv_write(kv, kv_heads, cos, sin, checked=True)  # moda_ffn_depth_kv asked

    @staticmethod
    def backward(ctx, dk, dv):
        cos, sin = ctx.saved_tensors
        B, T, width = ctx.shape
        dk, dv = (None if g is None else g if g.stride(-1) == 1 else g.contiguous() for g in (dk, dv))
        return native.moda_kv_grad(dk, dv, cos, sin, B, T, ctx.kv_heads, width // (2 * ctx.kv_heads)), None, None, None


def moda_ffn_depth_kv(kv: torch.Tensor, kv_heads: int, positions=None):
    """(K, V) [B, Hkv, T, hd] of an FFN sublayer's ``kv_proj`` output ``kv`` [B, T, 2 Hkv hd] (rows [k | v]), K rotated
    at the token's position by ``positions`` = (cos, sin) where given, in one native pass each way (fp32 on CPU, the
    ops' values and gradients bit for bit); None where the native path does not run (the caller runs the ops)."""
    cos, sin = (None, None) if positions is None else positions
    if not (_native_ok() and native.library() is not None and native.moda_kv_supported(kv, kv_heads, cos, sin)):
        return None
    return _FFNDepthKV.apply(kv, cos, sin, kv_heads)


def attach_moda_banks(k: torch.Tensor, v: torch.Tensor, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first depth K/V of a forward, each aliased with a bank of ``capacity`` slots."""
    return SourceBank.attach(k, capacity), SourceBank.attach(v, capacity)


# --------------------------------------------------------------------------------------------- HC / mHC
# A multi-stream connection routes H_s -> (x_s, mixed_s, w_s) and writes H_{s+1} = mixed_s + w_s y_s, where
# [x_s; mixed_s] = M_s H_s for a per-token (n+1) x n matrix M_s (row 0 reads the branch input, rows 1..n mix the
# streams) and write weights w_s, both functions of H_s (the connection's coefficients). Plain autograd keeps
# H_s (n d per token) and several stream-sized intermediates for every sublayer. Here, as in the mHC paper, only
# the first H of every segment of SEGMENT sublayers is saved, with every branch output y_s (d per token), write
# weights w_s (n per token) and the connection's small coefficient inputs (``routing_saved``: a few n-sized
# vectors per token, what the coefficients are computed from after the stream-sized products). The backward of
# a segment rebuilds its streams from that H (the forward's mixing and write ops: bit-identical streams), each
# sublayer's coefficients from their saved inputs (never a second pass over the streams), and differentiates by
# hand: the mixing by two batched products, the coefficients by the connection's ``routing_backward``.
# The hand-over between sublayers rides on the stream tensor itself (an attribute of H_{s+1}); anything else (a
# caller's own tensor, reentrant checkpointing, torch.compile) starts a new segment, which is only more memory,
# never a different result. With the Triton kernels (CUDA), the backward instead re-runs the segment's routing
# forward through the kernels' own autograd (``_Segment.graph``).

SEGMENT = 4
_SEG_ATTR = "_hf_depth_segment"


def _tokens(t: torch.Tensor) -> torch.Tensor:
    """``t`` [..., r, c] as [tokens, r, c] (a view where the layout allows)."""
    return t.reshape(-1, *t.shape[-2:])


def _native_streams(H: torch.Tensor) -> bool:
    """Whether HC / mHC's CPU path may run the native stream kernels on streams like ``H`` (``native.stream_mix``
    and its backward; each still returns None for tensors it does not take, or where the library is switched off or
    unavailable, and the eager form runs): streams of a training shape, where ``mix_streams`` runs its one-pass form
    (the kernel's rows equal it bit for bit; below, the batched product's other rounding stays), never under
    ``torch.compile``."""
    return _native_ok() and H.numel() >= _ONE_PASS_MIN


def native_stream_op(H: torch.Tensor, op: str, *args):
    """``hf_depth.native.<op>(*args)`` for the routing of streams ``H`` where the CPU path runs the native kernels
    (``_native_streams``), else None, as when the op declines its tensors: the caller then runs its eager form."""
    return getattr(native, op)(*args) if _native_streams(H) else None


def native_fused_op(op: str, *args):
    """``hf_depth.native.<op>(*args)`` for a connection's fused routing (``fused_route`` and the steps after it) where
    the native kernels may run (``_native_ok``), else None, as when the op declines its tensors. The callers decide
    the sizes: ``_Route`` fuses streams of a training shape (``_native_streams``), ``stream_route`` without grad
    fuses every size (a decoding step's routing in one native pass)."""
    return getattr(native, op)(*args) if _native_ok() else None


def _read_and_mix(M: torch.Tensor, H: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``read_and_mix(M, H)``: the native one-pass kernel where it runs (the same values, bit for bit on FMA CPUs)."""
    out = native_stream_op(H, "stream_mix", M, H, 1)
    return read_and_mix(M, H) if out is None else out


def _mix(M: torch.Tensor, H: torch.Tensor) -> torch.Tensor:
    """``mix_streams(M, H)``, native where it runs (see ``_read_and_mix``)."""
    out = native_stream_op(H, "stream_mix", M, H, 0)
    return mix_streams(M, H) if out is None else out[0]


def _sum_to(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``t`` summed over the leading dims that ``like`` (a parameter-shaped weight) does not have."""
    return t if t.dim() == like.dim() else t.flatten(0, t.dim() - like.dim() - 1).sum(0)


def _own_params(conn) -> list:
    """(name, parameter) of a connection's own parameters, as ``named_parameters(recurse=False)`` lists them, by a
    walk of its parameter dict (two per sublayer and step: the module-tree generator costs more than the walk)."""
    seen, out = set(), []
    for name, p in conn._parameters.items():
        if p is not None and id(p) not in seen:
            seen.add(id(p))
            out.append((name, p))
    return out


class _Segment:
    def __init__(self, start: int):
        self.start = start
        self.routes: dict = {}  # s -> (weakref to the route node, connection)
        self.writes: dict = {}  # s -> weakref to the write node
        self.local: dict = {}  # s -> what the backward of route s needs, rebuilt during backward
        self.unpacked: dict = {}  # s -> (w, y) of the write, unpacked by the rebuild, handed to its backward

    def _write_saved(self, j: int):
        if j not in self.unpacked:  # saved tensors are unpacked once (checkpointing allows no more)
            self.unpacked[j] = self.writes[j]().saved_tensors
        return self.unpacked[j]

    def graph(self, s: int):
        """(H_s leaf, (x, mixed, w)) of route s re-run with autograd (the Triton path)."""
        if s in self.local:
            return self.local.pop(s)
        ctx0 = self.routes[self.start][0]()
        H = ctx0.saved_tensors[0]
        for j in range(self.start, s + 1):
            conn = self.routes[j][1]
            Hd = H.detach().requires_grad_()
            with torch.enable_grad(), torch.autocast(device_type=H.device.type, enabled=False):
                x, mixed, w, _ = conn.route(Hd)
            self.local[j] = (Hd, (x, mixed, w))
            if j < s:
                y = self._write_saved(j)[1]
                with torch.no_grad(), torch.autocast(device_type=H.device.type, enabled=False):
                    H = conn.depth(mixed.detach(), w.detach(), y)
        return self.local.pop(s)

    def rebuilt(self, s: int):
        """(H_s, saved routing inputs, M_s, backward state) of route s: the streams rebuilt from the segment's
        first H by the forward's own ops, the coefficients from their saved inputs (the CPU path)."""
        if s in self.local:
            return self.local.pop(s)
        H = None
        for j in range(self.start, s + 1):
            saved = self.routes[j][0]().saved_tensors
            if j == self.start:
                H, saved = saved[0], saved[1:]
            conn, fused = self.routes[j][1], self.routes[j][0]().fused
            # a fused route's backward needs no M (the next streams come from ``fused_rebuild``)
            M, state = (None, None) if fused else conn.routing_rebuild(saved)
            self.local[j] = (H, saved, M, state)
            if j < s:
                w, y = self._write_saved(j)
                nxt = conn.fused_rebuild(H, saved, w, y) if fused else None
                if nxt is None:  # the forward's ops
                    M = conn.fused_mixing(H, saved) if M is None else M
                    nxt = write_streams(_mix(M[..., 1:, :], H), w, y, inplace=True)
                H = nxt
        return self.local.pop(s)


class _Route(torch.autograd.Function):
    @staticmethod
    def forward(ctx, conn, s, H, *params):
        seg = SourceBank.enabled() and getattr(H, _SEG_ATTR, None)
        # the decision depends on the input alone, so a checkpointed recomputation saves exactly what the forward did
        start = not seg or s - seg.start >= SEGMENT
        if start:
            seg = _Segment(s)
        if s not in seg.routes or seg.routes[s][0]() is None:  # a recomputation never replaces the original node
            seg.routes[s] = (weakref.ref(ctx), conn)
        ctx.seg, ctx.s, ctx.n_params = seg, s, len(params)
        ctx.by_hand = not dispatch.use_triton(H)
        x, mixed, w, seen = _outside_autocast(H, _Route.route, ctx, conn, H, start)
        conn.__dict__["_seen_raw"] = seen  # a plain attribute (nn.Module.__setattr__ costs more, per sublayer)
        return x, mixed, w

    @staticmethod
    def route(ctx, conn, H, start: bool):
        """(x, mixed, w, seen) of ``forward``, saving H (at a segment start) and what the backward rebuilds from."""
        fused = conn.fused_route(H) if ctx.by_hand and _native_streams(H) else None
        ctx.fused = fused is not None
        if fused is not None:  # the routing and the mixing in one native pass
            x, mixed, w, seen, saved = fused
            ctx.save_for_backward(*((H,) if start else ()), *saved)
        elif ctx.by_hand:
            M, w, seen, saved = conn.routing_saved(H)
            x, mixed = _read_and_mix(M, H)
            ctx.save_for_backward(*((H,) if start else ()), *saved)
        else:
            x, mixed, w, seen = conn.route(H)
            ctx.save_for_backward(*((H,) if start else ()))
        return x, mixed, w, seen

    @staticmethod
    def backward(ctx, dx, dmixed, dw):
        if not ctx.by_hand:
            return _Route.replay(ctx, dx, dmixed, dw)
        H, saved, M, state = ctx.seg.rebuilt(ctx.s)
        conn = ctx.seg.routes[ctx.s][1]
        if ctx.s == ctx.seg.start:
            ctx.seg.local.clear()
        dx = torch.zeros_like(H[..., 0, :]) if dx is None else _as(dx, H.dtype)
        dmixed = torch.zeros_like(H) if dmixed is None else _as(dmixed, H.dtype)
        if dw is None:
            dw = torch.zeros(H.shape[:-1], dtype=torch.float32, device=H.device)
        fused = conn.fused_backward(H, saved, dx, dmixed, dw) if ctx.fused else None
        if fused is not None:
            return _Route.param_grads(conn, *fused)
        if ctx.fused:  # a fused forward whose backward declined: the by-hand steps from the same M
            M, state = conn.fused_mixing(H, saved), conn.routing_rebuild(saved)[1]
        # the gradient of [x; mixed] = M H is [dx; dmixed], used by rows (never concatenated: a stream-sized copy)
        both = native_stream_op(H, "stream_mix_backward", M, H, dx.unsqueeze(-2), dmixed)
        if both is None:
            HT = _tokens(H).transpose(1, 2)  # per token [d, n]; bmm on 3-d views (no broadcasting matmul's extra ops)
            dM = torch.cat((torch.bmm(_tokens(dx.unsqueeze(-2)), HT), torch.bmm(_tokens(dmixed), HT)), dim=1)
            MT = M.to(H.dtype).transpose(-1, -2)  # dH = M^T [dx; dmixed] (+ the routing's part, in place)
            dH = mix_streams(MT[..., :, 1:], dmixed).addcmul_(MT[..., :, :1], dx.unsqueeze(-2))
        else:  # one pass per token: dM's dot products and dH's sums (the eager dH's order of terms)
            dM, dH = both
        dM = _sum_to(dM.view(H.shape[:-2] + dM.shape[1:]), M).to(M.dtype)
        return _Route.param_grads(conn, dH, conn.routing_backward(H, saved, state, dM, dw.to(M.dtype), dH))

    @staticmethod
    def param_grads(conn, dH, grads: dict):
        """``backward``'s outputs from dH and the {name: gradient} of the connection's parameters."""
        out = [(grads.get(name), p) for name, p in _own_params(conn)]
        return (None, None, dH, *(None if g is None or not p.requires_grad else _as(g, p.dtype) for g, p in out))

    @staticmethod
    def replay(ctx, dx, dmixed, dw):
        Hd, outs = ctx.seg.graph(ctx.s)
        conn = ctx.seg.routes[ctx.s][1]
        params = [p for _, p in _own_params(conn)]
        wanted = [Hd] + [p for p in params if p.requires_grad]
        pairs = [(o, g) for o, g in zip(outs, (dx, dmixed, dw)) if g is not None and o.requires_grad]
        grads = torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True)
        if ctx.s == ctx.seg.start:
            ctx.seg.local.clear()
        by_param = dict(zip([id(p) for p in wanted[1:]], grads[1:]))
        return (None, None, grads[0], *(by_param.get(id(p)) for p in params))


class _Write(torch.autograd.Function):
    """H' = mixed + w y (the write of HC and mHC alike); saves w and y only."""

    @staticmethod
    def forward(ctx, conn, seg, s, mixed, w, y):
        if seg is not None and (s not in seg.writes or seg.writes[s]() is None):
            seg.writes[s] = weakref.ref(ctx)
        ctx.save_for_backward(w, y)
        ctx.mixed_dtype, ctx.seg, ctx.s = mixed.dtype, seg, s
        if dispatch.use_triton(mixed):
            return _outside_autocast(mixed, conn.depth, mixed, w, y)
        # the CPU path writes into the mixed streams (``_Route``'s own output, saved by nobody): ``depth``'s
        # arithmetic without a fresh stream-sized output
        ctx.mark_dirty(mixed)
        return _outside_autocast(mixed, write_streams, mixed, w, y, True)

    @staticmethod
    def backward(ctx, dH):
        seg = ctx.seg
        w, y = seg.unpacked.pop(ctx.s) if seg is not None and ctx.s in seg.unpacked else ctx.saved_tensors
        both = native_stream_op(dH, "stream_write_backward", w, dH, y)
        if both is not None:  # one pass per token over dH: dy = w^T dH and dw = dH y together
            return None, None, None, dH, both[1], both[0]  # static w: autograd sums dw
        wm = w.to(ctx.mixed_dtype).expand(dH.shape[:-1])  # static weights: [n], one for every token
        # per token: dy = w^T dH, a batched [1, n] @ [n, d] product; dw = dH y by a product and a sum (on CPU
        # several times faster than the batched [n, d] @ [d, 1] product)
        dy = torch.bmm(_tokens(wm.unsqueeze(-2)), _tokens(dH)).view(y.shape).to(y.dtype)
        dw = (dH * y.to(dH.dtype).unsqueeze(-2)).sum(-1).to(w.dtype)
        return None, None, None, dH, dw, dy


def _eager(x: torch.Tensor) -> bool:
    """Whether streams like ``x`` take the hand-written CPU path (neither ``torch.compile`` nor Triton)."""
    return SourceBank.enabled() and not dispatch.use_triton(x)


def stream_route(conn, s: int, H: torch.Tensor):
    """``conn.route(H)`` -> (x, mixed, w, seen), saving H only at segment starts (see above). Without grad, nothing
    is saved (``_route_without_grad``)."""
    if SourceBank.enabled() and torch.is_grad_enabled():
        x, mixed, w = _Route.apply(conn, s, H, *(p for _, p in _own_params(conn)))
        seen = conn.__dict__.pop("_seen_raw")
        return x, mixed, w, seen
    return _outside_autocast(H, _route_without_grad, conn, H)


def _route_without_grad(conn, H: torch.Tensor):
    """The routing of a prompt, an evaluation batch or a decoding step: the connection's fused native routing where
    it runs, at every size (the training forward's kernel, token by token: a decoding step runs one native pass per
    sublayer, not the reference's dozens of small ops); else, on CPU at a training shape (``_ONE_PASS_MIN`` stream
    elements), the training forward's eager ops (one coefficient projection, mHC's token-last Sinkhorn; the same
    values as training); else (a few tokens, ``torch.compile``, the Triton path) ``conn.route``."""
    if not _eager(H):
        return conn.route(H)
    fused = conn.fused_route(H) if _native_ok() else None
    if fused is not None:
        return fused[:4]
    if H.numel() < _ONE_PASS_MIN:
        return conn.route(H)
    M, w, seen, _ = conn.routing_saved(H)
    return (*_read_and_mix(M, H), w, seen)


def stream_write(conn, s: int, mixed: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``conn.depth(mixed, w, y)`` saving (w, y); the output carries the segment on to the next sublayer."""
    if not SourceBank.enabled() or not torch.is_grad_enabled():
        # the CPU path writes into the route's own mixed streams, as ``_Write`` does (no fresh stream-sized output)
        if not _eager(mixed):
            return _outside_autocast(mixed, conn.depth, mixed, w, y)
        return _outside_autocast(mixed, write_streams, mixed, w, y, True)
    node = mixed.grad_fn
    seg = None
    if node is not None and getattr(node, "seg", None) is not None and getattr(node, "s", None) == s:
        seg = node.seg
    H = _Write.apply(conn, seg, s, mixed, w, y)
    if seg is not None:
        setattr(H, _SEG_ATTR, seg)
    return H
