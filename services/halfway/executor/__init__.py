"""The executor: performs intended steps with their keys, journals attempts and outcomes."""
