"""deepserve: an inference server for the DeepSeek-V4 model family.

The offline API follows vLLM's: `from deepserve import LLM, SamplingParams`.
"""

from deepserve.async_api import AsyncEngine
from deepserve.core.outputs import CompletionOutput, Logprob, RequestOutput
from deepserve.core.sampling_params import SamplingParams
from deepserve.llm import LLM

__version__ = "0.1.0"
__all__ = ["LLM", "AsyncEngine", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob", "__version__"]
