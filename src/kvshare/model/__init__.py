"""The DeepSeek-V4 / V4.1 network (`Transformer`) and its quantisation switch."""

from kvshare.model.deepseek import Transformer
from kvshare.model.quantize import QuantMode

__all__ = ["QuantMode", "Transformer"]
