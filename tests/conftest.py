"""Suite-wide set-up. Fixtures live in plugin modules, one concern each."""
import os

import torch

# The Triton kernels must see this before any @triton.jit runs: without a GPU
# they run under the interpreter, which is how CI exercises them.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Tiny models: one intra-op thread avoids the pool's spin-waits, which dominate small ops.
torch.set_num_threads(1)

pytest_plugins = ["tests.fixtures_models", "tests.fixtures_redis", "tests.fixtures_server"]
