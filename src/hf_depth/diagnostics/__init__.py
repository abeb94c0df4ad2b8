"""hf_depth.diagnostics"""
