"""The attacker processes of the victim benches import their module without torch: seconds of import in
each spawned process would land inside a phase (in the tests, past a 2 s rate window, so that an over-quota
tenant's bodies were admitted and refused as too large instead of 429)."""
import subprocess
import sys

import pytest

from tests.repo import ROOT_DIR

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("module", ["benchmarks.security.abuse", "benchmarks.security.schema_flood"])
def test_an_attacker_process_imports_its_module_without_torch(module):
    code = f"import sys, {module}; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT_DIR, check=True)
