"""Suite-wide set-up. Fixtures live in plugin modules, one concern each."""
import os

import pytest
import torch

# The Triton kernels must see this before any @triton.jit runs. Without a GPU they run under the
# interpreter, which is how CI exercises them. With one they launch for real, so the interpreter stays
# off (it is process-wide) and the kernel tests put their tensors on the GPU (`kernel_device`).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Tiny models: one intra-op thread avoids the pool's spin-waits, which dominate small ops.
torch.set_num_threads(1)

pytest_plugins = ["tests.fixtures_models", "tests.fixtures_redis", "tests.fixtures_server", "tests.fixtures_http",
                  "tests.fixtures_architectures", "tests.fixtures_moe"]


@pytest.fixture(scope="session")
def kernel_device() -> torch.device:
    """Where Triton kernel tests run: the GPU when there is one, else the CPU under the interpreter."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
