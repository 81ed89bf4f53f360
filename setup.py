"""Package discovery (the rest of the metadata is in pyproject.toml).

setuptools finds every package under cluster/ by itself, so a new subpackage can never be left
out of the wheel. templates/ and train/ live at the top of the checkout and are installed as
cluster.templates and cluster.train, so an installed copy finds them too.
"""
from setuptools import find_packages, setup

setup(
    packages=find_packages(include=["cluster", "cluster.*"]) + ["cluster.templates", "cluster.train"],
    package_dir={"cluster.templates": "templates", "cluster.train": "train"},
)
