"""Build shardformer and its C core, shardformer._C.

The extension needs a C11 compiler, the Python headers and NumPy's headers;
it does not need torch: tensors reach C through the DLPack protocol.
"""
import glob
import os

from setuptools import Extension, find_packages, setup

import numpy

HERE = os.path.dirname(os.path.abspath(__file__))

sources = sorted(glob.glob(os.path.join("csrc", "**", "*.c"), recursive=True))
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

setup(
    package_dir={"": "python", "shardformer.policies": "policies"},
    packages=PACKAGES + POLICIES,
    ext_modules=[
        Extension(
            "shardformer._C",
            sources=sources,
            include_dirs=["csrc", numpy.get_include()],
            define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_22_API_VERSION")],
            extra_compile_args=extra_compile_args,
            extra_link_args=extra_link_args,
        )
    ],
)
