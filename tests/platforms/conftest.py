from llmhal.testing.fixtures import install_dists, markers  # noqa: F401
