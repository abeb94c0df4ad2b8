"""Bindings of ``hf_depth.evaluation.tasks.BENCHES["gpqa"]`` for the YAML tasks in this folder."""

from hf_depth.evaluation.tasks import bindings

globals().update(bindings("gpqa"))
