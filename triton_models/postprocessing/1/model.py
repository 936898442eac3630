"""Triton Python-backend model 'postprocessing' of lmd's repository; the code is lmd.triton_models.serving.PostprocessingModel."""
from lmd.triton_models.serving import PostprocessingModel as TritonPythonModel  # noqa: F401
