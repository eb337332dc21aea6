# Thin entry point: the engine and its Triton adapter live in the kvshare package.
from kvshare.triton_adapter.llm_engine_model import LLMEngineModel as TritonPythonModel  # noqa: F401
