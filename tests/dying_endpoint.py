"""A TCP relay in front of a real endpoint that dies, as a crashed or partitioned server does, at a
chosen moment: the first time a client sends a given byte string (an object key in a request
line, say), it stops listening and drops every open connection mid-request. `revive()` listens
again on the same port: the endpoint is back, with the data it held."""

from __future__ import annotations

import socket
import threading


class DyingEndpoint:
    def __init__(self, target: tuple[str, int], die_on: bytes | None = None):
        self.target, self.die_on = target, die_on
        self.died = threading.Event()
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()
        self.port = self._listen(0)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _listen(self, port: int) -> int:
        srv = socket.socket()
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.bind(("127.0.0.1", port))
        srv.listen(64)
        self._srv = srv
        threading.Thread(target=self._accept, args=(srv,), daemon=True).start()
        return srv.getsockname()[1]

    def _accept(self, srv: socket.socket) -> None:
        while True:
            try:
                client, _ = srv.accept()
            except OSError:        # closed: the endpoint died
                return
            try:
                upstream = socket.create_connection(self.target)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._conns += [client, upstream]
            threading.Thread(target=self._pump, args=(client, upstream, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, watch: bool) -> None:
        tail = b""
        while True:
            try:
                data = src.recv(1 << 16)
            except OSError:
                data = b""
            if not data:
                break
            if watch and self.die_on:
                seen = tail + data           # the string may straddle two reads
                if self.die_on in seen:
                    self.die()
                    return
                tail = seen[-len(self.die_on):]
            try:
                dst.sendall(data)
            except OSError:
                break
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def die(self) -> None:
        self._srv.close()
        with self._lock:
            conns, self._conns = self._conns, []
        for s in conns:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()
        self.died.set()

    def revive(self) -> None:
        self.die_on = None
        self._listen(self.port)

    def close(self) -> None:
        self.die_on = None
        self.die()
