"""Scorers for the hfd_* evaluation tasks, usable without lm-eval.

* Teacher-forced NLL of a gold answer: :func:`nll_record` per item, :func:`aggregate_nll` over a set
  (sum of NLL divided by the sum of tokens / characters / UTF-8 bytes: a length-weighted mean).
* GSM8K: :func:`gsm8k_gold`, :func:`extract_final_number` (the final number of the answer statement),
  :func:`gsm8k_exact_match` (numeric comparison).
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
import unicodedata
from collections.abc import Iterable, Sequence
from decimal import Decimal
from fractions import Fraction

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

# A number as written in a solution: sign, currency, thousands separators, decimals, a fraction or a mixed number
# (2 3/4). Not inside a word or another number; what follows (%, units, words) is not part of it.
_NUMBER_RE = re.compile(r"""
    (?<![\w.])
    (?P<sign>-)?\s?(?:[$€£¥₹]\s?)?(?P<sign2>-)?
    (?:
        (?P<whole>\d+)\ (?P<mnum>\d+)/(?P<mden>\d+)(?![\d/])
      | (?P<num>\d+)/(?P<den>\d+)(?![\d/])
      | (?P<int>\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?P<dec>\.\d+)?
      | (?P<bare>\.\d+)
    )""", re.X)
_OPERATOR_THEN_NUMBER = re.compile(r"\s*(?:[-+*/×÷x]|\\times|\\cdot)\s*\(?\s*-?[$€£¥₹]?\s*[\d.]")
_MINUS_SIGNS = {**dict.fromkeys(map(ord, "\u2212\u2012\u2013\ufe63\uff0d"), "-"), 0x2044: "/"}   # − ‒ – ﹣ －, ⁄
# The answer statements a solution ends with: '#### n', '(the) (final) answer is / : n', '\boxed{n}'.
_STATEMENT_RE = re.compile(r"####|\b(?:the\s+)?(?:final\s+)?answer\s*(?:is\b|=|:)\s*:?|\\boxed\s*\{|\\fbox\s*\{",
                           re.I)
_STATEMENT_END_RE = re.compile(r"\n|[.!?](?=\s|$)|\.(?=[A-Z*])")


def _plain_math(text: str) -> str:
    """The text with unicode minus signs, markdown emphasis and the LaTeX of numbers made plain:
    ``\\frac{3}{4}`` -> 3/4, ``\\$`` -> $, ``\\%`` -> %, ``1{,}234`` / ``1\\,234`` -> 1,234, ``\\text{ km}`` -> km."""
    text = unicodedata.normalize("NFKC", text).translate(_MINUS_SIGNS)
    text = strip_calculator(text).replace("**", "").replace("\\!", "")
    text = re.sub(r"\\[dt]?frac\s*\{\s*(-?\d+)\s*\}\s*\{\s*(\d+)\s*\}", r"\1/\2", text)
    text = re.sub(r"(?<=\d)(?:\{,\}|\\,)(?=\d{3}(?!\d))", ",", text)
    text = re.sub(r"\\(?:text|textbf|mathrm|mbox)\s*\{([^{}]*)\}", r" \1", text)
    return text.replace("\\$", "$").replace("\\%", "%").replace("\\left", "").replace("\\right", "")


def _number_value(m: re.Match) -> Fraction:
    g = m.groupdict()
    if g["whole"] is not None:
        value = int(g["whole"]) + Fraction(int(g["mnum"]), int(g["mden"]) or 1)
    elif g["num"] is not None:
        value = Fraction(int(g["num"]), int(g["den"])) if int(g["den"]) else Fraction(int(g["num"]))
    elif g["bare"] is not None:
        value = Fraction(g["bare"])
    else:
        value = Fraction(g["int"].replace(",", "") + (g["dec"] or ""))
    return -value if (g["sign"] is None) != (g["sign2"] is None) else value


def number_text(value: Fraction) -> str:
    """A canonical spelling: 18, -5.5, 0.75, 1/3 (a fraction that is no finite decimal)."""
    if value.denominator == 1:
        return str(value.numerator)
    den = value.denominator
    for p in (2, 5):
        while den % p == 0:
            den //= p
    if den != 1:
        return f"{value.numerator}/{value.denominator}"
    return format(Decimal(value.numerator) / Decimal(value.denominator), "f").rstrip("0").rstrip(".")


def parse_number(text: str | None) -> Fraction | None:
    """The value of the first number in ``text`` ('$1,234.50' -> 2469/2, '−5' -> -5, '3/4' -> 3/4), else None."""
    if text is None:
        return None
    m = _NUMBER_RE.search(_plain_math(text))
    return _number_value(m) if m else None


def normalize_number(text: str | None) -> str | None:
    """'$1,234.50' -> '1234.5', '3/4' -> '0.75'; None when ``text`` holds no number."""
    value = parse_number(text)
    return None if value is None else number_text(value)


def gsm8k_gold(answer: str) -> str:
    """The gold final answer of a GSM8K ``answer`` field: the text after ``####``, normalized."""
    if "####" not in answer:
        raise ValueError("GSM8K `answer` must contain '#### <number>'")
    gold = normalize_number(answer.split("####")[-1])
    if gold is None:
        raise ValueError(f"GSM8K `answer` has no number after '####': {answer.split('####')[-1].strip()!r}")
    return gold


def _statement_number(span: str) -> Fraction | None:
    """The answer in one answer statement: its first number, or -- when that number starts an expression
    (``5 * 3 = 15``) -- the result after the last '='."""
    numbers = list(_NUMBER_RE.finditer(span))
    if not numbers:
        return None
    first = numbers[0]
    if "=" in span[first.end():] and _OPERATOR_THEN_NUMBER.match(span, first.end()):
        after = [m for m in numbers if m.start() > span.rindex("=")]
        if after:
            return _number_value(after[0])
    return _number_value(first)


def _statement_span(text: str, m: re.Match) -> str:
    if m.group(0).rstrip().endswith("{"):   # \boxed{...}: its balanced content
        depth, i = 1, m.end()
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        return text[m.end():i - 1] if depth == 0 else text[m.end():]
    end = _STATEMENT_END_RE.search(text, m.end())
    while end and end.group(0) == "." and end.start() == m.end():   # "The answer is: ..." -> skip no span
        end = _STATEMENT_END_RE.search(text, end.end())
    return text[m.end():end.start() if end else len(text)]


def extract_final_value(text: str) -> Fraction | None:
    """The model's final answer to a GSM8K problem, as a number (see :func:`extract_final_number`)."""
    text = re.split(r"\n\s*(?:Q|Question|Problem)\s*:", _plain_math(text))[0]   # a hallucinated next question
    for m in reversed(list(_STATEMENT_RE.finditer(text))):
        value = _statement_number(_statement_span(text, m))
        if value is not None:
            return value
    numbers = list(_NUMBER_RE.finditer(text))
    return _number_value(numbers[-1]) if numbers else None


def extract_final_number(text: str) -> str | None:
    """The model's final answer: the number of its last answer statement ('#### n', '(the) (final) answer is n',
    'Answer: n', '\\boxed{n}'; of a trailing equation 'a op b = n' in it, the result n), else the last number
    of the text; None when there is none. Unicode minus, thousands separators, currency, units, '%', 'n.00' and
    LaTeX fractions are normalized; a fraction reads as its value ('3/4' -> '0.75'). Text after a new
    'Q:' / 'Question:' line (the model writing the next few-shot question) is ignored."""
    value = extract_final_value(text)
    return None if value is None else number_text(value)


def gsm8k_exact_match(prediction: str, gold_answer: str) -> bool:
    """``gold_answer`` is the GSM8K ``answer`` field (with ``####``) or a bare number; numbers compare by value
    (18 == 18.00, 3/4 == 0.75)."""
    gold = parse_number(gsm8k_gold(gold_answer) if "####" in gold_answer else gold_answer)
    pred = extract_final_value(prediction)
    return pred is not None and gold is not None and pred == gold


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

