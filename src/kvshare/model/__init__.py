"""The DeepSeek-V4 / V4.1 network (`Transformer`), its quantisation switch and the dense reference cache."""

from kvshare.model.deepseek import Transformer
from kvshare.model.dense_cache import DenseCache
from kvshare.model.quantize import QuantMode

__all__ = ["DenseCache", "QuantMode", "Transformer"]
