"""`python -m halfway.projector`: run the projector until SIGTERM (configured by environment)."""

from halfway import eventloop
from halfway.projector.service import serve

eventloop.run(serve())
