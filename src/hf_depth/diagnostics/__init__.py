"""Depth diagnostics (DepthBench section 6): do extra layers do useful computation, and at what price?

One module per measurement, each working on any hf_depth design and on plain ``LlamaForCausalLM``:
``angular`` (Figure 5), ``causal`` (Figure 6a/b), ``permutation`` (Figure 6c/d), ``pruning`` and ``logit_lens``
(Figure 8), ``paths`` (Figures 7, 9, 10), ``cost`` (Figure 11); ``report`` runs them all and ``cli`` is
``hf-depth diagnose``. What "skip a layer" and "swap two layers" mean per design is documented in ``common``.
"""

from .report import MEASUREMENTS, headline, run_diagnostics, write_report

__all__ = ["MEASUREMENTS", "headline", "run_diagnostics", "write_report"]
