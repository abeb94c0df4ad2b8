"""hf_depth.evaluation"""
