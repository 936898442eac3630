"""lmd's Triton Inference Server model repository template.

``lmd serve triton MODEL --model-repository DIR`` writes a repository from it:
``preprocessing`` -> ``engine`` -> ``postprocessing`` chained by ``ensemble``, and
``lmd_model``, the whole pipeline in one model. See README.md here for the interface.
"""
