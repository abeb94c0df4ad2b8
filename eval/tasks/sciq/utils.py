"""Bindings of ``hf_depth.evaluation.tasks.BENCHES["sciq"]`` for the YAML tasks in this folder."""

from hf_depth.evaluation.tasks import bindings

globals().update(bindings("sciq"))
