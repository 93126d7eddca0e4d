"""Layers with a torch reference and a native implementation, bound once when the model is built.

`KernelChoice` (choice.py) says which implementations a model runs: the pure-torch reference, the
batched mode, or the batch-invariant mode with kvshare's native kernels. `BoundOp` (bound.py) is the
base of every layer that has more than one implementation: `bind(choice)` picks one, and `forward`
calls it; nothing in the network asks per call which backend serves it. `switches.py` is the one
module that reads the environment (``KVSHARE_*``) into engine arguments.

The layers (each with its torch reference and its native implementation(s)):

| module | layer | implementations |
|---|---|---|
| norm.py | `RMSNorm` | `forward_torch`, `forward_native` (batch-invariant native) |
| rope.py | `RotaryEmbedding` | `forward_torch`, `forward_native` (any native choice) |
| linear.py | `Linear`, `QLinear` | `forward_torch` (oneDNN / F.linear), `forward_invariant`, `forward_packed` |
| quant.py | FP8 / FP4 roundings | ``native`` argument (the caller's bound choice) |
| mhc.py | `Mhc` (enter / boundary / leave / head) | `TorchMhc`, `NativeMhc`, `FusedMhc`, `ChunkedMhc` |
| moe_gate.py | `Gate` | `forward_torch`, `forward_native` |
| moe_experts.py | `MoeExperts` (base of `model.moe.MoE`) | `forward_torch`, `forward_native` |
"""

from kvshare.layers.bound import BoundOp, bind_model
from kvshare.layers.choice import KernelChoice

__all__ = ["BoundOp", "KernelChoice", "bind_model"]
