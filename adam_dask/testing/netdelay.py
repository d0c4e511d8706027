"""A link delay for the namespace cluster where the kernel has no ``netem``: packets leaving a host
are queued to user space (netfilter's NFQUEUE, by an iptables rule in the host's namespace) and
let go ``delay`` seconds later (plus a uniform jitter), in this small process that runs inside the
namespace::

    ip netns exec NS python -m adam_dask.testing.netdelay --queue 7 --delay 0.1 [--jitter 0.01]

It speaks the nfnetlink queue protocol directly (a raw netlink socket): bind the queue, ask for
packet metadata only, then answer each packet with an ACCEPT verdict once its time has come.
Packets are never reordered without jitter. It ends on SIGTERM; the iptables rule is the
caller's to remove (a queue nobody reads drops its packets: the link is then cut).
"""

from __future__ import annotations

import argparse
import heapq
import os
import random
import select
import signal
import socket
import struct
import sys
import time

NETLINK_NETFILTER = 12
NFNL_SUBSYS_QUEUE = 3
NFQNL_MSG_PACKET, NFQNL_MSG_VERDICT, NFQNL_MSG_CONFIG = 0, 1, 2
NFQA_CFG_CMD, NFQA_CFG_PARAMS, NFQA_CFG_QUEUE_MAXLEN = 1, 2, 3
NFQNL_CFG_CMD_BIND = 1
NFQNL_COPY_META = 1
NFQA_PACKET_HDR, NFQA_VERDICT_HDR = 1, 2
NF_ACCEPT = 1
NLM_F_REQUEST, NLM_F_ACK = 1, 4
NLMSG_ERROR = 2


def _attr(kind: int, payload: bytes) -> bytes:
    n = 4 + len(payload)
    return struct.pack("=HH", n, kind) + payload + b"\0" * (-n % 4)


def _message(kind: int, queue: int, attrs: bytes, flags: int = NLM_F_REQUEST, seq: int = 0):
    body = struct.pack("=BBH", socket.AF_UNSPEC, 0, socket.htons(queue)) + attrs
    return (
        struct.pack("=IHHII", 16 + len(body), (NFNL_SUBSYS_QUEUE << 8) | kind, flags, seq, 0) + body
    )


class Delayer:
    """Reads the packets of NFQUEUE ``queue`` and accepts each ``delay`` (+ jitter) s later."""

    def __init__(self, queue: int, delay: float, jitter: float = 0.0):
        self.queue, self.delay, self.jitter = int(queue), float(delay), float(jitter)
        self.sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
        self.sock.setsockopt(socket.SOL_SOCKET, 33, 64 << 20)  # SO_RCVBUFFORCE (root)
        self.sock.bind((0, 0))
        self._seq = 0
        self._config(_attr(NFQA_CFG_CMD, struct.pack("!BBH", NFQNL_CFG_CMD_BIND, 0, 0)))
        self._config(_attr(NFQA_CFG_PARAMS, struct.pack("!IB", 0xFFFF, NFQNL_COPY_META)))
        self._config(_attr(NFQA_CFG_QUEUE_MAXLEN, struct.pack("!I", 1 << 16)))
        self.due: list[tuple[float, int, int]] = []  # (time, order, packet id)
        self._order = 0

    def _config(self, attrs: bytes) -> None:
        self._seq += 1
        self.sock.send(
            _message(NFQNL_MSG_CONFIG, self.queue, attrs, NLM_F_REQUEST | NLM_F_ACK, self._seq)
        )
        data = self.sock.recv(65536)
        length, kind = struct.unpack_from("=IH", data)
        if kind == NLMSG_ERROR:
            (err,) = struct.unpack_from("=i", data, 16)
            if err != 0:
                raise OSError(-err, f"nfqueue config of queue {self.queue}: {os.strerror(-err)}")

    def _packets(self, data: bytes) -> list[int]:
        ids, off = [], 0
        while off + 16 <= len(data):
            length, kind = struct.unpack_from("=IH", data, off)
            if length < 16:
                break
            if kind == (NFNL_SUBSYS_QUEUE << 8) | NFQNL_MSG_PACKET:
                a = off + 20  # nlmsghdr (16) + nfgenmsg (4)
                while a + 4 <= off + length:
                    n, t = struct.unpack_from("=HH", data, a)
                    if n < 4:
                        break
                    if t & 0x7FFF == NFQA_PACKET_HDR:
                        ids.append(struct.unpack_from("!I", data, a + 4)[0])
                        break
                    a += n + (-n % 4)
            off += length + (-length % 4)
        return ids

    def _accept(self, packet_id: int) -> None:
        attrs = _attr(NFQA_VERDICT_HDR, struct.pack("!II", NF_ACCEPT, packet_id))
        self.sock.send(_message(NFQNL_MSG_VERDICT, self.queue, attrs))

    def run(self) -> None:
        while True:
            now = time.monotonic()
            while self.due and self.due[0][0] <= now:
                self._accept(heapq.heappop(self.due)[2])
            timeout = max(0.0, self.due[0][0] - now) if self.due else 1.0
            ready, _, _ = select.select([self.sock], [], [], timeout)
            if not ready:
                continue
            data = self.sock.recv(1 << 20)
            at = time.monotonic() + self.delay
            for pid in self._packets(data):
                extra = random.uniform(0.0, self.jitter) if self.jitter else 0.0
                self._order += 1
                heapq.heappush(self.due, (at + extra, self._order, pid))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="delay a host's packets (NFQUEUE)")
    ap.add_argument("--queue", type=int, required=True)
    ap.add_argument("--delay", type=float, required=True, help="seconds")
    ap.add_argument("--jitter", type=float, default=0.0, help="seconds, uniform, added")
    args = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    d = Delayer(args.queue, args.delay, args.jitter)
    print("ready", flush=True)
    d.run()


if __name__ == "__main__":
    main()
