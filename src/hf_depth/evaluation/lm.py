"""lm-eval's ``HFLM`` fitted to the model's context, so every ``hfd_*`` task runs on any causal LM.

lm-eval 0.4.13's HFLM (``lm_eval/models/huggingface.py``) stops on two things a short-context model meets:
``generate_until`` asserts ``max_gen_toks < max_length`` (then left-truncates the prompt to
``max_length - max_gen_toks`` tokens in ``tok_batch_encode(left_truncate_len=...)``), and
``_loglikelihood_tokens`` asserts ``len(continuation_enc) <= max_length`` (it left-truncates only the
context: ``(context_enc + continuation_enc)[-(max_length + 1):][:-1]``). :class:`ContextFitHFLM` changes
only those two cases and keeps everything else lm-eval's:

* generation: per request, the budget ``G`` of the task (``max_gen_toks``) is kept when the prompt (``P``
  tokens, ``tok_encode`` as lm-eval's ``_collate``) leaves room for it in ``L = max_length``; else it is capped
  to the room ``L - P`` when that is at least ``min(G, L // 4)``; else to ``min(G, L // 4)``, and lm-eval
  left-truncates the prompt to ``L - G'`` tokens, as it always does (:func:`generation_budget`);
* loglikelihood: a continuation longer than ``L`` is scored over lm-eval's rolling windows
  (``utils.get_rolling_token_windows(token_list=continuation, prefix_token=context[-1], max_seq_len=L,
  context_len=1)`` made disjoint by ``utils.make_disjoint_window``, as ``HFLM.loglikelihood_rolling`` does
  for a document), summed; a continuation that fits is lm-eval's single request, unchanged
  (:func:`continuation_windows`).

What was changed is counted per task (docs whose generation budget was capped, whose prompt or context was
left-truncated, whose gold answer was scored in windows) and reported by ``get_model_info()`` under
``hfd_context``, which lm-eval copies into ``results["config"]``.

Plain lm-eval with this model class: ``python -m hf_depth.evaluation.lm --model hfd --model_args
pretrained=DIR,trust_remote_code=True --include_path eval/tasks --tasks hfd_all ...`` (lm-eval's own CLI, with
``hfd`` registered first).
"""

from __future__ import annotations

from collections import defaultdict

from lm_eval import utils as lm_utils
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM

GEN_ALIASES = ("max_new_tokens", "max_tokens", "max_completion_tokens")


def generation_budget(prompt_tokens: int, max_gen_toks: int, max_length: int) -> int:
    """The generation budget used for a prompt of ``prompt_tokens`` (see the module docstring); the prompt is
    then left-truncated to ``max_length - budget`` tokens."""
    if max_length < 2:
        raise ValueError(f"`max_length` must be >= 2 tokens to generate after a prompt, got {max_length}")
    if max_gen_toks < 1:
        raise ValueError(f"`max_gen_toks` must be >= 1, got {max_gen_toks}")
    room = max_length - prompt_tokens
    if room >= max_gen_toks:
        return max_gen_toks
    floor = min(max_gen_toks, max(1, max_length // 4))
    return min(max(room, floor), max_gen_toks, max_length - 1)


def continuation_windows(context_enc: list[int], continuation_enc: list[int],
                         max_length: int) -> list[tuple[list[int], list[int]]]:
    """(context, continuation) token requests whose summed loglikelihood is that of ``continuation_enc`` after
    ``context_enc``: the pair itself when the continuation fits in ``max_length``, else lm-eval's disjoint
    rolling windows over the continuation (each predicts at most ``max_length`` tokens)."""
    if len(continuation_enc) <= max_length:
        return [(context_enc, continuation_enc)]
    windows = lm_utils.get_rolling_token_windows(token_list=continuation_enc, prefix_token=context_enc[-1],
                                                 max_seq_len=max_length, context_len=1)
    return [lm_utils.make_disjoint_window(w) for w in windows]


def _new_task_stats() -> dict:
    return {"docs": set(), "gen_capped": set(), "prompt_truncated": set(), "context_truncated": set(),
            "rolling": set(), "rolling_windows": 0, "max_gen_toks": set(), "min_gen_toks_used": None}


@register_model("hfd")
class ContextFitHFLM(HFLM):
    """``HFLM`` whose generation budgets and gold-answer scoring fit ``max_length`` (module docstring)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._stats: dict[str, dict] = defaultdict(_new_task_stats)
        self._pending: list[tuple[str | None, int | None]] | None = None

    # ---- generation
    def generate_until(self, requests, disable_tqdm: bool = False):
        from lm_eval.models.utils import normalize_gen_kwargs

        for req in requests:
            context, gen_kwargs = req.args
            wanted = normalize_gen_kwargs(dict(gen_kwargs), self.max_gen_toks)["max_gen_toks"]
            prompt = len(self.tok_encode(context))
            used = generation_budget(prompt, wanted, self.max_length)
            s = self._stats[req.task_name]
            s["docs"].add(req.doc_id)
            s["max_gen_toks"].add(wanted)
            s["min_gen_toks_used"] = used if s["min_gen_toks_used"] is None else min(used, s["min_gen_toks_used"])
            if used < wanted:
                s["gen_capped"].add(req.doc_id)
                kw = {k: v for k, v in gen_kwargs.items() if k not in GEN_ALIASES}
                req.arguments = (context, {**kw, "max_gen_toks": used})
            if prompt > self.max_length - used:
                s["prompt_truncated"].add(req.doc_id)
        return super().generate_until(requests, disable_tqdm=disable_tqdm)

    # ---- loglikelihood
    def loglikelihood(self, requests, disable_tqdm: bool = False):
        self._pending = [(r.task_name, r.doc_id) for r in requests]
        try:
            return super().loglikelihood(requests, disable_tqdm=disable_tqdm)
        finally:
            self._pending = None

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs=None):
        owners, self._pending = self._pending, None   # set only for the call from loglikelihood()
        if owners is not None and len(owners) != len(requests):
            owners = None
        expanded, spans = [], []
        for i, (key, ctx, cont) in enumerate(requests):
            windows = continuation_windows(ctx, cont, self.max_length)
            if owners is not None:
                s = self._stats[owners[i][0]]
                s["docs"].add(owners[i][1])
                if len(windows) > 1:
                    s["rolling"].add(owners[i][1])
                    s["rolling_windows"] += len(windows)
                elif len(ctx) + len(cont) > self.max_length + 1:
                    s["context_truncated"].add(owners[i][1])
            spans.append((key, len(expanded), len(windows)))
            # windows carry cache key None (as loglikelihood_rolling's do); the sum is cached under the key below
            expanded += [(key, ctx, cont)] if len(windows) == 1 else [(None, c, w) for c, w in windows]
        if len(expanded) == len(requests):
            return super()._loglikelihood_tokens(requests, disable_tqdm=disable_tqdm, override_bs=override_bs)
        scored = super()._loglikelihood_tokens(expanded, disable_tqdm=disable_tqdm, override_bs=override_bs)
        out = []
        for key, start, n in spans:
            part = scored[start:start + n]
            answer = (sum(ll for ll, _ in part), all(g for _, g in part))
            if n > 1 and key is not None:
                self.cache_hook.add_partial("loglikelihood", key, answer)
            out.append(answer)
        return out

    # ---- report
    def context_report(self) -> dict:
        """Per task: what fitting the context changed (counts of docs), with ``max_length``."""
        report = {}
        for task, s in sorted(self._stats.items(), key=lambda kv: str(kv[0])):
            r = {"max_length": self.max_length, "docs": len(s["docs"])}
            if s["max_gen_toks"]:
                r |= {"max_gen_toks": max(s["max_gen_toks"]), "min_gen_toks_used": s["min_gen_toks_used"],
                      "docs_gen_capped": len(s["gen_capped"]), "docs_prompt_truncated": len(s["prompt_truncated"])}
            else:
                r |= {"docs_context_truncated": len(s["context_truncated"]), "docs_rolling": len(s["rolling"]),
                      "rolling_windows": s["rolling_windows"]}
            report[str(task)] = r
        return report

    def get_model_info(self) -> dict:
        return {**super().get_model_info(), "hfd_context": self.context_report()}


def main() -> None:
    """lm-eval's CLI with the ``hfd`` model class registered (``--model hfd``)."""
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()


if __name__ == "__main__":
    main()
