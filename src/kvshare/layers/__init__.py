"""Layers with a torch reference and a native implementation, bound once when the model is built.

`KernelChoice` (choice.py) says which implementations a model runs: the pure-torch reference, the
batched mode, or the batch-invariant mode with kvshare's native kernels. `BoundOp` (bound.py) is the
base of every layer that has more than one implementation: `bind(choice)` picks one, and `forward`
calls it; nothing in the network asks per call which backend serves it. `switches.py` is the one
module that reads the environment (``KVSHARE_*``) into engine arguments.
"""

from kvshare.layers.bound import BoundOp, bind_model
from kvshare.layers.choice import KernelChoice

__all__ = ["BoundOp", "KernelChoice", "bind_model"]
