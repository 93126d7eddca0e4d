"""Test-session settings shared by every test module."""

import torch

# The suite runs tiny models whose ops are far too small to gain from intra-op threads; on a
# 2-core machine one thread is several times faster and keeps results independent of the load.
torch.set_num_threads(1)
