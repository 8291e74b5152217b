from llmhal.testing.fixtures import install_dists  # noqa: F401
