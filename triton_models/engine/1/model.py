"""Triton Python-backend model 'engine' of lmd's repository; the code is lmd.triton_models.serving.EngineModel."""
from lmd.triton_models.serving import EngineModel as TritonPythonModel  # noqa: F401
