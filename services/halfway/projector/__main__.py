"""`python -m halfway.projector`: run the projector until SIGTERM (configured by environment)."""

import asyncio

from halfway.projector.service import serve

asyncio.run(serve())
