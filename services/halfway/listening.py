"""The socket an HTTP service listens on (the API, the gateway), and, when there can be none,
one line saying which setting to change."""

from __future__ import annotations

import asyncio
import errno
import socket

HOST_SHOWN_CHARS_MAX = 100  # of a host name in a refusal (a setting may be anything)


class CannotListen(Exception):
    """No socket on the address: the message says why and which setting to change."""


def authority(host: str, port: int) -> str:
    """`host:port` as a URL writes it (an IPv6 address in brackets)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def why_not(host: str, port: int, exc: OSError, *, host_setting: str,
            port_setting: str) -> str:
    """Why `host`:`port` cannot be listened on, naming the setting to change."""
    change = {errno.EADDRINUSE: f"{port_setting} to a free port",
              errno.EACCES: f"{port_setting} to another port"}.get(
        exc.errno or 0, f"{host_setting} to an address of this machine")
    return (f"cannot listen on {authority(host[:HOST_SHOWN_CHARS_MAX], port)}: "
            f"{exc.strerror or exc}; set {change}")


async def bound_socket(host: str, port: int, *, host_setting: str,
                       port_setting: str) -> socket.socket:
    """A socket bound to `host`:`port`, of the host's address family (IPv4 first when a name
    has both). The service's own socket, so that with port 0 it can read back the port the
    kernel chose. CannotListen when it cannot be bound."""
    try:
        found = await asyncio.get_running_loop().getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except UnicodeError:  # not a name at all (idna refuses it)
        raise CannotListen(why_not(host, port, OSError(errno.EINVAL, "not a host name"),
                                   host_setting=host_setting, port_setting=port_setting)
                           ) from None
    except OSError as exc:  # socket.gaierror: a name that does not resolve
        raise CannotListen(why_not(host, port, exc, host_setting=host_setting,
                                   port_setting=port_setting)) from None
    family, kind, proto, _, address = min(found, key=lambda a: a[0] != socket.AF_INET)
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise CannotListen(why_not(host, port, exc, host_setting=host_setting,
                                   port_setting=port_setting)) from None
    return sock
