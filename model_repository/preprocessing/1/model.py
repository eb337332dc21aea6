# Thin entry point: tokenization lives in the kvshare package.
from kvshare.triton_adapter.preprocessing_model import PreprocessingModel as TritonPythonModel  # noqa: F401
