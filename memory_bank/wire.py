"""Commands with large values on a redis-py connection, without the client library's copies.

redis-py (with hiredis) copies every argument into one packed buffer before it writes, and
reads a bulk reply into its own buffer before it copies it into a `bytes`: for the bank's
megabyte blobs that is two passes over freshly allocated memory each way, most of what a push
or a pull cost beyond the raw transfer. Here commands are written as RESP2 with each large
value sent from its own memory (a `tensorfile.Blob` goes out part by part), and replies are
parsed as they arrive, each large bulk string received straight into its own buffer (returned
as a read-only memoryview that decoding views without copying).

The connection comes from the client's pool and goes back to it: password, TLS, unix
sockets, timeouts and the protocol (RESP2 or RESP3; replies are read as RESP2 shapes) are the
client's. A dropped connection is retried with the client's retry policy, so every command
sequence sent here must be safe to send twice (the bank's are: SET/HSET of the same values,
scripts that detect their own retry, reads).
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from typing import Any

import numpy as np
import redis
from redis.exceptions import NoScriptError, ResponseError

from memory_bank.tensorfile import Blob

BIG = 1 << 15          # values from this size on are sent and received without a copy
READ = 1 << 16         # bytes asked of the socket per read for headers and small values


def execute(client: redis.Redis, commands: Sequence[Sequence[Any]]) -> list[Any]:
    """Send `commands` in one write and return their replies in order; an error reply is
    returned as its exception (as `pipeline.execute(raise_on_error=False)` does)."""
    if not isinstance(client, redis.Redis):
        raise TypeError(f"the memory bank needs a redis.Redis client, not {type(client).__name__}")
    chunks = _pack(commands)
    pool = client.connection_pool

    def attempt() -> list[Any]:
        conn = pool.get_connection()
        try:
            conn.send_packed_command(chunks)
            reader = _Reader(conn._sock)
            out = [reader.reply() for _ in commands]
            if reader.pending():
                raise redis.ConnectionError("bytes after the last reply")
            return out
        except BaseException:
            conn.disconnect()
            raise
        finally:
            pool.release(conn)

    retry = client.get_retry()
    return retry.call_with_retry(attempt, lambda _e: None) if retry is not None else attempt()


def _arg(a: Any) -> bytes | memoryview | Blob:
    if isinstance(a, (bytes, Blob)):
        return a
    if isinstance(a, str):
        return a.encode()
    if isinstance(a, (bytearray, memoryview)):
        return memoryview(a).cast("B")
    if isinstance(a, (int, float)) and not isinstance(a, bool):
        return repr(a).encode()
    raise TypeError(f"cannot send a {type(a).__name__} to Redis")


def _pack(commands: Sequence[Sequence[Any]]) -> list[bytes | bytearray | memoryview]:
    """RESP2 arrays of bulk strings; small pieces are gathered into one buffer, large values
    are their own chunks (sendall writes each from where it lies)."""
    chunks: list[bytes | bytearray | memoryview] = []
    buf = bytearray()
    for cmd in commands:
        buf += b"*%d\r\n" % len(cmd)
        for a in map(_arg, cmd):
            buf += b"$%d\r\n" % len(a)
            if len(a) < BIG:
                buf += bytes(a) if isinstance(a, Blob) else a
            else:
                chunks.append(buf)
                buf = bytearray()
                chunks.extend(a.parts if isinstance(a, Blob) else [a])
            buf += b"\r\n"
    chunks.append(buf)
    return chunks


class _Reader:
    """Replies from a socket, parsed as they arrive (RESP2 and RESP3 types)."""

    def __init__(self, sock: socket.socket):
        self.sock, self.buf, self.pos = sock, bytearray(), 0

    def pending(self) -> bool:
        return self.pos < len(self.buf)

    def _fill(self) -> None:
        try:
            chunk = self.sock.recv(READ)
        except TimeoutError:
            raise redis.TimeoutError("timeout reading a reply from Redis") from None
        except OSError as e:
            raise redis.ConnectionError(f"error reading a reply from Redis: {e}") from None
        if not chunk:
            raise redis.ConnectionError("Redis closed the connection")
        if self.pos:
            del self.buf[:self.pos]
            self.pos = 0
        self.buf += chunk

    def _line(self) -> bytes:
        while (end := self.buf.find(b"\r\n", self.pos)) < 0:
            self._fill()
        line = bytes(self.buf[self.pos:end])
        self.pos = end + 2
        return line

    def _bulk(self, n: int) -> bytes | memoryview:
        have = len(self.buf) - self.pos
        if n < BIG:
            while have < n + 2:
                self._fill()
                have = len(self.buf) - self.pos
            out = bytes(self.buf[self.pos:self.pos + n])
            self.pos += n + 2
            return out
        arr = np.empty(n, dtype=np.uint8)      # no zero fill: the socket writes every byte
        view = memoryview(arr)
        got = min(have, n)
        view[:got] = self.buf[self.pos:self.pos + got]
        self.pos += got
        try:
            while got < n:
                k = self.sock.recv_into(view[got:])
                if not k:
                    raise redis.ConnectionError("Redis closed the connection")
                got += k
        except TimeoutError:
            raise redis.TimeoutError("timeout reading a reply from Redis") from None
        except OSError as e:
            raise redis.ConnectionError(f"error reading a reply from Redis: {e}") from None
        while len(self.buf) - self.pos < 2:
            self._fill()
        self.pos += 2
        return view.toreadonly()

    def _small_bulks(self, n: int) -> list[bytes] | None:
        """The n items of an array when they are all small bulk strings already in the buffer
        (an HGETALL of entry fields), parsed in one pass; None (nothing consumed) otherwise."""
        buf, pos, out = self.buf, self.pos, []
        for _ in range(n):
            end = buf.find(b"\r\n", pos)
            if end < 0 or buf[pos] != 36:        # b"$"
                return None
            size = int(buf[pos + 1:end])
            if not 0 <= size < BIG or end + size + 4 > len(buf):
                return None
            out.append(bytes(buf[end + 2:end + 2 + size]))
            pos = end + size + 4
        self.pos = pos
        return out

    def reply(self) -> Any:
        """One reply; RESP3 maps and sets come back as flat lists, as RESP2 sends them, and
        out-of-band push messages are skipped."""
        while True:
            line = self._line()
            kind = line[:1]
            if kind in (b"*", b"%", b"~") and (n := int(line[1:]) * (2 if kind == b"%" else 1)) > 0 \
                    and (fast := self._small_bulks(n)) is not None:
                return fast
            rest = line[1:]
            if kind in (b"$", b"="):                     # bulk, verbatim string
                n = int(rest)
                if n < 0:
                    return None
                out = self._bulk(n)
                return out[4:] if kind == b"=" else out  # verbatim: "txt:" prefix
            if kind in (b"*", b"~", b"%", b">", b"|"):   # array, set, map, push, attribute
                n = int(rest) * (2 if kind in (b"%", b"|") else 1)
                items = [] if n < 0 else [self.reply() for _ in range(n)]
                if kind in (b">", b"|"):
                    continue                             # not a reply: the next one is
                return None if n < 0 else items
            if kind == b":":
                return int(rest)
            if kind in (b"+", b"("):
                return rest
            if kind == b",":
                return float(rest)
            if kind == b"#":
                return rest == b"t"
            if kind == b"_":
                return None
            if kind in (b"-", b"!"):
                msg = (self._bulk(int(rest)) if kind == b"!" else rest)
                msg = bytes(msg).decode("utf-8", "replace")
                return NoScriptError(msg) if msg.startswith("NOSCRIPT") else ResponseError(msg)
            raise redis.ConnectionError(f"unexpected reply from Redis: {line[:40]!r}")
