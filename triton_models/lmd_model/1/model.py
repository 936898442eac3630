"""Triton Python-backend model 'lmd_model' of lmd's repository; the code is lmd.triton_models.serving.LmdModel."""
from lmd.triton_models.serving import LmdModel as TritonPythonModel  # noqa: F401
