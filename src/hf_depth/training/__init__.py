"""hf_depth.training"""
