"""Pure-Python TCP transfer backend: NIXL's read/notify semantics without NIXL.

Each agent runs a small server thread (127.0.0.1 and an OS-chosen port by default)
that serves reads of its registered host memory, refusing any span outside it, and
receives notifications. A ``read`` runs in a background thread that asks the peer's
server for the remote spans and receives the bytes straight into local memory
(``recv_into`` on a view of the address, no extra copy). Only after every byte has
arrived does it send READ_DONE; the server then queues the read's notif for its
agent. So the notif exists only for reads that completed.

The wire protocol (frames, READ/READ_DONE/NOTIF payloads, agent metadata) lives in
tcp_wire.py. Malformed frames get ERR and a closed connection; the server keeps
serving others. Connections are pooled per peer and reused. Every socket wait has a
timeout. Host memory only (device "cpu").
"""

from __future__ import annotations

import logging
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

from kvbridge.kv_transfer.backends.base import (
    DescList, MemoryRegion, NotificationError, TransferBackend, TransferError,
    TransferSetupError, TransferState, XferHandle, check_read_pairing, host_view, validate_descs,
)
from kvbridge.kv_transfer.backends.tcp_wire import (
    Cancelled, Op, Peer, ProtocolError, decode_agent_metadata, decode_notif, decode_read,
    encode_agent_metadata, encode_notif, encode_read, recv_frame, recv_views, send_frame,
    send_views,
)

logger = logging.getLogger(__name__)

_SERVER_IDLE_S = 60.0  # a server drops a connection idle this long
_POOL_MAX_IDLE_S = 20.0  # so clients reuse pooled connections well before that


def _tune(sock: socket.socket) -> None:
    # Control frames are tiny: no Nagle delay. Buffer sizes stay auto-tuned (fixing
    # them at 4 MiB was slower on loopback).
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class _Server:
    """Accepts connections and serves each in its own thread until stopped."""

    def __init__(self, host: str, port: int,
                 views: Callable[[Sequence[tuple[int, int]]], list[memoryview] | None],
                 on_notif: Callable[[str, bytes], None], io_timeout_s: float) -> None:
        self._views, self._on_notif, self._io_timeout_s = views, on_notif, io_timeout_s
        self._listener = socket.create_server((host, port))
        self._listener.settimeout(0.2)  # how often the accept loop checks for stop
        self.host, self.port = self._listener.getsockname()[:2]
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._conns: dict[socket.socket, threading.Thread] = {}
        self._last_warning, self._suppressed = 0.0, 0  # refusals are logged at most every 5 s
        self._thread = threading.Thread(target=self._accept_loop, daemon=True,
                                        name=f"kvbridge-tcp-server-{self.port}")
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        _shutdown_quietly(self._listener)  # wakes accept() at once on Linux
        self._thread.join(timeout=2.0)
        self._listener.close()
        with self._lock:
            conns = list(self._conns.items())
        for conn, thread in conns:
            _shutdown_quietly(conn)
            thread.join(timeout=self._io_timeout_s)

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            _tune(conn)
            thread = threading.Thread(target=self._serve, args=(conn,), daemon=True,
                                      name=f"kvbridge-tcp-conn-{self.port}")
            with self._lock:
                self._conns[conn] = thread
            thread.start()

    def _serve(self, conn: socket.socket) -> None:
        pending: tuple[str, bytes] | None = None  # the notif of a READ awaiting READ_DONE
        try:
            while not self._stop.is_set():
                conn.settimeout(_SERVER_IDLE_S)
                op, payload = recv_frame(conn)
                conn.settimeout(self._io_timeout_s)
                if op is Op.READ:
                    pending = self._serve_read(conn, payload)
                elif op is Op.READ_DONE and pending is not None and not payload:
                    if pending[1]:  # an empty notif: the reader asked for none
                        self._on_notif(*pending)
                    pending = None
                    send_frame(conn, Op.OK)
                elif op is Op.NOTIF:
                    self._on_notif(*decode_notif(payload))
                    send_frame(conn, Op.OK)
                else:
                    raise ProtocolError(f"unexpected {op.name}")
        except ProtocolError as exc:
            self._warn_refused(exc)
            try:
                send_frame(conn, Op.ERR, str(exc).encode())
            except OSError:
                pass
        except (OSError, ConnectionError, struct.error):
            pass  # peer went away or timed out: nothing to answer
        finally:
            with self._lock:
                self._conns.pop(conn, None)
            conn.close()

    def _warn_refused(self, exc: ProtocolError) -> None:
        with self._lock:
            now = time.monotonic()
            if now - self._last_warning < 5.0:
                self._suppressed += 1
                return
            suppressed, self._suppressed, self._last_warning = self._suppressed, 0, now
        logger.warning("tcp backend port %s refused a request: %s (%s more since last report)",
                       self.port, exc, suppressed)

    def _serve_read(self, conn: socket.socket, payload: bytes) -> tuple[str, bytes]:
        sender, notif, spans = decode_read(payload)
        views = self._views(spans)
        if views is None:
            raise ProtocolError("a span is empty or outside registered memory")
        send_frame(conn, Op.OK, struct.pack("!Q", sum(n for _, n in spans)))
        send_views(conn, views)
        return sender, notif


def _shutdown_quietly(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def _views_of(table: Sequence[tuple[MemoryRegion, memoryview]],
              spans: Sequence[tuple[int, int]]) -> list[memoryview] | None:
    """Slices of the registered regions' views for ``spans``; None if any span is
    empty or not inside one region. Slicing a cached view is ~50x cheaper per block
    than building a ctypes view for each span."""
    out = []
    for addr, length in spans:
        for region, view in table:
            if length > 0 and region.contains(addr, length):
                out.append(view[addr - region.addr:addr - region.addr + length])
                break
        else:
            return None
    return out


@dataclass(eq=False)
class _TcpRead:
    payload: bytes
    local: list[memoryview]  # where the bytes land, in stream order
    nbytes: int
    peer: Peer
    cancel: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)
    sock: socket.socket | None = None
    thread: threading.Thread | None = None
    state: TransferState = TransferState.IN_PROGRESS
    error: str = ""


class TcpBackend(TransferBackend):
    """One agent; its server starts in the constructor so the metadata has its port."""

    def __init__(self, agent_name: str, *, host: str = "127.0.0.1", port: int = 0,
                 connect_timeout_s: float = 5.0, io_timeout_s: float = 30.0, advertise_host: str = "") -> None:
        """The server listens on `host`; its metadata names `advertise_host` (default: `host`),
        the address peers connect to (required when `host` is 0.0.0.0 or ::)."""
        super().__init__(agent_name)
        self._advertise_host = advertise_host
        self._connect_timeout_s, self._io_timeout_s = connect_timeout_s, io_timeout_s
        self._lock = threading.RLock()
        self._regions: list[tuple[MemoryRegion, memoryview]] = []  # with a view of each
        self._peers: dict[str, Peer] = {}
        self._pool: dict[Peer, list[tuple[socket.socket, float]]] = {}
        self._inbox: dict[str, list[bytes]] = {}
        self._closed = False
        self._server = _Server(host, port, self._views_for, self._deliver, io_timeout_s)

    @property
    def address(self) -> tuple[str, int]:
        return self._server.host, self._server.port

    def register_memory(self, regions: Sequence[MemoryRegion]) -> None:
        if any(r.device != "cpu" for r in regions):
            raise TransferError("the tcp backend serves host memory only (device 'cpu')")
        with self._lock:
            self._ensure_open()
            self._regions.extend((r, host_view(r.addr, r.length)) for r in regions)

    def agent_metadata(self) -> bytes:
        self._ensure_open()
        host, port = self.address
        return encode_agent_metadata(self.agent_name, self._advertise_host or host, port)

    def add_remote_agent(self, metadata: bytes) -> str:
        peer = decode_agent_metadata(metadata)
        with self._lock:
            self._ensure_open()
            self._peers[peer.name] = peer
        return peer.name

    def remove_remote_agent(self, name: str) -> None:
        with self._lock:
            peer = self._peers.pop(name, None)
            idle = self._pool.pop(peer, []) if peer else []
        for sock, _ in idle:
            sock.close()

    def prep_descs(self, descs: Sequence[tuple[int, int]], device: str = "cpu",
                   device_id: int = 0) -> DescList:
        return DescList(validate_descs(descs, device, device_id), device, device_id)

    def read(self, remote_agent: str, local: DescList, remote: DescList,
             notif: bytes) -> XferHandle:
        check_read_pairing(local, remote)
        if local.device != "cpu" or remote.device != "cpu":
            raise TransferSetupError("the tcp backend moves host memory only (device 'cpu')")
        with self._lock:
            self._ensure_open()
            peer = self._peers.get(remote_agent)
            if peer is None:
                raise TransferSetupError(f"unknown remote agent {remote_agent!r}")
            views = _views_of(self._regions, local.descs)
            if views is None:
                raise TransferSetupError("local descriptors outside registered memory")
            read = _TcpRead(encode_read(self.agent_name, bytes(notif), remote.descs),
                            views, local.nbytes, peer)
            handle = XferHandle(remote_agent, local.nbytes, len(local), bytes(notif), native=read)
            read.thread = threading.Thread(target=self._run_read, args=(read,), daemon=True,
                                           name=f"kvbridge-tcp-read-{handle.handle_id}")
            self._live[handle.handle_id] = handle
        self._count(reads_started=1)
        read.thread.start()
        return handle

    def check_state(self, handle: XferHandle) -> TransferState:
        with self._lock:
            self._check_live(handle)
        read: _TcpRead = handle.native
        state = read.state
        if state is TransferState.IN_PROGRESS:
            time.sleep(0)  # lets the read's thread take the GIL when the caller busy-polls
        elif state is TransferState.ERROR and not handle.settled:  # the caller logs failures
            logger.debug("tcp read from %s failed: %s", handle.remote_agent, read.error)
        self._settle(handle, state)
        return state

    def release(self, handle: XferHandle) -> None:
        with self._lock:
            if not self._untrack(handle):
                return  # released before, or not ours
        read: _TcpRead = handle.native
        with read.lock:
            read.cancel.set()
            if read.sock is not None:
                _shutdown_quietly(read.sock)  # wakes a blocked recv at once
        thread = read.thread  # an unstarted thread will see the cancel and exit at once
        if thread is not None and thread.ident is not None \
                and thread is not threading.current_thread():
            thread.join(timeout=self._io_timeout_s)
            if thread.is_alive():
                logger.warning("tcp read %s still running after release", handle.handle_id)

    def send_notif(self, remote_agent: str, msg: bytes) -> None:
        with self._lock:
            self._ensure_open()
            peer = self._peers.get(remote_agent)
        if peer is None:
            raise NotificationError(f"unknown remote agent {remote_agent!r}")
        sock = None
        try:
            sock = self._checkout(peer)
            send_frame(sock, Op.NOTIF, encode_notif(self.agent_name, bytes(msg)))
            op, body = recv_frame(sock)
            if op is not Op.OK:
                raise NotificationError(f"{remote_agent} refused the notification: {body!r}")
        except (OSError, ConnectionError, ProtocolError, struct.error) as exc:
            if sock is not None:
                sock.close()
            raise NotificationError(f"cannot notify {remote_agent}: {exc}") from exc
        self._checkin(peer, sock)
        self._count(notifs_sent=1)

    def get_new_notifs(self) -> dict[str, list[bytes]]:
        with self._lock:
            self._ensure_open()
            inbox, self._inbox = self._inbox, {}
        self._count(notifs_received=sum(len(v) for v in inbox.values()))
        return inbox

    def shutdown(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            handles = list(self._live.values())
        self._server.stop()  # before forgetting regions: no reader touches them after
        for handle in handles:
            self.release(handle)
        with self._lock:
            for conns in self._pool.values():
                for sock, _ in conns:
                    sock.close()
            self._pool.clear()
            self._peers.clear()
            self._regions.clear()

    # -- internals ---------------------------------------------------------------------

    def _run_read(self, read: _TcpRead) -> None:
        """Body of a read's thread: request, receive into local memory, confirm."""
        sock = None
        try:
            sock = self._checkout(read.peer)
            with read.lock:
                if read.cancel.is_set():
                    raise Cancelled()
                read.sock = sock
            send_frame(sock, Op.READ, read.payload)
            op, body = recv_frame(sock)
            if op is Op.ERR:
                reason = body.decode(errors="replace")
                raise ProtocolError(f"refused by {read.peer.name}: {reason}")
            if op is not Op.OK or body != struct.pack("!Q", read.nbytes):
                raise ProtocolError(f"unexpected answer {op.name} to READ")
            recv_views(sock, read.local, read.cancel)
            if read.cancel.is_set():
                raise Cancelled()
            send_frame(sock, Op.READ_DONE)
            if recv_frame(sock)[0] is not Op.OK:
                raise ProtocolError("READ_DONE not acknowledged")
            with read.lock:
                read.state = TransferState.DONE
                if not read.cancel.is_set():  # else release() has shut the socket down
                    read.sock = None
                    self._checkin(read.peer, sock)
                    sock = None
        except Cancelled:
            pass
        except (OSError, ConnectionError, ProtocolError, struct.error) as exc:
            read.error = str(exc) or type(exc).__name__
            read.state = TransferState.ERROR
        finally:
            if sock is not None:
                sock.close()

    def _checkout(self, peer: Peer) -> socket.socket:
        """A pooled connection that is still open, or a new one."""
        now = time.monotonic()
        while True:
            with self._lock:
                idle = self._pool.get(peer)
                sock, since = idle.pop() if idle else (None, 0.0)
            if sock is None:
                break
            if now - since < _POOL_MAX_IDLE_S and _reusable(sock, self._io_timeout_s):
                return sock
            sock.close()
        sock = socket.create_connection((peer.host, peer.port), timeout=self._connect_timeout_s)
        _tune(sock)
        sock.settimeout(self._io_timeout_s)
        return sock

    def _checkin(self, peer: Peer, sock: socket.socket) -> None:
        """Return a healthy connection to the pool (closed if the peer is gone)."""
        with self._lock:
            if not self._closed and self._peers.get(peer.name) == peer:
                self._pool.setdefault(peer, []).append((sock, time.monotonic()))
                return
        sock.close()

    def _deliver(self, sender: str, msg: bytes) -> None:
        with self._lock:
            self._inbox.setdefault(sender, []).append(msg)

    def _views_for(self, spans: Sequence[tuple[int, int]]) -> list[memoryview] | None:
        with self._lock:
            table = list(self._regions)
        return _views_of(table, spans)

    def _ensure_open(self) -> None:
        if self._closed:
            raise TransferError(f"agent {self.agent_name!r} is shut down")


def _reusable(sock: socket.socket, io_timeout_s: float) -> bool:
    """True when an idle pooled connection has nothing to read: not closed by the
    peer (EOF) and no stray bytes."""
    try:
        sock.setblocking(False)
        sock.recv(1, socket.MSG_PEEK)
        return False
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        try:
            sock.settimeout(io_timeout_s)
        except OSError:
            pass
