"""circle_jax: deep metric learning losses and training in JAX/Flax."""

import pathlib

import setuptools

_HERE = pathlib.Path(__file__).parent


def _requirements(name):
  """The pins of a requirements file (pip options such as indexes skipped)."""
  lines = (_HERE / name).read_text().splitlines()
  reqs = [l.split("#")[0].strip() for l in lines]
  return [r for r in reqs if r and not r.startswith("-")]


setuptools.setup(
    name="circle_jax",
    version="0.1.0",
    description=(
        "Pair-similarity losses (Circle, Multi-Similarity, Ranked List, "
        "Proxy-Anchor, ...) and a Flax training stack for deep metric learning."
    ),
    long_description=(_HERE / "README.md").read_text(),
    long_description_content_type="text/markdown",
    python_requires=">=3.11",
    packages=setuptools.find_packages(include=["circle_jax", "circle_jax.*"]),
    # The Omniglot 'background small' zips (MIT) that omniglot_small reads.
    package_data={"circle_jax.data": ["archives/omniglot_small/*"]},
    install_requires=_requirements("requirements.txt"),
    extras_require={
        # The test suite (torch is the CPU build; see requirements-test.txt).
        "test": _requirements("requirements-test.txt"),
        # Side-by-side benchmarks against the peer libraries.
        "bench": ["torch==2.13.0", "pytorch-metric-learning==2.9.0",
                  "faiss-cpu==1.15.1"],
    },
)
