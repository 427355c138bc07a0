"""Everything is in pyproject.toml except the package list: the GPU profiles live in the top-level
profiles/ folder (where a user finds and adds one) and install as the package autotune.profiles,
which pyproject.toml's package-dir can map but its package discovery cannot list."""

from setuptools import find_packages, setup

setup(packages=[*find_packages(include=["autotune", "autotune.*"]), "autotune.profiles"])
