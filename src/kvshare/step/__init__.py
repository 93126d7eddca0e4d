"""The per-step types: what one forward step is made of and hands between its parts.

* `StepBatch` (batch.py): the ragged batch of sequence chunks, with host ints for its addresses;
* `StepAddresses` (addresses.py): every index a step's layers and cache need, derived once per step
  on the host and moved to the device once;
* `StepState` (state.py): the cross-layer hand-offs of one step (top-k, candidate masks, taps);
* `StepContext` (context.py): what a forward threads through the layers;
* `CacheBackend` (backend.py): the protocol the model's cache implements.

The package imports no cache, model or engine code (tests/test_import_graph.py).
"""

from kvshare.step.addresses import StepAddresses
from kvshare.step.backend import CacheBackend
from kvshare.step.batch import StepBatch
from kvshare.step.context import StepContext
from kvshare.step.state import StepState

__all__ = ["CacheBackend", "StepAddresses", "StepBatch", "StepContext", "StepState"]
