"""ladle: LLM inference whose every prefill is split into memory-bounded chunks."""
from ladle.entrypoints.llm import LLM
from ladle.outputs import CompletionOutput, Logprob, RequestOutput
from ladle.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob"]
