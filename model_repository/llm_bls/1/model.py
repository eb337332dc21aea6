# Thin entry point: the cancellable text model lives in the kvshare package.
from kvshare.triton_adapter.bls_text_model import BLSTextModel as TritonPythonModel  # noqa: F401
