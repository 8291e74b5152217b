"""Test kits for platform vendors and llmhal itself: conformance suites and fixtures."""
