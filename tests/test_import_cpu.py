"""`import coda` (and the benchmark package's modules) import none of the
optional packages: matplotlib, transformers, Liger and accelerate load only
where a model is patched, a plot drawn or a baseline run (`pip install
coda-epilogues[bench]`)."""

import subprocess
import sys

import pytest

OPTIONAL = ("matplotlib", "transformers", "liger_kernel", "accelerate")


@pytest.mark.parametrize("module", ["coda", "coda.bench", "coda.bench.cli", "coda.hf", "coda.nn", "coda.ops"])
def test_import_loads_no_optional_package(module):
    code = (f"import sys, {module}\n"
            f"print(','.join(m for m in {OPTIONAL!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"import {module} loaded {out.stdout.strip()}"
