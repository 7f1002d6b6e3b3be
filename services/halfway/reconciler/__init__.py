"""The reconciler: settles unknown steps from provider webhooks and lookups."""
