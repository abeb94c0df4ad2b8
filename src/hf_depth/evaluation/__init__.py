"""hf_depth.evaluation: scorers (``scorers``), the code sandbox (``sandbox``), the Python side of the hfd_*
lm-eval tasks in ``eval/tasks`` (``tasks``, ``fewshot``), ``hf-depth eval`` (``cli``) and
``hf-depth val-loss`` (``perplexity``). Submodules import lazily; nothing here imports lm-eval."""
