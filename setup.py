"""Maps the two source folders onto one import package: core/ -> llmhal, platforms/ -> llmhal.platforms."""

from setuptools import find_packages, setup


def _packages(root: str, name: str) -> list[str]:
    return [name] + [f"{name}.{sub}" for sub in find_packages(root)]


setup(packages=_packages("core", "llmhal") + _packages("platforms", "llmhal.platforms"))
