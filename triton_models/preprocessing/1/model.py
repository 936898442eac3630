"""Triton Python-backend model 'preprocessing' of lmd's repository; the code is lmd.triton_models.serving.PreprocessingModel."""
from lmd.triton_models.serving import PreprocessingModel as TritonPythonModel  # noqa: F401
