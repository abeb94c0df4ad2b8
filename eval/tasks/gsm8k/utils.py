"""Bindings of ``hf_depth.evaluation.tasks.BENCHES["gsm8k"]`` for the YAML tasks in this folder."""

from hf_depth.evaluation.tasks import bindings

globals().update(bindings("gsm8k"))
