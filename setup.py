"""Build shardformer and its C core, shardformer._C, and (with the CUDA
toolkit) its CUDA kernels, shardformer._cuda.

The extensions need a C11 compiler, the Python headers and NumPy's headers
(_cuda also nvcc); neither needs torch: tensors reach C through the DLPack
protocol.  _cuda is built when nvcc is found (on PATH, or under CUDA_HOME /
CUDA_PATH / /usr/local/cuda), or always with SHARDFORMER_CUDA=1 (an error
then if nvcc is missing); SHARDFORMER_CUDA=0 never builds it.  See
docs/cuda.md.
"""
import glob
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

import numpy

HERE = os.path.dirname(os.path.abspath(__file__))

# csrc/cuda/ is the CUDA extension's (below), not _C's.
sources = sorted(f for f in glob.glob(os.path.join("csrc", "**", "*.c"), recursive=True)
                 if not f.startswith(os.path.join("csrc", "cuda") + os.sep))
# -fopenmp-simd: `#pragma omp simd` reductions vectorize; no OpenMP runtime is linked.
extra_compile_args = ["-std=c11", "-O3", "-fopenmp-simd", "-Wall", "-Wextra", "-fvisibility=hidden"]
if os.environ.get("SHARDFORMER_WERROR") == "1":
    extra_compile_args.append("-Werror")
extra_link_args = []
if os.environ.get("SHARDFORMER_ASAN") == "1":
    extra_compile_args += ["-O1", "-g", "-fsanitize=address", "-fno-omit-frame-pointer"]
    extra_link_args += ["-fsanitize=address"]

# Every package under python/ and policies/ (the built-in policies install as
# shardformer.policies), found rather than listed: a new subpackage is never left
# out of the wheel.  tests/test_packaging.py checks the wheel against the tree.
PACKAGES = find_packages("python", include=["shardformer", "shardformer.*"])
POLICIES = ["shardformer.policies"] + [f"shardformer.policies.{p}" for p in find_packages("policies")]

# ---- the CUDA extension ------------------------------------------------------

# H100 / H200 code (sm_90) plus its PTX, which the driver compiles for newer cards.
NVCC_FLAGS = ["-std=c++17", "-O3", "--Werror", "all-warnings", "-Xcompiler", "-Wall,-Wextra,-Werror",
              "-gencode", "arch=compute_90,code=sm_90", "-gencode", "arch=compute_90,code=compute_90",
              "-Xcompiler", "-fPIC,-fvisibility=hidden"]
# The C side of _cuda: its module, the DLPack gate and the shared argument checks.
CUDA_C_SOURCES = ["csrc/cuda/module.c", "csrc/glue.c", "csrc/tensor_view.c", "csrc/status.c",
                  "csrc/kernels/checks.c"]


def find_nvcc():
    """nvcc's path and the toolkit root (include/, lib/), or (None, None)."""
    roots = [os.environ.get(v) for v in ("CUDA_HOME", "CUDA_PATH")] + ["/usr/local/cuda"]
    on_path = shutil.which("nvcc")
    if on_path:
        roots.insert(0, os.path.dirname(os.path.dirname(os.path.realpath(on_path))))
    for root in filter(None, roots):
        if os.path.exists(os.path.join(root, "include", "cuda_runtime.h")):
            nvcc = os.path.join(root, "bin", "nvcc")
            return (nvcc if os.path.exists(nvcc) else on_path), root
    return on_path, None


def want_cuda():
    """Whether to build _cuda: SHARDFORMER_CUDA=1 / 0, else when nvcc is found."""
    flag = os.environ.get("SHARDFORMER_CUDA", "")
    if flag not in ("", "0", "1"):
        sys.exit(f"setup.py: SHARDFORMER_CUDA must be 0, 1 or unset, not {flag!r}")
    if flag == "0":
        return False
    nvcc, root = find_nvcc()
    if flag == "1" and (nvcc is None or root is None):
        sys.exit("setup.py: SHARDFORMER_CUDA=1 but no CUDA toolkit was found (nvcc on PATH, or "
                 "CUDA_HOME / CUDA_PATH / /usr/local/cuda with include/cuda_runtime.h)")
    return nvcc is not None and root is not None


class BuildExt(build_ext):
    """build_ext that first compiles csrc/cuda/*.cu with nvcc (in parallel) into
    objects linked into shardformer._cuda, with the CUDA runtime linked statically."""

    def build_extension(self, ext):
        if ext.name == "shardformer._cuda":
            nvcc, root = find_nvcc()
            out = os.path.join(self.build_temp, "cuda")
            os.makedirs(out, exist_ok=True)
            cus = sorted(glob.glob(os.path.join(HERE, "csrc", "cuda", "*.cu")))

            def compile_one(cu):
                obj = os.path.join(out, os.path.basename(cu) + ".o")
                cmd = [nvcc, *NVCC_FLAGS, "-I", os.path.join(HERE, "csrc"), "-c", cu, "-o", obj]
                print(" ".join(cmd), flush=True)
                subprocess.run(cmd, check=True)
                return obj

            with ThreadPoolExecutor(max_workers=max(1, min(len(cus), os.cpu_count() or 1))) as pool:
                ext.extra_objects = list(pool.map(compile_one, cus))
            libdirs = [d for d in (os.path.join(root, "lib64"), os.path.join(root, "lib"),
                                   os.path.join(root, "targets", "x86_64-linux", "lib"))
                       if os.path.exists(os.path.join(d, "libcudart_static.a"))]
            ext.library_dirs = libdirs[:1]
            ext.libraries = ["cudart_static", "stdc++", "dl", "pthread", "rt"]
        super().build_extension(ext)


ext_modules = [
    Extension(
        "shardformer._C",
        sources=sources,
        include_dirs=["csrc", numpy.get_include()],
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_22_API_VERSION")],
        extra_compile_args=extra_compile_args,
        extra_link_args=extra_link_args,
    )
]
if want_cuda():
    ext_modules.append(Extension(
        "shardformer._cuda",
        sources=CUDA_C_SOURCES,
        include_dirs=["csrc"],
        extra_compile_args=["-std=c11", "-O3", "-Wall", "-Wextra", "-Werror", "-fvisibility=hidden"],
        extra_link_args=extra_link_args,
    ))

setup(
    cmdclass={"build_ext": BuildExt},
    package_dir={"": "python", "shardformer.policies": "policies"},
    packages=PACKAGES + POLICIES,
    ext_modules=ext_modules,
)
