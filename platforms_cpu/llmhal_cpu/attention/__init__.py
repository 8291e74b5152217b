"""The CPU platform's attention backends (``cpu_attn``); imported only when a backend is selected."""
