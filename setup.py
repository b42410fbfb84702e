"""Build bagua_lite: the C++ core (csrc/) as a torch extension plus the Python package.

Install with ``pip install --no-build-isolation -e .``. Build isolation would fetch a second, newer
torch into a temporary environment and compile against *its* headers; the extension would then fail to
load (or worse, silently mis-convert ProcessGroup arguments) under the torch you actually run. With
``--no-build-isolation`` the extension is compiled against the installed torch and its bundled
pybind11 headers.

For a fast incremental loop: ``python setup.py build_ext --inplace``.
"""
import glob
import os

from setuptools import setup

import torch
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

HERE = os.path.dirname(os.path.abspath(__file__))


def sources(pattern):
    return sorted(os.path.relpath(p, HERE) for p in glob.glob(os.path.join(HERE, pattern), recursive=True)
                  if os.sep + "tests" + os.sep not in p)


cpp_sources = sources("csrc/**/*.cpp")
cu_sources = sources("csrc/**/*.cu")
with_cuda = torch.cuda.is_available() or os.environ.get("BAGUA_LITE_FORCE_CUDA") == "1"
with_cuda = with_cuda and torch.version.cuda is not None and CUDA_HOME is not None and bool(cu_sources)

cxx_flags = ["-O3", "-fno-trapping-math", "-fopenmp", "-std=c++17"]
define_macros = []
if with_cuda:
    define_macros.append(("BAGUA_LITE_WITH_CUDA", "1"))
    ext = CUDAExtension(
        "bagua_lite._C",
        cpp_sources + cu_sources,
        include_dirs=[os.path.join(HERE, "csrc")],
        define_macros=define_macros,
        extra_compile_args={"cxx": cxx_flags, "nvcc": ["-O3"]},
        extra_link_args=["-fopenmp"],
    )
else:
    ext = CppExtension(
        "bagua_lite._C",
        cpp_sources,
        include_dirs=[os.path.join(HERE, "csrc")],
        define_macros=define_macros,
        extra_compile_args={"cxx": cxx_flags},
        extra_link_args=["-fopenmp"],
    )

setup(
    name="bagua_lite",
    version="0.1.0",
    description="Communication relaxations for data-parallel PyTorch training on slow networks",
    packages=["bagua_lite", "bagua_lite.bench", "bagua_lite.algorithms", "bagua_lite.algorithms.parts",
              "bagua_lite.configs"],
    package_dir={"bagua_lite": "bagua_lite", "bagua_lite.algorithms": "algorithms", "bagua_lite.configs": "configs"},
    package_data={"bagua_lite": ["*.json"], "bagua_lite.configs": ["*.yaml"]},
    ext_modules=[ext],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
    python_requires=">=3.9",
    install_requires=["numpy", "pyyaml"],
    # Optional benchmark rows, never needed by the library: torchft's DiLoCo baseline (torchft_diloco; torchft
    # itself needs torch >= 2.7, which the installed torch satisfies: install it with --no-deps to be sure no
    # other torch comes along) and Hugging Face's GPT-2 built from a config (hf_gpt2).
    # Integrations, each optional (the core needs only torch, numpy and pyyaml): bagua_lite.lightning's strategy,
    # DistributedModel under Accelerate, Hugging Face models. Each accepts the installed torch, which pip keeps.
    # [lightning] is the unified `lightning` package (`import lightning as L`); the strategy works as well with
    # the `pytorch-lightning` package, for scripts that import pytorch_lightning.
    extras_require={"test": ["pytest", "hypothesis", "scikit-learn"], "benchmark": ["matplotlib"],
                    "lightning": ["lightning>=2.1"], "accelerate": ["accelerate>=1.0"],
                    "hf": ["transformers>=4.40"],
                    "torchft": ["torchft==0.2.0", "opentelemetry-sdk>=1.39", "opentelemetry-exporter-otlp-proto-http>=1.39"],
                    "transformers": ["transformers"]},
)
