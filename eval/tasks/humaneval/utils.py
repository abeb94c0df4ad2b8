"""Bindings of ``hf_depth.evaluation.tasks.BENCHES["humaneval"]`` for the YAML tasks in this folder."""

from hf_depth.evaluation.tasks import bindings

globals().update(bindings("humaneval"))
