"""Model configuration: `ModelConfig` and how it is read and checked.

Modules, bottom up (none imports a module above it; `tests/test_import_graph.py` checks the whole
package graph): `types` (Arch, YarnConfig); `limits`, `engram` (rules on sizes and Engram fields);
`rules` (every check `ModelConfig` runs when built); `parse` (HF V4 / V4.1 and DeepSeek reference
dicts -> ModelConfig fields); `model` (ModelConfig); `load` (load_config).
"""

from kvshare.config.load import load_config
from kvshare.config.model import ModelConfig
from kvshare.config.types import Arch, YarnConfig

__all__ = ["Arch", "ModelConfig", "YarnConfig", "load_config"]
