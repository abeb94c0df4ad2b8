"""Bindings of ``hf_depth.evaluation.tasks.BENCHES["math500"]`` for the YAML tasks in this folder."""

from hf_depth.evaluation.tasks import bindings

globals().update(bindings("math500"))
