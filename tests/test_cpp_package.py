"""The C++ example configures, builds and links against the *installed* CMake
package (find_package(coda) -> coda::coda). CI installs it and sets
CODA_INSTALL_PREFIX; the program itself runs only where an sm_90 GPU is."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(not os.environ.get("CODA_INSTALL_PREFIX"),
                    reason="CODA_INSTALL_PREFIX is not set (cmake --install a build there first, as .ci/run does)")
def test_example_builds_against_installed_package(tmp_path):
    prefix = Path(os.environ["CODA_INSTALL_PREFIX"])
    configs = list(prefix.glob("lib*/cmake/coda/codaConfig.cmake"))
    assert configs, f"no lib*/cmake/coda/codaConfig.cmake under {prefix}"
    libdir = configs[0].parent.parent.parent
    assert (prefix / "include" / "coda" / "coda.h").exists()
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    subprocess.run(["cmake", "-S", str(ROOT / "examples" / "cpp"), "-B", str(tmp_path), *gen,
                    f"-DCMAKE_PREFIX_PATH={prefix}"], check=True)
    subprocess.run(["cmake", "--build", str(tmp_path)], check=True)
    exe = tmp_path / "linear_gelu"
    assert exe.exists()
    env = dict(os.environ, LD_LIBRARY_PATH=f"{libdir}:{os.environ.get('LD_LIBRARY_PATH', '')}")
    out = subprocess.run([str(exe)], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
