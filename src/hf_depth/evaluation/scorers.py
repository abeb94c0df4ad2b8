"""Scorers for the hfd_* evaluation tasks, usable without lm-eval.

* Teacher-forced NLL of a gold answer: :func:`nll_record` per item, :func:`aggregate_nll` over a set
  (sum of NLL divided by the sum of tokens / characters / UTF-8 bytes: a length-weighted mean).
* GSM8K: :func:`gsm8k_gold`, :func:`extract_final_number`, :func:`gsm8k_exact_match`.
* MATH: :func:`last_boxed`, :func:`extract_math_answer`, :func:`math_equivalent` (``math-verify``:
  LaTeX -> SymPy equivalence, not string equality).
* Multiple choice: :func:`mc_predict` (argmax of loglikelihood, raw and length-normalized),
  :func:`extract_letter` for a generated letter.
* Code: :func:`pass_at_k` (the unbiased estimator of Chen et al. 2021), :func:`humaneval_program`,
  :func:`mbpp_program` and :func:`execute` (runs programs in :mod:`hf_depth.evaluation.sandbox`).
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Iterable, Sequence
from decimal import Decimal, InvalidOperation

import numpy as np

# --------------------------------------------------------------------------------------------- NLL


def nll_record(loglikelihood: float, target: str, n_tokens: int | None = None) -> dict:
    """Per-item numbers for a gold continuation: NLL (nats) and its length in tokens, characters and bytes."""
    return {"nll": -float(loglikelihood), "tokens": n_tokens, "chars": len(target), "bytes": len(target.encode())}


def aggregate_nll(records: Iterable[dict], unit: str) -> float:
    """Sum of NLL over the set divided by the total number of ``unit`` ("tokens", "chars" or "bytes")."""
    if unit not in ("tokens", "chars", "bytes"):
        raise ValueError(f"`unit` must be one of 'tokens', 'chars', 'bytes', got {unit!r}")
    nll = total = 0.0
    for r in records:
        if r[unit] is None:
            return float("nan")
        nll += r["nll"]
        total += r[unit]
    return nll / total if total else float("nan")


def agg_ratio(pairs: Sequence[tuple[float, float]]) -> float:
    """sum(a) / sum(b) over (a, b) pairs: lm-eval aggregation for length-weighted NLL."""
    num = sum(a for a, _ in pairs)
    den = sum(b for _, b in pairs)
    return num / den if den else float("nan")


# --------------------------------------------------------------------------------------------- GSM8K

_NUMBER = r"-?[$]?\d[\d,]*(?:\.\d+)?|-?\.\d+"


def normalize_number(text: str | None) -> str | None:
    """'$1,234.50' -> '1234.5'; None when ``text`` is not a number."""
    if text is None:
        return None
    s = text.strip().replace(",", "").replace("$", "").rstrip(".")
    try:
        d = Decimal(s)
    except InvalidOperation:
        return None
    if not d.is_finite():
        return None
    d = d.normalize()
    return format(d, "f") if d != d.to_integral() else str(int(d))


def gsm8k_gold(answer: str) -> str:
    """The gold final answer of a GSM8K ``answer`` field: the text after ``####``, normalized."""
    if "####" not in answer:
        raise ValueError("GSM8K `answer` must contain '#### <number>'")
    return normalize_number(answer.split("####")[-1])


def extract_final_number(text: str) -> str | None:
    """The model's final number: after '####' or 'The answer is', else the last number in the text."""
    for pattern in (r"####\s*(" + _NUMBER + ")", r"[Tt]he (?:final )?answer is:?\s*\$?\s*(" + _NUMBER + ")"):
        found = re.findall(pattern, text)
        if found:
            return normalize_number(found[-1])
    found = re.findall(_NUMBER, text)
    return normalize_number(found[-1]) if found else None


def gsm8k_exact_match(prediction: str, gold_answer: str) -> bool:
    """``gold_answer`` is the GSM8K ``answer`` field (with ``####``) or a bare number."""
    gold = gsm8k_gold(gold_answer) if "####" in gold_answer else normalize_number(gold_answer)
    pred = extract_final_number(prediction)
    return pred is not None and pred == gold


def strip_calculator(text: str) -> str:
    """Remove GSM8K's ``<<48/2=24>>`` calculator annotations."""
    return re.sub(r"<<[^>]*>>", "", text)


# --------------------------------------------------------------------------------------------- MATH


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` / ``\\fbox{...}`` (balanced braces), or ``\\boxed x``."""
    idx = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if idx < 0:
        return None
    rest = text[idx:]
    brace = rest.find("{")
    if rest.startswith("\\boxed ") and (brace < 0 or rest[:brace].strip() != "\\boxed"):
        return rest[len("\\boxed "):].split("$")[0].strip()
    if brace < 0:
        return None
    depth = 0
    for i in range(brace, len(rest)):
        if rest[i] == "{":
            depth += 1
        elif rest[i] == "}":
            depth -= 1
            if depth == 0:
                return rest[brace + 1:i]
    return None


def extract_math_answer(text: str) -> str | None:
    """The answer of a MATH solution/generation: the last ``\\boxed{}``, else Minerva's
    'Final Answer: The final answer is X. I hope it is correct.', else None."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    m = re.findall(r"[Ff]inal [Aa]nswer(?: is)?:?\s*(?:[Tt]he final answer is\s*)?(.+?)(?:\.\s*I hope it is correct|$)",
                   text, flags=re.M)
    if m:
        ans = m[-1].strip().rstrip(".").strip()
        if ans.startswith("$") and ans.endswith("$") and len(ans) > 1:
            ans = ans.strip("$")
        return ans.strip() or None
    return None


def _math_verify_timeout() -> int | None:
    # math-verify's timeouts use signal.alarm, which works only in the main thread
    return 5 if threading.current_thread() is threading.main_thread() else None


def math_equivalent(prediction: str | None, gold: str) -> bool:
    """True iff the extracted answer ``prediction`` and ``gold`` (LaTeX) are mathematically equivalent."""
    if prediction is None or not prediction.strip():
        return False
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    t = _math_verify_timeout()
    cfg = [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()]
    g = parse(f"$\\boxed{{{gold}}}$", extraction_config=cfg, parsing_timeout=t)
    p = parse(f"$\\boxed{{{prediction}}}$", extraction_config=cfg, parsing_timeout=t)
    if not g or not p:   # unparseable: fall back to whitespace-insensitive string identity
        return _strip_latex(prediction) == _strip_latex(gold)
    return bool(verify(g, p, timeout_seconds=t))


def _strip_latex(s: str) -> str:
    s = re.sub(r"\\text\{([^}]*)\}", r"\1", s)
    return re.sub(r"\s+|\\[ ,!;]|\\left|\\right|\$", "", s)


def math_score(generation: str, gold_answer: str) -> bool:
    return math_equivalent(extract_math_answer(generation), gold_answer)


# --------------------------------------------------------------------------------------------- multiple choice

LETTERS = "ABCDEFGHIJ"


def mc_predict(loglikelihoods: Sequence[float], choices: Sequence[str] | None = None) -> tuple[int, int]:
    """(argmax loglikelihood, argmax loglikelihood per character of the choice)."""
    ll = np.asarray(loglikelihoods, dtype=np.float64)
    raw = int(np.argmax(ll))
    if choices is None:
        return raw, raw
    lengths = np.asarray([max(1, len(c)) for c in choices], dtype=np.float64)
    return raw, int(np.argmax(ll / lengths))


def extract_letter(text: str, n_choices: int = 4) -> str | None:
    """The first standalone choice letter (A..) in a generation: 'B', '(B)', 'B.', 'Answer: B'."""
    allowed = LETTERS[:n_choices]
    m = re.search(rf"(?<![A-Za-z])\(?([{allowed}])\)?(?![A-Za-z])", text)
    return m.group(1) if m else None


def shuffled_choices(key: str, correct: str, incorrect: Sequence[str]) -> tuple[list[str], int]:
    """A fixed, model-independent order of the choices (seeded by ``key``, e.g. the question text)."""
    import hashlib

    seed = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little")
    order = np.random.default_rng(seed).permutation(len(incorrect) + 1)
    options = [correct, *incorrect]
    choices = [options[i] for i in order]
    return choices, int(np.where(order == 0)[0][0])


# --------------------------------------------------------------------------------------------- code


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct: 1 - C(n-c, k) / C(n, k)."""
    if not 0 <= c <= n or k < 1:
        raise ValueError(f"need 0 <= c <= n and k >= 1, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def humaneval_program(problem: dict, completion: str) -> str:
    """Prompt + completion (the candidate), then the tests: the official ``check`` and ``check(entry_point)``."""
    from .sandbox import join_program

    return join_program(f"{problem['prompt']}{completion}", f"{problem['test']}\n\ncheck({problem['entry_point']})")


def mbpp_program(problem: dict, code: str) -> str:
    """The candidate, then the tests: ``test_setup_code`` (in MBPP it builds inputs from the solution's classes,
    e.g. ``Node`` in tasks 367/927), then the official ``test_list`` asserts."""
    from .sandbox import join_program

    setup = problem.get("test_setup_code") or ""
    return join_program(code, f"{setup}\n\n" + "\n".join(problem["test_list"]))


_LOGGED_CONTAINMENT = []


def execute(programs: Sequence[str], *, timeout: float = 10.0, allow: bool | None = None,
            workers: int | None = None) -> list[bool]:
    """Run programs in the sandbox (in parallel); True where the harness proved that one ran to its end (the
    tests included) without an exception, within its limits. Logs once what the sandbox contains."""
    from .sandbox import Limits, containment, run_many

    results = run_many(programs, Limits(timeout=timeout), allow=allow, workers=workers)
    if results and not _LOGGED_CONTAINMENT:
        _LOGGED_CONTAINMENT.append(containment(results[0].isolation))
        missing = _LOGGED_CONTAINMENT[0]["not_contained"]
        log = logging.getLogger(__name__)
        (log.warning if missing else log.info)("code sandbox: not contained: %s", "; ".join(missing) or "nothing")
    return [r.passed for r in results]

