"""pip drives CMake: `pip install --no-build-isolation .` (or `-e .`).

Environment:
  MAX_JOBS             parallel compile jobs (one CUTLASS TU takes ~4.5 GB of RAM: MAX_JOBS x 4.5 GB must fit)
  CODA_BUILD_DIR       where CMake builds (default: build/py<version>)
  CUTLASS_INCLUDE_DIR  CUTLASS headers, if not from the nvidia-cutlass package
  CODA_CMAKE_ARGS      extra arguments for the CMake configure step
"""

import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


class CMakeExtension(Extension):
    def __init__(self, name: str):
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def build_extension(self, ext: CMakeExtension) -> None:
        build_dir = Path(os.environ.get("CODA_BUILD_DIR", ROOT / "build" / f"py{sys.version_info.major}{sys.version_info.minor}"))
        build_dir.mkdir(parents=True, exist_ok=True)
        suffix = sysconfig.get_config_var("EXT_SUFFIX")
        configure = [
            "cmake", "-S", str(ROOT), "-B", str(build_dir),
            f"-DPython3_EXECUTABLE={sys.executable}",
            f"-DCODA_PYTHON_EXT_SUFFIX={suffix}",
            "-DCODA_BUILD_TORCH=ON",
            "-DCMAKE_BUILD_TYPE=Release",
        ]
        if shutil.which("ninja"):
            configure += ["-G", "Ninja"]
        if os.environ.get("CUTLASS_INCLUDE_DIR"):
            configure.append(f"-DCUTLASS_INCLUDE_DIR={os.environ['CUTLASS_INCLUDE_DIR']}")
        configure += shlex.split(os.environ.get("CODA_CMAKE_ARGS", ""))
        subprocess.check_call(configure)
        jobs = os.environ.get("MAX_JOBS") or str(os.cpu_count() or 1)
        subprocess.check_call(["cmake", "--build", str(build_dir), "--target", "_C", "-j", jobs])

        built = build_dir / f"_C{suffix}"
        target = Path(self.get_ext_fullpath(ext.name))
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(built, target)
        if self.inplace:  # editable installs import from python/coda
            shutil.copyfile(built, ROOT / "python" / "coda" / f"_C{suffix}")


setup(ext_modules=[CMakeExtension("coda._C")], cmdclass={"build_ext": CMakeBuild})
