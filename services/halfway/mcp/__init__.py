"""MCP: an MCP server's tools as halfway tools (`App.mcp`, the bridge)."""

from halfway.mcp.bridge import KEY_ARGUMENT, KEY_META, STEP_META, McpBridge, McpUnavailable

__all__ = ["KEY_ARGUMENT", "KEY_META", "STEP_META", "McpBridge", "McpUnavailable"]
