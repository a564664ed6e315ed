"""Builds hpmoe's Python module (hpmoe._core) with the project's CMake, for
the Python running the build, and puts it into the package (pyproject.toml
holds the metadata). The build folder is build-pip/ (HPMOE_PIP_BUILD_DIR),
kept between installs so a second install only relinks."""
import os
import pathlib
import shutil
import subprocess
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = pathlib.Path(__file__).parent.resolve()


class CMakeExtension(Extension):
    def __init__(self, name):
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def build_extension(self, ext):
        build = pathlib.Path(os.environ.get("HPMOE_PIP_BUILD_DIR", ROOT / "build-pip")).resolve()
        configure = ["cmake", "-S", str(ROOT), "-B", str(build), "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
                     "-DHPMOE_BUILD_TESTS=OFF", "-DHPMOE_BUILD_BENCH=OFF", f"-DPython_EXECUTABLE={sys.executable}"]
        subprocess.run(configure, check=True)
        subprocess.run(["cmake", "--build", str(build), "--target", "hpmoe_python", "-j", str(os.cpu_count() or 1)],
                       check=True)
        built = sorted((build / "python" / "hpmoe").glob("_core*.so"))
        if not built:
            raise RuntimeError(f"hpmoe: CMake built no Python module in {build}/python/hpmoe (are pybind11-dev and "
                               "python3-dev installed? scripts/setup.sh installs them)")
        target = pathlib.Path(self.get_ext_fullpath(ext.name))
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(built[0], target)


# setuptools' own staging goes beside the CMake build, not into build/ (the
# CMake build folder the README and scripts use).
setup(ext_modules=[CMakeExtension("hpmoe._core")], cmdclass={"build_ext": CMakeBuild},
      options={"build": {"build_base": os.environ.get("HPMOE_PIP_BUILD_DIR", "build-pip") + "/setuptools"}})
