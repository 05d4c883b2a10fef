"""C++ programs configure, build and link against the *installed* CMake
package (find_package(coda) -> coda::coda). CI installs it and sets
CODA_INSTALL_PREFIX. The example computes only where an sm_90 GPU is; the
API checks run anywhere."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


needs_install = pytest.mark.skipif(
    not os.environ.get("CODA_INSTALL_PREFIX"),
    reason="CODA_INSTALL_PREFIX is not set (cmake --install a build there first, as .ci/run does)")


def build_against_install(source: Path, build: Path, target: str):
    """Configure and build `source` against the installed package; returns (exe, env to run it)."""
    prefix = Path(os.environ["CODA_INSTALL_PREFIX"])
    configs = list(prefix.glob("lib*/cmake/coda/codaConfig.cmake"))
    assert configs, f"no lib*/cmake/coda/codaConfig.cmake under {prefix}"
    assert (prefix / "include" / "coda" / "coda.h").exists()
    libdir = configs[0].parent.parent.parent
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    subprocess.run(["cmake", "-S", str(source), "-B", str(build), *gen, f"-DCMAKE_PREFIX_PATH={prefix}"], check=True)
    subprocess.run(["cmake", "--build", str(build)], check=True)
    exe = build / target
    assert exe.exists()
    return exe, dict(os.environ, LD_LIBRARY_PATH=f"{libdir}:{os.environ.get('LD_LIBRARY_PATH', '')}")


@needs_install
def test_example_builds_against_installed_package(tmp_path):
    exe, env = build_against_install(ROOT / "examples" / "cpp", tmp_path, "linear_gelu")
    out = subprocess.run([str(exe)], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr


@needs_install
def test_api_rejects_bad_arguments(tmp_path):
    exe, env = build_against_install(ROOT / "tests" / "cpp", tmp_path, "api_checks")
    out = subprocess.run([str(exe)], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert " 0 failed" in out.stdout
