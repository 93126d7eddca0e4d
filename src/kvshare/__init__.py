"""kvshare: an inference engine for DeepSeek-V4 / V4.1 models that share their KV cache across layers."""

__version__ = "0.1.0"
